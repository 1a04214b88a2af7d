"""The optimizers of one or more model parts (AdamW, or Muon with AdamW), their per-group learning
rates under µP, and the learning-rate schedule: linear warmup, an optional stable phase, then decay.

Under pipeline parallelism a rank holds several model parts (stages); each gets its own optimizers,
and the container below makes them act as one, with a state dict keyed by parameter name so that a
checkpoint loads under any layout."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from components.config import CHOICES, ConfigError, LRScheduler as LRSchedulerConfig, Optimizer as OptimizerConfig
from components.training.muon import Muon

# Flattened keys ("state.layers.0.attention.wq.weight.exp_avg") let every model part find its own
# entries in one merged dict.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Optimizers(Stateful):
    """The optimizers of every model part, stepped together: one AdamW per part, or under Muon a Muon
    for the part's block matrices and an AdamW for the rest of it."""

    def __init__(self, model_parts: list[nn.Module], cfg: OptimizerConfig):
        if cfg.name not in CHOICES["optimizer.name"]:
            raise ConfigError(f"optimizer.name must be one of {', '.join(CHOICES['optimizer.name'])}, got {cfg.name!r}")
        self.owners, self.optimizers = [], []  # each optimizer and the model part whose parameters it holds
        for part in model_parts:
            for optimizer in build_optimizers(part, cfg):
                self.owners.append(part)
                self.optimizers.append(optimizer)
        self.skip_on_device = cfg.name == "AdamW" and cfg.implementation == "fused"

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self, skip: torch.Tensor | None = None) -> None:
        """One optimizer step, or none where the boolean tensor `skip` is true. The fused AdamW
        decides on the device (the `found_inf` mechanism of torch.amp.GradScaler: weights, moments
        and step count stay as they were), the others (and Muon) need `skip` on the host."""
        if skip is not None and not self.skip_on_device:
            if skip.item():
                return
            skip = None
        for optimizer in self.optimizers:
            if skip is not None:  # on the parameters' device: the host's with FSDP's CPU offload
                device = optimizer.param_groups[0]["params"][0].device
                optimizer.found_inf, optimizer.grad_scale = skip.float().to(device), None
            optimizer.step()

    def state_dict(self) -> dict:
        merged = {}
        for part, optimizer in zip(self.owners, self.optimizers):
            merged.update(get_optimizer_state_dict(part, optimizer, options=_FLAT))
        return merged

    def load_state_dict(self, state_dict: dict) -> None:
        for part, optimizer in zip(self.owners, self.optimizers):
            set_optimizer_state_dict(part, optimizer, state_dict, options=_FLAT)


def build_optimizers(part: nn.Module, cfg: OptimizerConfig) -> list[torch.optim.Optimizer]:
    """AdamW over all of `part`; or Muon over the matrices of its blocks and AdamW over the rest.

    Under µP (a width multiplier m, see mup_width) the block matrices run at a lower peak lr: AdamW's
    lr / m, Muon's lr x muon_mup_scale(m, ...); everything else at the configured lr (docs/mup.md)."""
    width = mup_width(part)
    if cfg.name == "AdamW":
        if width is None:
            return [adamw([(list(part.parameters()), cfg.lr)], cfg, cfg.weight_decay)]
        matrices, rest = split_matrices(part)
        return [adamw([(matrices, cfg.lr / width), (rest, cfg.lr)], cfg, cfg.weight_decay)]
    matrices, rest = split_matrices(part)
    optimizers = []
    if matrices:
        lr = cfg.lr if width is None else cfg.lr * muon_mup_scale(width, cfg.muon_adjust_lr)
        optimizers.append(Muon(
            [{"params": group} for group in by_mesh(matrices)], lr=lr, weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
            adjust_lr=cfg.muon_adjust_lr, ns_dtype=cfg.muon_ns_dtype,
        ))
    if rest:
        lr = cfg.lr if cfg.adamw_lr is None else cfg.adamw_lr
        weight_decay = cfg.weight_decay if cfg.adamw_weight_decay is None else cfg.adamw_weight_decay
        optimizers.append(adamw([(rest, lr)], cfg, weight_decay))
    return optimizers


