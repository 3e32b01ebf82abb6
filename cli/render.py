"""Human-readable text for the CLI's answers (the --json flag prints them raw instead)."""

from __future__ import annotations

import math
from typing import Any

BAR_WIDTH = 30


def progress_bar(done: float, total: float, width: int = BAR_WIDTH) -> str:
    fraction = 0.0 if total <= 0 else min(1.0, max(0.0, done / total))
    filled = round(fraction * width)
    return "[" + "#" * filled + "." * (width - filled) + f"] {fraction * 100:5.1f}%"


def render_info(info: dict[str, Any]) -> str:
    runs = ", ".join(f"{n} {state}" for state, n in info.get("runs", {}).items()) or "none"
    p2p = ", ".join(info["addresses"].get("p2p", [])) or "none yet"
    reachable = {True: "yes", False: "no (behind NAT or firewall)", None: "not known yet"}[
        info.get("reachable")]
    dht = info.get("dht") or {}
    control = info["addresses"]["control"]
    if info["addresses"].get("control_tcp"):
        control += f", tcp:{info['addresses']['control_tcp']}"
    return (f"peer id   {info['peer_id']}\n"
            f"version   {info['version']} (pid {info['pid']}, up {info['uptime_seconds']:.0f} s)\n"
            f"control   {control}\n"
            f"p2p       {p2p}\n"
            f"reachable {reachable}\n"
            f"dht       {dht.get('mode', '?')}, {dht.get('routing_table_size', 0)} peers known"
            f"{'' if dht.get('joined') else ', not joined'}\n"
            f"state dir {info['state_dir']}\n"
            f"runs      {runs}\n")


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024  # type: ignore[assignment]
    return str(count)


def render_peers(peers: list[dict[str, Any]]) -> str:
    if not peers:
        return "no peers connected\n"
    lines = [f"{'peer id':<48} {'link':<5} {'dir':<4} {'rtt':>8} {'in':>10} {'out':>10}  address\n"]
    for peer in sorted(peers, key=lambda p: p["peer_id"]):
        rtt = "-" if peer.get("rtt_ms") is None else f"{peer['rtt_ms']:.1f} ms"
        lines.append(f"{peer['peer_id']:<48} {peer['kind']:<5} "
                     f"{'out' if peer['outbound'] else 'in':<4} {rtt:>8} {_size(peer['bytes_in']):>10} "
                     f"{_size(peer['bytes_out']):>10}  {peer.get('address') or ''}\n")
    return "".join(lines)


def render_workloads(listing: dict[str, Any]) -> str:
    lines = []
    for workload in listing.get("workloads", []):
        lines.append(f"{workload['name']}  ({workload.get('plugin', '?')}, version "
                     f"{workload.get('version', '?')})\n  {workload.get('description', '')}\n")
        for key, schema in workload.get("config_schema", {}).get("properties", {}).items():
            lines.append(f"    {key} = {schema.get('default')!r}  {schema.get('description', '')}\n")
    for error in listing.get("errors", []):
        lines.append(f"! plugin {error.get('plugin')} failed to load: {error.get('error')}\n")
    return "".join(lines) or "no workloads installed\n"


LABEL_WIDTH = 12
STATUS_BAR_WIDTH = 20
PEER_ID_CHARS = 12
CONTRIBUTION_ROWS = 10
NONE = "—"


