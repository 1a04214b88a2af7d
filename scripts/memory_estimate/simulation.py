"""One micro-batch's forward and backward through the real model code on fake tensors, with a
dispatch mode that follows the bytes of every tensor storage: the activations and working memory
of one rank without parallelism, which breakdown.py scales to the layout."""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from components.model.attention import CAUSAL, attention_layers
from components.model.moe_layer import moe_layers
from components.training.loss import MultiTokenLoss, cross_entropy_loss
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.context_parallel import (
    attach_context_parallel,
    documents_attention,
    zigzag_attention,
    zigzag_declared_attention,
    zigzag_masks,
    zigzag_positions,
    zigzag_to_sequence_order,
)
from parallelisms.context_parallel_documents import ShardedDocuments, allgather_documents, ring_documents, take
from parallelisms.ring_attention import RingAttention, head_repeats


class StorageTracker(TorchDispatchMode):
    """Adds up the bytes of the tensor storages that operators create while it is active, and takes
    them off when a storage is freed. Storages given to `ignore` (parameters, buffers) are never
    counted. A storage that becomes a parameter's `.grad` moves from the `other` count to a
    gradient count (`root` or `block`, see `watch_grads`). `samples` holds (other, root_grads,
    block_grads) after every change, the timeline the peak is read from."""

    def __init__(self):
        super().__init__()
        self.other = self.root_grads = self.block_grads = 0
        self._live: dict[int, tuple[weakref.ref, int, str]] = {}  # id(storage) -> (ref, bytes, category)
        self._ignored: dict[int, weakref.ref] = {}
        self.samples: list[tuple[int, int, int]] = []

    def ignore(self, tensors) -> None:
        for t in tensors:
            st = t.untyped_storage()
            self._ignored[id(st)] = weakref.ref(st)

    def _known(self, st) -> bool:
        key = id(st)
        live, ignored = self._live.get(key), self._ignored.get(key)
        return (live is not None and live[0]() is st) or (ignored is not None and ignored() is st)

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if self._known(st):
            return
        key, nbytes = id(st), st.nbytes()
        self._live[key] = (weakref.ref(st, lambda _, key=key: self._free(key)), nbytes, "other")
        self.other += nbytes
        self._sample()

    def _free(self, key: int) -> None:
        _, nbytes, category = self._live.pop(key)
        setattr(self, category, getattr(self, category) - nbytes)
        self._sample()

    def _sample(self) -> None:
        self.samples.append((self.other, self.root_grads, self.block_grads))

    def watch_grads(self, model: torch.nn.Module) -> None:
        """Reclassify each parameter's gradient when autograd stores it: `block_grads` for the
        transformer blocks' parameters, `root_grads` for the others (embeddings, norm, output)."""
        in_blocks = {id(p) for p in model.transformer_blocks().parameters()}

        def hook(param: torch.Tensor, category: str) -> None:
            st = param.grad.untyped_storage()
            entry = self._live.get(id(st))
            if entry is not None and entry[0]() is st and entry[2] == "other":
                self._live[id(st)] = (entry[0], entry[1], category)
                self.other -= entry[1]
                setattr(self, category, getattr(self, category) + entry[1])

        for param in model.parameters():
            category = "block_grads" if id(param) in in_blocks else "root_grads"
            param.register_post_accumulate_grad_hook(lambda p, c=category: hook(p, c))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


@dataclass
class Simulation:
    """Bytes measured for one micro-batch of one stage, one rank without parallelism."""

    saved: int
    """Tensors alive at the end of the forward (activations saved for backward, the loss)."""
    samples: list[tuple[int, int, int]]
    """(other, root gradients, block gradients) over the forward and backward."""
    root_grad_bytes: int
    block_grad_bytes: int
    seconds: float


class LoopbackRing:
    """ring_attention's Ring without a process group: what it "receives" is a new tensor of the size sent."""

    def __init__(self, size: int):
        self.rank, self.size = 0, size

    def start(self, tensor: torch.Tensor, tag: int = 0):
        return torch.empty_like(tensor)

    @staticmethod
    def finish(pending: torch.Tensor) -> torch.Tensor:
        return pending


