"""Replica groups on torchft: data-parallel replicas that fail and rejoin while the others keep training.

With fault_tolerance.enable, a job is `replica_groups` separate torchrun jobs (groups), each with the same config
but for fault_tolerance.replica_id, laid out inside as any run (FSDP, TP, PP, CP, EP), and all of them joined by
torchft: its lighthouse (`torchft_lighthouse`, one per job) forms a quorum of the live groups before every step,
and each group's manager averages the gradients over the groups of that quorum (rank r of every group with rank r
of the others: the same layout holds the same shard, of the same pipeline stage, tensor and context parallel rank)
before the step is clipped and taken. A group that dies leaves the quorum at the next step; the others go on without
a restart. A group that (re)joins is behind the quorum's step: its manager fetches the weights, optimizer, schedule,
step guard and step of a live group from that group's same-rank process (no checkpoint read) before the step, and
from then on every group takes the same update from the same weights: bitwise the same weights.

With fault_tolerance.semi_sync_method diloco the quorums are those of DiLoCo's synchronisations instead, every
sync_every steps (components/distributed/diloco.py); a group (re)joins at the next one.

Each group writes into <job.dump_folder>/replica_<id>: its own log (log.txt; its lines carry the group, [g<id>
rank<r>]), metrics and checkpoints. A group that took a live group's state keeps the records it logged before and
marks the steps it did not train (MetricsLogger.continue_after). What each group reads while another is away, and
what a lost group costs: docs/reliability.md.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from components.config import Config, ConfigError, FaultTolerance
from components.distributed.diloco import OuterStep
from components.metrics.reporting import MetricsLogger
from components.model.moe_layer import moe_layers
from components.torch_private import tree_map

logger = logging.getLogger("ingot")


def replica_folder(dump_folder: str, cfg: FaultTolerance) -> str:
    """Where a group writes: its own folder under the job's."""
    return os.path.join(dump_folder, f"replica_{cfg.replica_id}") if cfg.enable else dump_folder


def data_share(cfg: FaultTolerance, dims) -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel degree) over all groups: group g's ranks follow those of
    groups 0 to g - 1, as the replicas of data_parallel_replicate_degree would."""
    rank, degree = dims.dp_mesh.get_local_rank(), dims.dp
    return (cfg.replica_id * degree + rank, cfg.replica_groups * degree) if cfg.enable else (rank, degree)


def check_replica_config(cfg: FaultTolerance, dims) -> None:
    if not cfg.enable:
        if cfg.semi_sync_method != "none":
            raise ConfigError(f"fault_tolerance.semi_sync_method {cfg.semi_sync_method} synchronises replica groups: "
                              "set fault_tolerance.enable true and launch each group (docs/reliability.md)")
        return
    if cfg.replica_id >= cfg.replica_groups:
        raise ConfigError(f"fault_tolerance.replica_id {cfg.replica_id} is not a group of replica_groups "
                          f"{cfg.replica_groups}: give each group an id from 0 to {cfg.replica_groups - 1}")
    if dims.dp_replicate > 1:
        raise ConfigError(f"parallelism.data_parallel_replicate_degree {dims.dp_replicate} with fault_tolerance: "
                          "the replica groups are the replicas; shard inside a group (data_parallel_shard_degree)")
    if "RANK" not in os.environ:
        raise ConfigError("fault_tolerance needs torchrun's store: launch each group with ./run_train.sh")


def replica_groups(config: Config, checkpointed: dict[str, Stateful], step: int, metrics: MetricsLogger,
                   folder: Path, device: torch.device) -> ReplicaGroups | NoReplicas:
    """`checkpointed`: the run's checkpointed states by name (components/checkpoint/dcp.py), under DiLoCo an
    `outer_step` (components/distributed/diloco.py) among them."""
    if not config.fault_tolerance.enable:
        return NoReplicas()
    return ReplicaGroups(config.fault_tolerance, checkpointed, step, config.training.steps, metrics, folder, device)


def outer_step(cfg: FaultTolerance, model_parts: list[nn.Module]) -> OuterStep | None:
    """DiLoCo's state, to checkpoint with the run; None without DiLoCo."""
    return OuterStep(model_parts, cfg) if cfg.enable and cfg.semi_sync_method == "diloco" else None


