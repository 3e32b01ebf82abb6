"""Hostile-peer benchmark (issue 15, "Show it"): 4 honest dedlocd daemons train the built-in `tiny`
workload in an open collaborative run while 1, then 3, hostile identities join it, one attack at
a time; each run is compared with a clean run of the same honest peers.

    python benchmarks/hostile.py --json [--epochs 5] [--attacks sender_nan,weight,...]
                                 [--identities 1,3] [--quick]

Every daemon listens on 127.0.0.1 only (temporary state directories). The honest peers keep the
same identities (identity.key) in every run, so their data seeds (from the peer id and the run's
name) and the leaders' order among them are those of the clean run. A hostile identity is a real
daemon that joins the same run as a trainer (it trains and reports progress honestly) and
misbehaves through a test-only switch of daemon/averaging/corruption.py (DEDLOC_TESTING=1):

  sender_nan     DEDLOC_TEST_CORRUPT_PARTS=nan: every chunk it sends holds a NaN. Honest outcome:
                 the reducers reject its chunks and leave it out of the round (senders_excluded),
                 then ban it (offences_nonfinite, bans); no honest round fails for it; the
                 parameters stay within the clean runs' own spread.
  sender_scale   DEDLOC_TEST_CORRUPT_PARTS=scale=1e6: its chunks are finite but a million times
                 too large. Honest outcome: the norm rule (1000 x the median) rejects them, as
                 above. With 3 identities, 3 of 7 senders: the median is still honest.
  wrong_answers  DEDLOC_TEST_WRONG_ANSWERS=scale=10: as a reducer it answers its part times 10,
                 its account honest. Honest outcome: every member finds the answer contradicts
                 the account, does not apply it (that part keeps its own values: failed_parts,
                 the round counted in rounds_failed) and bans the reducer at once
                 (offences_wrong_average); later rounds leave it out. The first round's part stays
                 local, so the honest peers' parameters can differ a little from the clean run's.
  wrong_zeros    DEDLOC_TEST_WRONG_ANSWERS=zeros: the same with zeros (not in the default list).
  forged_account DEDLOC_TEST_WRONG_ANSWERS=forge: as a reducer it answers zeros and forges its
                 account to agree, misstating the contribution of the sender of largest weight.
                 Honest outcome: that sender refuses the answer (offences_wrong_average) and
                 shows the others the chunk it signed (accusations_sent); they applied the zeros,
                 find the account misstated it and ban the reducer (forged_accounts,
                 offences_forged_account). Its first round's part is lost.
  forged_own     DEDLOC_TEST_WRONG_ANSWERS=forge_own: the same, misstating its own contribution,
                 which nobody else sees. Honest outcome: every member applies the zeros, then
                 audits a segment of its own contribution (audits_failed) and bans it
                 (offences_forged_account); honest reducers pass (audits_passed).
  equivocating   DEDLOC_TEST_WRONG_ANSWERS=equivocate: it answers zeros and sends each member an
                 account in which that member's entry is true and another's forged. Honest
                 outcome: every member applies the zeros; after the round their summaries of
                 what it signed differ, and each bans it (equivocations, offences_equivocation).
  withheld_forgery  DEDLOC_TEST_WRONG_ANSWERS=forge_skip: it answers zeros, forges its account
                 to agree by misstating the sender of largest weight, and sends that sender a
                 skip in place of each answer. Honest outcome: the others apply the zeros; after
                 the round the skipped sender asks one of them for the account (avg.account),
                 finds its entry misstated and accuses; all ban it (withheld_forgeries,
                 offences_forged_account).
  bandwidth      DEDLOC_TEST_CLAIMED_BANDWIDTH=1e12: it claims 1e12 B/s to be given most of the
                 vector to reduce. Honest outcome: it is NOT excluded (its transfers are honest):
                 honest leaders bound its claim (bandwidth_claims_bounded, _cut), it reduces at
                 most 2 equal shares (`attacker_max_share`, a fraction of the vector: at most
                 2 / group size), every round completes, the parameters are unharmed.
  weight         DEDLOC_TEST_CLAIMED_WEIGHT=1e15: it claims (and weights its contribution by) an
                 averaging weight of 1e15 to make the average its own vector. Honest outcome: an
                 honest leader refuses it at join (offences_weight; banned after 3), honest
                 followers refuse a group it leads (refused_groups: that round they average
                 alone or in smaller groups), so it never averages with honest peers; the
                 parameters are unharmed.
  leader_equivocation  DEDLOC_TEST_EQUIVOCATING_LEADER=1: leading a group of three or more, it
                 sends its first follower the group with its own weight halved, under the same
                 id and signed as the true one. Honest outcome: the members' streams and chunks
                 name their round by its group and carry the leader's signature; every member
                 that meets the other group's name holds the leader's two signatures and bans it
                 at once (offences_leader_equivocation, leader_equivocations); no honest member
                 is counted an offence. It goes unseen while it never leads three or more.
  handshake_flood  no hostile daemon: each identity stands for 4 source addresses (127.0.0.2,
                 ...) from which this process holds 16 silent TCP connections to every honest
                 daemon's peer port (connection_flood.py: 64 per daemon with one identity, all
                 its handshake slots), opening another as soon as one is dropped, from before
                 the honest peers link up until the end. The honest daemons count loopback per
                 address for this attack (--net.limit_loopback true). Honest outcome: the
                 honest peers link up and train as in the clean run, every round completes;
                 `net_counters` shows the slots taken over (handshakes_evicted) and the
                 refusals, `flood` what the attacker opened and lost.
  waiting_flood  no hostile daemon: each identity stands for 32 free peer ids of this process
                 (stream_flood.py), each linked to every honest daemon and holding 8 `avg.part`
                 streams there for rounds that never start (one identity: 256 per daemon, every
                 waiting slot), opening another as soon as one is dropped, from before the run
                 starts until the end. Honest outcome: every round completes as in the clean run;
                 an early honest stream takes over a flood stream's slot (`allreduce_counters`:
                 streams_evicted_waiting) instead of being refused and asking again
                 (streams_refused_all_waiting, streams_reopened_not_started); `flood` says what
                 the attacker opened and how each stream was dropped.
  control        no switch: the extra identities are honest trainers (DEDLOC_TESTING=1 only).
                 The baseline for param_distance: extra trainers' gradients and samples change
                 the trajectory by themselves (e.g. `bandwidth`, whose attacker is averaged in).

For each (attack, identities) the JSON object's `attacks` has one entry:
  rounds                max over honest peers of the averaging rounds its run ran (run.status)
  honest_rounds_failed  the honest peers' rounds that did not allow a step (run.status
                        failed_rounds, summed); `honest_rounds_with_failed_parts`: their rounds
                        with a part left at the local value (averaging counters rounds_failed)
  param_distance        max over honest peers of ||p - p_clean|| / ||p_clean||, p the peer's final
                        parameters (its last checkpoint), p_clean the same peer's in the clean run
                        (same identity, seeds and epochs). Two clean runs differ too (which peer's
                        batches make an epoch depends on timing): `clean.repeat_distance` is that
                        noise floor; `clean.peer_spread` the largest distance between the clean
                        run's peers
  victim_peak_rss_mb    the honest daemons' peak RSS (sampled every 0.5 s; max, and mean)
  attacker_excluded     every attacker is, for every honest peer, banned or absent from its last
                        round (or left out of it as a sender). Also: `attackers_banned_by` (per
                        attacker, how many honest peers ban it), `rounds_with_attacker` (honest
                        peers' rounds that listed an attacker), `attacker_max_share`
  counters              the honest peers' averaging counters summed (the non-zero ones)
  wall_seconds, epochs_done, honest_states, attacker_states
An honest run that fails, crashes or does not finish within --max-seconds is reported as such
(`completed`: false, `error`), never hidden; its distance is then null.

`clean` is the clean run (4 honest peers): rounds, wall seconds, peer_spread and (unless
--clean-repeats 1) repeat_distance. `robust_aggregation` times one all-reduce of 4 x 64 MiB in
one process (benchmarks/allreduce_inproc.py: TLS on loopback, the reducers' accounts on), best of
--robust-rounds, with the weighted mean, the norm-clipped mean (a run's default aggregation) and
centered clipping (averaging.robust_aggregation = "centered_clip"), their rounds taking turns,
and the ratios to the mean (`ratio`: centered clipping's; `norm_clip_ratio`).

--quick is a smoke run: 2 epochs, target batch 128, identities 1, one clean run, robust
aggregation on 4 x 4 MiB with 1 round. Every honest daemon is stopped (run.stop, node.shutdown,
then its process group killed), every hostile one killed (its process group), also on errors,
Ctrl-C and SIGTERM, and the temporary directory is removed (--keep keeps it). Prints one JSON
object (with --json only that; else a table first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collab import RUN, BenchmarkError, Daemon, MemorySampler  # one copy of the daemon handling
from connection_flood import ConnectionFlood, flood_sources
from stream_flood import WaitingStreamFlood

from dedloc.rpc import RpcError

HONEST = 4
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
DAEMON_ARGS = ("--workers.threads", "1")
HOSTILE_ENV = {"DEDLOC_TESTING": "1"}
MIB = 1 << 20


@dataclass(frozen=True)
class Attack:
    name: str
    env: dict[str, str]
    flood_sources: int = 0  # per identity: a ConnectionFlood from this process, no hostile daemon
    stream_flood_peers: int = 0  # per identity: a WaitingStreamFlood's peer ids, no hostile daemon


ATTACKS: dict[str, Attack] = {a.name: a for a in (
    Attack("sender_nan", {"DEDLOC_TEST_CORRUPT_PARTS": "nan"}),
    Attack("sender_scale", {"DEDLOC_TEST_CORRUPT_PARTS": "scale=1e6"}),
    Attack("wrong_answers", {"DEDLOC_TEST_WRONG_ANSWERS": "scale=10"}),
    Attack("wrong_zeros", {"DEDLOC_TEST_WRONG_ANSWERS": "zeros"}),
    Attack("forged_account", {"DEDLOC_TEST_WRONG_ANSWERS": "forge"}),
    Attack("forged_own", {"DEDLOC_TEST_WRONG_ANSWERS": "forge_own"}),
    Attack("equivocating", {"DEDLOC_TEST_WRONG_ANSWERS": "equivocate"}),
    Attack("withheld_forgery", {"DEDLOC_TEST_WRONG_ANSWERS": "forge_skip"}),
    Attack("bandwidth", {"DEDLOC_TEST_CLAIMED_BANDWIDTH": "1e12"}),
    Attack("weight", {"DEDLOC_TEST_CLAIMED_WEIGHT": "1e15"}),
    Attack("leader_equivocation", {"DEDLOC_TEST_EQUIVOCATING_LEADER": "1"}),
    Attack("handshake_flood", {}, flood_sources=4),
    Attack("waiting_flood", {}, stream_flood_peers=32),
    Attack("control", {}),
)}
FLOOD_PER_SOURCE = 16  # connections per source address and honest daemon (a daemon's own limit)
NET_COUNTERS = ("connections_accepted", "connections_refused", "connections_refused_per_source",
                "handshakes_evicted", "handshake_failures")
ALLREDUCE_COUNTERS = ("streams_evicted_waiting", "streams_refused_all_waiting",
                      "streams_refused_peer_waiting", "streams_refused", "streams_reopened_not_started",
                      "accusations_sent", "forged_accounts", "accusations_false",
                      "accusations_unproven", "equivocations", "leader_equivocations",
                      "withheld_forgeries", "withheld_checked", "withheld_unproven",
                      "group_mismatches", "answer_summaries_unproven",
                      "audits_made", "audits_passed", "audits_failed",
                      "audits_unanswered")
DEFAULT_ATTACKS = ("control,sender_nan,sender_scale,wrong_answers,forged_account,forged_own,"
                   "equivocating,withheld_forgery,bandwidth,weight,leader_equivocation,"
                   "handshake_flood,waiting_flood")


# --- pure parts -------------------------------------------------------------------------------------

def parse_attacks(text: str) -> list[Attack]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("no attack given")
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        raise ValueError(f"unknown attack(s) {', '.join(unknown)} (known: {', '.join(ATTACKS)})")
    if len(set(names)) != len(names):
        raise ValueError("an attack is named twice")
    return [ATTACKS[n] for n in names]


def parse_identities(text: str) -> list[int]:
    try:
        counts = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise ValueError(f"identities must be whole numbers, not {text!r}") from None
    if not counts or any(c < 1 for c in counts):
        raise ValueError("identities: at least one count, each at least 1")
    return counts


def flatten(state: Mapping[str, Any]) -> np.ndarray:
    """A model's state (name -> array or tensor) as one float64 vector, names in sorted order."""
    parts = [np.asarray(state[name], dtype=np.float64).reshape(-1) for name in sorted(state)]
    return np.concatenate(parts) if parts else np.zeros(0)