def context_parallel_attention(cp: int, local_seq: int, method: str, target: str, masks):
    """The attention of parallelisms/context_parallel.py (by `method`) on context-parallel rank 0, with its
    communication replaced by tensors of the sizes received (no process group is needed, and on fake tensors
    only sizes matter), and ring's kernels of the `target` device. `masks`: `allgather_masks`."""
    positions = zigzag_positions(local_seq * cp, cp, 0)

    def allgather(q, k, v, mask=None, spec=CAUSAL, sink_logits=None):
        joined = torch.cat([k, v], dim=-1)  # (batch, n_kv_heads, local_seq, k and v head sizes)
        gathered = joined.repeat_interleave(cp, dim=2)
        sizes = [k.shape[-1], v.shape[-1]]
        if mask is not None:
            k, v = take(gathered, mask.shares.flatten(1).argsort(dim=1), dim=2).split(sizes, dim=-1)
            return documents_attention(q, k, v, mask, 0, spec, sink_logits)
        k, v = zigzag_to_sequence_order(gathered, cp).split(sizes, dim=-1)
        if spec != CAUSAL or sink_logits is not None:
            return zigzag_declared_attention(q, k, v, cp, 0, spec, sink_logits)
        return zigzag_attention(q, k, v, masks)

    def alltoall(q, k, v, mask=None, spec=CAUSAL, sink_logits=None):  # full causal attention's sizes, an upper bound
        def trade(t):  # (batch, heads, local_seq, d) -> (batch, heads / cp, seq, d), as sized as the all-to-all's
            return t.unflatten(1, (cp, -1))[:, 0].repeat_interleave(cp, dim=2)

        if k.shape[1] % cp:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(*map(trade, (q, k, v)),
                                                               attn_mask=None if mask is None else mask.plan,
                                                               is_causal=mask is None,
                                                               enable_gqa=q.shape[1] != k.shape[1])
        return out.unflatten(2, (cp, -1))[:, :, 0].repeat_interleave(cp, dim=1)

    def ring(q, k, v, mask=None, spec=CAUSAL, sink_logits=None):
        return RingAttention.apply(q, k, v, LoopbackRing(cp), mask, head_repeats(q, k, target), spec, sink_logits)

    return {"allgather": allgather, "alltoall": alltoall, "ring": ring}[method], positions


def unmasked_stand_in(queries: int, keys: int):
    """A mask of `queries` x `keys` that SDPA runs with none (causal from the top left): on fake tensors, where only
    sizes matter, the stand-in of a mask the target's kernel needs none of. Made before the fake mode."""
    from torch.nn.attention.bias import causal_upper_left  # here: the module imports torch's compiler

    return causal_upper_left(queries, keys)


