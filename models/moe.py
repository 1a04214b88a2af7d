"""Mixture of experts, shared by the model families: a token-choice top-k router, routed experts
computed as one grouped matmul, optional shared experts, and load balancing.

Dropless: every token goes to its top_k experts, however uneven the load. Load balancing has two
mechanisms, usable together:
- the auxiliary-loss-free bias (DeepSeek-V3): a per-expert bias added to the scores only to choose
  the experts, moved after each optimizer step by `bias_update_speed` towards the less loaded ones
  (`update_expert_bias`);
- an auxiliary loss, aux_loss_coef x num_experts x sum_i f_i P_i, with f_i the fraction of the
  routed slots that expert i takes and P_i its mean score, over each sequence ("sequence") or over the
  micro-batch ("global"), plus an optional router z-loss (the mean squared logsumexp of the logits).
  Its gradient is attached to the layer's output (`AttachLoss`), so it reaches the router from any
  pipeline stage without passing through the loss function.

Expert parallelism (parallelisms/expert_parallel.py) sets `MoE.dispatcher`, which sends each token to
the rank holding its expert and brings the result back; without it all experts are local.

Code outside the families finds these layers by the interface of components/model/moe_layer.py (`MoELayer`), which
`MoE` has: a fork's copy of this module is recognised alike. The step's tally of what they routed, and the
bias updates, are in components/training/routing.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from components.torch_private import grouped_mm, has_grouped_mm, in_backward
from models.activations import activation
from models.decoder import FeedForward


@dataclass
class MoEArgs:
    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256
    """The hidden size of one expert (moe_intermediate_size in Hugging Face configs)."""
    num_shared_experts: int = 0
    """Experts every token goes through (DeepSeek-V3), as one feed-forward of this many x hidden_dim."""
    score_func: str = "softmax"
    """softmax or sigmoid (DeepSeek-V3) of the router's logits."""
    norm_topk_prob: bool = True
    """Rescale the chosen experts' scores to sum to 1 (Qwen3-MoE's norm_topk_prob)."""
    route_scale: float = 1.0
    """Multiplies the chosen experts' weights (DeepSeek-V3's routed_scaling_factor)."""
    n_groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts form this many groups of consecutive
    indices, and a token chooses among those of its best `topk_groups` groups only, each group ranked by the
    sum of its two best scores (routing bias included). 1: no groups."""
    topk_groups: int = 1
    """DeepSeek-V3's topk_group: with n_groups, the groups a token's experts may come from."""
    bias_update_speed: float = 0.0
    """Auxiliary-loss-free balancing: the step by which each expert's routing bias moves after an
    optimizer step; 0 turns it off."""
    aux_loss_coef: float = 0.0
    aux_loss_type: str = "sequence"
    """sequence or global: the span over which the auxiliary loss measures balance."""
    z_loss_coef: float = 0.0
    hidden_act: str = "silu"
    """The experts' activation, by Hugging Face's name (models/activations.py): SwiGLU with silu."""
    shared_gate: bool = False
    """A sigmoid gate on the shared experts' output, one logit per token (Qwen2-MoE's and Qwen3.5's
    shared_expert_gate)."""
    router_bias: bool = False
    """A learned bias on the router's logits (gpt-oss), which takes part in the scores, unlike expert_bias."""


