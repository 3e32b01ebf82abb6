"""Prometheus metrics (text exposition format 0.0.4) made from a dashboard snapshot.

The snapshot holds the answers of the control API's own methods (node.info, node.peers,
node.bandwidth, run.status, averaging.status; see dashboard.py), so every number here is one that
those methods report: nothing is counted twice or estimated again. Names start with `dedloc_`;
run metrics carry a `run` label, link metrics a `kind` label. Counters end in `_total`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["counter", "gauge", "untyped"]
LINK_KINDS = ("tcp", "holepunch", "webrtc", "relay")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Refusals by reason: the node.info counter that holds each.
REFUSALS = {
    "access_denied": "error.access_denied",  # control connections from users who may not use it
    "bad_token": "error.bad_token",  # TCP control clients with a wrong token
    "membership": "membership.refusals",  # closed runs: peers without a valid token
    "banned_peer": "averaging.refused_banned",  # streams of peers banned for bad contributions
    "peer_connection": "net.connections_refused",  # peer links refused by the transport
    # handshakes dropped, all slots being held, for a source that held fewer (net/admission.py)
    "peer_handshake_evicted": "net.handshakes_evicted",
    # all-reduce streams refused (bad header, unknown or finished round, no waiting slot)
    "peer_stream": "averaging.allreduce.streams_refused",
    # streams waiting for their round dropped, all slots being held, for a sender that held
    # fewer (averaging/allreduce.py)
    "peer_stream_evicted": "averaging.allreduce.streams_evicted_waiting",
}


@dataclass
class _Family:
    name: str
    kind: Kind
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and not math.isnan(value):
        return float(value)
    return None


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


class Exposition:
    """Metric families in the order they were first added; samples whose value is None are left out."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}

    def add(self, name: str, metric_type: Kind, help_text: str, value: Any, /, **labels: Any) -> None:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = _Family(name, metric_type, help_text)
        number = _number(value)
        if number is not None:
            family.samples.append(({k: str(v) for k, v in labels.items()}, number))

    def text(self) -> str:
        lines = []
        for family in self._families.values():
            if not family.samples:
                continue
            lines.append(f"# HELP {family.name} {_escape(family.help)}")
            lines.append(f"# TYPE {family.name} {family.kind}")
            for labels, value in family.samples:
                label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{family.name}{{{label_text}}} {_format(value)}" if label_text
                             else f"{family.name} {_format(value)}")
        return "\n".join(lines) + "\n"


def render_metrics(snapshot: Mapping[str, Any]) -> str:
    """The Prometheus text of a snapshot (dashboard.Dashboard.snapshot)."""
    out = Exposition()
    _node(out, snapshot.get("node") or {}, snapshot.get("bandwidth") or {})
    _links(out, snapshot.get("peers") or [])
    _averaging(out, snapshot.get("averaging") or {})
    for run in snapshot.get("runs") or []:
        _run(out, run)
    return out.text()


def _node(out: Exposition, info: Mapping[str, Any], bandwidth: Mapping[str, Any]) -> None:
    if info:
        out.add("dedloc_info", "gauge", "This daemon (always 1): its peer id and version.", 1,
                peer_id=info.get("peer_id", ""), version=info.get("version", ""))
    out.add("dedloc_uptime_seconds", "gauge", "Seconds since the daemon started.",
            info.get("uptime_seconds"))
    out.add("dedloc_reachable", "gauge", "1 if other peers can dial this node, 0 if not "
            "(absent: not known yet).", info.get("reachable"))
    dht = info.get("dht") or {}
    out.add("dedloc_dht_routing_table_size", "gauge", "Peers in the DHT's routing table.",
            dht.get("routing_table_size"))
    counters = info.get("counters") or {}
    out.add("dedloc_rpc_requests_total", "counter", "Control API requests answered (the "
            "dashboard's own reads included).", counters.get("requests", 0))
    for reason, key in REFUSALS.items():
        out.add("dedloc_refused_total", "counter", "Refused calls and connections, by reason: "
                "access_denied (control users), bad_token (TCP control), membership (closed runs), "
                "banned_peer (averaging), peer_connection (peer links), peer_handshake_evicted "
                "(a peer link's handshake dropped for another source's when all slots were held), "
                "peer_stream (all-reduce streams), peer_stream_evicted (a stream waiting for its "
                "round dropped for another sender's when all slots were held).",
                counters.get(key, 0), reason=reason)
    for direction in ("up", "down"):
        cap_key = "upload_bytes_per_second" if direction == "up" else "download_bytes_per_second"
        out.add("dedloc_bandwidth_cap_bytes_per_second", "gauge", "The volunteer's bandwidth cap "
                "(0: none).", bandwidth.get(cap_key), direction=direction)
        out.add("dedloc_bandwidth_throttled_seconds_total", "counter", "Time peer traffic waited "
                "for the bandwidth cap.", bandwidth.get(f"throttled_seconds_{direction}"),
                direction=direction)
        out.add("dedloc_bandwidth_throttled_bytes_total", "counter", "Bytes that had to wait for "
                "the bandwidth cap.", bandwidth.get(f"throttled_bytes_{direction}"),
                direction=direction)
    for name, value in sorted(counters.items()):
        out.add("dedloc_node_counter", "untyped", "Every counter node.info reports, by its name "
                "there (most only grow; net.*_cap_* are settings).", value, name=name)