def one_document_plan(cp: int, local_seq: int, method: str, target: str):
    """Rank 0's `ShardedDocuments.plan` under allgather or ring for rows of one document each, the most work
    (alltoall's is the model's own mask: None). Real tensors, made before the fake mode: fake ones have no
    values to plan by. Where allgather runs FlexAttention (CUDA), each chunk's mask is a stand-in of its sizes
    that SDPA runs with no mask (on fake tensors only sizes matter): the CPU builds a boolean one instead."""
    if method == "alltoall":
        return None
    ids = torch.zeros(1, cp * local_seq, dtype=torch.long)
    plan = {"allgather": allgather_documents, "ring": ring_documents}[method](ids, cp_size=cp, cp_rank=0).plan
    if method == "allgather" and target == "cuda":
        return [keys._replace(block_mask=unmasked_stand_in(local_seq // 2, keys.end - keys.start)) for keys in plan]
    return plan


def flex_mask_stand_in(seq_len: int, target: str):
    """The model's document mask of the whole sequence where the target runs FlexAttention (CUDA): a stand-in of
    its sizes that SDPA runs with no mask, made before the fake mode. None elsewhere: the model's own builder makes
    the dense boolean mask that the CPU attends under."""
    return unmasked_stand_in(seq_len, seq_len) if target == "cuda" else None


def allgather_masks(cp: int, local_seq: int, target: str, dtype: torch.dtype):
    """Rank 0's `zigzag_masks`, made before the fake mode (which cannot construct them); where the flash kernel
    runs them with no mask (CUDA, half precision), stand-ins of their sizes that SDPA runs with none either."""
    masks = zigzag_masks(local_seq * cp, cp, 0)
    if target == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return tuple(unmasked_stand_in(mask.seq_len_q, mask.seq_len_kv) for mask in masks)
    return masks


def as_cuda_attends(sdpa):
    """The attention `sdpa` as CUDA's kernels keep memory, on fake CPU tensors. Values narrower than the keys
    (multi-head latent attention) are padded to their size: SDPA's CPU kernels would fall back to the math path,
    which keeps the attention weights for backward; CUDA's memory-efficient kernel keeps, like flash, only the output
    and the log-sum-exp. Learned sink logits are left out: the CPU path materializes the scores for them, CUDA's
    FlexAttention keeps what those kernels keep (its sink scale is one more output-sized tensor)."""
    def attend(q, k, v, mask=None, spec=CAUSAL, sink_logits=None):
        if v.shape[-1] >= q.shape[-1]:
            out = sdpa(q, k, v, mask, spec)
        else:
            out = sdpa(q, k, torch.nn.functional.pad(v, (0, q.shape[-1] - v.shape[-1])), mask, spec)[..., :v.shape[-1]]
        return out if sink_logits is None else out * 0.5  # the sinks' scale: one more output-sized tensor
    return attend


def balanced_dispatch(experts: torch.nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mixture-of-experts routing on fake tensors, which have no values to route by: every expert gets
    an equal share of the slots, the balance that load balancing aims at. Under expert parallelism a
    rank computes as many slots as it sends, so the one-rank simulation also stands for it."""
    slots, num_experts = x.shape[0], next(experts.parameters()).shape[0]  # stacks over the experts
    return experts(x, [slots // num_experts + (i < slots % num_experts) for i in range(num_experts)])


def checkpoint_period(ac_mode: str, ac_option: str) -> int:
    """Blocks after which the activation checkpointing pattern repeats (N for selective by layer)."""
    return int(ac_option) if ac_mode == "selective" and ac_option.isdigit() and int(ac_option) > 0 else 1


def blocks_to_simulate(n_blocks: int, ac_mode: str, ac_option: str) -> int:
    """How many blocks the simulation runs: a first block (its input is the embeddings') and two
    periods of the checkpointing pattern (two blocks without selective-by-layer checkpointing),
    with the blocks left out a whole number of periods; never more than the stage holds."""
    period = checkpoint_period(ac_mode, ac_option)
    k = 1 + 2 * period
    k += (n_blocks - k) % period
    return min(n_blocks, k)


def simulate_micro_batch(model_package: ModuleType, args, *, batch: int, seq: int, dtype: torch.dtype,
                         ac_mode: str = "none", ac_option: str = "2", n_blocks: int | None = None,
                         first: bool = True, last: bool = True, cp: int = 1, cp_method: str = "allgather",
                         document_masking: bool = False, target: str = "cpu",
                         simulate_blocks: int | None = None, layer_ids: Sequence[int] | None = None,
                         ep: int = 1) -> Simulation:
    """Forward and backward of `batch` sequences of `seq` tokens through a stage of `n_blocks` blocks
    (default: the model's; with the embeddings if `first`, the norm, output and loss if `last`) on
    fake tensors, with the kernels of the `target` device where they differ in what they allocate (ring's,
    allgather's). `layer_ids`: the stage's blocks' layer numbers (default: the first `n_blocks`), which decide
    each block's kind where a family's blocks differ (DeepSeek-V3's dense first blocks before its experts). `ep`:
    the expert-parallel degree, whose share of the experts a rank holds and computes.

    Only `simulate_blocks` blocks run (default: `blocks_to_simulate`): the stage's first and its last ones; the
    others repeat the last ones, so their effect is added exactly: think of them as inserted after the first
    block and one period of the checkpointing pattern. From the end of that period's forward until
    its backward starts, each of them holds what one block of the period leaves alive; from then on
    they are done, their activations freed and their gradients stored. Over the inserted blocks,
    what is alive changes by the same amount every period, plus the same ups and downs within each
    period, so its highest point is in the first or the last of them, which look exactly like the
    simulated periods on either side of the insertion point: the simulated timeline holds it."""
    start = time.perf_counter()
    n_blocks = args.n_layers if n_blocks is None else n_blocks
    k = blocks_to_simulate(n_blocks, ac_mode, ac_option) if simulate_blocks is None else min(simulate_blocks, n_blocks)
    layer_ids = list(range(n_blocks) if layer_ids is None else layer_ids)
    simulated = {str(i) for i in layer_ids[:1] + layer_ids[len(layer_ids) - k + 1:]}
    stage_args = type(args)(**vars(args))
    stage_args.n_layers = layer_ids[-1] + 1
    plan = one_document_plan(cp, seq, cp_method, target) if cp > 1 and document_masking else None
    masks = allgather_masks(cp, seq, target, dtype) if cp > 1 else None
    flex_mask = flex_mask_stand_in(seq * cp, target)
    with FakeTensorMode():
        model = model_package.Transformer(stage_args)
        for name in [name for name in model.transformer_blocks() if name not in simulated]:
            del model.transformer_blocks()[name]
        if flex_mask is not None:
            model.document_mask = lambda ids, spec: flex_mask
        first_modules, last_modules = model.pipeline_ends
        for name in (*([] if first else first_modules), *([] if last else last_modules)):
            setattr(model, name, None)  # as a pipeline stage without that end
        if dtype != torch.float32:  # FSDP's mixed precision: parameters in the compute dtype, buffers as they are
            converted = {}
            for module in model.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None:
                        converted.setdefault(id(p), torch.nn.Parameter(p.detach().to(dtype)))
                        module._parameters[name] = converted[id(p)]
        if cp > 1:
            attention, positions = context_parallel_attention(cp, seq, cp_method, target, masks)
            shares = torch.stack([zigzag_positions(seq * cp, cp, rank) for rank in range(cp)])  # of one document
            whole_mask = model.document_mask
            attach_context_parallel(
                model,
                lambda ids: positions if ids is None else positions.expand(len(ids), -1),
                lambda ids, spec: ShardedDocuments(ids, shares.expand(len(ids), -1, -1),
                                                   whole_mask(ids, spec) if plan is None else plan),
                lambda layer: attention,
            )
        for _, layer in moe_layers(model):
            layer.dispatcher = balanced_dispatch
            for module in layer.experts.modules():  # under expert parallelism, the 1/ep of each stack a rank holds
                for name, stack in list(module._parameters.items()):
                    module._parameters[name] = torch.nn.Parameter(stack.detach()[: stack.shape[0] // ep])
        if target == "cuda" and cp == 1:
            for _, layer in attention_layers(model):
                layer.sdpa = as_cuda_attends(layer.sdpa)
        apply_activation_checkpointing(model.transformer_blocks(), ac_mode, ac_option,
                                       ring_attention=cp > 1 and cp_method == "ring")
        model.train()
        tracker = StorageTracker()
        tracker.ignore([*model.parameters(), *model.buffers()])
        tracker.watch_grads(model)

        # Where the blocks left out would run (after the first block and one period), and how much
        # each block leaves alive when its forward is done.
        period = checkpoint_period(ac_mode, ac_option)
        marks, growth = {}, []

        def before(module, inputs):
            growth.append(-tracker.other)

        def after(module, inputs, output):
            growth[-1] += tracker.other

        def insertion_point(module, inputs, output):
            marks["forward"] = len(tracker.samples)
            output.register_hook(lambda grad: marks.setdefault("backward", len(tracker.samples)) and None)

        blocks = list(model.transformer_blocks().values())
        for block in blocks:
            block.register_forward_pre_hook(before)
            block.register_forward_hook(after)
        if k < n_blocks:
            blocks[period].register_forward_hook(insertion_point)

        with tracker:
            if first:
                inputs = torch.zeros(batch, seq, dtype=torch.long)
            else:  # hidden states received from the previous stage, kept for its backward
                inputs = torch.zeros(batch, seq, stage_args.dim, dtype=dtype, requires_grad=True)
            documents = torch.zeros(batch, seq * cp, dtype=torch.long) if document_masking else None
            if last:
                labels = torch.zeros(batch, seq, dtype=torch.long)
                out = MultiTokenLoss(cross_entropy_loss, torch.device("cpu"))(model(inputs, documents), labels)
            else:
                out = model(inputs, documents)
            saved = tracker.other  # with a stage's output, which the pipeline keeps for its backward
            if last:
                out.backward()
            else:
                grad = torch.ones_like(out)  # the gradient received from the next stage
                out.backward(grad)
                del grad
            del out, inputs
        blocks = model.transformer_blocks()
        in_blocks = sum(p.numel() for p in blocks.parameters())
        root = (sum(p.numel() for p in model.parameters()) - in_blocks) * dtype.itemsize
        block = sum(p.numel() for p in list(blocks.values())[-1].parameters()) * dtype.itemsize  # as the repeats
    samples = tracker.samples
    extra = n_blocks - k
    if extra:
        per_block = sum(growth[1 : 1 + period]) // period
        fwd, bwd = marks["forward"], marks["backward"]
        samples = (samples[:fwd] + [(o + extra * per_block, r, b) for o, r, b in samples[fwd:bwd]]
                   + [(o, r, b + extra * block) for o, r, b in samples[bwd:]])
        saved += extra * per_block
    return Simulation(saved, samples, root, block * n_blocks, time.perf_counter() - start)