def _number(value: Any) -> float | None:
    """`value` if it is a real number (not a bool, NaN or infinity), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if math.isfinite(value) else None


def format_duration(seconds: Any) -> str:
    """A short human duration: "12s", "3m04s", "1h02m", "2d03h"; "—" when unknown."""
    value = _number(seconds)
    if value is None:
        return NONE
    if 0 < value < 0.5:
        return "<1s"
    total = max(0, round(value))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    minutes = round(total / 60)
    if minutes < 24 * 60:
        return f"{minutes // 60}h{minutes % 60:02d}m"
    hours = round(total / 3600)
    return f"{hours // 24}d{hours % 24:02d}h"


def format_bytes(count: Any) -> str:
    """Decimal units, as network traffic is usually counted: "950 B", "1.2 MB"."""
    value = _number(count)
    if value is None:
        return NONE
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def _count(value: Any) -> str:
    number = _number(value)
    return NONE if number is None else f"{number:,.0f}"


def _rate(value: Any) -> str:
    number = _number(value)
    return NONE if number is None else f"{number:,.1f} samples/s"


def _seconds(value: Any) -> str:
    number = _number(value)
    return NONE if number is None else f"{number:.2f} s"


def _plural(count: float, word: str) -> str:
    return f"{count:,.0f} {word if count == 1 else word + 's'}"


def _row(label: str, text: str) -> str:
    return f"  {label:<{LABEL_WIDTH}}{text}\n"


def _epoch_text(run: dict[str, Any]) -> str | None:
    own, shared, target = run.get("epoch"), run.get("run_epoch"), run.get("epochs")
    current = shared if shared is not None else own
    if current is None and target is None:
        return None
    text = f"epoch {NONE if current is None else current}"
    if target is not None:
        text += f"/{target}"
    if shared is not None and own is not None and own != shared:
        text += f" (own {own})"
    return text


def _step_row(run: dict[str, Any], collaborative: bool) -> str | None:
    """Samples toward the next optimizer step: the run's if known, else this peer's."""
    own = _number(run.get("accumulated"))
    shared = _number(run.get("run_samples_accumulated"))
    target = _number(run.get("target_batch_size"))
    sync = run.get("sync") if isinstance(run.get("sync"), dict) else {}
    inner = _number(sync.get("inner_steps"))
    if sync.get("mode") == "local" and target is not None and inner is not None:
        target *= inner  # a local-update run steps after H target batches
    done = shared if shared is not None else own
    if done is None and target is None:
        return None
    text = f"{_count(done)}/{_count(target)} samples"
    if target is not None and target > 0 and done is not None:
        text = f"{progress_bar(done, target, STATUS_BAR_WIDTH)}  {text}"
    if collaborative and shared is None:
        text += " (this peer's; the run's not known yet)"
    eta = run.get("run_eta_seconds")
    if collaborative or _number(eta) is not None:
        text += f" · eta {format_duration(eta)}"
    return _row("next outer step" if sync.get("mode") == "local" else "next step", text)


def _sync_row(run: dict[str, Any]) -> str | None:
    """A local-update run's inner and outer steps, and what each exchange costs."""
    sync = run.get("sync")
    if not isinstance(sync, dict) or sync.get("mode") != "local":
        return None
    parts = [f"local updates, H {_count(sync.get('inner_steps'))}",
             f"outer step {_count(sync.get('outer_step'))}",
             f"inner step {_count(sync.get('inner_step'))}"]
    if sync.get("bytes_sent_per_step") is not None:
        parts.append(f"↑{format_bytes(sync.get('bytes_sent_per_step'))}/outer step")
    ratio = _number(sync.get("compression_ratio"))
    if ratio is not None:
        parts.append(f"compression ×{ratio:.1f}")
    inner_lr = _number(sync.get("inner_lr"))
    if inner_lr is not None:  # the workload's lr times inner_lr_scale
        scale = sync.get("inner_lr_scale")
        parts.append(f"inner lr {inner_lr:.3g}" + (" (auto)" if scale == "auto" else ""))
    return _row("sync", " · ".join(parts))


def _round_text(last: Any) -> str:
    if not isinstance(last, dict):
        return "none yet"
    size = last.get("group_size")
    parts = [f"group {NONE if size is None else size}", _seconds(last.get("seconds")),
             f"↑{format_bytes(last.get('bytes_sent'))} ↓{format_bytes(last.get('bytes_received'))}"]
    failed = last.get("failed_parts")
    if failed:
        parts.append(f"failed ({_plural(len(failed), 'part')} not averaged)"
                     if isinstance(failed, list | tuple) else "failed")
    return " · ".join(parts)


def _contribution_rows(contributions: dict[str, Any], own_id: Any) -> list[str]:
    ranked = sorted(contributions.items(), key=lambda item: (-(_number(item[1]) or 0), str(item[0])))
    indent = " " * (2 + LABEL_WIDTH)
    lines = [f"{indent}{str(peer)[:PEER_ID_CHARS]:<{PEER_ID_CHARS}} {_count(samples):>12}"
             + ("  (you)" if own_id is not None and peer == own_id else "") + "\n"
             for peer, samples in ranked[:CONTRIBUTION_ROWS]]
    if len(ranked) > CONTRIBUTION_ROWS:
        rank = next((i for i, (peer, _) in enumerate(ranked, 1) if own_id is not None and peer == own_id), 0)
        lines.append(f"{indent}… and {len(ranked) - CONTRIBUTION_ROWS} more"
                     + (f" (this peer is #{rank})" if rank > CONTRIBUTION_ROWS else "") + "\n")
    return lines


