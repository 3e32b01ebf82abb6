"""The collaborative-run benchmark with hivemind.Optimizer, for side-by-side numbers with dedloc.

Run through `collab.py --impl hivemind` (or `--impl both`), which starts this script with the
Python of `.venv-hivemind` (its own virtual environment:
`python -m venv .venv-hivemind && .venv-hivemind/bin/pip install hivemind==1.1.12 torch==2.14.1 orjson`)
and adds the metrics common to both implementations. Run alone it writes its raw result (JSON)
to --out or stdout:

    .venv-hivemind/bin/python benchmarks/collab_hivemind.py --peers 4 --epochs 10

N processes train the problem of dedloc's `tiny` workload (an MLP 16-64-4 with ReLU, cross-entropy
on points of a 4-class Gaussian mixture whose centres come from seed 0; each peer samples its own
points; the same initial weights everywhere; Adam, lr 0.01) with hivemind.Optimizer in gradient
averaging mode (use_local_updates=False) and the quick-start settings of hivemind's documentation
(matchmaking_time 3 s, averaging_timeout 10 s). Each peer has its own hivemind DHT (and hivemind's
Go daemon) on 127.0.0.1 only, the first peer's being the others' initial peer; they start training
together (a barrier) and stop when their `local_epoch` reaches --epochs, or at --max-seconds
(then the result says `timed_out` and holds what was recorded).

Per epoch each peer records when its `local_epoch` advanced (`applied_at`), when the opt.step()
call that advanced it began (`accumulate_end_at`: the peer had trained its last batch for that
epoch), its samples in the epoch, and the averaging round the step used. The round is read from
the optimizer's gradient round (`opt.scheduled_grads`, the StepControl of hivemind's averager
step, whose result is the group's gathered data: one entry per peer): `full` (all N peers),
`partial` (fewer), `none` (the optimizer skipped averaging: its tracker saw no other peer) or
`failed` (the round raised or timed out: hivemind then steps on the local gradients). `none` and
`failed` are steps on this peer's gradients alone. A group's size counts every peer of the
all-reduce, also one that joined it with weight 0 (as hivemind has a peer that downloads the
state "tag along"): `full` says that N peers averaged, not that N peers' gradients were in it.
State downloads are counted by wrapping opt.load_state_from_peers; the epochs a download jumps
over are `skipped` by that peer.

Every process started (the peers, and hivemind's processes under them) is stopped at the end,
also on errors, SIGTERM and Ctrl-C: the peers are asked to stop, then terminated, then every
process descending from this script that is still there is killed by its pid.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

HOST = "127.0.0.1"
LOCAL_ONLY = {"nat_port_map": False, "auto_nat": False, "use_relay": False, "use_auto_relay": False}
# The tiny workload's defaults (plugins/tiny/workload.py).
INPUT_DIM, CLASSES, HIDDEN, SEPARATION, LR, DATA_SEED, INIT_SEED = 16, 4, 64, 1.0, 0.01, 0, 0
# hivemind's quick-start settings.
MATCHMAKING_TIME, AVERAGING_TIMEOUT = 3.0, 10.0
RUN_ID = "dedloc_collab_bench"


def _peer(index: int, args: argparse.Namespace, initial: list[str], addresses: Any, start: Any,
          stop: Any, results: Any) -> None:
    """One trainer: its DHT, its hivemind.Optimizer, training until local_epoch reaches the target."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when peers stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results.cancel_join_thread()  # never hang at exit on records the driver no longer reads
    import hivemind
    import torch
    import torch.nn.functional as F
    from torch import nn

    dht = opt = None
    try:
        dht = hivemind.DHT(start=True, initial_peers=initial or None, host_maddrs=[f"/ip4/{HOST}/tcp/0"],
                           **LOCAL_ONLY)
        if index == 0:
            addresses.put([str(a) for a in dht.get_visible_maddrs() if f"/ip4/{HOST}/" in str(a)])
        torch.manual_seed(INIT_SEED)  # the same initial weights on every peer
        model = nn.Sequential(nn.Linear(INPUT_DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
        centres = torch.randn(CLASSES, INPUT_DIM, generator=torch.Generator().manual_seed(DATA_SEED))
        centres = centres * SEPARATION
        data = torch.Generator().manual_seed(index * 4 + 1)  # this peer's points
        opt = hivemind.Optimizer(
            dht=dht, run_id=RUN_ID, target_batch_size=args.target_batch_size,
            batch_size_per_step=args.batch_size, optimizer=torch.optim.Adam(model.parameters(), lr=LR),
            use_local_updates=False, matchmaking_time=MATCHMAKING_TIME,
            averaging_timeout=AVERAGING_TIMEOUT, verbose=False)

        counter = {"samples": 0}  # this peer's samples toward its current epoch
        load_state = opt.load_state_from_peers

        def counted_load_state(**kwargs: Any) -> None:
            before, began = opt.local_epoch, time.time()
            load_state(**kwargs)
            counter["samples"] = 0  # hivemind drops the accumulated gradients
            results.put(("download", index, {"at": began, "seconds": round(time.time() - began, 4),
                                             "from_epoch": before, "to_epoch": opt.local_epoch}))

        opt.load_state_from_peers = counted_load_state  # hivemind's step() calls it through self
        start.wait(timeout=300)
        steps = 0
        while opt.local_epoch < args.epochs and not stop.is_set():
            labels = torch.randint(CLASSES, (args.batch_size,), generator=data)
            points = centres[labels] + torch.randn(args.batch_size, INPUT_DIM, generator=data)
            opt.zero_grad()
            F.cross_entropy(model(points), labels).backward()
            counter["samples"] += args.batch_size
            epoch, began = opt.local_epoch, time.time()
            opt.step()
            applied = time.time()
            steps += 1
            if opt.local_epoch == epoch + 1 and counter["samples"] > 0:  # an optimizer step, not a download
                size, kind = _round(opt.scheduled_grads, args.peers)
                results.put(("epoch", index, {
                    "epoch": epoch, "applied_at": applied, "accumulate_end_at": began,
                    "step_seconds": round(applied - began, 4), "samples": counter["samples"],
                    "group_size": size, "round": kind,
                    "tracker_peers": opt.tracker.global_progress.num_peers}))
                counter["samples"] = 0
        results.put(("done", index, {"steps": steps, "epoch": opt.local_epoch}))
        stop.wait(timeout=args.max_seconds + 60)  # stay in the swarm until every peer is done
    except Exception as exc:
        results.put(("error", index, {"error": f"{type(exc).__name__}: {exc}"}))
        raise
    finally:
        if opt is not None:
            with contextlib.suppress(Exception):
                opt.shutdown()
        if dht is not None:
            with contextlib.suppress(Exception):
                dht.shutdown()


def _round(control: Any, peers: int) -> tuple[int, str]:
    """(group size, kind) of the gradient round a step just used (see the module docstring)."""
    if control is None:
        return 1, "none"
    if not control.done() or control.cancelled():
        return 1, "failed"
    try:
        gathered = control.result(timeout=0)
    except Exception:
        return 1, "failed"
    if not gathered:
        return 1, "failed"
    return len(gathered), "full" if len(gathered) >= peers else "partial"


def _descendants(root: int) -> dict[int, str]:
    """pid -> start time (to recognise the same process later) of every process under `root`."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        pid, ppid = int(entry.name), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        started[pid] = fields[19]
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = started[pid]
        todo += children.get(pid, [])
    return found


def _kill_leftovers(known: dict[int, str]) -> None:
    """SIGKILL the processes of `known` (and any under them) that are still the same processes."""
    for pid, start in known.items():
        with contextlib.suppress(OSError, IndexError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat[stat.rindex(")") + 2:].split()[19] == start:
                os.kill(pid, signal.SIGKILL)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the peers, collect their records until all are done (or --max-seconds), stop them."""
    context = mp.get_context("fork")  # hivemind starts its own processes by fork too
    addresses, results = context.Queue(), context.Queue()
    start, stop = context.Barrier(args.peers + 1), context.Event()
    processes: list[Any] = []
    histories: list[list[dict[str, Any]]] = [[] for _ in range(args.peers)]
    downloads: list[list[dict[str, Any]]] = [[] for _ in range(args.peers)]
    done: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    began = time.time()
    started_at = None
    timed_out = False
    known: dict[int, str] = {}
    try:
        processes.append(context.Process(target=_peer, args=(0, args, [], addresses, start, stop, results)))
        processes[0].start()
        try:
            initial = addresses.get(timeout=120)
        except queue.Empty:
            raise RuntimeError("the first peer's DHT did not start within 120 s") from None
        for index in range(1, args.peers):
            processes.append(context.Process(target=_peer,
                                             args=(index, args, initial, addresses, start, stop, results)))
            processes[-1].start()
        try:
            start.wait(timeout=300)
        except Exception:
            raise RuntimeError("the peers did not all create their optimizer within 300 s") from None
        started_at = time.time()
        deadline = started_at + args.max_seconds
        while len(done) + len(errors) < args.peers:
            known.update(_descendants(os.getpid()))
            if time.time() > deadline:
                timed_out = True
                break
            if any(not p.is_alive() for i, p in enumerate(processes) if i not in done and i not in errors):
                time.sleep(0.5)  # a record may still be in the queue
                _drain(results, histories, downloads, done, errors)
                for i, p in enumerate(processes):
                    if not p.is_alive() and i not in done and i not in errors:
                        errors[i] = f"exited with code {p.exitcode}"
                continue
            _drain(results, histories, downloads, done, errors, timeout=1.0)
        finished_at = time.time()
        _drain(results, histories, downloads, done, errors)
    finally:
        stop.set()
        known.update(_descendants(os.getpid()))
        for process in processes:
            process.join(timeout=20)
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(timeout=10)
        known.update(_descendants(os.getpid()))
        _kill_leftovers(known)
        for process in processes:
            process.join(timeout=5)
    return {
        "histories": histories, "downloads": downloads,
        "peer_steps": [done.get(i, {}).get("steps") for i in range(args.peers)],
        "peer_final_epochs": [done.get(i, {}).get("epoch") for i in range(args.peers)],
        "errors": {str(i): e for i, e in sorted(errors.items())},
        "timed_out": timed_out, "partial": timed_out or bool(errors),
        "setup_seconds": round(started_at - began, 2),
        "seconds": round(finished_at - started_at, 2),
    }


def _drain(results: Any, histories: list[list[dict[str, Any]]], downloads: list[list[dict[str, Any]]],
           done: dict[int, dict[str, Any]], errors: dict[int, str], timeout: float = 0.0) -> None:
    while True:
        try:
            kind, index, record = results.get(timeout=timeout) if timeout else results.get_nowait()
        except queue.Empty:
            return
        timeout = 0.0
        if kind == "epoch":
            histories[index].append(record)
        elif kind == "download":
            downloads[index].append(record)
        elif kind == "done":
            done[index] = record
        else:
            errors[index] = record["error"]


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "max": None, "mean": None}
    array = np.asarray(values, dtype=float)
    return {"p50": round(float(np.percentile(array, 50)), 4),
            "p90": round(float(np.percentile(array, 90)), 4),
            "max": round(float(array.max()), 4), "mean": round(float(array.mean()), 4)}


def summarize(raw: dict[str, Any], peers: int, target: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """hivemind's own numbers (who stepped each epoch, with whom) and one row per epoch."""
    by_peer = [{e["epoch"]: e for e in h} for h in raw["histories"]]
    skipped: dict[int, list[int]] = {}
    for index, loads in enumerate(raw["downloads"]):
        for load in loads:
            for epoch in range(load["from_epoch"], load["to_epoch"]):
                skipped.setdefault(epoch, []).append(index)
    epochs = sorted(set().union(*by_peer, skipped))
    rows = []
    for epoch in epochs:
        stepped = [i for i in range(peers) if epoch in by_peer[i]]
        entries = [by_peer[i][epoch] for i in stepped]
        gaps = [by_peer[i][epoch]["applied_at"] - by_peer[i][epoch - 1]["applied_at"]
                for i in stepped if epoch - 1 in by_peer[i]]
        rows.append({
            "epoch": epoch,
            "seconds": round(float(np.median(gaps)), 4) if gaps else None,
            "applied_spread": round(max(e["applied_at"] for e in entries)
                                    - min(e["applied_at"] for e in entries), 4) if entries else None,
            "stepped": stepped,
            "group_sizes": [e["group_size"] for e in entries],
            "rounds": [e["round"] for e in entries],
            "without_full_group": [i for i, e in zip(stepped, entries, strict=True) if e["round"] != "full"],
            "alone": [i for i, e in zip(stepped, entries, strict=True) if e["round"] in ("none", "failed")],
            "skipped": sorted(skipped.get(epoch, [])),
            "samples": sum(e["samples"] for e in entries),
            "step_seconds_max": max((e["step_seconds"] for e in entries), default=None),
        })
    steady = [r for r in rows if r["epoch"] >= 1 and r["stepped"]]
    all_entries = [e for h in raw["histories"] for e in h]
    result = {
        # a peer's epoch at the end: as it said when done, else as far as its records go
        "epochs_reached": min(
            final if final is not None else max([0, *(e["epoch"] + 1 for e in history),
                                                 *(d["to_epoch"] for d in loads)])
            for final, history, loads in zip(raw["peer_final_epochs"], raw["histories"], raw["downloads"],
                                             strict=True)),
        "epochs_all_peers_stepped": sum(len(r["stepped"]) == peers for r in rows),
        "epochs_with_full_group": sum(len(r["stepped"]) == peers and not r["without_full_group"]
                                      for r in rows),
        "epochs_without_full_group": [r["epoch"] for r in rows
                                      if len(r["stepped"]) < peers or r["without_full_group"]],
        "peer_epochs_without_full_group": sum(len(r["without_full_group"]) for r in rows),
        "peer_epochs_alone": sum(len(r["alone"]) for r in rows),
        "epochs_with_a_peer_alone": [r["epoch"] for r in rows if r["alone"]],
        "rounds": {kind: sum(e["round"] == kind for e in all_entries)
                   for kind in ("full", "partial", "none", "failed")},
        "state_downloads": sum(len(d) for d in raw["downloads"]),
        "epochs_skipped_by_state_downloads": sum(len(v) for v in skipped.values()),
        "step_seconds": _stats([e["step_seconds"] for r in steady
                                for i in r["stepped"] for e in [by_peer[i][r["epoch"]]]]),
        "epoch_samples_over_target": (round(float(np.mean([r["samples"] for r in steady])) / target, 3)
                                      if steady else None),
        "samples": sum(e["samples"] for e in all_entries),
    }
    return result, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--target-batch-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=300.0,
                        help="stop training after this long and report what was recorded (timed_out)")
    parser.add_argument("--out", type=Path, help="write the JSON result here (default: stdout)")
    args = parser.parse_args()
    if args.peers < 1 or args.epochs < 1:
        parser.error("--peers and --epochs must be at least 1")
    try:
        import hivemind
        import torch
    except ImportError as exc:
        sys.stderr.write(f"collab_hivemind: {exc}; create the environment with `python -m venv "
                         ".venv-hivemind && .venv-hivemind/bin/pip install hivemind==1.1.12 "
                         "torch==2.14.1 orjson`\n")
        return 2

    def interrupted(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # stop the peers as on Ctrl-C
    try:
        raw = run(args)
    except KeyboardInterrupt:
        sys.stderr.write("collab_hivemind interrupted; the peers were stopped\n")
        return 130
    except RuntimeError as exc:
        sys.stderr.write(f"collab_hivemind failed: {exc}\n")
        return 1
    result, rows = summarize(raw, args.peers, args.target_batch_size)
    output = {"impl": "hivemind", "hivemind_version": hivemind.__version__,
              "torch_version": torch.__version__,
              "settings": {"run_id": RUN_ID, "use_local_updates": False, "matchmaking_time": MATCHMAKING_TIME,
                           "averaging_timeout": AVERAGING_TIMEOUT, "optimizer": "Adam", "lr": LR},
              **{k: raw[k] for k in ("timed_out", "partial", "errors", "setup_seconds", "seconds",
                                     "peer_steps", "peer_final_epochs")},
              **result, "rows": rows, "histories": raw["histories"], "downloads": raw["downloads"]}
    data = orjson.dumps(output)
    if args.out:
        args.out.write_bytes(data)
    else:
        sys.stdout.write(data.decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
