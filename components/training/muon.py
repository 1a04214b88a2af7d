"""Muon: momentum whose update is orthogonalised by a Newton-Schulz iteration before it is applied,
for the matrices of the transformer blocks (docs/optimizers.md).

torch.optim.Muon computes the same update (bit for bit on plain matrices in bfloat16, see
tests/test_muon.py) but serves only part of this trainer: it refuses parameters that are not 2-D
(MoE experts are stacks of matrices), runs its iteration in bfloat16 only, and on a sharded DTensor
leaves the communication to DTensor's per-operation sharding rules: collectives inside every
iteration (11 all-reduces per matrix and step for a Shard(0) matrix). Here a rank gathers each
matrix it holds a shard of once, orthogonalises it whole, and keeps its own shard of the result (as
Moonlight's Distributed Muon). The state, one momentum buffer per parameter sharded like the
parameter, goes through torch.distributed.checkpoint as AdamW's does.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from components.config import DTYPES

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic iteration of Keller Jordan's Muon (also torch.optim.Muon's): it pushes every singular
value into roughly [0.7, 1.2] in five steps, close enough to 1 for training and cheaper than exact."""


def newton_schulz(g: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """U V^T of g = U S V^T, approximately; for a 3-D g, of each matrix g[i] on its own. Computed in
    g's dtype, on the wide orientation (rows <= columns) so that X X^T is the smaller product. The
    operations are torch.optim.Muon's (its results in bfloat16, bit for bit), batched."""
    a, b, c = NS_COEFFICIENTS
    x = g if g.ndim == 3 else g.unsqueeze(0)
    tall = x.size(-2) > x.size(-1)
    x = x.mT if tall else x
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # singular values now at most 1
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.mT if tall else x
    return x if g.ndim == 3 else x.squeeze(0)


def lr_scale(shape: torch.Size, rule: str) -> float:
    """The factor Muon's lr is multiplied by for a parameter of `shape` (a matrix, or a stack of
    matrices that share it): optimizer.muon_adjust_lr."""
    rows, cols = shape[-2:]
    if rule == "match_rms_adamw":  # an orthogonal A x B matrix has RMS 1/sqrt(max(A, B)); AdamW's ~0.2
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1, rows / cols))
    return 1.0


def orthogonalise(update: torch.Tensor, param: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """newton_schulz of the whole update of `param`, given and returned as this rank's local share.

    For a DTensor `param` whose placements split a matrix dimension over more than one rank, the
    update is all-gathered (in `dtype`), every rank of the mesh orthogonalises the whole of it, and
    each keeps its own shard. A stack of matrices split only along its first dimension (MoE experts
    under expert parallelism or FSDP) holds whole matrices on each rank: no communication."""
    if not isinstance(param, DTensor) or not any(
        placement.is_shard() and placement.dim % param.ndim >= param.ndim - 2 and param.device_mesh.size(i) > 1
        for i, placement in enumerate(param.placements)
    ):
        return newton_schulz(update.to(dtype), steps)
    mesh, placements = param.device_mesh, param.placements
    # The collective runs on the mesh's device: with FSDP's CPU offload the update is in host memory.
    shard = update.to(mesh.device_type, dtype)
    # Contiguous: the gathered tensor's layout depends on the placements (and the torch release), and a matmul's
    # rounding on the layout; orthogonalised from the same layout, the result is the whole matrix's bit for bit.
    whole = DTensor.from_local(shard, mesh, placements, shape=param.shape, stride=param.stride()).full_tensor()
    whole = whole.contiguous()
    mine = distribute_tensor(newton_schulz(whole, steps), mesh, placements, src_data_rank=None).to_local()
    return mine.to(update.device)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Muon(torch.optim.Optimizer):
    """Muon over 2-D and 3-D parameters, plain tensors or DTensors of any placement. Per step:

        buffer = momentum x buffer + (1 - momentum) x gradient
        update = orthogonalise(gradient + momentum x (buffer - gradient) if nesterov else buffer)
        param  = (1 - lr x weight_decay) x param - lr x lr_scale(shape, adjust_lr) x update

    The momentum buffer is kept in the `momentum_buffer` state of each parameter, sharded as it is.
    Hyperparameters are per param group, as in torch.optim: lr, weight_decay, momentum, nesterov,
    ns_steps, adjust_lr (see lr_scale) and ns_dtype (a key of components.config.DTYPES)."""

    def __init__(self, params, *, lr: float, weight_decay: float, momentum: float, nesterov: bool, ns_steps: int,
                 adjust_lr: str, ns_dtype: str):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        adjust_lr=adjust_lr, ns_dtype=ns_dtype)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            momentum, lr = group["momentum"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                grad, buffer = local(p.grad), local(state["momentum_buffer"])
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = orthogonalise(update, p, group["ns_steps"], DTYPES[group["ns_dtype"]])
                weights = local(p)
                weights.mul_(1 - lr * group["weight_decay"])
                weights.add_(update, alpha=-lr * lr_scale(p.shape, group["adjust_lr"]))
        return loss