def _links(out: Exposition, peers: list[Mapping[str, Any]]) -> None:
    kinds = {kind: [0, 0, 0] for kind in LINK_KINDS}
    for link in peers:
        entry = kinds.setdefault(str(link.get("kind")), [0, 0, 0])
        entry[0] += 1
        entry[1] += _number(link.get("bytes_in")) or 0
        entry[2] += _number(link.get("bytes_out")) or 0
    for kind, (count, _, _) in kinds.items():
        out.add("dedloc_links", "gauge", "Open links to peers, by kind (tcp, holepunch, webrtc, "
                "relay).", count, kind=kind)
    for kind, (_, bytes_in, bytes_out) in kinds.items():
        out.add("dedloc_link_bytes", "gauge", "Bytes carried by the open links, by kind and "
                "direction (a closed link's bytes leave the sum).", bytes_in, kind=kind,
                direction="in")
        out.add("dedloc_link_bytes", "gauge", "", bytes_out, kind=kind, direction="out")


def _averaging(out: Exposition, status: Mapping[str, Any]) -> None:
    counters = status.get("counters") or {}
    if status:
        out.add("dedloc_averaging_rounds_total", "counter", "Averaging rounds this node took "
                "part in.", counters.get("rounds", 0))
        out.add("dedloc_averaging_rounds_failed_total", "counter", "Rounds with a part left at the "
                "local value (a reducer vanished).", counters.get("rounds_failed", 0))
        out.add("dedloc_averaging_rounds_not_formed_total", "counter", "Rounds whose group could "
                "not be formed (matchmaking failed before the deadline).",
                counters.get("rounds_not_formed", 0))
        out.add("dedloc_averaging_seconds_total", "counter", "Time spent in averaging rounds "
                "(matchmaking and all-reduce), summed.", counters.get("round_milliseconds", 0) / 1000)
        for direction, key in (("sent", "bytes_sent"), ("received", "bytes_received")):
            out.add("dedloc_averaging_bytes_total", "counter", "Bytes this node sent and received "
                    "in averaging rounds.", counters.get(key, 0), direction=direction)
        out.add("dedloc_averaging_rejected_contributions_total", "counter", "Contributions this "
                "node's reducer rejected (screening: NaN, too large, norm outlier).",
                counters.get("offences", 0))
        out.add("dedloc_averaging_bans_total", "counter", "Peers banned for bad contributions.",
                counters.get("bans", 0))
    rounds = status.get("rounds") or []
    last = rounds[-1] if rounds else {}
    out.add("dedloc_averaging_last_round_seconds", "gauge", "Duration of the last round "
            "(matchmaking and all-reduce).", last.get("seconds"))
    out.add("dedloc_averaging_last_round_matchmaking_seconds", "gauge", "Matchmaking time of the "
            "last round.", last.get("matchmaking_seconds"))
    out.add("dedloc_averaging_last_round_group_size", "gauge", "Members of the last round's "
            "group.", last.get("group_size"))
    for direction, key in (("sent", "bytes_sent"), ("received", "bytes_received")):
        out.add("dedloc_averaging_last_round_bytes", "gauge", "Bytes this node sent and received "
                "in the last round.", last.get(key), direction=direction)
    measured = status.get("bandwidth") or {}
    for direction, key in (("up", "upload_bytes_per_second"), ("down", "download_bytes_per_second")):
        out.add("dedloc_averaging_bandwidth_bytes_per_second", "gauge", "Bandwidth that "
                "averaging measured (what the load balancer plans with, before caps).",
                measured.get(key), direction=direction)


