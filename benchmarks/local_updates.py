"""Local-update runs (issue 16) against DeDLOC's gradient rounds: traffic, held-out loss, wall time.

    python benchmarks/local_updates.py --json [--samples N] [--configs gradients,local_h25,...]
                                       [--peers 4] [--workload albert|tiny] [--shaped]

N real dedlocd daemons (one trainer each, `--workers.threads 1`, OMP_NUM_THREADS=1) train the same
workload on 127.0.0.1 in one collaborative run per configuration, each on the same sample budget:

  gradients          today's DeDLOC rounds: the gradients of every target batch are averaged
  local_h<H>         sync "local" with inner_steps H (outer Nesterov SGD, lr 0.7, momentum 0.9
                     (with topk: lr 1.5, no momentum, the residual decaying by 0.95, SparseLoCo's);
                     inner steps at the workload's lr x inner_lr_scale, by default "auto":
                     batch / target, 16 / 64 here)
  local_h<H>[_<codec>]_overlap  the same with overlap (train on during the exchange)
  local_h<H>_<codec> the same with the pseudo-gradients compressed by <codec> (e.g. topk); a codec
                     the manifest does not accept is reported as skipped, with the daemon's reason
  gradients_<codec>  gradient rounds with a codec (fp16, uint8, quantile8)
  alone              the reference: one process (this one) training alone with the run's global
                     batch (target_batch_size samples of gradients per optimizer step), with the
                     workload's own model, optimizer, schedule and data

The default is albert-tiny (workload `albert`, preset `albert-tiny`, the built-in corpus) with 4
peers, batch 16 and target_batch_size = peers x batch (64): each trainer then takes H inner steps
per outer step, which is what the local-update schedule assumes (the worker puts the learning-rate
schedule of outer step t at t x H). The sample budget is rounded up to whole outer steps of the
largest H. Every run uses min_peers N and no state averaging (average_state_every 0).

For every configuration:
  samples              the samples all trainers trained (run.status), overshoot included
  heldout_loss         the workload's loss of the final parameters (a local run's outer ones) on
                       the first --eval-samples of the eval split (data seed --eval-seed: the same
                       batches for every configuration), evaluated here from the last checkpoint
  bytes_sent_per_peer  averaging payload sent per trainer (averaging.status counters, mean)
  bytes_per_sample     averaging bytes sent by all trainers / samples
  link_bytes_sent_per_peer  all bytes the trainer's open links sent (DHT and progress included)
  wall_seconds         from every run.start answered (the workers loaded) to the last trainer's
                       final checkpoint; `start_seconds`: the run.start calls (worker start-up)
  curve                [seconds, epoch, samples, heldout_loss]: the checkpoints of trainer 0 (about
                       --curve-points of them, the final one included), linked as they appear
                       (the daemon keeps only its last two) and evaluated after the run; samples:
                       the swarm's at that time (run.status polled every 0.25 s, interpolated)
  seconds_to_gradients_loss  the first time on the curve whose held-out loss is at most the final
                       held-out loss of `gradients` (null if never; needs `gradients` in the list)
  failed               only for a run that ended before its epochs (a run failed on a daemon, or
                       --max-seconds passed): why; its numbers are what it did until then, its
                       curve and held-out loss those of its checkpoints so far
  heldout_loss_at_budget  the curve's loss at the sample budget (linear between the checkpoints
                       around it): a run trains more than its epochs x target batch (each
                       trainer trains whole batches and what it promised its peers after the
                       run's target is reached: with 4 x 16 = 64 samples per gradient round,
                       about twice as much); this compares the runs at equal samples

`shaped` (with --shaped; root, iproute2 and tc) is the same list with every daemon in a network
namespace of benchmarks/netlab.py, shaped by the --profile of netlab_profiles.toml (default
uplink20x4: every peer uploads at 20 Mbit/s and downloads at 100 Mbit/s); `alone` has no network
and is not repeated there. There the local runs train --shaped-local-budget (3) times the sample
budget (`sample_budget` in each entry; their `heldout_loss_at_budget` is still at the common
budget): what counts there is the wall time to the loss `gradients` ends with, and a local run
needs more samples than gradient rounds for one loss. Without --shaped, `shaped` says why it was
not run.

--workload-config JSON adds fields to every run's workload config; --local-workload-config JSON
to the local runs' only. A local run's inner steps take each trainer's own batch, not the run's
target, so the workload's learning rate wants scaling (albert-tiny: lr 0.03 x 16 / 64 = 0.0075
made local_h25 end below gradients' loss, where 0.03 diverged or stalled near 7.03): the
manifest's inner_lr_scale does it, "auto" (batch / target) by default; --inner-lr-scale sets
another. An "lr" in --local-workload-config is taken as the inner rate itself, as before this
option existed: the local runs then get inner_lr_scale 1 unless --inner-lr-scale says otherwise.

`goals` compares each local configuration with `gradients`: bytes per sample at least 100x fewer,
held-out loss within 3 % (relative; also given at equal samples, not judged), and on the shaped
profile at least 5x less wall time to the loss `gradients` ends with; each with what was measured.

Prints one JSON object (with --json only that; without it a table per part first, on stderr).
Every daemon started is stopped (run.stop, node.shutdown, then its process group killed), also on
errors, Ctrl-C and SIGTERM; the namespaces are removed and the temporary directory too (--keep
keeps it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from dedloc.rpc import RpcError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collab import BenchmarkError, Daemon  # one copy of the daemon handling

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
DEFAULT_CONFIGS = "gradients,local_h25,local_h100,local_h25_topk,alone"
DEFAULT_PROFILE = "uplink20x4"
GOAL_BYTES_RATIO = 100.0
GOAL_LOSS_WITHIN = 0.03
GOAL_SHAPED_SPEEDUP = 5.0
# the run's workload config besides batch_size (and albert's cache_dir)
WORKLOAD_CONFIGS: dict[str, dict[str, Any]] = {
    "albert": {"preset": "albert-tiny"},
    "tiny": {},
}
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


# --- configurations -------------------------------------------------------------------------------

_CONFIG_NAME = re.compile(r"^(?:(?P<alone>alone)|(?P<gradients>gradients)|local_h(?P<h>[0-9]+))"
                          r"(?:_(?!overlap$)(?P<codec>[a-z0-9]+))?(?:_(?P<overlap>overlap))?$")


@dataclass(frozen=True)
class ConfigSpec:
    """One configuration of the benchmark (see the module docstring for the names)."""

    name: str
    sync: str  # "gradients", "local" or "alone"
    inner_steps: int = 0
    compression: str = "none"
    overlap: bool = False

    @property
    def epoch_batches(self) -> int:
        """Target batches per epoch (an outer step of a local run; one otherwise)."""
        return self.inner_steps if self.sync == "local" else 1


def parse_config(name: str) -> ConfigSpec:
    match = _CONFIG_NAME.match(name)
    if match is None:
        raise ValueError(f"unknown configuration {name!r} (gradients, gradients_<codec>, local_h<H>, "
                         "local_h<H>_<codec>, alone)")
    codec = match["codec"] or "none"
    if match["overlap"] and not match["h"]:
        raise ValueError(f"{name}: overlap is for local runs (local_h<H>_overlap)")
    if match["alone"]:
        if codec != "none":
            raise ValueError("alone trains without a network: it takes no codec")
        return ConfigSpec(name, "alone")
    if match["gradients"]:
        return ConfigSpec(name, "gradients", 0, codec)
    steps = int(match["h"])
    if steps < 1:
        raise ValueError(f"{name}: H must be at least 1")
    return ConfigSpec(name, "local", steps, codec, bool(match["overlap"]))


def parse_configs(text: str) -> list[ConfigSpec]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("no configuration given")
    if len(set(names)) != len(names):
        raise ValueError("a configuration is named twice")
    return [parse_config(n) for n in names]


def sample_budget(requested: int | None, target: int, specs: Sequence[ConfigSpec],
                  default_epochs: int) -> int:
    """The samples of every configuration: whole outer steps of the largest H (`default_epochs`
    of them when not given), rounded up."""
    unit = target * max([s.epoch_batches for s in specs] or [1])
    if requested is None:
        return unit * default_epochs
    return max(1, -(-requested // unit)) * unit


def run_params(spec: ConfigSpec, workload: str, config: dict[str, Any], peers: int, target: int,
               samples: int, curve_points: int, outer: dict[str, float | str] | None = None
               ) -> dict[str, Any]:
    """run.start's parameters for one collaborative configuration."""
    epochs = samples // (target * spec.epoch_batches)
    params: dict[str, Any] = {
        "workload": workload, "name": f"lu-{spec.name.replace('_', '-')}", "collaborative": True,
        "min_peers": peers, "epochs": epochs, "target_batch_size": target, "config": config,
        "checkpoint_every": max(1, epochs // max(1, curve_points)), "average_state_every": 0,
        "compression": spec.compression}
    if spec.sync == "local":
        params.update({"sync": "local", "inner_steps": spec.inner_steps, **(outer or {})})
        if spec.overlap:
            params["overlap"] = True
    return params


def manifest_problem(params: dict[str, Any]) -> str | None:
    """Why this daemon's manifest would refuse `params` (ManifestError's text), or None."""
    from dedloc.daemon.collab.errors import ManifestError
    from dedloc.daemon.collab.manifest import RunManifest

    fields = {k: params[k] for k in ("workload", "config", "target_batch_size", "epochs", "min_peers",
                                     "average_state_every", "compression") if k in params}
    if params.get("sync") == "local":
        fields.update(sync="local", inner_steps=params["inner_steps"],
                      **{k: params[k] for k in ("outer_lr", "outer_momentum", "overlap",
                                                "inner_lr_scale", "feedback_decay")
                         if k in params})
    try:
        RunManifest(**fields)
    except ManifestError as exc:
        return f"ManifestError: {exc}"
    return None


# --- evaluation -----------------------------------------------------------------------------------

def load_workload(name: str) -> Any:
    if name == "albert":
        from dedloc.plugins.albert import ALBERT
        return ALBERT
    if name == "tiny":
        from dedloc.plugins.tiny.workload import TINY
        return TINY
    raise ValueError(f"unknown workload {name!r}")


class Evaluator:
    """The held-out loss of saved parameters: one model, the same eval batches every time."""

    def __init__(self, workload: Any, config: dict[str, Any], samples: int, seed: int) -> None:
        import torch

        self.torch = torch
        self.workload = workload
        self.config = workload.resolve_config(config)
        self.device = torch.device("cpu")
        self.model = workload.build_model(self.config, self.device)
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.batches: list[Any] = []
        data = iter(workload.build_data(self.config, seed, "eval"))
        taken = 0
        while taken < samples:
            try:
                batch = next(data)
            except StopIteration:
                break
            self.batches.append(batch)
            taken += self._batch_size(batch)
        if not self.batches:
            raise BenchmarkError(f"workload {workload.name!r}: the eval split gave no batch")
        self.samples = taken

    def _batch_size(self, batch: Any) -> int:
        _, size = self.workload.loss(self.model, batch, self.device)
        return int(size)

    def loss(self) -> float:
        torch = self.torch
        total, done = 0.0, 0
        self.model.eval()
        try:
            with torch.no_grad():
                for batch in self.batches:
                    value, size = self.workload.loss(self.model, batch, self.device)
                    total += float(value) * size
                    done += size
        finally:
            self.model.train()
        return total / done

    def load_checkpoint(self, path: Path) -> None:
        """A worker checkpoint's parameters: a local-update run's outer ones when it has them."""
        torch = self.torch
        document = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(document["model"])
        outer = document.get("outer")
        if isinstance(outer, dict) and isinstance(outer.get("parameters"), torch.Tensor):
            flat, offset = outer["parameters"].reshape(-1), 0
            with torch.no_grad():
                for _, param in self.named:
                    param.copy_(flat[offset:offset + param.numel()].view_as(param))
                    offset += param.numel()
            if offset != flat.numel():
                raise BenchmarkError(f"{path}: {flat.numel()} outer parameters, the model has {offset}")

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)

    def checkpoint_loss(self, path: Path) -> float:
        self.load_checkpoint(path)
        return self.loss()