def adamw(params_and_lrs: list[tuple[list[nn.Parameter], float]], cfg: OptimizerConfig,
          weight_decay: float) -> torch.optim.AdamW:
    """One AdamW over lists of parameters, each with its own peak lr (the first is the default)."""
    implementations = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}
    groups = [{"params": group, "lr": lr} for params, lr in params_and_lrs for group in by_mesh(params)]
    return torch.optim.AdamW(groups, lr=params_and_lrs[0][1], betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=weight_decay, **implementations[cfg.implementation])


def mup_width(part: nn.Module) -> float | None:
    """The width multiplier m = dim / model.mup_base_dim of a µP model part (models/llama3: ModelArgs.mup_width);
    None under the standard parametrization, and for model families without µP (which refuse model.mup)."""
    args = getattr(part, "args", None)
    return args.mup_width if getattr(args, "mup_base_dim", None) else None


def muon_mup_scale(width: float, adjust_lr: str) -> float:
    """What µP multiplies Muon's lr by at width multiplier m. µP asks of a hidden matrix's update a
    spectral norm independent of width (for the ratios of fan-out to fan-in that hold as the width
    grows). An orthogonalised update has spectral norm 1, so under `original` (sqrt(max(1, A/B)))
    and `none` the lr is already width-free; `match_rms_adamw` multiplies it by 0.2 x sqrt(max(A, B)),
    which grows as sqrt(m): divide by sqrt(m) (the AdamW-like RMS is then that of the base width's)."""
    return width**-0.5 if adjust_lr == "match_rms_adamw" else 1.0


def split_matrices(part: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the block matrices, the rest): the 2-D parameters of the transformer blocks (`part.transformer_blocks()`)
    and their 3-D ones (MoE experts, one matrix per expert), which Muon updates and µP scales as hidden
    weights; and embeddings, the output layer, norms and biases (AdamW's, at the configured lr). A
    block parameter of more dimensions is refused, by name (Muon could not update it)."""
    in_blocks = {id(p) for p in part.transformer_blocks().parameters()}
    matrices, rest = [], []
    for name, p in part.named_parameters():
        if id(p) not in in_blocks or p.ndim < 2:
            rest.append(p)
        elif p.ndim <= 3:
            matrices.append(p)
        else:
            raise ConfigError(f"optimizer.name Muon cannot update {name} of shape {tuple(p.shape)}: it takes "
                              "matrices and stacks of matrices (the experts of an MoE layer), at most 3-D")
    return matrices, rest


def lr_factor(step: int, total_steps: int, cfg: LRSchedulerConfig) -> float:
    """Multiplier of the peak lr used for optimizer step `step` (counted from 1).

    Warmup rises linearly to 1 over `warmup_steps`; the last `decay_ratio` of all steps (or every
    step after warmup when decay_ratio is unset) fall from 1 to `min_lr_factor`; between the two
    the lr stays at its peak (warmup-stable-decay)."""
    warmup = cfg.warmup_steps
    if step <= warmup:
        return step / (warmup + 1)
    decay_steps = total_steps - warmup if cfg.decay_ratio is None else round(total_steps * cfg.decay_ratio)
    decay_start = total_steps - decay_steps
    if cfg.decay_type == "constant" or step <= decay_start or decay_steps <= 0:
        return 1.0
    progress = (step - decay_start) / decay_steps
    if cfg.decay_type == "linear":
        remaining = 1 - progress
    elif cfg.decay_type == "sqrt":
        remaining = 1 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1 - cfg.min_lr_factor) * remaining


class LRSchedule(Stateful):
    """Sets every param group's lr to its peak lr x lr_factor(step) before each optimizer step. A
    group's peak is the lr it was built with (under Muon, optimizer.lr for the Muon groups and
    optimizer.adamw_lr for the AdamW ones); `peak_lr` gives the lr that is logged.

    Only the number of steps taken is state; the schedule itself comes from the config."""

    def __init__(self, optimizers: Optimizers, total_steps: int, cfg: LRSchedulerConfig, peak_lr: float):
        if cfg.decay_ratio is not None and not 0 <= cfg.decay_ratio <= 1:
            raise ValueError(f"lr_scheduler.decay_ratio must be between 0 and 1, got {cfg.decay_ratio}")
        if cfg.decay_ratio is not None and cfg.warmup_steps + round(total_steps * cfg.decay_ratio) > total_steps:
            raise ValueError(
                f"lr_scheduler.warmup_steps ({cfg.warmup_steps}) + decay_ratio*training.steps "
                f"({round(total_steps * cfg.decay_ratio)}) exceed training.steps ({total_steps})"
            )
        self.optimizers, self.total_steps, self.cfg, self.peak_lr = optimizers, total_steps, cfg, peak_lr
        self.peak_lrs = [group["lr"] for group in optimizers.param_groups]
        self.steps_taken = 0
        self._apply()

    @property
    def lr(self) -> float:
        """The lr of the next optimizer step."""
        return self.peak_lr * lr_factor(self.steps_taken + 1, self.total_steps, self.cfg)

    def _apply(self) -> None:
        factor = lr_factor(self.steps_taken + 1, self.total_steps, self.cfg)
        for group, peak_lr in zip(self.optimizers.param_groups, self.peak_lrs):
            group["lr"] = peak_lr * factor

    def step(self) -> None:
        self.steps_taken += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"steps_taken": self.steps_taken}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps_taken = int(state_dict["steps_taken"])
        self._apply()


def by_mesh(params) -> list[list[nn.Parameter]]:
    """Parameters in groups that one foreach or fused kernel can take: plain tensors together, and
    DTensors per device mesh. A model may mix them (e.g. a replicated norm beside tensor-parallel
    weights, or FSDP-only weights beside FSDP x TP ones), and those kernels refuse a mix."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(groups.values())


