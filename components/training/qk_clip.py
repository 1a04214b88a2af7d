"""The largest attention logit of every layer, and QK-clip (the second half of Kimi K2's MuonClip).

Each attention layer's kernel (its `sdpa`, components/model/attention.py) is wrapped so that every call also takes,
for each head, the largest pre-softmax logit q.k / sqrt(head_dim) over the keys its mask lets each query see
(`largest_logits`: query chunk by query chunk, never the whole score matrix at once); the step's largest over its
micro-batches (and recomputations) stays on the device. After the optimizer step (a loop feature,
components/training/loop_features.py) one all-reduce (max) over every rank gives each rank the (layers x heads)
maxima of the whole step: tensor-parallel ranks fill their heads, pipeline stages their layers, data-parallel ranks
their batches. With `optimizer.qk_clip_threshold` tau, every head whose largest logit exceeded tau has its query
and key projections scaled back (the layer's `scale_query_key`, ClippableAttention) so that the same logit would
be tau; a step the step guard skipped clips nothing. On logged steps each layer's largest logit is a figure,
`max_logit/<layer>` (docs/optimizers.md).

Not yet: context parallelism (a rank's queries would see only its own chunk of the keys) and FlexAttention's block
masks (CUDA under document masking): refused at start-up, as is a model whose attention does not declare
`scale_query_key` or normalizes its queries and keys (QK-norm would undo the scaling).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from components.config import Config, ConfigError
from components.model.attention import CAUSAL, AttentionMask, ClippableAttention, attention_layers
from components.model.protocols import provides
from components.training.model_on_rank import ModelOnRank

QUERY_CHUNK = 1024
"""Queries whose scores are held at once: (batch, heads, 1024, keys) floats."""


def largest_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None,
                   spec: AttentionMask = CAUSAL) -> torch.Tensor:
    """(heads,): each query head's largest pre-softmax logit over (batch, query, visible key). q: (batch, heads,
    seq, head_dim); k may have fewer heads (grouped-query); mask: a document mask (batch, 1, seq, seq), else `spec`
    over positions."""
    q, k = q.detach().float(), k.detach().float()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    positions = torch.arange(k.shape[2], device=q.device)
    largest = torch.full((q.shape[1],), float("-inf"), device=q.device)
    for start in range(0, q.shape[2], QUERY_CHUNK):
        rows = slice(start, start + QUERY_CHUNK)
        scores = q[:, :, rows] @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        visible = mask[:, :, rows] if mask is not None else spec.allows(positions[rows, None], positions[None])
        largest = torch.maximum(largest, scores.masked_fill(~visible, float("-inf")).amax(dim=(0, 2, 3)))
    return largest


class AttentionLogits:
    """The loop feature: records the largest logits, clips, and reports them (the module docstring)."""

    def __init__(self, model_parts: list[nn.Module], layer_names: list[str], n_heads: int, threshold: float,
                 tp_rank: int, tp_size: int, device: torch.device, pipeline=None):
        """`layer_names`: every attention layer of the whole model (its name in the unsplit model), which fixes the
        rows of the step's maxima on every rank, whatever stage holds it. `pipeline` (parallelisms/pipeline.py's):
        a step that starts with torch's shape inference runs each stage first on placeholders (uninitialized memory
        past the first stage), whose logits are left out."""
        self.threshold, self.tp_size, self.pipeline = threshold, tp_size, pipeline
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
                torch.maximum(step_max, largest_logits(q, k, mask, spec), out=step_max)
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


def attention_logits(config: Config, model: ModelOnRank, whole_model: nn.Module, n_heads: int, mesh: DeviceMesh,
                     device: torch.device) -> list[AttentionLogits]:
    """The feature where the config asks for it (optimizer.qk_clip_threshold, metrics.max_attention_logit), after
    the refusals the module docstring names; `whole_model`: the model before it was split into pipeline stages."""
    threshold = config.optimizer.qk_clip_threshold
    if not threshold and not config.metrics.max_attention_logit:
        return []
    asked = f"optimizer.qk_clip_threshold {threshold}" if threshold else "metrics.max_attention_logit"
    if config.parallelism.context_parallel_degree > 1:
        raise ConfigError(f"not available yet: {asked} with context parallelism (a rank's queries see only its chunk "
                          "of the keys there)")
    if config.training.document_masking and device.type == "cuda":
        raise ConfigError(f"not available yet: {asked} with training.document_masking on CUDA (FlexAttention's "
                          "block masks)")
    layers = list(attention_layers(whole_model))
    if not layers:
        raise ConfigError(f"{asked}: {config.model.name} declares no attention layer (components/model/attention.py)")
    for name, layer in layers if threshold else ():
        if not provides(layer, ClippableAttention) or getattr(layer, "qk_norm", False):
            raise ConfigError(f"optimizer.qk_clip_threshold: {config.model.name}'s attention ({name}) cannot be "
                              "clipped: it declares no scale_query_key (components/model/attention.py's "
                              "ClippableAttention), or a QK-norm would undo the scaling")
    tp = mesh["tp"]
    return [AttentionLogits(model.parts, [name for name, _ in layers], n_heads, threshold, tp.get_local_rank(),
                            tp.size(), device, model.pipeline)]
