"""The largest attention logit of every layer, and QK-clip (the second half of Kimi K2's MuonClip).

Each attention layer's kernel (its `sdpa`, components/model/attention.py) is wrapped so that every call also takes,
for each head, the largest pre-softmax logit q.k / sqrt(head_dim) over the keys its mask lets each query see
(`largest_logits`: a few queries at a time, never the whole score matrix; the fused kernels, flash and
FlexAttention, return no such maximum). Under context parallelism a rank's queries are measured against the keys of
every rank (ModelOnRank's `cp_largest_logits`, parallelisms/context_parallel.py), whatever the method. The step's
largest over its micro-batches (and recomputations) stays on the device. After the optimizer step (a loop feature,
components/training/loop_features.py) one all-reduce (max) over every rank gives each rank the (layers x heads)
maxima of the whole step: tensor-parallel ranks fill their heads, pipeline stages their layers, data-parallel ranks
their batches. With `optimizer.qk_clip_threshold` tau, every head whose largest logit exceeded tau has its query
and key projections scaled back (the layer's `scale_query_key`, ClippableAttention) so that the same logit would
be tau; a step the step guard skipped clips nothing. On logged steps each layer's largest logit is a figure,
`max_logit/<layer>` (docs/optimizers.md).

The cost: one more product of queries and keys per attention forward (and recomputation), in the inputs'
precision (bf16 on CUDA: the maximum to about three digits). Refused at start-up: a model whose attention does not
declare `scale_query_key` or normalizes its queries and keys (QK-norm would undo the scaling).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask

from components.config import Config, ConfigError
from components.model.attention import CAUSAL, AttentionMask, ClippableAttention, attention_layers
from components.model.protocols import provides
from components.training.model_on_rank import ModelOnRank

SCORES_AT_ONCE = 2**26
"""The most scores held at once (256 MiB of float32): the queries measured together are as many as fit."""


def largest_logits(q: torch.Tensor, k: torch.Tensor,
                   visible: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    """(heads,): each query head's largest pre-softmax logit over (batch, query, visible key). q: (batch, heads,
    queries, head_dim); k: (batch, kv_heads, keys, head_dim), kv_heads dividing heads (grouped-query);
    `visible(rows)`: booleans broadcasting to (batch, heads, len(rows), keys), which keys the queries `rows` see."""
    q, k = q.detach(), k.detach()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    rows_at_once = max(1, SCORES_AT_ONCE // (q.shape[0] * q.shape[1] * k.shape[2]))
    largest = torch.full((q.shape[1],), float("-inf"), device=q.device)
    for start in range(0, q.shape[2], rows_at_once):
        rows = slice(start, start + rows_at_once)
        scores = (q[:, :, rows] @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
        largest = torch.maximum(largest, scores.masked_fill(~visible(rows), float("-inf")).amax(dim=(0, 2, 3)))
    return largest


def layer_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | BlockMask | None = None,
                 spec: AttentionMask = CAUSAL) -> torch.Tensor:
    """`largest_logits` of a whole sequence's queries and keys, under what the layer's kernel got: a document mask,
    boolean (batch, 1, seq, seq) or FlexAttention's (whose mask_mod is asked about the rows measured), else `spec`
    over the positions."""
    positions = torch.arange(k.shape[2], device=q.device)
    if isinstance(mask, BlockMask):
        batch = torch.arange(q.shape[0], device=q.device)[:, None, None, None]
        head = torch.zeros((), dtype=torch.long, device=q.device)
        return largest_logits(q, k, lambda rows: mask.mask_mod(batch, head, positions[rows, None], positions[None]))
    if mask is not None:
        return largest_logits(q, k, lambda rows: mask[:, :, rows])
    return largest_logits(q, k, lambda rows: spec.allows(positions[rows, None], positions[None]))


class AttentionLogits:
    """The loop feature: records the largest logits, clips, and reports them (the module docstring)."""

    def __init__(self, model_parts: list[nn.Module], layer_names: list[str], n_heads: int, threshold: float,
                 tp_rank: int, tp_size: int, device: torch.device, pipeline=None, measure: Callable = layer_logits):
        """`layer_names`: every attention layer of the whole model (its name in the unsplit model), which fixes the
        rows of the step's maxima on every rank, whatever stage holds it. `pipeline` (parallelisms/pipeline.py's):
        a step that starts with torch's shape inference runs each stage first on placeholders (uninitialized memory
        past the first stage), whose logits are left out. `measure(q, k, mask, spec)`: a kernel call's largest
        logits per head (`layer_logits`, or context parallelism's over every rank's keys)."""
        self.threshold, self.tp_size, self.pipeline, self.measure = threshold, tp_size, pipeline, measure
        self.seen: set[str] = set()
        """The layers that ran in this step (a shape-inferring step's first call of each is the placeholder)."""
        self.rows = {name: i for i, name in enumerate(layer_names)}
        self.heads = slice(tp_rank * n_heads // tp_size, (tp_rank + 1) * n_heads // tp_size)
        self.n_heads, self.device = n_heads, device
        self.layers = {name: layer for part in model_parts for name, layer in attention_layers(part)}
        self.step_max = {name: torch.full((n_heads // tp_size,), float("-inf"), device=device)
                         for name in self.layers}
        for name, layer in self.layers.items():
            layer.sdpa = self.recording(name, layer.sdpa)

    def recording(self, name: str, kernel):
        """`kernel`, taking the logits of a training forward (validation's and evaluation's run without gradients)
        into the step's maxima."""
        step_max = self.step_max[name]

        def sdpa(q, k, v, mask=None, spec=CAUSAL, **kwargs):
            if torch.is_grad_enabled() and not self.placeholder(name):
                torch.maximum(step_max, self.measure(q, k, mask, spec), out=step_max)
            return kernel(q, k, v, mask, spec, **kwargs)
        return sdpa

    def placeholder(self, name: str) -> bool:
        first = name not in self.seen
        self.seen.add(name)
        return first and self.pipeline is not None and self.pipeline.infers_shapes

    def after_step(self, step: int, skipped: torch.Tensor, log: bool) -> dict[str, float]:
        self.seen.clear()
        maxima = torch.full((len(self.rows), self.n_heads), float("-inf"), device=self.device)
        for name, values in self.step_max.items():
            maxima[self.rows[name], self.heads] = values
            values.fill_(float("-inf"))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        if self.threshold:
            factors = (self.threshold / maxima).clamp(max=1.0).where(~skipped, torch.ones_like(maxima))
            for name, layer in self.layers.items():
                layer.scale_query_key(factors[self.rows[name]])
        if not log:
            return {}
        return {f"max_logit/{name}": value for name, value in zip(self.rows, maxima.amax(1).tolist())}


def measures_attention_logits(config: Config) -> bool:
    """Whether the run takes its attention layers' largest logits: for QK-clip, or as a metric."""
    return bool(config.optimizer.qk_clip_threshold) or config.metrics.max_attention_logit


def attention_logits(config: Config, model: ModelOnRank, whole_model: nn.Module, n_heads: int, mesh: DeviceMesh,
                     device: torch.device) -> list[AttentionLogits]:
    """The feature where the config asks for it (optimizer.qk_clip_threshold, metrics.max_attention_logit), after
    the refusals the module docstring names; `whole_model`: the model before it was split into pipeline stages."""
    threshold = config.optimizer.qk_clip_threshold
    if not measures_attention_logits(config):
        return []
    asked = f"optimizer.qk_clip_threshold {threshold}" if threshold else "metrics.max_attention_logit"
    layers = list(attention_layers(whole_model))
    if not layers:
        raise ConfigError(f"{asked}: {config.model.name} declares no attention layer (components/model/attention.py)")
    for name, layer in layers if threshold else ():
        if not provides(layer, ClippableAttention) or getattr(layer, "qk_norm", False):
            raise ConfigError(f"optimizer.qk_clip_threshold: {config.model.name}'s attention ({name}) cannot be "
                              "clipped: it declares no scale_query_key (components/model/attention.py's "
                              "ClippableAttention), or a QK-norm would undo the scaling")
    # Context parallelism's measure sends keys point to point: eager inside compiled blocks (imported here, not for
    # every run: torch's compiler).
    measure = torch.compiler.disable(model.cp_largest_logits) if model.cp_largest_logits else layer_logits
    tp = mesh["tp"]
    return [AttentionLogits(model.parts, [name for name, _ in layers], n_heads, threshold, tp.get_local_rank(),
                            tp.size(), device, model.pipeline, measure)]
