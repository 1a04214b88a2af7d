"""What the mixture-of-experts layers routed during a step, over all ranks: it moves their routing biases
(auxiliary-loss-free balancing) and gives the step's MoE metrics. The layers are found by the interface of
components/model/moe_layer.py, whatever module defines them (models/moe.py, or a fork's copy)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from components.metrics.reporting import MetricsLogger
from components.model.moe_layer import moe_layers


class RoutingTally:
    """Every rank holds a tally per layer of the tokens it routed; one all-reduce over all ranks adds
    them up (ranks of other pipeline stages contribute zeros for layers they do not hold), so every
    rank then moves its biases by the same counts, whatever the layout."""

    def __init__(self, model_parts: list[nn.Module], n_layers: int, micro_batches_per_step: int,
                 metrics: MetricsLogger | None = None, device: torch.device | str = "cpu"):
        self.layers = {int(index): moe for part in model_parts for index, block in part.transformer_blocks().items()
                       for _, moe in moe_layers(block)}
        # MoE layers outside the blocks (multi-token prediction's) take the rows after the blocks', in model order.
        in_blocks = {id(moe) for moe in self.layers.values()}
        outside = [moe for part in model_parts for _, moe in moe_layers(part) if id(moe) not in in_blocks]
        self.layers |= {n_layers + i: moe for i, moe in enumerate(outside)}
        self.metrics, self.device = metrics, device
        # Of the whole model: a pipeline stage may hold no MoE layer (DeepSeek-V3's first blocks are dense), and
        # its rank must still join the tally's all-reduce. Agreed on once, here.
        whole = torch.tensor([max((m.num_experts for m in self.layers.values()), default=0),
                              any(m.bias_update_speed > 0 for m in self.layers.values()), len(outside)], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(whole, op=dist.ReduceOp.MAX)
        self.num_experts, self.update_bias, self.rows = int(whole[0]), bool(whole[1]), n_layers + int(whole[2])
        for moe in self.layers.values():  # averaged over the step's micro-batches, like the training loss
            moe.aux_loss_scale = 1 / micro_batches_per_step

    def after_step(self, step: int, skipped: torch.Tensor, log: bool) -> dict[str, float]:
        """In the training loop (components/training/loop_features.py): the step's figures, and each layer's expert load
        as histograms, on the steps that log."""
        figures, expert_load = self.end_step(skipped, metrics=log)
        if self.metrics is not None and log:
            self.metrics.log_expert_load(step, expert_load)
        return figures

    @torch.no_grad()
    def end_step(self, skipped: torch.Tensor, metrics: bool) -> tuple[dict[str, float], dict[int, torch.Tensor]]:
        """Call on every rank after the optimizer step (`skipped`: a boolean tensor, true where it was
        not taken, which leaves the biases as they are). With `metrics`, returns {moe_aux_loss,
        moe_max_load} and each layer's expert load (tokens per expert / their mean); else empty dicts."""
        if not self.num_experts or not (self.update_bias or metrics):
            for moe in self.layers.values():
                moe.reset_tally()
            return {}, {}
        # Per layer: the experts' token counts, the auxiliary loss summed over forwards, the forwards.
        tally = torch.zeros(self.rows, self.num_experts + 2, device=self.device)
        for index, moe in self.layers.items():
            tally[index, : moe.num_experts] = moe.tokens_per_expert
            tally[index, -2], tally[index, -1] = moe.aux_loss_sum, moe.forwards
            moe.reset_tally()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(tally)
        for index, moe in self.layers.items():
            if moe.bias_update_speed > 0:
                counts = tally[index, : moe.num_experts]
                delta = moe.bias_update_speed * torch.sign(counts.mean() - counts)
                moe.expert_bias.add_((delta - delta.mean()) * ~skipped)
        if not metrics:
            return {}, {}
        # Every MoE layer of the model, those of other pipeline stages too: the layers that routed tokens on some rank.
        layers = tally[:, :-2].sum(1).nonzero().flatten().tolist()
        rows = tally[layers].cpu()
        counts = rows[:, :-2]
        load = counts / counts.mean(1, keepdim=True).clamp(min=1e-9)
        aux = (rows[:, -2] / rows[:, -1].clamp(min=1)).mean()
        figures = {"moe_aux_loss": aux.item(), "moe_max_load": load.max().item()}
        return figures, {layer: load[i] for i, layer in enumerate(layers)}
