"""Human-readable text for the CLI's answers (the --json flag prints them raw instead)."""

from __future__ import annotations

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
    return (f"peer id   {info['peer_id']}\n"
            f"version   {info['version']} (pid {info['pid']}, up {info['uptime_seconds']:.0f} s)\n"
            f"control   {info['addresses']['control']}\n"
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


def render_status(run: dict[str, Any]) -> str:
    loss = run.get("loss")
    loss_text = "-" if loss is None else f"{loss:.4f}"
    first = run.get("loss_first")
    if first is not None and loss is not None:
        loss_text += f" (from {first:.4f})"
    speed = run.get("samples_per_second")
    epochs = run.get("epochs")
    epoch_text = f"{run['epoch']}" + (f"/{epochs}" if epochs else "")
    text = (f"{run['name']} [{run['workload']}] {run['state']}  epoch {epoch_text}  "
            f"samples {run['samples']}  loss {loss_text}"
            + (f"  {speed:.1f} samples/s" if speed else "") + "\n"
            + f"  next step {progress_bar(run['accumulated'], run['target_batch_size'])} "
              f"{run['accumulated']}/{run['target_batch_size']}\n")
    if run.get("collaborative") and run.get("run_peers") is not None:
        eta = run.get("run_eta_seconds")
        last = run.get("last_round") or {}
        text += (f"  run: {run['run_peers']} trainers, {run.get('run_samples_accumulated', 0)}/"
                 f"{run['target_batch_size']} samples toward the next step"
                 + (f", eta {eta:.1f} s" if eta else "")
                 + (f"; last round: {last.get('group_size')} peers in {last.get('seconds')} s"
                    if last else "") + "\n")
    error = run.get("error")
    if error:
        text += f"  error: {error.get('message')}\n"
    worker = run.get("worker") or {}
    if run["state"] in ("crashed", "failed") and worker.get("last_log_lines"):
        text += "  worker's last lines:\n" + "".join(
            f"    {line}\n" for line in worker["last_log_lines"][-10:])
    return text