def check_moe_args(args: MoEArgs, key_prefix: str = "moe.") -> None:
    """One-line errors naming the key, for settings the layer cannot run."""
    if args.num_experts < 1:
        raise ValueError(f"{key_prefix}num_experts must be >= 1, got {args.num_experts}")
    if not 1 <= args.top_k <= args.num_experts:
        raise ValueError(f"{key_prefix}top_k {args.top_k} must be between 1 and {key_prefix}num_experts "
                         f"({args.num_experts})")
    if args.n_groups > 1 and (args.num_experts % args.n_groups or args.num_experts // args.n_groups < 2):
        raise ValueError(f"{key_prefix}n_groups {args.n_groups} must divide {key_prefix}num_experts "
                         f"({args.num_experts}) into groups of at least 2 experts")
    if args.n_groups > 1 and not 1 <= args.topk_groups <= args.n_groups:
        raise ValueError(f"{key_prefix}topk_groups {args.topk_groups} must be between 1 and {key_prefix}n_groups "
                         f"({args.n_groups})")
    if args.n_groups > 1 and args.top_k > args.topk_groups * (args.num_experts // args.n_groups):
        raise ValueError(f"{key_prefix}top_k {args.top_k} is more than the experts of {key_prefix}topk_groups "
                         f"({args.topk_groups}) groups of {args.num_experts // args.n_groups}")
    if args.score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"{key_prefix}score_func must be softmax or sigmoid, got {args.score_func!r}")
    if args.aux_loss_type not in ("sequence", "global"):
        raise ValueError(f"{key_prefix}aux_loss_type must be sequence or global, got {args.aux_loss_type!r}")


FLAVOR_KEYS = ("num_experts", "top_k", "hidden_dim", "num_shared_experts", "n_groups", "topk_groups")
"""The [moe] keys that, when set, replace the flavor's value; the section's other keys always apply."""


def moe_args_from_config(flavor: MoEArgs, moe) -> MoEArgs:
    """A flavor's experts with the `[moe]` section (components/config: MoE) applied, checked."""
    args = replace(flavor, **{key: getattr(moe, key) for key in FLAVOR_KEYS if getattr(moe, key) is not None},
                   bias_update_speed=moe.bias_update_speed, aux_loss_coef=moe.aux_loss_coef,
                   aux_loss_type=moe.aux_loss_type, z_loss_coef=moe.z_loss_coef)
    check_moe_args(args, key_prefix="moe.")
    return args


class AttachLoss(torch.autograd.Function):
    """Returns x unchanged; in backward, also sends a gradient of 1 to `loss` (so that backward from
    the model's output includes loss's gradient, as if it had been added to the training loss)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


class Router(nn.Module):
    """Scores every expert for every token and picks the top_k, in fp32."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=args.router_bias)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor):
        """x: (tokens, dim). Returns the logits and scores (tokens, num_experts), and the chosen
        experts and their weights (tokens, top_k). The routing bias takes part in the choice only."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.args.score_func == "softmax" else logits.sigmoid()
        choice = scores + expert_bias
        if self.args.n_groups > 1:  # only the experts of each token's best topk_groups groups stay in the running
            groups = choice.unflatten(-1, (self.args.n_groups, -1))
            group_scores = groups.topk(2, dim=-1).values.sum(-1)
            kept = group_scores.topk(self.args.topk_groups, dim=-1).indices
            out = torch.ones_like(group_scores, dtype=torch.bool).scatter_(-1, kept, False)
            choice = groups.masked_fill(out.unsqueeze(-1), float("-inf")).flatten(-2)
        experts = choice.topk(self.args.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.args.norm_topk_prob and self.args.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, scores, experts, weights * self.args.route_scale


def use_grouped_mm(x: torch.Tensor) -> bool:
    """torch._grouped_mm needs CUDA compute capability 9.0 or newer and bf16; elsewhere a loop."""
    return (has_grouped_mm() and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


class GroupedExperts(nn.Module):
    """num_experts SwiGLU feed-forwards, their weights stacked: w1, w3 (experts, hidden, dim), w2
    (experts, dim, hidden). Under expert parallelism each is a DTensor sharded on dim 0 and this rank
    computes its own experts."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, hidden_act: str = "silu"):
        super().__init__()
        self.act = activation(hidden_act)
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=std)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: (tokens, dim), sorted by expert, counts[i] of them for this rank's expert i."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        if use_grouped_mm(x):
            offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            h = self.act(grouped_mm(x, w1.transpose(-2, -1), offsets))
            h = h * grouped_mm(x, w3.transpose(-2, -1), offsets)
            return grouped_mm(h, w2.transpose(-2, -1), offsets)
        outputs = []
        for i, chunk in enumerate(x.split(counts)):
            outputs.append((self.act(chunk @ w1[i].T) * (chunk @ w3[i].T)) @ w2[i].T)
        return torch.cat(outputs) if outputs else x.new_zeros(0, w2.shape[1])


