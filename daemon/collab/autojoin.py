"""The run a daemon takes part in by itself: the config's `[run]` section (RunSettings,
daemon/collab/settings.py).

A volunteer's service names the run it lends the machine to (`join`, and a closed run's `token` or
`token_file`); a run's owner names the manifest file that `dedloc run create` wrote (`manifest`).
Once the daemon serves, RunAutoJoin starts that run through the same path as `run.start` and,
while that fails for a reason that may pass (no peer publishes the run yet, the DHT is still
filling, a worker did not start), tries again after a wait that doubles from BASE_DELAY up to
`retry_max_seconds`, with jitter, logging why each time. Nothing it meets stops the daemon: a
mistake it cannot get past (a token of another run, a closed run owned by another peer) is logged
and it gives up.

A run the volunteer stops (run.stop) is not started again: a marker in the state directory keeps
that across restarts, until the run is started by hand again (`dedloc restart` / `dedloc join`).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import structlog

from .. import timebase
from ..errors import RunExistsError, RunNotActiveError, ShuttingDownError, UnknownRunError
from .errors import ManifestError, MembershipError
from .manifest import RunManifest
from .settings import BASE_DELAY, RunSettings
from .tokens import MembershipToken

if TYPE_CHECKING:
    from .aux import AuxRun
    from .run import Run
    from .runs import RunRegistry

log = structlog.get_logger(__name__)

NETWORK_WAIT = 60.0  # how long one wait for the DHT to join lasts (a join by name needs it)
STOPPED_MARKER = "autojoin-stopped"
MAX_MANIFEST_FILE_BYTES = 1 << 20


def backoff_delay(attempt: int, cap: float, rng: random.Random) -> float:
    """The wait after failed attempt number `attempt` (0 first): doubling, capped, jittered
    down by up to half so that peers restarted together do not retry together."""
    delay = min(cap, BASE_DELAY * 2.0 ** min(attempt, 30))
    return delay * rng.uniform(0.5, 1.0)


def read_manifest_file(path: Path) -> tuple[str, RunManifest, str | None]:
    """(run name, manifest, fingerprint as written) from a `dedloc run create` file; ValueError."""
    try:
        if path.stat().st_size > MAX_MANIFEST_FILE_BYTES:
            raise ValueError(f"{path} is too large for a manifest file")
        data = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read the manifest file {path}: {exc}") from None
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ValueError(f"{path} is not a manifest file of `dedloc run create` (no name)")
    try:
        manifest = RunManifest.from_json(data.get("manifest"))
    except ManifestError as exc:
        raise ValueError(f"{path}: {exc}") from None
    fingerprint = data.get("fingerprint")
    return data["name"], manifest, fingerprint if isinstance(fingerprint, str) else None


@dataclass(frozen=True)
class Target:
    """What to start: a run to join (by name and/or token), or an owned run from its manifest."""

    name: str
    token: str | None = None
    manifest: RunManifest | None = None
    fingerprint: str | None = None


class RunAutoJoin:
    def __init__(self, runs: RunRegistry, settings: RunSettings, state_dir: Path, *,
                 watch_every: float = 2.0, rng: random.Random | None = None) -> None:
        self._runs = runs
        self._settings = settings
        self._marker = state_dir / STOPPED_MARKER
        self._watch_every = watch_every
        self._rng = rng or random.Random()

    @property
    def enabled(self) -> bool:
        s = self._settings
        return bool(s.join or s.token or s.token_file or s.manifest)

    async def run(self) -> None:
        """Start the configured run, then watch it for a stop by the volunteer; returns at once
        when nothing is configured. The node cancels it before it stops the runs."""
        if not self.enabled:
            return
        try:
            await self._run()
        except Exception:  # a bug here must never take the daemon down with it
            log.exception("run_autojoin_crashed")

    async def _run(self) -> None:
        try:
            target = self._target()
        except (ValueError, MembershipError) as exc:
            log.error("run_autojoin_failed", error=str(exc), hint="fix [run] in the config, then "
                      "restart the daemon (systemctl restart dedlocd)")
            return
        if self._stopped_by_volunteer(target.name):
            log.info("run_autojoin_skipped", run=target.name,
                     reason="the volunteer stopped it (dedloc stop); `dedloc restart` or "
                            "`dedloc join` starts it again")
        elif not await self._start_until_done(target):
            return
        await self._watch(target.name)

    def _target(self) -> Target:
        s = self._settings
        if s.manifest:
            name, manifest, fingerprint = read_manifest_file(Path(s.manifest).expanduser())
            if manifest.closed and manifest.owner != self._runs.peer_id:
                raise ValueError(f"run {name!r} of {s.manifest} is a closed run owned by peer "
                                 f"{manifest.owner}, not by this daemon ({self._runs.peer_id}): "
                                 "only its owner starts it; others join it with a token")
            return Target(name, manifest=manifest, fingerprint=fingerprint)
        token = s.token or None
        if s.token_file:
            try:
                token = Path(s.token_file).expanduser().read_text().strip()
            except OSError as exc:
                raise ValueError(f"cannot read run.token_file: {exc}") from None
        if token is not None:
            held = MembershipToken.decode(token)
            if s.join and s.join != held.run:
                raise ValueError(f"the token is for run {held.run!r}, not {s.join!r}")
            return Target(held.run, token=token)
        return Target(s.join)

    def _existing(self, name: str) -> Run | AuxRun | None:
        try:
            return self._runs.get(name)
        except UnknownRunError:
            return None

    async def _start_until_done(self, target: Target) -> bool:
        """Start the run, retrying what may pass; True once it runs (by us or someone else)."""
        attempt = 0
        waiting_for_network = False
        while True:
            existing = self._existing(target.name)
            if existing is not None:  # started by hand meanwhile
                log.info("run_autojoin_not_needed", run=target.name, state=existing.state)
                return True
            network = self._runs.network
            if target.manifest is None and network is not None and not network.joined:
                if not waiting_for_network:
                    log.info("run_autojoin_waiting_for_network", run=target.name)
                    waiting_for_network = True
                await network.wait_joined(timeout=NETWORK_WAIT)
                continue
            try:
                status = await self._start(target)
            except RunExistsError:
                return True
            except ShuttingDownError:
                return False
            except (MembershipError, RunNotActiveError, ValueError) as exc:
                log.error("run_autojoin_failed", run=target.name, error=str(exc),
                          hint="fix [run] in the config, then restart the daemon")
                return False
            except Exception as exc:  # no peer publishes it yet, a worker failed, ...: try again
                delay = backoff_delay(attempt, self._settings.retry_max_seconds, self._rng)
                attempt += 1
                dht = None if network is None else network.dht_status()
                log.info("run_autojoin_waiting", run=target.name, attempt=attempt,
                         retry_in=round(delay, 1), error=str(exc), kind=type(exc).__name__,
                         dht_joined=None if dht is None else dht["joined"],
                         hint=_hint(target, exc, dht))
                await asyncio.sleep(delay)
                continue
            log.info("run_autojoined", run=target.name, role=status.get("role"),
                     fingerprint=status.get("fingerprint"), epoch=status.get("epoch"),
                     attempts=attempt + 1)
            if target.fingerprint and status.get("fingerprint") != target.fingerprint:
                log.warning("run_autojoin_other_fingerprint", run=target.name,
                            file_fingerprint=target.fingerprint, fingerprint=status.get("fingerprint"),
                            hint="the workload's defaults or files changed since `dedloc run "
                                 "create`; peers joining by name follow the run as started now")
            return True

    async def _start(self, target: Target) -> dict[str, Any]:
        s = self._settings
        device = s.device or None
        manifest = target.manifest
        if manifest is not None:
            return await self._runs.start(
                manifest.workload, dict(manifest.config), target.name,
                target_batch_size=manifest.target_batch_size, epochs=manifest.epochs,
                checkpoint_every=10, device=device, collaborative=True,
                min_peers=manifest.min_peers, average_state_every=manifest.average_state_every,
                compression=manifest.compression, closed=manifest.closed,
                aggregation=manifest.aggregation,
                sync=manifest.sync_fields())
        # What run.start does when given only a name (or a token): the manifest comes from peers.
        name = (s.join or None) if target.token else target.name  # a token names its run
        return await self._runs.start(
            None, {}, name, target_batch_size=256,
            epochs=None, checkpoint_every=10, device=device, collaborative=True,
            role="aux" if s.aux else None, token=target.token)

    # A stop by the volunteer ----------------------------------------------------------------

    def _stopped_by_volunteer(self, name: str) -> bool:
        try:
            data = orjson.loads(self._marker.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return False
        return isinstance(data, dict) and data.get("run") == name

    async def _watch(self, name: str) -> None:
        """Until cancelled: a run that was active and is now `stopped` was stopped by the
        volunteer (the node cancels this before stopping runs at shutdown), so remember it; a run
        active again was started by hand, so forget it."""
        was_active = False
        while True:
            run = self._existing(name)
            if run is not None and run.active:
                was_active = True
                if self._marker.exists():
                    self._marker.unlink(missing_ok=True)
                    log.info("run_autojoin_resumed", run=name)
            elif run is not None and run.state == "stopped" and was_active:
                was_active = False
                self._marker.parent.mkdir(parents=True, exist_ok=True)
                self._marker.write_bytes(orjson.dumps({"run": name, "stopped_at": timebase.now()}))
                log.info("run_autojoin_remembers_stop", run=name,
                         reason="stopped by the volunteer: not joined again at start until it is "
                                "started by hand")
            await asyncio.sleep(self._watch_every)


def _hint(target: Target, exc: Exception, dht: dict[str, Any] | None) -> str:
    if dht is not None and not dht["joined"]:
        return "this node has no DHT peers yet: check net.bootstrap and the network"
    if "no peer publishes" in str(exc):
        return ("no trainer of the run is online, or the name is wrong"
                + ("" if target.token else "; a closed run also needs run.token_file"))
    return "retrying"
