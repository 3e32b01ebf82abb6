"""`run.status`: one run as the control API shows it (trainer or aux, local or collaborative)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..averaging.compression import get_codec

if TYPE_CHECKING:
    from .aux import AuxRun
    from .engine import RunEngine
    from .manifest import RunManifest
    from .run import Run

RECENT_EPOCHS = 20
_RATIO_CHUNK = 1 << 20  # elements: a codec's nominal compression ratio on a chunk this size


def sync_status(manifest: RunManifest, engine: RunEngine | None,
                inner_step: int | None, clipped_steps: int = 0,
                inner_lr: float | None = None) -> dict[str, Any]:
    """How the run syncs and what its last exchange cost: `mode`; for a local-update run also
    `inner_steps` (H), `outer_step` (the run's epoch: outer steps taken), `inner_step` (inner
    steps since the last one), `clipped_steps` (outer steps its guard scaled down: a large
    count means a peer pushes, or `outer_clip` is too tight), `outer_lr`, `outer_momentum` and
    `feedback_decay` (the manifest's), `inner_lr_scale` (the manifest's)
    and `inner_lr` (the learning rate this trainer's last inner step took, scaled; null before
    one, and on an aux peer); for both, `bytes_sent_per_step`
    and `bytes_received_per_step` (this peer's traffic in the last round), `bytes_per_sample`
    (sent, per sample of that step), `compression_ratio` (float32 bytes per byte on the
    wire, nominal for the codec), `aggregation` (the run's: how every reducer combines
    contributions) and `contributions_clipped` (how many this peer's reducer scaled down in the
    last round: one per sender and chunk)."""
    codec = get_codec(manifest.compression)
    ratio = 4 * _RATIO_CHUNK / codec.max_payload_bytes(_RATIO_CHUNK)
    last = None if engine is None else engine.last_round
    history = [] if engine is None else list(engine.epoch_history)
    samples = history[-1]["samples"] if history else None
    status: dict[str, Any] = {
        "mode": manifest.sync,
        "bytes_sent_per_step": None if last is None else last.bytes_sent,
        "bytes_received_per_step": None if last is None else last.bytes_received,
        "bytes_per_sample": None if last is None or not samples else last.bytes_sent / samples,
        "compression_ratio": round(ratio, 3),
        "aggregation": manifest.aggregation,
        "contributions_clipped": None if last is None else last.contributions_clipped,
    }
    if manifest.local_updates:
        status.update({"inner_steps": manifest.inner_steps, "outer_lr": manifest.outer_lr,
                       "outer_momentum": manifest.outer_momentum,
                       "feedback_decay": manifest.feedback_decay,
                       "outer_step": None if engine is None else engine.progress.epoch,
                       "inner_step": inner_step, "outer_clip": manifest.outer_clip,
                       "clipped_steps": clipped_steps, "inner_lr_scale": manifest.inner_lr_scale,
                       "inner_lr": inner_lr})
    return status


def _run_level(engine: RunEngine | None, key: str | None, peer_id: str | None) -> dict[str, Any]:
    """The run as this peer estimates it from its peers' reports (collaborative runs only)."""
    gp = None if engine is None else engine.global_progress
    last = None if engine is None or engine.last_round is None else engine.last_round.to_json()
    return {
        "run_key": key,
        "peer_id": peer_id,
        "run_epoch": None if gp is None else gp.epoch,
        "run_lineage": None if gp is None else gp.lineage,
        "run_confirmed": None if gp is None else gp.confirmed,
        "run_peers": None if gp is None else gp.live_trainers,
        "run_aux_peers": None if gp is None else gp.live_aux,
        "run_samples_accumulated": None if gp is None else gp.samples_accumulated,
        "run_samples_per_second": None if gp is None else gp.samples_per_second,
        "run_eta_seconds": None if gp is None else gp.eta_seconds,
        "run_epoch_overhead_seconds": None if gp is None else gp.step_overhead,
        "contributions": {} if gp is None else gp.contributions,
        "live_peers": [] if gp is None else gp.live_peers,
        "last_round": last,
    }


def run_status(run: Run) -> dict[str, Any]:
    p = run.progress
    engine = run.engine
    history = [] if engine is None else list(engine.epoch_history)
    collaborative = run.collaborative
    level = _run_level(engine if collaborative else None, run.key,
                       None if engine is None or not collaborative else engine.peer_id)
    state_round = None if engine is None or engine.last_state_round is None \
        else engine.last_state_round.to_json()
    return {
        "name": run.spec.name,
        "role": "trainer",
        "workload": run.spec.manifest.workload,
        "config": run.description.get("config", run.spec.manifest.config),
        "manifest": run.spec.manifest.to_json(),
        "fingerprint": run.spec.fingerprint(),
        "state": run.state,
        "phase": run.phase,
        "epoch": p.epoch,
        "lineage": p.lineage,
        "epochs": run.spec.epochs,
        "samples": p.samples,
        "accumulated": p.accumulated,
        "target_batch_size": run.spec.target_batch_size,
        "sync": sync_status(run.spec.manifest, engine, run.inner_step, run.clipped_steps,
                            run.inner_lr),
        "loss_first": p.loss_first,
        "loss": p.loss_last,
        "epoch_losses": list(p.epoch_losses),
        "samples_per_second": p.samples_per_second,
        "lr": p.lr,
        "data_seed": run.spec.seed,
        "skipped_steps": p.skipped_steps,
        "skipped_batches": run.skipped_batches,
        "rounds": p.rounds,
        "failed_rounds": p.failed_rounds,
        "rounds_sat_out": p.rounds_sat_out,
        "state_rounds": p.state_rounds,
        "failed_state_rounds": p.failed_state_rounds,
        "state_downloads": p.state_downloads,
        "failed_state_downloads": p.failed_state_downloads,
        "refuted_states": p.refuted_states,
        "unverified_states": p.unverified_states,
        "unanswered_states": p.unanswered_states,
        "reports_beyond_pace": p.reports_beyond_pace,
        "reports_unserved": p.reports_unserved,
        "states_served": p.states_served,
        # finished: until when its final state is served to peers that come late (final_state.py)
        "final_state_served_until": None if run.final_donor is None
        or not run.final_donor.holds_state else run.final_donor.until,
        "collaborative": collaborative,
        **level,
        "last_state_round": state_round if collaborative else None,
        "epoch_overhead_seconds": history[-1]["overhead_seconds"] if history else None,
        "epoch_history": history[-RECENT_EPOCHS:],
        "restarts": p.restarts,
        "resumed_from": run.resumed_from,
        "checkpoints_rejected": 0 if run.store is None else run.store.rejected,
        "checkpoint_failures": run.checkpoint_failures,
        "last_checkpoint_error": run.last_checkpoint_error,
        "paused": None if engine is None else engine.paused_reason,
        "device": run.description.get("device"),
        "devices": run.description.get("devices"),
        "parameters": run.description.get("total_numel"),
        "started_at": run.started_at,
        "error": run.error,
        "worker": run.worker_status(),
    }


def aux_status(run: AuxRun) -> dict[str, Any]:
    engine = run.engine
    p = engine.progress
    return {
        "name": run.name,
        "role": "aux",
        "workload": run.manifest.workload,
        "config": run.manifest.config,
        "manifest": run.manifest.to_json(),
        "fingerprint": run.manifest.fingerprint(),
        "state": run.state,
        "phase": engine.phase.value,
        "epoch": p.epoch,
        "lineage": p.lineage,
        "epochs": run.manifest.epochs,
        "samples": 0,
        "accumulated": 0,
        "target_batch_size": run.manifest.target_batch_size,
        "sync": sync_status(run.manifest, engine, None),
        "loss_first": None,
        "loss": None,
        "epoch_losses": [],
        "samples_per_second": None,
        "rounds": p.rounds,
        "failed_rounds": p.failed_rounds,
        "rounds_sat_out": p.rounds_sat_out,
        "collaborative": True,
        **_run_level(engine, run.key, engine.peer_id),
        "epoch_overhead_seconds": None,
        "parameters": run.parameters,
        "started_at": run.started_at,
        "error": run.error,
        "worker": {"state": "none", "pid": None, "exit_code": None, "last_log_lines": []},
    }
