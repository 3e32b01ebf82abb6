"""The dashboard of a daemon in a running 2-peer collaboration: rendered by headless Chromium with
live data (the run's epoch, both peers), its snapshot equal to the control API's answers, and
/metrics valid Prometheus text whose values move as the run trains."""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import p2p_address, wait_until

PARAMS = {"workload": "tiny", "name": "dash", "target_batch_size": 128, "collaborative": True,
          "min_peers": 2, "checkpoint_every": 0}
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                  "--disable-extensions", "--disable-dev-shm-usage", "--hide-scrollbars",
                  "--window-size=1280,1000", "--virtual-time-budget=6000")


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("headless chromium is needed to render the dashboard and is not installed: "
                    "`make test` installs it (make system-deps: apt-get install "
                    "--no-install-recommends chromium)", pytrace=False)
    return path


async def run_chromium(url: str, profile: Path, *args: str) -> str:
    """Load `url` in headless Chromium (its JS runs for the virtual-time budget); its stdout."""
    process = await asyncio.create_subprocess_exec(
        chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(120):
            out, err = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode == 0, err.decode(errors="replace")[-3000:]
    return out.decode()


async def http_get(url: str, path: str) -> tuple[int, str, bytes]:
    """(status, content type, body) of a GET to the dashboard at `url` (http://HOST:PORT/)."""
    match = re.fullmatch(r"http://([\d.]+):(\d+)/", url)
    assert match, url
    host, port = match.group(1), int(match.group(2))
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        async with asyncio.timeout(30):
            answer = await reader.read()
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers["content-type"], body


async def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, kind, body = await http_get(url, "/metrics")
    assert status == 200 and kind.startswith("text/plain; version=0.0.4")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body.decode())
            for sample in family.samples}


def section(dom: str, start: str) -> str:
    """The DOM text from the element opened by `start` (an attribute) to its table's end."""
    index = dom.index(start)
    return dom[index:dom.index("</table>", index)]


async def test_the_dashboard_of_a_two_peer_run(daemon_factory: Any, tmp_path: Path) -> None:
    chromium()  # fail early, with the hint, where it is missing
    first = await daemon_factory("--dashboard.listen", "127.0.0.1:0")
    second = await daemon_factory("--net.bootstrap", await p2p_address(first),
                                  "--dashboard.listen", "127.0.0.1:0")
    infos = [await d.call("node.info") for d in (first, second)]
    url = infos[0]["dashboard"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url) and infos[1]["dashboard"] != url
    ids = [info["peer_id"] for info in infos]
    await asyncio.gather(first.call("run.start", PARAMS), second.call("run.start", PARAMS))

    async def both_live_at(epoch: int) -> dict[str, Any] | None:
        (status,) = await first.call("run.status", {"name": "dash"})
        peers = {p["peer_id"] for p in status.get("live_peers", [])}
        return status if (status["run_epoch"] or 0) >= epoch and peers == set(ids) else None

    await wait_until(lambda: both_live_at(2), timeout=120)
    before = await metrics(url)

    # The snapshot is the control API's own answers.
    status, kind, body = await http_get(url, "/api/snapshot")
    assert status == 200 and kind == "application/json"
    snapshot = orjson.loads(body)
    assert snapshot["node"]["peer_id"] == ids[0] and snapshot["node"]["dashboard"] == url
    assert snapshot["errors"] == {}
    assert {link["peer_id"] for link in snapshot["peers"]} >= {ids[1]}
    (run,) = snapshot["runs"]
    (reference,) = await first.call("run.status", {"name": "dash"})
    assert run["fingerprint"] == reference["fingerprint"] and run["manifest"] == reference["manifest"]
    assert {p["peer_id"] for p in run["live_peers"]} == set(ids)
    assert all(p["started_at"] is not None for p in run["live_peers"])
    assert snapshot["bandwidth"] == await first.call("node.bandwidth")
    assert "rounds" in snapshot["averaging"]
    for path in ("/", "/page.js", "/page.css"):
        status, _, _ = await http_get(url, path)
        assert status == 200

    # The page, rendered with its JS run: live, the run's epoch, both peers, the plots drawn.
    (low,) = await first.call("run.status", {"name": "dash"})
    dom = await run_chromium(url, tmp_path / "profile", "--dump-dom")
    (high,) = await first.call("run.status", {"name": "dash"})
    (tmp_path / "dashboard.html").write_text(dom)
    body_tag = re.search(r"<body[^>]*>", dom)
    assert body_tag and 'data-state="live"' in body_tag.group(0), dom[:2000]
    updates = re.search(r'data-updates="(\d+)"', body_tag.group(0))
    assert updates and int(updates.group(1)) >= 2  # it polled again: live, not a one-off
    run_tag = re.search(r'<section[^>]*data-run="dash"[^>]*>', dom)
    assert run_tag, dom[:3000]
    shown = int(re.search(r'data-run-epoch="(\d+)"', run_tag.group(0)).group(1))  # type: ignore[union-attr]
    assert low["run_epoch"] <= shown <= high["run_epoch"]
    assert re.search(rf'data-field="run-epoch">{shown}<', dom)
    assert re.search(r'data-field="sync">gradients · ↑[^<]*/step · compression ×1\.0<', dom), \
        section(dom, 'data-field="sync"')
    alive = section(dom, 'data-table="alive-peers"')
    leaderboard = section(dom, 'data-table="leaderboard"')
    links = section(dom, 'id="links"')
    for peer_id in ids:
        assert f'data-peer-id="{peer_id}"' in alive and f'data-peer-id="{peer_id}"' in leaderboard
        assert peer_id[:12] in alive  # the short form the page shows
    assert f'data-peer-id="{ids[1]}"' in links and 'data-kind="tcp"' in links
    assert f'id="node-peer-id" data-peer-id="{ids[0]}"' in dom
    for plot in ("loss", "throughput"):
        points = re.search(rf'data-plot="{plot}"[^>]*data-points="(\d+)"', dom)
        assert points and int(points.group(1)) > 0, plot
    assert "<polyline" in dom

    screenshot = tmp_path / "dashboard.png"
    await run_chromium(url, tmp_path / "profile", f"--screenshot={screenshot}")
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 10_000

    # /metrics moves as the run trains.
    await wait_until(lambda: both_live_at(before[("dedloc_run_global_epoch", (("run", "dash"),))] + 2),
                     timeout=120)
    after = await metrics(url)
    run_label = (("run", "dash"),)
    for name in ("dedloc_run_epoch", "dedloc_run_global_epoch", "dedloc_run_samples_total"):
        assert after[(name, run_label)] > before[(name, run_label)], name
    assert after[("dedloc_averaging_rounds_total", ())] > before[("dedloc_averaging_rounds_total", ())]
    sent = ("dedloc_averaging_bytes_total", (("direction", "sent"),))
    assert after[sent] > before[sent]
    assert after[("dedloc_run_peers", (("role", "trainer"), ("run", "dash")))] == 2
    assert after[("dedloc_links", (("kind", "tcp"),))] >= 1
    assert after[("dedloc_rpc_requests_total", ())] > before[("dedloc_rpc_requests_total", ())]
    assert ("dedloc_run_loss", run_label) in after
    info = await first.call("node.info")
    assert info["counters"]["dashboard.requests"] >= 5