def _samples_rows(run: dict[str, Any], collaborative: bool) -> list[str]:
    """This peer's samples and, in a collaborative run, what each peer of the run contributed."""
    contributions = run.get("contributions")
    contributions = contributions if isinstance(contributions, dict) else {}
    own = run.get("samples")
    if not collaborative:
        return [] if own is None else [_row("samples", f"{_count(own)} trained")]
    rows = []
    if run.get("role") != "aux" or _number(own):
        accumulated = _number(run.get("accumulated"))
        rows.append(_row("samples", f"{_count(own)} by this peer"
                         + (f" ({_count(accumulated)} in this step)" if accumulated else "")))
    if contributions:
        total = sum(_number(samples) or 0 for samples in contributions.values())
        rows.append(_row("run samples", f"{_count(total)} from {_plural(len(contributions), 'peer')}"))
        rows.extend(_contribution_rows(contributions, run.get("peer_id")))
    return rows


def _events_text(run: dict[str, Any]) -> str | None:
    """The counters worth a volunteer's eye, those that are not zero."""
    events = []
    for key, word in (("failed_rounds", "failed round"), ("state_downloads", "state download"),
                      ("skipped_steps", "skipped step"), ("restarts", "restart")):
        count = _number(run.get(key))
        if count:
            events.append(_plural(count, word))
    return " · ".join(events) or None


def render_status(run: dict[str, Any]) -> str:
    """One run's progress, for people; every field may be missing or None (older daemons, local
    runs, aux peers) and is then left out or shown as "—"."""
    collaborative = bool(run.get("collaborative"))
    aux = run.get("role") == "aux"
    head = f"{run.get('name') or '?'} [{run.get('workload') or '?'}]  {run.get('state') or '?'}"
    epoch = _epoch_text(run)
    lines = [head + (f" · {epoch}" if epoch else "") + "\n"]

    role, phase = run.get("role"), run.get("phase")
    if role or phase:
        doing = f" · now {str(phase).replace('_', ' ')}" if phase else ""  # "downloading_state"
        lines.append(_row("role", f"{role or NONE}{doing}"))
    step = _step_row(run, collaborative)
    if step:
        lines.append(step)
    sync_row = _sync_row(run)
    if sync_row:
        lines.append(sync_row)
    trainers, helpers = run.get("run_peers"), run.get("run_aux_peers")
    if collaborative and trainers is None and helpers is None:
        lines.append(_row("peers", "not known yet"))
    elif trainers is not None or helpers is not None:
        count = _number(trainers)
        text = (NONE + " peers" if count is None else _plural(count, "peer")) + " training"
        if helpers is not None:
            text += f" · {_count(helpers)} aux"
        lines.append(_row("peers", text))

    own_speed, run_speed = run.get("samples_per_second"), run.get("run_samples_per_second")
    if collaborative or run_speed is not None:
        speeds = [] if aux and own_speed is None else [f"own {_rate(own_speed)}"]
        lines.append(_row("speed", " · ".join([*speeds, f"run {_rate(run_speed)}"])))
    elif own_speed is not None:
        lines.append(_row("speed", _rate(own_speed)))

    loss, first = _number(run.get("loss")), _number(run.get("loss_first"))
    if loss is not None:
        lines.append(_row("loss", f"{loss:.4f}" + (f" (from {first:.4f})" if first is not None else "")))
    elif not aux:
        lines.append(_row("loss", NONE))

    if collaborative or run.get("last_round") is not None:
        lines.append(_row("last round", _round_text(run.get("last_round"))))
    own_overhead, run_overhead = run.get("epoch_overhead_seconds"), run.get("run_epoch_overhead_seconds")
    if own_overhead is not None or run_overhead is not None:
        lines.append(_row("overhead", f"own {_seconds(own_overhead)} · run worst {_seconds(run_overhead)}"
                                      " (last epoch)"))
    lines.extend(_samples_rows(run, collaborative))

    events = _events_text(run)
    if events:
        lines.append(_row("events", events))
    error = run.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else error
        lines.append(_row("error", str(message or error)))
    worker = run.get("worker") if isinstance(run.get("worker"), dict) else {}
    last_lines = worker.get("last_log_lines")
    if run.get("state") in ("crashed", "failed") and isinstance(last_lines, list) and last_lines:
        lines.append("  worker's last lines:\n")
        lines.extend(f"    {line}\n" for line in last_lines[-10:])
    return "".join(lines)
