"""The control API: the JSON-RPC methods that the CLI and programs in any language call.

Every method is documented here once; `rpc.discover` publishes the same text and schemas.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypedDict

from dedloc import __version__
from dedloc.rpc import ErrorCode, InvalidParams, MethodRegistry, rpc_method

from . import timebase
from .averaging_api import ERROR_MAP as AVERAGING_ERROR_MAP
from .averaging_api import AveragingApi
from .bandwidth_api import BandwidthApi
from .collab.errors import ManifestError
from .collab.settings import RUN_NAME
from .errors import (
    RunExistsError,
    RunNotActiveError,
    ShuttingDownError,
    UnknownRunError,
    WorkerError,
)
from .limits_api import LimitsApi
from .membership_api import ERROR_MAP as MEMBERSHIP_ERROR_MAP
from .membership_api import MembershipApi
from .network_api import ERROR_MAP as NETWORK_ERROR_MAP
from .network_api import NetworkApi

if TYPE_CHECKING:
    from .node import Node

ERROR_MAP: dict[type[BaseException], ErrorCode] = {
    **NETWORK_ERROR_MAP,
    **AVERAGING_ERROR_MAP,
    **MEMBERSHIP_ERROR_MAP,
    ShuttingDownError: ErrorCode.SHUTTING_DOWN,
    RunExistsError: ErrorCode.RUN_EXISTS,
    UnknownRunError: ErrorCode.UNKNOWN_RUN,
    RunNotActiveError: ErrorCode.RUN_NOT_ACTIVE,
    WorkerError: ErrorCode.WORKER_FAILED,
    ManifestError: ErrorCode.MANIFEST_ERROR,
}


class Addresses(TypedDict):
    control: Annotated[str, "The control socket, as unix:PATH."]
    control_tcp: Annotated[str | None, "The loopback TCP control listener as HOST:PORT, for "
                           "clients that authenticate with the token file (null: off; "
                           "rpc.tcp_listen)."]
    p2p: Annotated[list[str], "Addresses other peers can dial (multiaddr style)."]


class NodeInfo(TypedDict):
    peer_id: Annotated[str, "This peer's id, derived from its Ed25519 identity key."]
    version: str
    pid: int
    started_at: Annotated[float, "Unix time the daemon started."]
    uptime_seconds: float
    state_dir: str
    addresses: Addresses
    reachable: Annotated[bool | None, "Whether other peers could dial this node back "
                         "(null: not known yet, e.g. no peer to ask)."]
    relays: Annotated[list[str], "Peers that relay links to this node (when nobody can dial it)."]
    dht: Annotated[dict[str, Any], "mode (server, client or starting), joined, routing_table_size."]
    runs: Annotated[dict[str, int], "Number of runs in each state."]
    counters: Annotated[dict[str, int], "Requests served and errors answered, by kind; refused "
                        "control connections as error.access_denied and access_denied.uid.<uid>, "
                        "wrong TCP tokens as error.bad_token."]
    dashboard: Annotated[str | None, "The web dashboard's URL, like http://127.0.0.1:8470/ "
                         "(null: off; dashboard.listen)."]


class ShutdownAnswer(TypedDict):
    stopping: bool


class WorkloadList(TypedDict):
    workloads: Annotated[list[dict[str, Any]], "name, description, version, plugin, config_schema"]
    errors: Annotated[list[dict[str, Any]], "Plugins that failed to load: plugin, error."]


RunStatus = Annotated[dict[str, Any], "A run's state: name, role, workload, manifest, fingerprint, "
                      "state, phase, epoch, samples, accumulated, target_batch_size, loss_first, "
                      "loss, epoch_losses, samples_per_second, error, worker {state, pid, exit_code, "
                      "last_log_lines}; collaborative runs add run_epoch, run_peers, run_aux_peers, "
                      "run_samples_accumulated, run_samples_per_second, run_eta_seconds, "
                      "contributions, live_peers, last_round, epoch_overhead_seconds, "
                      "run_epoch_overhead_seconds and epoch_history (docs/collaboration.md)."]


def build_registry(node: Node) -> MethodRegistry:
    registry = MethodRegistry(
        "dedlocd control API", __version__,
        "Control a dedloc peer daemon: node, workloads and runs. JSON-RPC 2.0, one message per line.",
        error_map=ERROR_MAP)
    registry.register_object(ControlApi(node))
    registry.register_object(NetworkApi(node.network))
    registry.register_object(AveragingApi(node.network))
    registry.register_object(MembershipApi(node.runs))
    registry.register_object(LimitsApi(node.runs))
    registry.register_object(BandwidthApi(node.network))
    return registry


class ControlApi:
    def __init__(self, node: Node) -> None:
        self._node = node

    @rpc_method("node.info")
    async def node_info(self) -> NodeInfo:
        """This node: peer id, version, uptime, addresses, runs and request counters."""
        node = self._node
        return {
            "peer_id": node.identity.peer_id,
            "version": __version__,
            "pid": os.getpid(),
            "started_at": node.started_at,
            "uptime_seconds": round(timebase.now() - node.started_at, 3),
            "state_dir": str(node.config.state_dir()),
            "addresses": {"control": f"unix:{node.socket_path}",
                          "control_tcp": node.control_tcp_address,
                          "p2p": node.network.addresses()},
            "reachable": node.network.status.reachable,
            "relays": node.network.relays(),
            "dht": node.network.dht_status(),
            "runs": node.runs.counts(),
            "counters": node.counters(),
            "dashboard": node.dashboard_url,
        }

    @rpc_method("node.shutdown")
    async def node_shutdown(self) -> ShutdownAnswer:
        """Stop the daemon: runs are checkpointed, workers stopped, then the process exits 0."""
        self._node.request_shutdown("node.shutdown")
        return {"stopping": True}

    @rpc_method("workloads.list", errors=(ErrorCode.WORKER_FAILED,))
    async def workloads_list(
        self, refresh: Annotated[bool, "Ask the worker program again instead of the cache."] = False,
    ) -> WorkloadList:
        """The installed workloads with their description and config schema."""
        listing = await self._node.workloads.get(refresh=refresh)
        return {"workloads": listing["workloads"], "errors": listing.get("errors", [])}

    @rpc_method("run.start", errors=(ErrorCode.UNKNOWN_WORKLOAD, ErrorCode.INVALID_WORKLOAD_CONFIG,
                                     ErrorCode.RUN_EXISTS, ErrorCode.WORKER_FAILED,
                                     ErrorCode.PLUGIN_ERROR, ErrorCode.SHUTTING_DOWN,
                                     ErrorCode.MANIFEST_ERROR, ErrorCode.MEMBERSHIP_ERROR))
    async def run_start(
        self,
        workload: Annotated[str | None, "Name of an installed workload (workloads.list); null: join "
                            "the collaborative run of this name that peers publish in the DHT."] = None,
        config: Annotated[dict[str, Any], "Workload config; omitted keys take their defaults."] = {},  # noqa: B006
        name: Annotated[str | None, "Run name; default: the workload's name."] = None,
        target_batch_size: Annotated[int, "Samples per optimizer step (one epoch).",
                                     {"minimum": 1}] = 256,
        epochs: Annotated[int | None, "The schedule's length: stop after this many epochs; null: "
                          "until run.stop.", {"minimum": 1}] = None,
        checkpoint_every: Annotated[int, "Checkpoint every N epochs (0: only on stop).",
                                    {"minimum": 0}] = 10,
        device: Annotated[str | None, 'Device for the worker ("auto", "cpu", "cuda:N", several '
                          'comma-separated like "cuda:0,cuda:1", or "cuda:all"); default: '
                          "workers.device."] = None,
        collaborative: Annotated[bool, "Train together with the peers running the same run (same "
                                 "name and manifest): progress is shared through the DHT and "
                                 "gradients are averaged at the run's target."] = False,
        min_peers: Annotated[int, "A collaborative run takes no step before this many trainers "
                             "take part.", {"minimum": 1}] = 1,
        role: Annotated[Literal["trainer", "aux"] | None, "trainer (a worker trains) or aux (no "
                        "worker; it reduces in the run's rounds; implies collaborative); null: "
                        "node.role."] = None,
        average_state_every: Annotated[int, "Average parameters and optimizer state every K epochs "
                                       "(0: never).", {"minimum": 0}] = 5,
        compression: Annotated[Literal["none", "fp16", "uint8", "quantile8", "topk"],
                               "Compression of the gradients in averaging rounds (topk: "
                               "local-update runs only, with error feedback)."] = "none",
        aggregation: Annotated[Literal["auto", "norm_clip", "mean"], "How the reducers of the run's "
                               "rounds combine contributions: norm_clip (each clipped to 4 times "
                               "the median norm of its chunk, then the weighted mean: honest "
                               "rounds are the weighted mean) or mean (the weighted mean alone); "
                               "auto: norm_clip for gradient rounds, mean for a local-update "
                               "run."] = "auto",
        closed: Annotated[bool, "Create a closed run owned by this daemon: only peers holding a "
                          "token it issued (token.issue) may take part."] = False,
        token: Annotated[str | None, "Join the closed run this token (issued by its owner to this "
                         "peer) is for; its name and manifest come from the token and the DHT."] = None,
        sync: Annotated[Literal["gradients", "local"], "How the run syncs: gradients (DeDLOC: "
                        "the gradients of every target batch are averaged) or local (DiLoCo: "
                        "inner_steps target batches of local optimizer steps, then the "
                        "pseudo-gradients are averaged and one outer step is taken)."] = "gradients",
        inner_steps: Annotated[int | None, "A local run's H: target batches of inner steps per "
                               "outer step (required with sync local).",
                               {"minimum": 1, "maximum": 1_000_000}] = None,
        outer_lr: Annotated[float | None, "A local run's outer learning rate (default 0.7; with "
                            "compression topk 1.5).", {"minimum": 0, "maximum": 10}] = None,
        outer_momentum: Annotated[float | None, "A local run's outer Nesterov momentum (default "
                                  "0.9; with compression topk 0).",
                                  {"minimum": 0, "maximum": 0.999}] = None,
        feedback_decay: Annotated[float | None, "A local run with a lossy codec: its error-feedback "
                                  "residual is multiplied by this before each exchange (default "
                                  "1: kept whole; with compression topk 0.95, SparseLoCo's; "
                                  "refused with compression none, which has no residual).",
                                  {"minimum": 0, "maximum": 1}] = None,
        overlap: Annotated[bool | None, "A local run trains on while its pseudo-gradient is "
                           "averaged (a one-step-delayed outer step; default false)."] = None,
        outer_clip: Annotated[float | None, "A local run's outer-step guard: a step at most this "
                              "many times the recent steps' norm (default 4; 0: none).",
                              {"minimum": 0, "maximum": 1000}] = None,
        inner_lr_scale: Annotated[float | Literal["auto"] | None, "A local run's inner learning "
                                  "rate: the workload's lr times this, or auto (the default): "
                                  "times the trainer's batch size / target_batch_size.",
                                  {"minimum": 0.0001, "maximum": 10}] = None,
    ) -> RunStatus:
        """Start a run, or join a collaborative one; answers once the worker has loaded it.

        The manifest (workload, config with its defaults filled in, target_batch_size, epochs,
        min_peers, average_state_every, compression, aggregation, and for a local-update run
        sync, inner_steps, outer_lr, outer_momentum, overlap, outer_clip, inner_lr_scale and
        feedback_decay)
        identifies a collaborative run together with its name: peers with the same name and
        manifest train together, and a run started with only a name (no workload) joins the run
        its peers publish under that name. A run of the same name and manifest that stopped
        resumes from its last intact checkpoint.
        """
        if name is not None and not RUN_NAME.match(name):
            raise InvalidParams("name", "1-64 letters, digits, '_', '.' or '-', starting with a "
                                        "letter or digit")
        if workload is None and name is None and token is None:
            raise InvalidParams("workload", "give a workload to start a run, a run name to join "
                                            "one, or the token of a closed run")
        local = {"sync": sync, "inner_steps": inner_steps, "outer_lr": outer_lr,
                 "outer_momentum": outer_momentum, "overlap": overlap, "outer_clip": outer_clip,
                 "inner_lr_scale": inner_lr_scale, "feedback_decay": feedback_decay}
        return await self._node.runs.start(workload, dict(config), name, target_batch_size, epochs,
                                           checkpoint_every, device, collaborative, min_peers,
                                           role, average_state_every, compression, closed, token,
                                           sync={k: v for k, v in local.items() if v is not None},
                                           aggregation=aggregation)

    @rpc_method("run.status", errors=(ErrorCode.UNKNOWN_RUN,))
    async def run_status(
        self, name: Annotated[str | None, "A run's name; null: every run."] = None,
    ) -> Annotated[list[RunStatus], "One entry per run."]:
        """Progress of the runs: epoch, samples, loss, throughput, and the worker's state."""
        if name is None:
            return self._node.runs.statuses()
        return [self._node.runs.get(name).status()]

    @rpc_method("run.stop", errors=(ErrorCode.UNKNOWN_RUN,))
    async def run_stop(
        self, name: Annotated[str | None, "The run's name; may be omitted when there is one run."] = None,
    ) -> RunStatus:
        """Stop a run: finish the current step, checkpoint, stop its worker."""
        return await self._node.runs.stop(name)

    @rpc_method("run.restart", errors=(ErrorCode.UNKNOWN_RUN, ErrorCode.RUN_NOT_ACTIVE,
                                       ErrorCode.WORKER_FAILED, ErrorCode.SHUTTING_DOWN))
    async def run_restart(
        self, name: Annotated[str | None, "The run's name; may be omitted when there is one run."] = None,
    ) -> RunStatus:
        """Restart a stopped, crashed or failed run with a new worker, from its last checkpoint."""
        return await self._node.runs.restart(name)


__all__ = ["ControlApi", "build_registry"]
