"""The Prometheus text made from a snapshot: valid exposition, the right names, labels and values."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from dedloc.daemon.web.metrics import Exposition, render_metrics

SNAPSHOT: dict[str, Any] = {
    "time": 1_700_000_100.0,
    "errors": {},
    "node": {"peer_id": "6Mkq", "version": "0.1.0", "uptime_seconds": 12.5, "reachable": True,
             "dht": {"mode": "server", "joined": True, "routing_table_size": 3},
             "counters": {"requests": 40, "error.access_denied": 2, "error.bad_token": 1,
                          "membership.refusals": 4, "averaging.refused_banned": 5,
                          "net.connections_refused": 0, "net.handshakes_evicted": 6,
                          "averaging.allreduce.streams_evicted_waiting": 9,
                          "net.links_opened": 7}},
    "peers": [
        {"peer_id": "a", "kind": "tcp", "bytes_in": 100, "bytes_out": 50},
        {"peer_id": "b", "kind": "tcp", "bytes_in": 1, "bytes_out": 2},
        {"peer_id": "c", "kind": "relay", "bytes_in": 10, "bytes_out": 20},
    ],
    "bandwidth": {"upload_bytes_per_second": 20000.0, "download_bytes_per_second": 0.0,
                  "throttled_seconds_up": 1.5, "throttled_seconds_down": 0.0,
                  "throttled_bytes_up": 4096, "throttled_bytes_down": 0},
    "averaging": {"counters": {"rounds": 9, "rounds_ok": 8, "rounds_failed": 1, "offences": 2,
                               "round_milliseconds": 2500, "bytes_sent": 7000, "bytes_received": 6000,
                               "rounds_not_formed": 3, "bans": 1},
                  "rounds": [{"seconds": 0.5}, {"seconds": 0.25, "matchmaking_seconds": 0.1,
                                                "group_size": 2, "bytes_sent": 800,
                                                "bytes_received": 900}],
                  "bandwidth": {"upload_bytes_per_second": 1e6, "download_bytes_per_second": 2e6}},
    "runs": [{"name": "open", "workload": "tiny", "role": "trainer", "state": "running",
              "epoch": 7, "run_epoch": 7, "loss": 0.75, "samples": 1234, "samples_per_second": 99.5,
              "run_samples_per_second": 200.0, "accumulated": 10, "run_samples_accumulated": 30,
              "target_batch_size": 128, "run_eta_seconds": None, "epoch_overhead_seconds": 0.2,
              "run_peers": 2, "run_aux_peers": 0, "failed_rounds": 1, "skipped_steps": 0,
              "state_rounds": 1, "state_downloads": 0, "failed_state_downloads": 0,
              "restarts": 3}],
}


def families(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(parsed: dict[str, Any], name: str, /, **labels: str) -> float:
    """The one sample named `name` (a counter's `_total` included) whose labels include `labels`."""
    found = [s.value for f in parsed.values() for s in f.samples
             if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_the_snapshot_as_prometheus_text() -> None:
    text = render_metrics(SNAPSHOT)
    parsed = families(text)
    for family in parsed.values():
        assert family.name.startswith("dedloc_")
        assert family.documentation, family.name
    for line in text.splitlines():  # every family has its HELP and TYPE lines
        if not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            base = name.removesuffix("_total")
            assert f"# TYPE {name} " in text or f"# TYPE {base} " in text, line
    assert parsed["dedloc_run_epoch"].type == "gauge"
    assert parsed["dedloc_run_samples"].type == "counter"
    assert value(parsed, "dedloc_run_epoch", run="open") == 7
    assert value(parsed, "dedloc_run_loss", run="open") == 0.75
    assert value(parsed, "dedloc_run_samples_total", run="open") == 1234
    assert value(parsed, "dedloc_run_samples_per_second", run="open") == 99.5
    assert value(parsed, "dedloc_run_worker_restarts_total", run="open") == 3
    assert value(parsed, "dedloc_run_peers", run="open", role="trainer") == 2
    assert value(parsed, "dedloc_run_info", run="open", state="running", workload="tiny") == 1
    assert "dedloc_run_eta_seconds" not in parsed  # None: left out, never a made-up number
    assert value(parsed, "dedloc_averaging_rounds_total") == 9
    assert value(parsed, "dedloc_averaging_rounds_failed_total") == 1
    assert value(parsed, "dedloc_averaging_rejected_contributions_total") == 2
    assert value(parsed, "dedloc_averaging_last_round_seconds") == 0.25
    assert value(parsed, "dedloc_averaging_seconds_total") == 2.5
    assert value(parsed, "dedloc_averaging_bytes_total", direction="received") == 6000
    assert value(parsed, "dedloc_averaging_rounds_not_formed_total") == 3
    assert value(parsed, "dedloc_averaging_last_round_bytes", direction="sent") == 800
    assert value(parsed, "dedloc_links", kind="tcp") == 2
    assert value(parsed, "dedloc_links", kind="relay") == 1
    assert value(parsed, "dedloc_links", kind="webrtc") == 0
    assert value(parsed, "dedloc_link_bytes", kind="tcp", direction="in") == 101
    assert value(parsed, "dedloc_refused_total", reason="access_denied") == 2
    assert value(parsed, "dedloc_refused_total", reason="membership") == 4
    assert value(parsed, "dedloc_refused_total", reason="banned_peer") == 5
    assert value(parsed, "dedloc_refused_total", reason="peer_handshake_evicted") == 6
    assert value(parsed, "dedloc_refused_total", reason="peer_stream_evicted") == 9
    assert value(parsed, "dedloc_refused_total", reason="peer_stream") == 0
    assert value(parsed, "dedloc_rpc_requests_total") == 40
    assert value(parsed, "dedloc_bandwidth_cap_bytes_per_second", direction="up") == 20000
    assert value(parsed, "dedloc_bandwidth_throttled_seconds_total", direction="up") == 1.5
    assert value(parsed, "dedloc_node_counter", name="net.links_opened") == 7
    assert value(parsed, "dedloc_info", peer_id="6Mkq", version="0.1.0") == 1
    assert value(parsed, "dedloc_reachable") == 1


def test_a_snapshot_with_nothing_yet() -> None:
    """A daemon that has not joined (averaging.status failed) and runs nothing."""
    parsed = families(render_metrics({"time": 1.0, "node": None, "peers": None, "runs": [],
                                      "averaging": None, "bandwidth": None,
                                      "errors": {"averaging": {"code": 1, "message": "x"}}}))
    assert "dedloc_averaging_rounds" not in parsed and "dedloc_run_epoch" not in parsed
    assert value(parsed, "dedloc_links", kind="tcp") == 0


def test_labels_are_escaped() -> None:
    out = Exposition()
    out.add("dedloc_x", "gauge", 'help with \\ and\nnewline', 1.5, run='a"b\\c\nd')
    out.add("dedloc_x", "gauge", "", float("inf"), run="e")
    out.add("dedloc_x", "gauge", "", float("nan"), run="f")  # NaN is left out
    out.add("dedloc_x", "gauge", "", None, run="g")
    parsed = families(out.text())
    samples = parsed["dedloc_x"].samples
    assert [(s.labels["run"], s.value) for s in samples] == [('a"b\\c\nd', 1.5), ("e", float("inf"))]
    assert parsed["dedloc_x"].documentation == "help with \\ and\nnewline"
