"""Process group start-up and the DeviceMesh built from the [parallelism] degrees."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from components.config import Comm, ConfigError, Parallelism
from components.torch_private import set_group_timeout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The world mesh. With expert parallelism, dp_shard is two dims, dp_shard_mod_ep x ep (ep inner, so that
an expert-parallel group is as close together as the layout allows), flattened back into dp_shard."""


def init_distributed(comm: Comm, dump_folder: Path) -> torch.device:
    """Join the process group torchrun describes (or a one-process group without torchrun).

    CUDA runs get NCCL for GPU tensors and gloo for CPU tensors (async checkpointing and the
    agreement on stop signals use the latter); CPU runs use gloo. torch's flight recorder keeps the last
    comm.trace_buf_size collectives of each rank (gloo's too: a hang report compares the ranks' last ones,
    components/run/heartbeat.py); on CUDA NCCL's are dumped when a collective times out (variables already set in the
    environment win)."""
    timeout = timedelta(seconds=comm.init_timeout_seconds)
    if comm.trace_buf_size > 0:
        # TORCH_FR_BUFFER_SIZE is the newer name of TORCH_NCCL_TRACE_BUFFER_SIZE; torch reads either.
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(comm.trace_buf_size))
    if torch.cuda.is_available() and comm.trace_buf_size > 0:
        traces = dump_folder / comm.flight_recorder_folder
        traces.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(comm.trace_buf_size))
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(traces / "rank_"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device


def on_rank0_for_all(check: Callable[..., None], *args) -> None:
    """check(*args) on rank 0 alone (a check of the shared dump folder, say); where it raises, every rank raises
    an exception of the same type and message, so that all of them stop alike rather than wait for rank 0."""
    failure: list[tuple[type, str] | None] = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            check(*args)
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error, failure = e, [(type(e), str(e))]
    dist.broadcast_object_list(failure, src=0)
    if error is not None:
        raise error
    if failure[0] is not None:
        kind, message = failure[0]
        raise kind(message)


def set_collective_timeout(seconds: int, mesh: DeviceMesh) -> None:
    """Swap the generous start-up timeout for the training one on every group the run uses."""
    for group in {dist.group.WORLD, *mesh.get_all_groups()}:
        set_group_timeout(group, seconds)


@dataclass
class ParallelDims:
    """The degree of each parallelism; their product is the number of processes."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1

    @classmethod
    def from_config(cls, p: Parallelism, world_size: int) -> ParallelDims:
        dims = cls(p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.context_parallel_degree,
                   p.tensor_parallel_degree, p.pipeline_parallel_degree, world_size, p.expert_parallel_degree)
        dims.validate()
        return dims

    def validate(self) -> None:
        names = {
            "dp_replicate": "parallelism.data_parallel_replicate_degree",
            "cp": "parallelism.context_parallel_degree",
            "tp": "parallelism.tensor_parallel_degree",
            "pp": "parallelism.pipeline_parallel_degree",
        }
        for attr, key in names.items():
            if getattr(self, attr) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, attr)}")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"dp_replicate*cp*tp*pp = {others} (the parallelism.*_degree keys) needs a multiple of {others} "
                    f"processes, but {self.world_size} were started (NGPU / --nproc_per_node)"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ConfigError(f"parallelism.data_parallel_shard_degree must be >= 1 or -1, got {self.dp_shard}")
        if others * self.dp_shard != self.world_size:
            raise ConfigError(
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) * tp({self.tp}) * "
                f"pp({self.pp}) = {others * self.dp_shard}, but {self.world_size} processes were started; "
                "the parallelism.*_degree keys must multiply to the world size"
            )
        if self.ep < 1 or self.dp_shard % self.ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree {self.ep} must be >= 1 and divide the data-parallel shard degree "
                f"({self.dp_shard}): expert parallelism uses data-parallel ranks"
            )

    @property
    def dp(self) -> int:
        """Ranks that see different data: replicas times shards."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        names = ("dp_replicate", "dp_shard", "cp", "tp", "pp") + (("ep",) if self.ep > 1 else ())
        return " ".join(f"{name}={getattr(self, name)}" for name in names)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh with every dimension, size-1 ones too, so code can always index by name.

        Also sets the meshes of several dimensions taken together:
        - `dp_mesh`: the ranks that load different data (replicas x shards);
        - `fsdp_mesh`: what FSDP shards parameters over: shards x context-parallel ranks (these see
          the same parameters), with replicas as a second dimension for HSDP;
        - `loss_mesh`: the ranks whose losses are averaged for logging (dp x cp);
        - `ep_mesh`, and the FSDP meshes of mixture-of-experts layers (parallelisms/expert_parallel.py):
          `moe_fsdp_mesh` for their router and shared experts, `expert_fsdp_mesh` for their experts."""
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                 "tp": self.tp}
        shard_dims = ("dp_shard",)
        if self.ep > 1:
            sizes |= {"dp_shard_mod_ep": self.dp_shard // self.ep, "ep": self.ep}
            shard_dims = ("dp_shard_mod_ep", "ep")
        names = tuple(name for dim in MESH_DIMS for name in (shard_dims if dim == "dp_shard" else (dim,)))
        mesh = init_device_mesh(device_type, tuple(sizes[d] for d in names), mesh_dim_names=names)
        # DeviceMesh._flatten is private, but it is how torch makes one group out of several dims.
        dp_shard = mesh[shard_dims]._flatten("dp_shard") if self.ep > 1 else mesh["dp_shard"]
        self.dp_mesh = mesh[("dp_replicate", *shard_dims)]._flatten("dp")
        self.loss_mesh = mesh[("dp_replicate", *shard_dims, "cp")]._flatten("dp_cp")
        if self.cp > 1:
            dp_shard = mesh[(*shard_dims, "cp")]._flatten("dp_shard_cp")
        # Mixture-of-experts layers route each rank's own tokens, tensor-parallel ranks included
        # (their sequence shards), and are sharded by FSDP over every rank holding the same copy.
        moe_shard = mesh[(*shard_dims, "cp", "tp")]._flatten("moe_shard")

        def with_replicas(shard: DeviceMesh) -> DeviceMesh:
            """HSDP: replicas as a first dimension."""
            return mesh["dp_replicate", shard.mesh_dim_names[0]] if self.dp_replicate > 1 else shard

        self.fsdp_mesh, self.moe_fsdp_mesh = with_replicas(dp_shard), with_replicas(moe_shard)
        if self.ep == 1:
            self.expert_fsdp_mesh, self.ep_mesh = self.moe_fsdp_mesh, None
            return mesh
        # The experts' weights are DTensors over (their FSDP ranks, ep). DTensor reduces over such a
        # 2-D mesh only if its dims are in the order of their root mesh, which the world mesh cannot
        # give (cp and tp come after ep): the experts get a mesh of their own over the same ranks.
        ranks = torch.arange(self.world_size).view(*(sizes[d] for d in names))
        ranks = ranks.permute(0, 1, 2, 4, 5, 3).reshape(self.pp, self.dp_replicate, -1, self.ep)
        expert_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "dp_replicate", "expert_shard", "ep"))
        replicate = ("dp_replicate",) if self.dp_replicate > 1 else ()
        self.expert_fsdp_mesh, self.ep_mesh = expert_mesh[(*replicate, "expert_shard")], expert_mesh["ep"]
        return mesh