def _run(out: Exposition, run: Mapping[str, Any]) -> None:
    name = str(run.get("name"))
    out.add("dedloc_run_info", "gauge", "One per run (always 1): workload, role and state.", 1,
            run=name, workload=run.get("workload", ""), role=run.get("role", ""),
            state=run.get("state", ""))
    gauges = (
        ("dedloc_run_epoch", "epoch", "This peer's epoch (optimizer steps) in the run."),
        ("dedloc_run_global_epoch", "run_epoch", "The run's epoch as this peer estimates it "
         "(collaborative runs)."),
        ("dedloc_run_loss", "loss", "The last training loss."),
        ("dedloc_run_samples_per_second", "samples_per_second", "This peer's training throughput."),
        ("dedloc_run_global_samples_per_second", "run_samples_per_second", "The run's throughput "
         "(the trainers at its epoch)."),
        ("dedloc_run_accumulated_samples", "accumulated", "Samples this peer accumulated toward the "
         "current epoch."),
        ("dedloc_run_global_accumulated_samples", "run_samples_accumulated", "Samples the run "
         "accumulated toward its target batch."),
        ("dedloc_run_target_batch_size", "target_batch_size", "Samples per epoch (the target)."),
        ("dedloc_run_eta_seconds", "run_eta_seconds", "Estimated seconds until the run's target."),
        ("dedloc_run_epoch_overhead_seconds", "epoch_overhead_seconds", "Seconds from the target to "
         "this peer's last step (averaging and stepping)."),
    )
    for metric, key, help_text in gauges:
        out.add(metric, "gauge", help_text, run.get(key), run=name)
    for role, key in (("trainer", "run_peers"), ("aux", "run_aux_peers")):
        out.add("dedloc_run_peers", "gauge", "Live peers of the run, by role.", run.get(key),
                run=name, role=role)
    counters = (
        ("dedloc_run_samples_total", "samples", "Samples this peer trained in the run."),
        ("dedloc_run_rounds_total", "rounds", "Averaging rounds of an aux peer in the run."),
        ("dedloc_run_failed_rounds_total", "failed_rounds", "Gradient rounds that failed (no step "
         "was taken on them)."),
        ("dedloc_run_rounds_sat_out_total", "rounds_sat_out", "Grid rounds whose slices had no "
         "room for this peer (it sat them out)."),
        ("dedloc_run_skipped_steps_total", "skipped_steps", "Steps skipped for non-finite "
         "gradients."),
        ("dedloc_run_state_rounds_total", "state_rounds", "Parameter and optimizer state "
         "averaging rounds."),
        ("dedloc_run_state_downloads_total", "state_downloads", "Downloads of the run's state from "
         "a peer."),
        ("dedloc_run_failed_state_downloads_total", "failed_state_downloads", "State downloads "
         "that failed."),
        ("dedloc_run_refuted_states_total", "refuted_states", "Downloaded states that witnesses "
         "at their head contradicted (not loaded)."),
        ("dedloc_run_unverified_states_total", "unverified_states", "Downloaded states loaded "
         "with no witness able to check them."),
        ("dedloc_run_reports_beyond_pace_total", "reports_beyond_pace", "Peers seen reporting "
         "an epoch the run's pace rules out (not counted for its head)."),
        ("dedloc_run_reports_unserved_total", "reports_unserved", "Peers passed over: they "
         "reported an epoch ahead of this peer's but their state download failed lately."),
        ("dedloc_run_states_served_total", "states_served", "Downloads of this peer's state "
         "that it served to others."),
        ("dedloc_run_worker_restarts_total", "restarts", "Restarts of the run's worker."),
    )
    for metric, key, help_text in counters:
        out.add(metric, "counter", help_text, run.get(key), run=name)


__all__ = ["CONTENT_TYPE", "Exposition", "render_metrics"]
