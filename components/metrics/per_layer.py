"""Per-block statistics for looking inside a run (`metrics.per_layer`): each transformer block's
weight norm, gradient norm, and the RMS and largest magnitude of its output.

Forward hooks on the blocks record output statistics only on the steps that are logged, so other
steps pay nothing. All figures are over the whole model and batch, whatever the layout: norms of
sharded parameters are reduced over their shards (DTensor does that), blocks held by other pipeline
stages come in through the pipeline group, and activation sums come from every rank's share of the
batch and sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

FIELDS = ("weight_norm", "grad_norm", "output_rms", "output_max")


def _squared_norm(tensors) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32)
    for t in tensors:
        norm = torch.linalg.vector_norm(t.float())
        total += (norm.full_tensor() if isinstance(norm, DTensor) else norm).cpu() ** 2
    return total


class LayerMetrics:
    def __init__(self, model_parts: list[nn.Module], n_layers: int, pp_group=None):
        self.blocks = {int(name): block for part in model_parts for name, block in part.transformer_blocks().items()}
        self.n_layers, self.pp_group = n_layers, pp_group
        self.recording = False
        # Per layer: output sum of squares, element count, largest magnitude.
        self.outputs = torch.zeros(n_layers, 3)
        for index, block in self.blocks.items():
            block.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def record(module, args, output) -> None:
            if self.recording and torch.is_grad_enabled():
                local = (output.to_local() if isinstance(output, DTensor) else output).detach().float()
                self.outputs[index, 0] += local.square().sum().cpu()
                self.outputs[index, 1] += local.numel()
                self.outputs[index, 2] = max(self.outputs[index, 2], local.abs().max().cpu())

        return record

    def start(self) -> None:
        """Record block outputs during the next step (call before a step that will be logged)."""
        self.outputs.zero_()
        self.recording = True

    def collect(self, device: torch.device) -> dict[int, dict[str, float]]:
        """{layer: {field: value}} after the step's backward, before the optimizer clears gradients.
        Every rank must call it (it communicates)."""
        self.recording = False
        norms = torch.zeros(self.n_layers, 2)
        for index, block in self.blocks.items():
            params = list(block.parameters())
            norms[index, 0] = _squared_norm(params)
            norms[index, 1] = _squared_norm([p.grad for p in params if p.grad is not None])
        norms = norms.to(device)
        sums, maxima = self.outputs[:, :2].contiguous().to(device), self.outputs[:, 2].contiguous().to(device)
        if self.pp_group is not None:  # each stage holds some blocks
            dist.all_reduce(norms, group=self.pp_group)
        if dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        norms, sums, maxima = norms.sqrt().cpu(), sums.cpu(), maxima.cpu()
        rms = (sums[:, 0] / sums[:, 1].clamp(min=1)).sqrt()
        return {
            layer: dict(zip(FIELDS, (norms[layer, 0].item(), norms[layer, 1].item(),
                                     rms[layer].item(), maxima[layer].item())))
            for layer in range(self.n_layers)
        }