class LocalDispatch:
    """All experts on this rank: tokens sorted by expert go straight to them."""

    @torch.compiler.disable  # the split sizes are data: compiled, each new split would recompile
    def __call__(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return experts(x, counts.tolist())


class MoE(nn.Module):
    """The feed-forward of a block as a mixture of experts. Input and output (batch, seq, dim). `experts`: a
    family's own experts module (gpt-oss's), called as GroupedExperts is; default GroupedExperts."""

    def __init__(self, dim: int, args: MoEArgs, experts: nn.Module | None = None):
        super().__init__()
        check_moe_args(args)
        self.args = args
        self.router = Router(dim, args)
        self.experts = (experts if experts is not None
                        else GroupedExperts(dim, args.hidden_dim, args.num_experts, args.hidden_act))
        self.shared_experts = (FeedForward(dim, args.hidden_dim * args.num_shared_experts, args.hidden_act)
                               if args.num_shared_experts else None)
        self.shared_gate = nn.Linear(dim, 1, bias=False) if args.shared_gate and args.num_shared_experts else None
        self.dispatcher = LocalDispatch()
        # The routing bias is state to checkpoint; the counts and the auxiliary loss are
        # bookkeeping between optimizer steps (summed over micro-batches, read by the trainer).
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        self.register_buffer("forwards", torch.zeros(()), persistent=False)
        self.aux_loss_scale = 1.0
        """Multiplies the auxiliary loss's gradient: 1 / gradient accumulation steps, like the training loss."""

    @property
    def num_experts(self) -> int:
        return self.args.num_experts

    @property
    def bias_update_speed(self) -> float:
        return self.args.bias_update_speed

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.router.gate.weight, mean=0.0, std=std)
        if self.router.gate.bias is not None:
            nn.init.zeros_(self.router.gate.bias)
        self.experts.init_weights(std, out_std)
        if self.shared_experts is not None:  # the feed-forward every token goes through besides its routed experts
            self.shared_experts.init_weights(std, out_std)
        if self.shared_gate is not None:
            nn.init.trunc_normal_(self.shared_gate.weight, mean=0.0, std=std)
        self.expert_bias.zero_()
        self.reset_tally()

    def reset_tally(self) -> None:
        for buffer in (self.tokens_per_expert, self.aux_loss_sum, self.forwards):
            buffer.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        logits, scores, experts, weights = self.router(tokens, self.expert_bias)
        flat = experts.flatten()
        counts = flat.new_zeros(self.args.num_experts).index_add_(0, flat, torch.ones_like(flat))
        # Each (token, choice) slot, sorted by expert: the experts see their tokens contiguously.
        order = flat.argsort(stable=True)
        routed = self.dispatcher(self.experts, tokens[order // self.args.top_k], counts)
        slots = torch.empty_like(routed).index_copy_(0, order, routed).view(batch, seq, self.args.top_k, dim)
        # Summed over each token's choices into (batch, seq, dim): a tensor of its own, not a view of one (FSDP2 warns
        # that an in-place op on a view returned by a module it wraps would skip its backward hook).
        out = (slots * weights.view(batch, seq, -1, 1).to(slots.dtype)).sum(2)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            out = out + (shared if self.shared_gate is None else self.shared_gate(x).sigmoid() * shared)
        if self.training:
            aux, z = self.balancing_losses(logits, scores, experts, batch)
            record_routing(self, counts, aux)
            loss = self.args.aux_loss_coef * aux + self.args.z_loss_coef * z
            if torch.is_grad_enabled() and (self.args.aux_loss_coef or self.args.z_loss_coef):
                out = AttachLoss.apply(out, loss * self.aux_loss_scale)
        return out

    def balancing_losses(self, logits: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor,
                         batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's auxiliary balancing loss (without its coefficient) and router z-loss."""
        args = self.args
        groups = batch if args.aux_loss_type == "sequence" else 1
        probs = scores / scores.sum(-1, keepdim=True) if args.score_func == "sigmoid" else scores
        probs = probs.view(groups, -1, args.num_experts)
        chosen = experts.reshape(groups, -1)
        ones = torch.ones_like(chosen, dtype=scores.dtype)
        # (groups, experts): each expert's share of the group's routed slots, summing to 1.
        fraction = scores.new_zeros(groups, args.num_experts).scatter_add_(1, chosen, ones) / chosen.shape[1]
        aux = args.num_experts * (fraction * probs.mean(1)).sum(-1).mean()
        return aux, logits.logsumexp(-1).square().mean()


@torch.compiler.disable
def record_routing(moe: MoE, counts: torch.Tensor, aux_loss: torch.Tensor) -> None:
    """Add a micro-batch's expert counts and auxiliary loss to the layer's tally, once: activation
    checkpointing's recomputation runs inside backward and is not counted again."""
    if not in_backward():
        moe.tokens_per_expert.add_(counts.float())
        moe.aux_loss_sum.add_(aux_loss.detach())
        moe.forwards.add_(1)


def dense_or_moe(layer_id: int, args) -> nn.Module:
    """The feed-forward of block `layer_id`: in the blocks `args.is_moe_layer` picks a mixture of experts, its experts
    taking the model's activation; in the others SwiGLU with args.ffn_dim hidden units (models/decoder.py)."""
    if args.is_moe_layer(layer_id):
        return MoE(args.dim, replace(args.moe, hidden_act=args.hidden_act))
    return FeedForward(args.dim, args.ffn_dim, args.hidden_act)
