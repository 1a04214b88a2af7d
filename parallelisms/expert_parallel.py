"""Expert parallelism for mixture-of-experts layers (found by their interface, components/model/moe_layer.py: the
layers of models/moe.py or of a fork's copy), and how they are sharded under tensor parallelism and FSDP.

Each of the ep ranks holds num_experts / ep experts (their weights DTensors sharded on the expert
dimension, so checkpoints hold every expert once and load at another ep degree). A token goes to the
rank of each expert it chose and comes back by two all-to-alls; their autograd sends the gradients
the same way back. The ep ranks are data-parallel ranks (components/distributed/mesh.py): every rank
still routes its own tokens.

Under tensor parallelism an MoE layer is not split: each tensor-parallel rank routes the tokens of
its own sequence shard through whole experts (`moe_tensor_parallel_plan`). Its parameters are then
the same on ranks that see different tokens, the tp ranks among them, and FSDP shards them over all
of those (`shard_moe`): the router and shared experts over dp x cp x tp ranks, the experts over
the same less the ep ranks. Their gradients are sums over those ranks of per-rank contributions, so
FSDP divides them by the data-parallel degree (dp x cp), as it does the other parameters', not by the
size of the mesh it reduces over.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInput

from components.distributed.mesh import ParallelDims
from components.model.moe_layer import moe_layers
from components.torch_private import all_to_all_single_autograd
from parallelisms.fsdp import offload_policy, resharding


class AllToAllDispatch:
    """Sends each (token, expert) slot to the rank holding the expert, runs that rank's experts, and
    returns the results to where the slots came from, in their order."""

    def __init__(self, ep_mesh: DeviceMesh):
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()

    @torch.compiler.disable  # the split sizes are data: compiled, each new split would recompile
    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (slots, dim) sorted by expert; counts: slots per expert (all experts, this rank's tokens)."""
        send = counts.view(self.ep, -1)  # [rank, that rank's expert]
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        send_splits, received_splits = send.sum(1).tolist(), received.sum(1).tolist()
        tokens = all_to_all_single_autograd(x, received_splits, send_splits, self.group)
        # Received in (source rank, expert) order; the experts want (expert, source rank).
        starts = (received.flatten().cumsum(0) - received.flatten()).view_as(received)
        by_expert = torch.cat([torch.arange(s, s + n) for s, n in
                               zip(starts.T.flatten().tolist(), received.T.flatten().tolist())]
                              + [torch.zeros(0, dtype=torch.long)]).to(x.device)
        out = experts(tokens[by_expert], received.sum(0).tolist())
        back = torch.empty_like(out).index_copy_(0, by_expert, out)
        return all_to_all_single_autograd(back, send_splits, received_splits, self.group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard the experts of every MoE layer of `model` over `ep_mesh` and dispatch tokens to them."""
    for _, moe in moe_layers(model):
        num_experts = moe.num_experts
        if num_experts % ep_mesh.size():
            raise ValueError(f"moe.num_experts {num_experts} must be divisible by "
                             f"parallelism.expert_parallel_degree {ep_mesh.size()}")
        for name, param in list(moe.experts.named_parameters()):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            moe.experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        moe.dispatcher = AllToAllDispatch(ep_mesh)


def moe_tensor_parallel_plan() -> PrepareModuleInput:
    """The tensor-parallel style of an MoE feed-forward: its input, the sequence-parallel norm's
    DTensor, becomes this rank's sequence shard as a plain tensor, and its output is that shard's,
    as the residual stream between blocks is."""
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)


def shard_moe(model: nn.Module, dims: ParallelDims, fsdp: bool, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
              reshard_after_forward: str, cpu_offload: bool = False) -> None:
    """FSDP units for the MoE layers of `model`: the experts over `dims.expert_fsdp_mesh`, the rest of
    each layer over `dims.moe_fsdp_mesh`. Call before the blocks are sharded (they then leave these
    parameters out). Done whenever the rest of the model uses FSDP (`fsdp`), and also without it when
    ranks of the layout route different tokens through the same parameters (tensor parallelism):
    FSDP's reduce-scatter then adds up their gradients."""
    if not fsdp and dims.moe_fsdp_mesh.size() == 1:
        return
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = resharding(reshard_after_forward, dims.pp > 1)
    for _, moe in moe_layers(model):
        for module, mesh in ((moe.experts, dims.expert_fsdp_mesh), (moe, dims.moe_fsdp_mesh)):
            fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard,
                        offload_policy=offload_policy(cpu_offload, mesh.device_type))
            module.set_gradient_divide_factor(float(dims.dp * dims.cp))
            # gloo has no pre-multiplied sum: sum, then divide. (Not over one rank, where torch 2.13's
            # FSDP would then divide twice.)
            if mesh.device_type == "cpu" and mesh.size(mesh.ndim - 1) > 1:
                module.set_force_sum_reduction_for_comms(True)