def relative_distance(params: np.ndarray, reference: np.ndarray) -> float:
    """||params - reference|| / ||reference|| (inf when params is not finite)."""
    if params.shape != reference.shape:
        raise ValueError(f"{params.shape} parameters against {reference.shape}")
    if not np.isfinite(params).all():
        return float("inf")
    norm = float(np.linalg.norm(reference))
    if norm == 0.0:
        raise ValueError("the reference parameters are all zero")
    return float(np.linalg.norm(params - reference)) / norm


def param_distance(finals: Sequence[np.ndarray | None], cleans: Sequence[np.ndarray]) -> float | None:
    """The max over honest peers of their relative distance from the same peer in the clean run;
    None if a peer has no final parameters (its run did not finish)."""
    if any(f is None for f in finals) or len(finals) != len(cleans):
        return None
    return max(relative_distance(f, c) for f, c in zip(finals, cleans, strict=True) if f is not None)


def peer_spread(finals: Sequence[np.ndarray]) -> float:
    """The largest relative distance of a peer's parameters from peer 0's."""
    return max((relative_distance(f, finals[0]) for f in finals[1:]), default=0.0)


def sum_counters(counters: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The honest peers' averaging counters summed, the non-zero ones, sorted."""
    total: Counter[str] = Counter()
    for c in counters:
        total.update({k: v for k, v in c.items() if isinstance(v, int | float) and not isinstance(v, bool)})
    return {k: v for k, v in sorted(total.items()) if v}


def exclusion(averaging: Sequence[Mapping[str, Any]], attackers: Sequence[str]) -> dict[str, Any]:
    """From the honest peers' averaging.status: whether the attackers are left out by the end."""
    banned_by = {a: 0 for a in attackers}
    with_attacker, max_share, excluded = 0, 0.0, True
    for status in averaging:
        banned = {b["peer_id"] for b in status.get("bans", {}).get("active", [])}
        for a in attackers:
            banned_by[a] += a in banned
        rounds = status.get("rounds", [])
        for entry in rounds:
            members, shares = entry.get("members", []), entry.get("shares", [])
            total = sum(shares)
            for position, member in enumerate(members):
                if member in attackers and total and position < len(shares):
                    max_share = max(max_share, shares[position] / total)
            with_attacker += any(m in attackers for m in members)
        last = rounds[-1] if rounds else {}
        left_out = set(last.get("senders_excluded", {}))
        for a in attackers:
            if a not in banned and a in last.get("members", []) and a not in left_out:
                excluded = False
    return {"attacker_excluded": excluded if attackers else None,
            "attackers_banned_by": [banned_by[a] for a in attackers],
            "rounds_with_attacker": with_attacker, "attacker_max_share": round(max_share, 4)}


def rss_summary(peaks: Sequence[int]) -> dict[str, float | None]:
    values = [p / MIB for p in peaks if p]
    return {"max": round(max(values), 1) if values else None,
            "mean": round(float(np.mean(values)), 1) if values else None}


@dataclass
class RunResult:
    """What one run of the swarm gave (see run_swarm)."""

    completed: bool
    error: str | None
    seconds: float
    statuses: list[dict[str, Any]]  # the honest peers' run.status (those that answered)
    averaging: list[dict[str, Any]]  # the honest peers' averaging.status
    attackers: list[str]  # their peer ids
    attacker_states: list[str | None]
    finals: list[np.ndarray | None]
    rss_peaks: list[int]
    extra: dict[str, Any] = field(default_factory=dict)


def attack_entry(attack: str, identities: int, run: RunResult,
                 cleans: Sequence[np.ndarray]) -> dict[str, Any]:
    distance = param_distance(run.finals, cleans) if run.completed else None
    finite = None if distance is None else bool(np.isfinite(distance))
    counters = sum_counters([s.get("counters", {}) for s in run.averaging])
    return {
        "attack": attack, "identities": identities, "completed": run.completed, "error": run.error,
        "rounds": max((int(s.get("rounds", 0)) for s in run.statuses), default=0),
        "honest_rounds_failed": sum(int(s.get("failed_rounds", 0)) for s in run.statuses),
        "honest_rounds_with_failed_parts": int(counters.get("rounds_failed", 0)),
        "param_distance": round(distance, 6) if distance is not None and finite else None,
        "params_finite": finite,
        "victim_peak_rss_mb": rss_summary(run.rss_peaks),
        **exclusion(run.averaging, run.attackers),
        "wall_seconds": round(run.seconds, 2),
        "epochs_done": [s.get("epoch") for s in run.statuses],
        "honest_states": [s.get("state") for s in run.statuses],
        "attacker_states": run.attacker_states,
        "counters": counters,
        **run.extra,
    }


def failed_entry(attack: str, identities: int, error: str) -> dict[str, Any]:
    """A run that broke off (a daemon exited, an RPC failed): reported, not hidden."""
    return {"attack": attack, "identities": identities, "completed": False, "error": error,
            "rounds": None, "honest_rounds_failed": None, "param_distance": None,
            "attacker_excluded": None, "victim_peak_rss_mb": {"max": None, "mean": None},
            "wall_seconds": None}


def clean_entry(runs: Sequence[RunResult]) -> dict[str, Any]:
    first = runs[0]
    finals = [f for f in first.finals if f is not None]
    repeats = [param_distance(r.finals, finals) for r in runs[1:]]
    return {
        "rounds": max((int(s.get("rounds", 0)) for s in first.statuses), default=0),
        "honest_rounds_failed": sum(int(s.get("failed_rounds", 0)) for s in first.statuses),
        "wall_seconds": [round(r.seconds, 2) for r in runs],
        "peer_spread": round(peer_spread(finals), 6) if finals else None,
        "repeat_distance": (round(max(d for d in repeats if d is not None), 6)
                            if any(d is not None for d in repeats) else None),
        "victim_peak_rss_mb": rss_summary(first.rss_peaks),
        "counters": sum_counters([s.get("counters", {}) for s in first.averaging]),
    }


def robust_entry(plain: Mapping[str, Any] | None, robust: Mapping[str, Any] | None,
                 peers: int, mib: int, rounds: int,
                 norm_clip: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if plain is None or robust is None:
        return {"skipped": True}
    mean, clipped = plain["seconds_best"], robust["seconds_best"]
    entry = {"peers": peers, "mib": mib, "rounds": rounds, "mean_seconds_best": mean,
             "centered_clip_seconds_best": clipped,
             "ratio": round(clipped / mean, 3) if mean > 0 else None,
             "mean_max_error": plain["max_error"], "centered_clip_max_error": robust["max_error"]}
    if norm_clip is not None:
        entry.update({"norm_clip_seconds_best": norm_clip["seconds_best"],
                      "norm_clip_ratio": round(norm_clip["seconds_best"] / mean, 3) if mean > 0
                      else None,
                      "norm_clip_max_error": norm_clip["max_error"]})
    return entry


def assemble(args: argparse.Namespace, clean: dict[str, Any], attacks: list[dict[str, Any]],
             robust: dict[str, Any], seconds: float) -> dict[str, Any]:
    return {"benchmark": "hostile", "honest_peers": HONEST, "epochs": args.epochs,
            "target_batch_size": args.target_batch_size, "batch_size": args.batch_size,
            "hidden": args.hidden,
            "quick": args.quick, "cpus": os.cpu_count(), "clean": clean, "attacks": attacks,
            "robust_aggregation": robust, "seconds": round(seconds, 1)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default=DEFAULT_ATTACKS, help=f"known: {', '.join(ATTACKS)}")
    parser.add_argument("--identities", help="hostile identities per attack, e.g. 1,3 (default 1,3; "
                                             "--quick: 1)")
    parser.add_argument("--epochs", type=int, help="default 5 (--quick: 2)")
    parser.add_argument("--target-batch-size", type=int, help="default 256 (--quick: 128)")
    parser.add_argument("--batch-size", type=int, default=32, help="the tiny workload's batch_size")
    parser.add_argument("--hidden", type=int, default=512,
                        help="the tiny MLP's width (2 hidden layers; 512: 275k parameters, ~17 chunks "
                             "of 64 KiB, so that parts and shares mean something)")
    parser.add_argument("--clean-repeats", type=int, help="clean runs (the first is the reference, "
                                                         "the others give repeat_distance); default 2 "
                                                         "(--quick: 1)")
    parser.add_argument("--robust-mib", type=int, help="default 64 (--quick: 4)")
    parser.add_argument("--robust-rounds", type=int, help="default 3 (--quick: 1)")
    parser.add_argument("--no-robust", action="store_true", help="skip the robust-aggregation timing")
    parser.add_argument("--quick", action="store_true", help="a smoke run (see the docstring)")
    parser.add_argument("--max-seconds", type=float, default=300.0,
                        help="give up on one run after this long (reported, not fatal)")
    parser.add_argument("--stop-timeout", type=float, default=30.0)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--keep", action="store_true", help="keep the daemons' state dirs and logs")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"identities": "1" if quick else "1,3", "epochs": 2 if quick else 5,
                "target_batch_size": 128 if quick else 256, "clean_repeats": 1 if quick else 2,
                "robust_mib": 4 if quick else 64, "robust_rounds": 1 if quick else 3}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.attack_list = parse_attacks(args.attacks)
        args.identity_counts = parse_identities(args.identities)
    except ValueError as exc:
        parser.error(str(exc))
    if min(args.epochs, args.target_batch_size, args.batch_size, args.hidden) < 1:
        parser.error("--epochs, --target-batch-size, --batch-size and --hidden must be at least 1")
    if args.clean_repeats < 1 or args.robust_mib < 1 or args.robust_rounds < 1:
        parser.error("--clean-repeats, --robust-mib and --robust-rounds must be at least 1")
    return args


def table(clean: dict[str, Any], attacks: list[dict[str, Any]]) -> str:
    lines = [f"clean: rounds {clean['rounds']}, failed {clean['honest_rounds_failed']}, peer spread "
             f"{clean['peer_spread']}, repeat distance {clean['repeat_distance']}",
             f"{'attack':<14} {'ids':>3} {'rounds':>6} {'failed':>6} {'distance':>10} {'excluded':>8} "
             f"{'rss max':>8} {'seconds':>8}"]
    for a in attacks:
        lines.append(f"{a['attack']:<14} {a['identities']:>3} {a['rounds']!s:>6} "
                     f"{a['honest_rounds_failed']!s:>6} "
                     f"{a['param_distance']!s:>10} {a['attacker_excluded']!s:>8} "
                     f"{a['victim_peak_rss_mb']['max']!s:>8} {a['wall_seconds']!s:>8}")
    return "\n".join(lines) + "\n"


# --- the daemons ------------------------------------------------------------------------------------

def run_params(args: argparse.Namespace) -> dict[str, Any]:
    return {"workload": "tiny", "name": RUN, "collaborative": True, "min_peers": HONEST,
            "epochs": args.epochs, "target_batch_size": args.target_batch_size,
            "config": {"batch_size": args.batch_size, "hidden": args.hidden, "layers": 2},
            "checkpoint_every": args.epochs,
            "average_state_every": 0}


def load_final(daemon: Daemon, status: dict[str, Any], epochs: int) -> np.ndarray | None:
    import torch

    path = daemon.root / "runs" / RUN / status["fingerprint"] / f"checkpoint-{epochs:09d}.pt"
    if not path.exists():
        return None
    document = torch.load(path, map_location="cpu", weights_only=True)
    return flatten({k: v.numpy() for k, v in document["model"].items()})


async def _final(daemon: Daemon, status: dict[str, Any], epochs: int) -> np.ndarray | None:
    for _ in range(300):  # the worker writes the last checkpoint as the run finishes: 30 s at most
        final = load_final(daemon, status, epochs)
        if final is not None:
            return final
        await asyncio.sleep(0.1)
    return None


async def _joined(daemons: list[Daemon], timeout: float = 60.0) -> None:
    infos: list[dict[str, Any]] = []
    try:
        async with asyncio.timeout(timeout):
            while True:
                infos = await asyncio.gather(*(d.call("node.info") for d in daemons))
                if all(info["dht"]["joined"] for info in infos):
                    return
                for d in daemons:
                    d.check_alive()
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise BenchmarkError(f"not every daemon joined the DHT within {timeout} s: "
                             f"{[info['dht'] for info in infos]}") from None


async def _wait_honest(honest: list[Daemon], timeout: float) -> tuple[bool, str | None, list[dict[str, Any]]]:
    """Until every honest run is finished (True), one of them ended otherwise or the time is up
    (False, why); the last statuses."""
    deadline = time.monotonic() + timeout
    statuses: list[dict[str, Any]] = []
    while True:
        statuses = []
        for daemon in honest:
            daemon.check_alive()
            (status,) = await daemon.call("run.status", {"name": RUN}, timeout=30)
            statuses.append(status)
        bad = [(i, s["state"], s.get("error")) for i, s in enumerate(statuses)
               if s.get("state") in ("crashed", "failed", "stopped")]
        if bad:
            return False, f"honest run(s) ended: {bad}", statuses
        if all(s.get("state") == "finished" for s in statuses):
            return True, None, statuses
        if time.monotonic() > deadline:
            return False, (f"not finished within {timeout} s: (state, epoch) "
                           f"{[(s.get('state'), s.get('epoch')) for s in statuses]}"), statuses
        await asyncio.sleep(0.25)


async def run_swarm(args: argparse.Namespace, root: Path, keys: Path, attack: Attack | None,
                    identities: int) -> RunResult:
    """One run: the 4 honest daemons (identity.key from `keys` when there, saved there otherwise)
    and `identities` hostile ones; every daemon is stopped before this returns or raises."""
    honest_env = dict(WORKER_ENV)
    hostile_env = {**WORKER_ENV, **HOSTILE_ENV, **(attack.env if attack else {})}
    daemons: list[Daemon] = []
    sampler: asyncio.Task[None] | None = None
    memory = MemorySampler(daemons)
    flood = None
    honest_args = DAEMON_ARGS
    if attack is not None and attack.flood_sources:
        flood = ConnectionFlood(flood_sources(attack.flood_sources * identities), FLOOD_PER_SOURCE)
        honest_args = (*DAEMON_ARGS, "--net.limit_loopback", "true")
        identities = 0  # (no hostile daemon)
    streams = None
    if attack is not None and attack.stream_flood_peers:
        streams = WaitingStreamFlood(attack.stream_flood_peers * identities)
        identities = 0  # (no hostile daemon)
    for index in range(HONEST):
        key = keys / f"h{index}.key"
        if key.exists():
            (root / f"d{index}").mkdir(parents=True, mode=0o700)
            shutil.copy2(key, root / f"d{index}" / "identity.key")
    try:
        daemons.append(await Daemon.start(0, root / "d0", None, args.log_level, None, honest_args,
                                          honest_env))
        bootstrap = daemons[0].p2p_address(await daemons[0].wait_serving())
        if flood is not None:  # before anyone links up to it
            flood.target(_tcp_port(bootstrap))
        daemons += await asyncio.gather(*(
            Daemon.start(i, root / f"d{i}", bootstrap, args.log_level, None,
                         honest_args if i < HONEST else DAEMON_ARGS,
                         honest_env if i < HONEST else hostile_env)
            for i in range(1, HONEST + (identities if attack else 0))))
        infos = await asyncio.gather(*(d.wait_serving() for d in daemons[1:]))
        if flood is not None:
            for daemon, info in zip(daemons[1:], infos, strict=True):
                flood.target(_tcp_port(daemon.p2p_address(info)))
        if streams is not None:
            await streams.start()
            for address in [bootstrap, *(d.p2p_address(i) for d, i in zip(daemons[1:], infos,
                                                                           strict=True))]:
                streams.target(address)
        await _joined(daemons)
        honest, hostile = daemons[:HONEST], daemons[HONEST:]
        attackers = [(await d.call("node.info"))["peer_id"] for d in hostile]
        memory = MemorySampler(daemons)
        sampler = asyncio.create_task(memory.run())
        params = run_params(args)
        started = time.monotonic()
        await asyncio.gather(*(d.call("run.start", params) for d in daemons))
        completed, error, statuses = await _wait_honest(honest, args.max_seconds)
        seconds = time.monotonic() - started
        finals = [await _final(d, s, args.epochs) if completed else None
                  for d, s in zip(honest, statuses, strict=True)]
        averaging = [await d.call("averaging.status") for d in honest]
        nodes = [(await d.call("node.info"))["counters"] for d in honest]
        reduce = {name: sum(int(c.get(f"averaging.allreduce.{name}", 0)) for c in nodes)
                  for name in ALLREDUCE_COUNTERS}
        extra: dict[str, Any] = {"allreduce_counters": reduce}
        if flood is not None:
            net = {name: sum(int(c.get(f"net.{name}", 0)) for c in nodes) for name in NET_COUNTERS}
            # a flood that held nothing (no connection opened, none refused or taken over by the
            # honest daemons) did not attack: its run says nothing about the defence
            held = flood.counters["opened"] > 0 and (net["connections_refused"] > 0
                                                     or net["handshakes_evicted"] > 0
                                                     or net["handshake_failures"] > 0)
            extra.update({"net_counters": net, "flood": {"sources": len(flood.sources),
                                                         "held_slots": held, **dict(flood.counters)}})
        if streams is not None:
            # a flood that the daemons never had to turn away or drop did not fill their slots
            held = streams.counters["opened"] > 0 and (reduce["streams_refused_peer_waiting"] > 0
                                                       or reduce["streams_evicted_waiting"] > 0
                                                       or reduce["streams_refused_all_waiting"] > 0)
            extra["flood"] = {"peer_ids": streams.peers, "per_peer": streams.per_peer,
                              "held_slots": held, **dict(streams.counters)}
        attacker_states: list[str | None] = []
        for daemon in hostile:
            try:
                (status,) = await daemon.call("run.status", {"name": RUN}, timeout=10)
                attacker_states.append(status.get("state"))
            except (RpcError, OSError, TimeoutError):
                attacker_states.append(None)
        for index, daemon in enumerate(honest):
            keep = keys / f"h{index}.key"
            if not keep.exists():
                shutil.copy2(daemon.root / "identity.key", keep)
    finally:
        if sampler is not None:
            sampler.cancel()
        try:
            if flood is not None:
                await asyncio.shield(flood.close())
            if streams is not None:
                await asyncio.shield(streams.close())
        finally:  # (a second Ctrl-C during the flood's close still stops the daemons)
            # A hostile daemon is killed: its results are read by now, and its orderly stop
            # (run.stop finishes the round in progress) waits while the defence keeps it out of
            # the rounds, up to the averaging's timeouts (10 s in a --quick weight run).
            await asyncio.shield(asyncio.gather(*(d.stop(args.stop_timeout) if d.index < HONEST
                                                  else d.kill() for d in daemons)))
    return RunResult(completed, error, seconds, statuses, averaging, attackers, attacker_states,
                     finals, memory.daemon_peak[:HONEST], extra)


def _tcp_port(p2p_address: str) -> int:
    """The port of /ip4/127.0.0.1/tcp/PORT/p2p/ID."""
    parts = p2p_address.split("/")
    return int(parts[parts.index("tcp") + 1])


async def robust_timing(args: argparse.Namespace) -> dict[str, Any]:
    import allreduce_inproc

    bench_args = argparse.Namespace(peers=HONEST, mib=args.robust_mib, chunk_mib=4,
                                    rounds=args.robust_rounds, compression="none", plain=False,
                                    no_check=False, aggregation=list(allreduce_inproc.AGGREGATIONS),
                                    codecs=False)
    modes = (await allreduce_inproc.bench(bench_args))["modes"]
    return robust_entry(modes["mean"], modes["centered_clip"], HONEST, args.robust_mib,
                        args.robust_rounds, norm_clip=modes["norm_clip"])


async def benchmark(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)  # stop the daemons as on Ctrl-C
    try:
        began = time.monotonic()
        keys = workdir / "keys"
        keys.mkdir()
        cleans = []
        for repeat in range(args.clean_repeats):
            cleans.append(await run_swarm(args, workdir / f"clean{repeat}", keys, None, 0))
            if not cleans[0].completed:
                raise BenchmarkError(f"the clean run did not complete: {cleans[0].error}")
        reference = [f for f in cleans[0].finals if f is not None]
        attacks = []
        for attack in args.attack_list:
            for identities in args.identity_counts:
                try:
                    run = await run_swarm(args, workdir / f"{attack.name}-{identities}", keys, attack,
                                          identities)
                except (BenchmarkError, RpcError, OSError, TimeoutError) as exc:
                    attacks.append(failed_entry(attack.name, identities, f"{type(exc).__name__}: {exc}"))
                    continue
                attacks.append(attack_entry(attack.name, identities, run, reference))
        clean = clean_entry(cleans)
        robust = {"skipped": True} if args.no_robust else await robust_timing(args)
        if not args.json:
            sys.stderr.write(table(clean, attacks))
        return assemble(args, clean, attacks, robust, time.monotonic() - began)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import logging

    import structlog  # the in-process all-reduce logs through structlog: warnings only

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    # handshake_flood holds 16 connections per source address and daemon (768 with 3 identities):
    # past the usual soft limit of 1024 files the flood would weaken unseen
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    workdir = Path(tempfile.mkdtemp(prefix="dl-hostile-", dir="/tmp"))
    try:
        summary = asyncio.run(benchmark(args, workdir))
    except (BenchmarkError, RpcError, OSError, TimeoutError) as exc:
        sys.stderr.write(f"hostile benchmark failed: {exc}\n")
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        sys.stderr.write("hostile benchmark interrupted; the daemons were stopped\n")
        return 130
    finally:
        if args.keep:
            sys.stderr.write(f"the daemons' state and logs are in {workdir}\n")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