def reduce_partial_grads(params: list[nn.Parameter]) -> None:
    """Gradients still Partial (a sum over ranks not yet taken: those of the tensor-parallel QK-norm weights,
    components/model/attention.py) take their parameters' placements, one all-reduce each, before the norm and the step.
    torch 2.11's foreach AdamW reads such a gradient's local share as if whole (the weights drifted by 1e-2 from
    one process's within two steps); torch 2.13 reduces it inside each op, once per op."""
    for p in params:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def whole(norm: torch.Tensor) -> torch.Tensor:
    """A 2-norm, a DTensor partial over some mesh dimensions, made whole: its square summed over each of them, then
    the root (DTensor's full_tensor would take the root after each dimension, and warns that it reduces a
    2-D mesh's in sequence)."""
    if not isinstance(norm, DTensor):
        return norm
    squared = norm.to_local() ** 2
    for dim, placement in enumerate(norm.placements):
        if placement.is_partial():
            torch.distributed.all_reduce(squared, group=norm.device_mesh.get_group(dim))
    return squared.sqrt()


def clip_grad_norm(optimizers: Optimizers, max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip all gradients to a global norm of `max_norm` (0: no clipping) and return that norm.

    The norm is taken per parameter group of the optimizers (each a `by_mesh` group of a model part, its
    gradients first reduced where still partial: `reduce_partial_grads`) and the groups combined. Under
    pipeline parallelism each rank sees only its stages' gradients, so the squared norms are summed over the
    pipeline group."""
    groups = [[p for p in group["params"] if p.grad is not None] for group in optimizers.param_groups]
    groups = [params for params in groups if params]
    norms = []
    for params in groups:
        reduce_partial_grads(params)
        norms.append(whole(torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)))
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if pp_group is not None:
        squared = norm**2
        torch.distributed.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    if max_norm > 0:  # as torch.nn.utils.clip_grads_with_norm_, on each gradient's local share: a scaling by
        # one number needs no sharding decision, and DTensor's would cost each rank 0.5 CPU-s at its first step
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for params in groups for p in params]
        for device in {grad.device for grad in grads}:
            torch._foreach_mul_([grad for grad in grads if grad.device == device], coef.to(device))
    return norm