class NoReplicas:
    """A run without fault tolerance: one group that always commits."""

    def start_step(self) -> None:
        pass

    def average_step(self, model_parts: list[nn.Module], loss: torch.Tensor) -> None:
        pass

    def should_commit(self, step: int) -> bool:
        return True

    def after_step(self, step: int, skipped: torch.Tensor, log: bool) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class ReplicaGroups:
    """This process's side of the replica groups: its torchft manager, which takes part in the quorum of every
    step (start_step), averages the step over the groups of the quorum (average_step) and says whether the step may be
    taken (should_commit), or under DiLoCo in the quorum of every synchronisation (after_step); and `states`, what a
    (re)joining group takes from a live one."""

    def __init__(self, cfg: FaultTolerance, checkpointed: dict[str, Stateful], step: int, total_steps: int,
                 metrics: MetricsLogger, folder: Path, device: torch.device):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's server logs every quorum and commit at info
        for name in ("torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # It warns at every quorum on CPU (no NCCL flight recorder); its errors are in should_commit's line.
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        try:
            from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
            from torchft.checkpointing import HTTPTransport
        except ImportError as e:
            raise ConfigError("fault_tolerance.enable needs torchft: pip install -e '.[ft]'") from e
        self.states = {name: state for name, state in checkpointed.items() if name != "dataloader"}
        self.groups, self.group_id = cfg.replica_groups, cfg.replica_id
        timeout = timedelta(seconds=cfg.timeout_seconds)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        transport = HTTPTransport(timeout=timeout, num_chunks=0)  # torchft's default, made here to quiet it
        # Its HTTP server logs each transfer to stderr, as http.server does; this server's handler logs nothing
        # (torchft offers no setting: its private _server).
        transport._server.RequestHandlerClass.log_message = lambda *args: None
        # torch's streaming load reads the received bytes in place, which warns once that they are read-only.
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        self.manager = Manager(
            pg=pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=1,
            checkpoint_transport=transport,
            # The fewest groups a step is taken with is the lighthouse's --min_replicas: fewer wait there.
            use_async_quorum=False,  # a rejoining group takes the state before its forward, not during it
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            lighthouse_addr=cfg.lighthouse or None, replica_id=f"ingot_{cfg.replica_id}",
            init_sync=False,  # every group starts from the same weights: they are a function of the seed
        )
        self.outer: OuterStep | None = checkpointed.get("outer_step")
        self.sync_every, self.total_steps, self.error = cfg.sync_every, total_steps, False
        if self.outer is not None and step == 0:
            self.outer.snapshot()  # the weights as initialised or loaded (checkpoint.initial_load_path)
        self._at_step(step)
        self.participants, self.took_state, self.metrics, self.joined = cfg.replica_groups, False, metrics, False
        self.moe: list[nn.Module] = []  # this rank's mixture-of-experts layers, found at the first step
        self.speaks = dist.get_rank() == 0  # each group's rank 0
        self.file_log = logging.FileHandler(folder / "log.txt") if self.speaks else None
        if self.file_log:  # several groups share a terminal: each keeps its own log too
            self.file_log.setFormatter(logging.getLogger().handlers[0].formatter)
            logging.getLogger().addHandler(self.file_log)
        lighthouse = cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        logger.info(f"replica group {cfg.replica_id} of {cfg.replica_groups}, in the quorums of {lighthouse}; a live "
                    "group's step, if one is ahead, replaces this group's start at the first quorum")

    def start_step(self) -> None:
        """Join this step's quorum (under DiLoCo, the job's next synchronisation, once a launch). A group behind the
        quorum takes a live group's state here (self._load)."""
        if self.outer is None:
            self._quorum()
        elif not self.joined:
            self._synchronise()

    def _at_step(self, step: int) -> None:
        """The manager's step, which decides at a quorum which groups are behind (they take the state of one that
        is not): the training step, also under DiLoCo, where the manager would count synchronisations."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.groups})

    def _quorum(self) -> tuple[int, bool]:
        """Start a quorum. Returns the step this group is at after it, and whether it took a live group's state."""
        start = time.perf_counter()
        self.manager.start_quorum()
        step, took_state = self.states["train_state"].step, self.took_state
        if took_state:
            logger.info(f"replica group {self.group_id} took the state of step {step} from a live group in "
                        f"{time.perf_counter() - start:.2f}s (quorum and transfer)")
        if took_state or not self.joined:
            self.metrics.continue_after(step, took_state)
        self.took_state, self.joined = False, True
        participants = self.manager.num_participants()
        if participants != self.participants and self.speaks:
            away = self.groups - participants
            logger.warning(f"step {step + 1}: {participants} of {self.groups} replica groups take part"
                           + (f"; the share of the {away} away is not trained" if away > 0 else ""))
            self.participants = participants
        return step, took_state

    def average_step(self, model_parts: list[nn.Module], loss: torch.Tensor) -> None:
        """This rank's gradients (shards of DTensor ones) and the step's loss replaced by their means over the groups
        of this step's quorum (one all-reduce per dtype); the routing tallies of its mixture-of-experts layers by their
        sums, so that components/training/routing.py moves every group's routing biases as one job's. Under DiLoCo
        each group steps alone: nothing."""
        if self.outer is not None:
            return
        tensors = [_local(p.grad) for part in model_parts for p in part.parameters() if p.grad is not None] + [loss]
        self._all_reduce(tensors, ReduceOp.AVG)
        self.moe = [moe for part in model_parts for _, moe in moe_layers(part)]
        if self.moe:
            self._all_reduce([t for moe in self.moe for t in (moe.tokens_per_expert, moe.aux_loss_sum, moe.forwards)],
                             ReduceOp.SUM)

    def _all_reduce(self, tensors: list[torch.Tensor], op: ReduceOp) -> None:
        """Reduce `tensors` in place over the groups of the quorum, one all-reduce per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self.manager.allreduce(flat, reduce_op=op).wait()
            for t, reduced in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(reduced.view_as(t))

    def should_commit(self, step: int) -> bool:
        """Whether every group of the quorum got through this step; if not, it is taken again with the next batch.
        Under DiLoCo a step is this group's alone: always."""
        if self.outer is not None:
            return True
        committed = self._commit()
        if not committed:
            for moe in self.moe:  # what this attempt routed is not the step's
                moe.reset_tally()
            self._not_committed(f"step {step}", "taken again with this group's next batch; this attempt's batch is "
                                                "not trained")
        return committed

    def _commit(self) -> bool:
        self.error = self.manager.errored()
        return self.manager.should_commit()

    def _not_committed(self, what: str, consequence: str) -> None:
        if self.speaks:
            cause = "a collective with another group failed" if self.error else "another rank of this group failed"
            logger.warning(f"{what} not committed by the replica groups ({cause}): {consequence}")

    def after_step(self, step: int, skipped: torch.Tensor, log: bool) -> dict[str, float]:
        """In the training loop (components/training/loop_features.py): under DiLoCo, every sync_every steps and
        after the last, the groups synchronise."""
        if self.outer is not None and self._synchronises_at(step):
            self._synchronise()
        return {}

    def _synchronises_at(self, step: int) -> bool:
        return step % self.sync_every == 0 or step == self.total_steps

    def _synchronise(self) -> None:
        """DiLoCo's synchronisation (components/distributed/diloco.py), at a quorum: the groups average their
        pseudo-gradients and take the outer step, unless their step is none of a synchronisation or the one of the last
        (a job starting, or resumed from a checkpoint): the quorum puts them all at one step and one state, so they
        agree. A group that took its state at this quorum has moved nowhere of its own and counts for nothing in the
        mean."""
        start = time.perf_counter()
        self._at_step(self.states["train_state"].step)
        step, took_state = self._quorum()
        moves = self._synchronises_at(step) and step > self.outer.last_sync
        if moves:
            pseudo = self.outer.pseudo_gradients()
            shards = [_local(t) for t in pseudo.values()]
            contributes = torch.ones((), device=shards[0].device) * (not took_state)
            for shard in shards:
                shard.mul_(contributes)
            self._all_reduce([contributes, *shards], ReduceOp.SUM)  # one all-reduce where they share a dtype
            for shard in shards:
                shard.div_(contributes.clamp(min=1))
        if not self._commit():
            self.outer.restore()
            self._not_committed(f"the synchronisation of step {step}", "every group goes back to the weights of the "
                                "last one, the steps since are not trained")
            return
        if moves:
            self.outer.step(pseudo, step)
            if self.speaks:
                size = sum(shard.numel() * shard.element_size() for shard in shards)
                logger.info(f"step {step}: {int(contributes.item())} of {self.groups} replica groups synchronised "
                            f"({size / 2**20:.1f} MiB of pseudo-gradients a rank, {time.perf_counter() - start:.2f}s)")

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        if self.file_log:
            logging.getLogger().removeHandler(self.file_log)
            self.file_log.close()

    def _state(self) -> dict:
        """What a joining group takes: every state but the data loader's (each group reads its own share), with
        each DTensor as this rank's shard (the joining rank holds the same shard)."""
        return {name: tree_map(_local, state.state_dict()) for name, state in self.states.items()}

    def _load(self, received: dict) -> None:
        for name, state in self.states.items():
            state.load_state_dict(tree_map(_like, state.state_dict(), received[name]))
        self.took_state = True


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def _like(mine, received):
    """`received` (a shard, or a plain value) in the form of this rank's own entry `mine`."""
    if isinstance(mine, DTensor):
        return DTensor.from_local(received.to(mine.device), mine.device_mesh, mine.placements, run_check=False,
                                  shape=mine.shape, stride=mine.stride())
    if isinstance(mine, torch.Tensor) and isinstance(received, torch.Tensor):
        return received.to(mine.device)
    return received