# --- the reference: one process alone --------------------------------------------------------------

def train_alone(workload: Any, config: dict[str, Any], target: int, samples: int, points: int,
                seed: int, init_seed: int = 0) -> tuple[float, int, list[tuple[float, int, dict[str, Any]]]]:
    """Train alone with global batch `target` (gradients summed over whole batches, one optimizer
    and scheduler step per target): the wall seconds, the samples, and about `points` snapshots
    (seconds, step, state_dict) including the last."""
    import torch

    config = workload.resolve_config(config)
    device = torch.device("cpu")
    torch.manual_seed(init_seed)
    model = workload.build_model(config, device)
    optimizer, scheduler = workload.build_optimizer(model, config)
    torch.manual_seed(seed)
    data = iter(workload.build_data(config, seed, "train"))
    params = [p for p in model.parameters() if p.requires_grad]
    steps = samples // target
    every = max(1, steps // max(1, points))
    snapshots: list[tuple[float, int, dict[str, Any]]] = []
    done_total = 0
    started = time.perf_counter()
    for step in range(steps):
        sums = [torch.zeros_like(p) for p in params]
        done = 0
        while done < target:
            for p in params:
                p.grad = None
            loss, size = workload.loss(model, next(data), device)
            (loss * size).backward()
            for acc, p in zip(sums, params, strict=True):
                if p.grad is not None:
                    acc.add_(p.grad)
            done += size
        for acc, p in zip(sums, params, strict=True):
            p.grad = acc / done
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        done_total += done
        if (step + 1) % every == 0 or step + 1 == steps:
            snapshots.append((time.perf_counter() - started,
                              step + 1, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    return time.perf_counter() - started, done_total, snapshots


# --- the daemons ------------------------------------------------------------------------------------

class Swarm:
    """N daemons bootstrapped from the first, every one joined to the DHT."""

    def __init__(self, peers: int, workdir: Path, log_level: str, lab: Any | None = None) -> None:
        self.peers = peers
        self.workdir = workdir
        self.log_level = log_level
        self.lab = lab
        self.daemons: list[Daemon] = []

    def _host(self, index: int) -> str:
        return self.lab.addresses[index] if self.lab is not None else HOST

    def _prefix(self, index: int) -> Callable[[list[str]], list[str]] | None:
        lab = self.lab
        return None if lab is None else (lambda argv: lab.command(index, argv))

    async def _start(self, index: int, bootstrap: str | None) -> Daemon:
        return await Daemon.start(index, self.workdir / f"d{index}", bootstrap, self.log_level,
                                  extra=("--workers.threads", "1"), env=WORKER_ENV,
                                  host=self._host(index), prefix=self._prefix(index))

    async def start(self) -> None:
        first = await self._start(0, None)
        self.daemons.append(first)
        bootstrap = first.p2p_address(await first.wait_serving(timeout=90))
        for index in range(1, self.peers):
            self.daemons.append(await self._start(index, bootstrap))
        await asyncio.gather(*(d.wait_serving(timeout=90) for d in self.daemons[1:]))
        infos: list[dict[str, Any]] = []
        try:
            async with asyncio.timeout(90):
                while True:
                    infos = await asyncio.gather(*(d.call("node.info", timeout=10) for d in self.daemons))
                    if all(info["dht"]["joined"] for info in infos):
                        return
                    for d in self.daemons:
                        d.check_alive()
                    await asyncio.sleep(0.2)
        except TimeoutError:
            raise BenchmarkError(f"not every daemon joined the DHT within 90 s: "
                                 f"{[info['dht'] for info in infos]}") from None

    async def bytes_sent(self) -> list[int]:
        """Each daemon's averaging payload sent so far (averaging.status counters)."""
        statuses = await asyncio.gather(*(d.call("averaging.status", timeout=30) for d in self.daemons))
        return [int(s["counters"].get("bytes_sent", 0)) for s in statuses]

    async def link_bytes_sent(self) -> list[int]:
        """What each daemon's open links sent, all traffic (closed links are not counted)."""
        peers = await asyncio.gather(*(d.call("node.peers", timeout=30) for d in self.daemons))
        return [sum(int(link.get("bytes_out", 0)) for link in _links(p)) for p in peers]

    async def stop(self, timeout: float) -> list[int]:
        return list(await asyncio.gather(*(d.stop(timeout) for d in self.daemons)))


def _links(answer: Any) -> list[dict[str, Any]]:
    if isinstance(answer, dict):
        answer = answer.get("peers", [])
    return [p for p in answer if isinstance(p, dict)] if isinstance(answer, list) else []


class CheckpointCollector:
    """Hard-links every checkpoint a run directory shows (the daemon keeps only its last two),
    with the time it was written (its mtime)."""

    def __init__(self, run_dir: Path, dest: Path) -> None:
        self.run_dir = run_dir
        self.dest = dest
        self.found: dict[int, tuple[Path, float]] = {}
        dest.mkdir(parents=True, exist_ok=True)

    def scan(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            for path in self.run_dir.glob("checkpoint-*.pt"):
                try:
                    epoch = int(path.stem.split("-", 1)[1])
                except ValueError:
                    continue
                if epoch in self.found:
                    continue
                target = self.dest / path.name
                try:
                    mtime = path.stat().st_mtime
                    with contextlib.suppress(FileExistsError):
                        os.link(path, target)
                except FileNotFoundError:  # removed meanwhile: its successor is there
                    continue
                except OSError:
                    shutil.copy2(path, target)
                self.found[epoch] = (target, mtime)

    async def run(self, interval: float = 0.1) -> None:
        while True:
            self.scan()
            await asyncio.sleep(interval)


async def run_config(swarm: Swarm, spec: ConfigSpec, params: dict[str, Any], workdir: Path,
                     max_seconds: float, stop_timeout: float) -> dict[str, Any]:
    """One collaborative configuration on the swarm: its numbers and checkpoints (not evaluated)."""
    daemons = swarm.daemons
    sent_before, links_before = await swarm.bytes_sent(), await swarm.link_bytes_sent()
    name = params["name"]
    called = time.time()
    try:
        answers = await asyncio.gather(*(d.call("run.start", params, timeout=300) for d in daemons))
    except RpcError as exc:
        with contextlib.suppress(RpcError, OSError, TimeoutError):
            await asyncio.gather(*(d.call("run.stop", {"name": name}, timeout=stop_timeout) for d in daemons))
        return {"skipped": f"run.start refused it: {exc}"}
    started = time.time()
    run_dir = daemons[0].root / "runs" / name / answers[0]["fingerprint"]
    collector = CheckpointCollector(run_dir, workdir / "curves" / spec.name)
    collecting = asyncio.create_task(collector.run())
    epochs = params["epochs"]
    progress: list[tuple[float, int]] = [(0.0, 0)]  # (seconds, samples of every trainer)
    failed: str | None = None  # why the run ended before its epochs (reported, not raised)
    try:
        deadline = time.monotonic() + max_seconds
        while failed is None:
            statuses = []
            for daemon in daemons:
                daemon.check_alive()
                (status,) = await daemon.call("run.status", {"name": name}, timeout=30)
                if status["state"] in ("crashed", "failed", "stopped") and failed is None:
                    failed = f"daemon {daemon.index}'s run is {status['state']}: {status.get('error')}"
                    sys.stderr.write(f"{spec.name}: {failed}\nlog:\n{daemon.log_tail()}\n")
                statuses.append(status)
            progress.append((time.time() - started, sum(int(s["samples"]) for s in statuses)))
            collector.scan()
            if all(s["state"] == "finished" for s in statuses) and epochs in collector.found:
                break
            if time.monotonic() > deadline and failed is None:
                failed = (f"not finished within {max_seconds} s: (state, epoch) "
                          f"{[(s['state'], s['epoch']) for s in statuses]}")
            if failed is None:
                await asyncio.sleep(0.25)
        finished = time.time()
        # the other trainers' final checkpoints: the end of the run for everyone
        for daemon, status in zip(daemons if failed is None else (), statuses, strict=False):
            path = daemon.root / "runs" / name / status["fingerprint"] / f"checkpoint-{epochs:09d}.pt"
            for _ in range(600):  # a minute at most
                if path.exists():
                    break
                await asyncio.sleep(0.1)
            with contextlib.suppress(OSError):
                finished = max(finished, path.stat().st_mtime)
    finally:
        collecting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await collecting
    sent_after, links_after = await swarm.bytes_sent(), await swarm.link_bytes_sent()
    with contextlib.suppress(RpcError, OSError, TimeoutError):
        await asyncio.gather(*(d.call("run.stop", {"name": name}, timeout=stop_timeout) for d in daemons))
    samples = sum(int(s["samples"]) for s in statuses)
    sent = [a - b for a, b in zip(sent_after, sent_before, strict=True)]
    links = [a - b for a, b in zip(links_after, links_before, strict=True)]
    sync = statuses[0].get("sync") or {}
    return {
        **({"failed": failed} if failed is not None else {}),
        "samples": samples,
        "epochs": epochs,
        "epochs_done": [int(s["epoch"]) for s in statuses],
        "wall_seconds": round(finished - started, 2),
        "start_seconds": round(started - called, 2),
        "bytes_sent_per_peer": round(sum(sent) / len(sent)),
        "bytes_per_sample": round(sum(sent) / samples, 2) if samples else None,
        "link_bytes_sent_per_peer": round(sum(links) / len(links)),
        "failed_rounds": sum(int(s.get("failed_rounds", 0)) for s in statuses),
        "compression_ratio": sync.get("compression_ratio"),
        "checkpoint_every": params["checkpoint_every"],
        "_checkpoints": sorted((epoch, round(mtime - started, 2),
                                samples_at(progress, mtime - started, samples), path)
                               for epoch, (path, mtime) in collector.found.items()),
    }


def samples_at(progress: Sequence[tuple[float, int]], seconds: float, final: int) -> int:
    """The swarm's samples at `seconds`, interpolated between two polls of run.status (the
    last poll's count or more at the end: `final`)."""
    for (t0, s0), (t1, s1) in itertools.pairwise(progress):
        if t0 <= seconds <= t1:
            share = 0.0 if t1 <= t0 else (seconds - t0) / (t1 - t0)
            return round(s0 + share * (s1 - s0))
    return final if seconds > progress[-1][0] else progress[0][1]


# --- assembling the result -------------------------------------------------------------------------

def finish_entries(entries: list[dict[str, Any]], budget: int | None = None) -> None:
    """Fill in seconds_to_gradients_loss from `gradients`' final held-out loss, and the held-out
    loss at the sample budget (`heldout_loss_at_budget`)."""
    reference = next((e for e in entries if e["name"] == "gradients" and "heldout_loss" in e), None)
    target = None if reference is None else reference["heldout_loss"]
    for entry in entries:
        if "curve" not in entry:
            continue
        entry["gradients_loss"] = target
        entry["seconds_to_gradients_loss"] = time_to_loss(entry["curve"], target)
        if budget is not None:
            entry["heldout_loss_at_budget"] = loss_at_samples(entry["curve"], budget)


def loss_at_samples(curve: Sequence[Sequence[float]], samples: int) -> float | None:
    """The held-out loss at `samples`, linear between the two checkpoints around it (null before
    the first one)."""
    for (_, _, s0, l0), (_, _, s1, l1) in itertools.pairwise([[0, 0, -1, math.nan], *curve]):
        if s0 <= samples <= s1 and s0 >= 0:
            share = 0.0 if s1 <= s0 else (samples - s0) / (s1 - s0)
            return round(l0 + share * (l1 - l0), 5)
    if curve and curve[-1][2] <= samples:
        return curve[-1][3]
    return None


def time_to_loss(curve: Sequence[Sequence[float]], target: float | None) -> float | None:
    """The first seconds of a [seconds, epoch, samples, loss] curve whose loss is at most `target`."""
    if target is None:
        return None
    for seconds, _, _, loss in curve:
        if loss <= target:
            return seconds
    return None


def goals(configs: list[dict[str, Any]], shaped: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Each local configuration against `gradients` (module docstring), with what was measured."""
    def by_name(entries: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
        return {e["name"]: e for e in entries or [] if "skipped" not in e}

    loopback, lab = by_name(configs), by_name(shaped)
    base, shaped_base = loopback.get("gradients"), lab.get("gradients")
    results = []
    for name, entry in loopback.items():
        if not name.startswith("local"):
            continue
        row: dict[str, Any] = {"name": name}
        if base is not None and base.get("bytes_per_sample") and entry.get("bytes_per_sample"):
            row["bytes_per_sample_reduction"] = round(base["bytes_per_sample"] / entry["bytes_per_sample"], 1)
            row["bytes_goal_met"] = row["bytes_per_sample_reduction"] >= GOAL_BYTES_RATIO
        if base is not None and "heldout_loss" in base and "heldout_loss" in entry:
            relative = entry["heldout_loss"] / base["heldout_loss"] - 1.0
            row["heldout_loss_vs_gradients"] = round(relative, 4)
            row["loss_goal_met"] = relative <= GOAL_LOSS_WITHIN
        if base is not None and base.get("heldout_loss_at_budget") and entry.get("heldout_loss_at_budget"):
            row["heldout_loss_at_budget_vs_gradients"] = round(
                entry["heldout_loss_at_budget"] / base["heldout_loss_at_budget"] - 1.0, 4)
        other = lab.get(name)
        if shaped_base is not None and other is not None:
            mine = other.get("seconds_to_gradients_loss")
            theirs = shaped_base.get("seconds_to_gradients_loss")
            row["shaped_seconds_to_gradients_loss"] = mine
            row["shaped_gradients_seconds"] = theirs
            row["shaped_speedup"] = round(theirs / mine, 2) if mine and theirs else None
            speedup = row["shaped_speedup"]
            row["shaped_goal_met"] = speedup is not None and speedup >= GOAL_SHAPED_SPEEDUP
            if "failed" in other:  # what it reached before it failed still counts for the time
                row["shaped_failed"] = other["failed"]
        if "failed" in entry:  # its loss is that of its last checkpoint: no loss goal
            row["failed"] = entry["failed"]
            row["loss_goal_met"] = False
        results.append(row)
    return {"bytes_per_sample_reduction_min": GOAL_BYTES_RATIO, "heldout_loss_within": GOAL_LOSS_WITHIN,
            "shaped_speedup_min": GOAL_SHAPED_SPEEDUP, "results": results}


def table(title: str, entries: list[dict[str, Any]]) -> str:
    lines = [f"{title}:", f"{'name':<18} {'samples':>8} {'loss':>8} {'MB/peer':>9} {'B/sample':>10} "
             f"{'wall s':>8} {'to grad loss s':>14}"]
    for e in entries:
        if "skipped" in e:
            lines.append(f"{e['name']:<18} skipped: {e['skipped']}")
            continue
        def fmt(value: Any, spec: str) -> str:
            return format(value, spec) if isinstance(value, int | float) else "-"
        mb = e.get("bytes_sent_per_peer")
        lines.append(f"{e['name']:<18} {fmt(e.get('samples'), '>8')} {fmt(e.get('heldout_loss'), '>8.4f')} "
                     f"{fmt(None if mb is None else mb / 1e6, '>9.2f')} "
                     f"{fmt(e.get('bytes_per_sample'), '>10.1f')} {fmt(e.get('wall_seconds'), '>8.1f')} "
                     f"{fmt(e.get('seconds_to_gradients_loss'), '>14.1f')}")
    return "\n".join(lines) + "\n"


# --- the parts --------------------------------------------------------------------------------------

@dataclass
class Plan:
    workload: str
    config: dict[str, Any]
    peers: int
    target: int
    samples: int
    specs: list[ConfigSpec]
    eval_samples: int
    eval_seed: int
    curve_points: int
    max_seconds: float
    stop_timeout: float
    log_level: str
    eval_threads: int
    alone_threads: int = 1
    outer: dict[str, float | str] = field(default_factory=dict)  # local runs' manifest fields
    notes: list[str] = field(default_factory=list)
    shaped_local_budget: int = 1  # local runs of the shaped part train this many budgets
    local_config: dict[str, Any] = field(default_factory=dict)  # added to local runs' config


def evaluate_curve(evaluator: Evaluator, checkpoints: list[tuple[int, float, int, Path]]
                   ) -> list[list[float]]:
    return [[seconds, epoch, samples, round(evaluator.checkpoint_loss(path), 5)]
            for epoch, seconds, samples, path in checkpoints]


async def collaborative_part(plan: Plan, workdir: Path, evaluator: Evaluator, lab: Any | None,
                             local_budget: int = 1) -> list[dict[str, Any]]:
    """The collaborative configurations on one swarm; local runs train `local_budget` times the
    sample budget (the shaped part: how long until they reach gradients' loss)."""
    entries: list[dict[str, Any]] = []
    collaborative = [s for s in plan.specs if s.sync != "alone"]
    wanted = []
    for spec in collaborative:
        budget = plan.samples * (local_budget if spec.sync == "local" else 1)
        config = {**plan.config, **plan.local_config} if spec.sync == "local" else plan.config
        params = run_params(spec, plan.workload, config, plan.peers, plan.target, budget,
                            plan.curve_points * (local_budget if spec.sync == "local" else 1),
                            plan.outer)
        problem = manifest_problem(params)
        if problem is not None:
            entries.append({"name": spec.name, "skipped": f"this dedloc's manifests refuse it: {problem}"})
        else:
            wanted.append((spec, params))
    if not wanted:
        return entries
    swarm = Swarm(plan.peers, workdir / "daemons", plan.log_level, lab)
    try:
        await swarm.start()
        for spec, params in wanted:
            result = await run_config(swarm, spec, params, workdir, plan.max_seconds, plan.stop_timeout)
            entries.append({"name": spec.name, **result,
                            "sample_budget": params["epochs"] * plan.target * spec.epoch_batches})
    finally:
        await asyncio.shield(swarm.stop(plan.stop_timeout))
    for entry in entries:
        checkpoints = entry.pop("_checkpoints", None)
        if checkpoints:
            curve = await asyncio.to_thread(evaluate_curve, evaluator, checkpoints)
            entry["curve"] = curve
            entry["heldout_loss"] = curve[-1][3]
            for *_, path in checkpoints:
                with contextlib.suppress(OSError):
                    path.unlink()
    order = {s.name: i for i, s in enumerate(plan.specs)}
    entries.sort(key=lambda e: order[e["name"]])
    return entries


def alone_entry(plan: Plan, evaluator: Evaluator, seed: int = 1) -> dict[str, Any]:
    seconds, samples, snapshots = train_alone(load_workload(plan.workload), plan.config, plan.target,
                                              plan.samples, plan.curve_points, seed)
    curve = []
    for at, step, state in snapshots:
        evaluator.load_state(state)
        curve.append([round(at, 2), step, step * plan.target, round(evaluator.loss(), 5)])
    return {"name": "alone", "samples": samples, "epochs": plan.samples // plan.target,
            "heldout_loss": curve[-1][3], "bytes_sent_per_peer": 0, "bytes_per_sample": 0.0,
            "link_bytes_sent_per_peer": 0, "wall_seconds": round(seconds, 2), "start_seconds": 0.0,
            "curve": curve}


async def benchmark(plan: Plan, workdir: Path, shaped: bool, profile: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(plan.eval_threads)
    workload = load_workload(plan.workload)
    # builds (and caches) albert's corpus and tokenizer once, before the workers need them
    evaluator = await asyncio.to_thread(Evaluator, workload, plan.config, plan.eval_samples, plan.eval_seed)
    configs = await collaborative_part(plan, workdir / "loopback", evaluator, None)
    if any(s.sync == "alone" for s in plan.specs):
        torch.set_num_threads(plan.alone_threads)
        entry = await asyncio.to_thread(alone_entry, plan, evaluator)
        torch.set_num_threads(plan.eval_threads)
        order = {s.name: i for i, s in enumerate(plan.specs)}
        configs.append(entry)
        configs.sort(key=lambda e: order[e["name"]])
    finish_entries(configs, plan.samples)
    shaped_result: dict[str, Any]
    if not shaped:
        shaped_result = {"skipped": "not requested (--shaped: the NAT lab of benchmarks/netlab.py, "
                                    "root with network namespaces and tc)", "configs": []}
    else:
        reason = lab_problem()
        if reason is not None:
            shaped_result = {"skipped": reason, "configs": []}
        else:
            from netlab import NetLab, load_profile

            links = load_profile(profile)
            if len(links) < plan.peers:
                raise BenchmarkError(f"profile {profile!r} has {len(links)} peers, not {plan.peers}")
            lab = NetLab(links[:plan.peers])
            with lab:
                entries = await collaborative_part(plan, workdir / "shaped", evaluator, lab,
                                                   plan.shaped_local_budget)
            entries += [{"name": s.name, "skipped": "trains without a network: see configs"}
                        for s in plan.specs if s.sync == "alone"]
            finish_entries(entries, plan.samples)
            shaped_result = {"profile": profile, "local_budget": plan.shaped_local_budget,
                             "links_mbit": [[p.upload_mbit, p.download_mbit] for p in links[:plan.peers]],
                             "configs": entries}
    return {"configs": configs, "shaped": shaped_result,
            "goals": goals(configs, shaped_result.get("configs"))}


def lab_problem() -> str | None:
    """Why the NAT lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2)"
    return None


async def main_async(plan: Plan, workdir: Path, shaped: bool, profile: str) -> dict[str, Any]:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)  # stop the daemons as on Ctrl-C
    try:
        return await benchmark(plan, workdir, shaped, profile)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOAD_CONFIGS), default="albert",
                        help="albert (preset albert-tiny) or tiny (for a quick smoke run)")
    parser.add_argument("--workload-config", type=orjson.loads, default={},
                        help='fields added to the workload\'s config (JSON), e.g. \'{"lr": 0.015}\'')
    parser.add_argument("--local-workload-config", type=orjson.loads, default={},
                        help="fields added to the workload's config of local runs only (JSON); an "
                             "lr there is the inner rate itself (inner_lr_scale 1 unless "
                             "--inner-lr-scale is given)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"comma-separated configurations (default {DEFAULT_CONFIGS})")
    parser.add_argument("--peers", type=int, default=4, help="trainers (one daemon each)")
    parser.add_argument("--batch-size", type=int, default=16, help="the workload's batch_size")
    parser.add_argument("--target-batch-size", type=int,
                        help="the run's global batch; default peers x batch size")
    parser.add_argument("--samples", type=int,
                        help="samples per configuration, rounded up to whole outer steps of the "
                             "largest H; default: --outer-steps of them")
    parser.add_argument("--outer-steps", type=int, default=3,
                        help="the default budget in outer steps of the largest H")
    parser.add_argument("--outer-lr", type=float,
                        help="local runs' outer_lr (default: the daemon's, 0.7; topk 2)")
    parser.add_argument("--outer-momentum", type=float,
                        help="local runs' outer_momentum (default: the daemon's, 0.9; topk 0)")
    parser.add_argument("--feedback-decay", type=float,
                        help="local runs' feedback_decay (default: the daemon's, 1; with topk 0.95)")
    parser.add_argument("--inner-lr-scale", type=_inner_lr_scale,
                        help="local runs' inner_lr_scale: auto (the daemon's default: batch / "
                             "target) or a number")
    parser.add_argument("--alone-threads", type=int, default=1,
                        help="torch threads of the reference trainer (alone)")
    parser.add_argument("--eval-samples", type=int, default=512, help="held-out samples evaluated")
    parser.add_argument("--eval-seed", type=int, default=0, help="data seed of the eval batches")
    parser.add_argument("--eval-threads", type=int, default=2, help="torch threads of the evaluation")
    parser.add_argument("--curve-points", type=int, default=12,
                        help="checkpoints (evaluated after the run) per configuration, about")
    parser.add_argument("--cache-dir", type=Path,
                        help="albert's corpus and tokenizer cache (default: albert's own)")
    parser.add_argument("--shaped", action="store_true",
                        help="also run the list in the NAT lab (root, network namespaces, tc)")
    parser.add_argument("--shaped-local-budget", type=int, default=3,
                        help="on the shaped profile, local runs train this many sample budgets "
                             "(gradients one): the time to gradients' loss is what counts there")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="the lab's netlab_profiles.toml profile")
    parser.add_argument("--max-seconds", type=float, default=1800.0,
                        help="give up on one run after this long")
    parser.add_argument("--stop-timeout", type=float, default=60.0,
                        help="seconds to wait for a daemon to stop before killing it")
    parser.add_argument("--log-level", default="warning", help="the daemons' log level")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (daemons' logs)")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    return parser


def _inner_lr_scale(text: str) -> float | str:
    return "auto" if text.strip().lower() == "auto" else float(text)


def make_plan(args: argparse.Namespace) -> Plan:
    """The checked plan of a run (ValueError says what is wrong with the arguments)."""
    specs = parse_configs(args.configs)
    if args.peers < 1 or args.batch_size < 1 or args.outer_steps < 1 or args.eval_samples < 1 \
            or args.shaped_local_budget < 1:
        raise ValueError("--peers, --batch-size, --outer-steps, --eval-samples and "
                         "--shaped-local-budget must be at least 1")
    if args.samples is not None and args.samples < 1:
        raise ValueError("--samples must be at least 1")
    target = args.target_batch_size or args.peers * args.batch_size
    if not isinstance(args.workload_config, dict) or not isinstance(args.local_workload_config, dict):
        raise ValueError("--workload-config and --local-workload-config must be JSON objects")
    config: dict[str, Any] = {**WORKLOAD_CONFIGS[args.workload], "batch_size": args.batch_size,
                              **args.workload_config}
    if args.workload == "albert" and args.cache_dir is not None:
        config["cache_dir"] = str(args.cache_dir.expanduser().absolute())
    samples = sample_budget(args.samples, target, specs, args.outer_steps)
    scale = args.inner_lr_scale
    if scale is None and "lr" in args.local_workload_config:
        scale = 1.0  # the lr given is the inner rate itself: not scaled again
    local = {k: v for k, v in (("outer_lr", args.outer_lr), ("outer_momentum", args.outer_momentum),
                               ("feedback_decay", args.feedback_decay),
                               ("inner_lr_scale", scale)) if v is not None}
    plan = Plan(args.workload, config, args.peers, target, samples, specs, args.eval_samples,
                args.eval_seed, args.curve_points, args.max_seconds, args.stop_timeout, args.log_level,
                max(1, args.eval_threads), max(1, args.alone_threads), local,
                shaped_local_budget=args.shaped_local_budget,
                local_config=dict(args.local_workload_config))
    if target % (args.peers * args.batch_size):
        plan.notes.append("target_batch_size is not peers x batch_size: a local run's inner steps per "
                          "outer step then differ from H, and so does its schedule's position")
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args)
    except ValueError as exc:
        parser.error(str(exc))
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # netlab.py beside this file
    workdir = Path(tempfile.mkdtemp(prefix="dl-local-", dir="/tmp"))
    started = time.time()
    try:
        result = asyncio.run(main_async(plan, workdir, args.shaped, args.profile))
    except (BenchmarkError, RpcError, OSError, TimeoutError) as exc:
        sys.stderr.write(f"local_updates benchmark failed: {exc}\n")
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        sys.stderr.write("local_updates benchmark interrupted; the daemons were stopped\n")
        return 130
    finally:
        if args.keep:
            sys.stderr.write(f"the daemons' state and logs are in {workdir}\n")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    summary = {"benchmark": "local_updates", "workload": plan.workload, "config": plan.config,
               "local_config": plan.local_config,
               "inner_lr_scale": plan.outer.get("inner_lr_scale", "auto"),
               "peers": plan.peers, "target_batch_size": plan.target, "batch_size": args.batch_size,
               "samples_per_config": plan.samples, "eval_samples": plan.eval_samples,
               "cpus": os.cpu_count(), "notes": plan.notes, **result,
               "benchmark_seconds": round(time.time() - started, 1)}
    if not args.json:
        sys.stderr.write(table("loopback", summary["configs"]))
        if summary["shaped"].get("configs"):
            sys.stderr.write(table(f"shaped ({summary['shaped']['profile']})", summary["shaped"]["configs"]))
    sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
