"""Ring attention for context parallelism (parallelism.context_parallel_method = "ring").

Every rank holds the queries, keys and values of its zigzag share of the sequence (two chunks of 2*cp:
r and 2*cp-1-r, parallelisms/context_parallel.py). The keys and values travel around the ring of CP ranks;
at each of the cp steps a rank attends its queries to the block it holds and merges the partial result into
its output by the log-sum-exp of each query's scores, while the next block is already on its way. No rank
ever holds more than two blocks of keys and values, and no mask is built: against the zigzag chunks a block
is either the rank's own (causal), or one whose first chunk all of the rank's queries see (an earlier rank),
or one that only the rank's second chunk sees, whole (a later rank).

With document masking each row's chunks go to the ranks by their documents (parallelisms/
context_parallel_documents.py), every rank has the document ids of the whole sequence, and each block's mask,
of that block's queries and keys only, is built from them as the block is attended: at or before the query, in
its document. Each block is attended by chunk pairs (each of this rank's two query chunks against each of the
block's two key chunks), and a pair that holds no key any of its queries sees, in any row, is skipped
(`ring_documents` says which): with documents shorter than the sequence most are. A query with no key of its
document in a pair takes nothing from it (its log-sum-exp there is -inf).

Under a sliding window a layer declares (components/model/attention.py's AttentionMask), the blocks go by chunk pairs
too: a pair whose keys are all out of the window of its queries is skipped, one the window cuts is attended under
a bias (also within documents), the others as above, so the work falls with the window. Attention sinks keep every
causal pair (the first keys are seen from everywhere), and a mask_mod puts a bias on every pair, which it may
leave without a key for some queries: those take nothing from it, as above.

Learned sink logits (gpt-oss, components/model/attention.py's `with_sink_logits`) apply once the blocks are merged: the
output is scaled by sigmoid(lse - sink) and the sink joins the log-sum-exp. The kernels' backward, given that output
and log-sum-exp, computes the probabilities with the sink's share taken out, which is the whole gradient of q, k and
v; the sink's own is -sum(p_sink * rowsum(grad_out * out)) over the queries.

The backward runs the ring again: each block's key and value gradients travel with it and arrive back at
its owner after the last step. Each step's attention, forward and backward, is one call of PyTorch's fused
kernel that returns the log-sum-exp (flash attention on CPU and for half precision on CUDA, the
memory-efficient kernel for float32 on CUDA): the scores are never materialized.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from components.model.attention import CAUSAL, AttentionMask, visible_keys, with_sink_logits
from parallelisms.context_parallel_documents import chunk_in_window

aten = torch.ops.aten


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bias: torch.Tensor | None = None):
    """Attention of q (batch, heads, q_len, head_dim) to k, v (same heads), causal or under an additive `bias`
    (`block_bias`): the output, the log-sum-exp of each query's scores, float32 (batch, heads, q_len), and what
    the kernel's backward needs of its forward besides (`block_backward`'s `aux`: sequence offsets and
    random-number state, empty on CPU). A query the bias leaves no key gets output 0 and log-sum-exp -inf."""
    if bias is not None:
        out, lse, aux = _biased_forward(q, k, v, bias)
        empty = bias.amax(-1) == float("-inf")
        return out.masked_fill(empty[..., None], 0), lse.masked_fill(empty, float("-inf")), aux
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse, ()
    if q.dtype in (torch.float16, torch.bfloat16):
        out, lse, cum_seq_q, cum_seq_k, _, _, philox_seed, philox_offset, _ = (
            aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal))
        return out, lse, (cum_seq_q, cum_seq_k, philox_seed, philox_offset)
    out, lse, philox_seed, philox_offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                                                        causal)
    return out, lse[..., : q.shape[2]], (philox_seed, philox_offset)  # its log-sum-exp is padded to 32 queries


def _biased_forward(q, k, v, bias):
    """block_forward under a bias: the CPU flash kernel takes one; on CUDA the memory-efficient kernel (flash
    takes no mask), whose bias rows must start at multiples of 16 elements."""
    if q.device.type == "cpu":
        return (*aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias), ())
    out, lse, philox_seed, philox_offset = aten._scaled_dot_product_efficient_attention(q, k, v, _aligned(bias, q),
                                                                                        True, 0.0, False)
    return out, lse[..., : q.shape[2]], (philox_seed, philox_offset)


def _aligned(bias: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The bias as the memory-efficient kernel takes it: rows starting at multiples of 16 elements, a view
    over q's heads."""
    padding = -bias.shape[-1] % 16
    bias = torch.nn.functional.pad(bias, (0, padding))[..., : bias.shape[-1]] if padding else bias
    return bias.expand(q.shape[0], q.shape[1], -1, -1)


def block_bias(document_ids: torch.Tensor | None, q_positions: torch.Tensor, k_positions: torch.Tensor,
               dtype: torch.dtype, spec: AttentionMask = CAUSAL) -> torch.Tensor:
    """(batch, 1, queries, keys), or (1, 1, queries, keys) without documents: 0 where the query may see the key
    under `spec` (`visible_keys`), -inf elsewhere."""
    allowed = visible_keys(document_ids, q_positions, k_positions, spec)
    allowed = allowed[:, None] if document_ids is not None else allowed[None, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def block_backward(grad_out, q, k, v, out, lse, causal: bool, aux=(), bias: torch.Tensor | None = None):
    """The gradients of q, k, v for one block of `block_forward`, given the final output and log-sum-exp of
    these queries over every block (which is what makes the per-block gradients add up to the whole)."""
    if bias is not None and q.device.type != "cpu":
        # In float32: the kernel's bf16 backward under a bias gave dq 129% off SDPA's on an H200 (torch 2.11,
        # tests/test_cuda.py's ring blocks), where its float32 one matched.
        grad_out_, q_, k_, v_, out_, bias_ = (t.float() for t in (grad_out, q, k, v, out, bias))
        grads = _efficient_backward(grad_out_, q_, k_, v_, _aligned(bias_, q_), out_, lse, aux, False)
        return tuple(grad.to(q.dtype) for grad in grads)
    if q.device.type == "cpu":  # a bias comes with causal False
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal,
                                                                         attn_mask=bias)
    if q.dtype in (torch.float16, torch.bfloat16):
        cum_seq_q, cum_seq_k, philox_seed, philox_offset = aux
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, q.shape[2], k.shape[2], 0.0, causal, philox_seed,
            philox_offset)
    return _efficient_backward(grad_out, q, k, v, None, out, lse, aux, causal)


def _efficient_backward(grad_out, q, k, v, bias, out, lse, aux, causal: bool):
    """The memory-efficient kernel's backward (CUDA: float32, or under a bias), which takes the log-sum-exp padded
    to 32 queries as its forward gave it."""
    padded = lse.new_zeros(*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32)
    padded[..., : lse.shape[-1]] = lse
    philox_seed, philox_offset = aux
    return aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, bias, out, padded, philox_seed, philox_offset, 0.0, [True, True, True, False], causal)[:3]


def head_repeats(q: torch.Tensor, k: torch.Tensor, device_type: str) -> int:
    """Grouped-query attention: how many times the kernels on `device_type` need each key/value head repeated.
    The CPU flash kernel takes fewer key/value heads as they are (and returns their gradients so); CUDA's want
    as many as q has."""
    return 1 if device_type == "cpu" else q.shape[1] // k.shape[1]


def _expand_heads(t: torch.Tensor, repeats: int) -> torch.Tensor:
    """Each key/value head serving `repeats` query heads (SDPA's enable_gqa order)."""
    return t if repeats == 1 else t.repeat_interleave(repeats, dim=1)


def _sum_heads(grad: torch.Tensor, repeats: int) -> torch.Tensor:
    return grad if repeats == 1 else grad.unflatten(1, (-1, repeats)).sum(2)


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge a partial attention of the same queries over other keys into (out, lse), float32, in place."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_((lse - merged).exp_()[..., None]).add_(block_out.float() * (block_lse - merged).exp_()[..., None])
    lse.copy_(merged)


class Ring:
    """Send a tensor to the next CP rank while receiving the previous rank's. (The memory estimator runs the
    attention with a stand-in of the same interface: rank, size, start and finish.)"""

    def __init__(self, cp_mesh: DeviceMesh):
        group, self.rank, self.size = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.group = group

    def start(self, tensor: torch.Tensor, tag: int = 0):
        """The keys and values (tag 0) and their gradients (tag 1) travel at once in the backward."""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor.contiguous(), self.next, self.group, tag),
                                        dist.P2POp(dist.irecv, received, self.previous, self.group, tag)])
        return works, received

    @staticmethod
    def finish(pending) -> torch.Tensor:
        works, received = pending
        for work in works:
            work.wait()
        return received


def _block_slices(owner: int, rank: int, chunk: int):
    """Which of this rank's queries attend to which keys of the block `owner` sent, and whether causally:
    (query slice, key slice, causal)."""
    every = slice(None)
    if owner == rank:
        return every, every, True
    if owner < rank:  # its first chunk is before both of this rank's chunks, its second after them
        return every, slice(0, chunk), False
    return slice(chunk, None), every, False  # both its chunks are before this rank's second chunk only


def _declared_parts(q, rank: int, owner: int, size: int, spec: AttentionMask):
    """`_blocks` without documents under a window, sinks or a mask_mod: the zigzag chunk pairs with a key a query
    may see (all the causal ones but those wholly out of a window without sinks); a bias where the spec cuts a pair
    (a mask_mod, sinks, a diagonal pair wider than the window, or keys partly out of reach)."""
    chunk = q.shape[2] // 2
    mine, theirs = (rank, 2 * size - 1 - rank), (owner, 2 * size - 1 - owner)
    parts = []
    for a, b in sorted(((a, b) for a in range(2) for b in range(2)), key=lambda pair: pair[0] != pair[1]):
        query, key = mine[a], theirs[b]
        if key > query or not (spec.sinks or chunk_in_window(query, key, chunk, spec.window)):
            continue
        rows, keys = slice(a * chunk, (a + 1) * chunk), slice(b * chunk, (b + 1) * chunk)
        reach = (query - key + 1) * chunk - 1  # the farthest pair's distance
        if spec.mask_mod is None and not spec.sinks and (spec.window is None or reach < spec.window):
            parts.append((rows, keys, key == query, None, key == query))  # every key in reach (the diagonal: causally)
            continue
        positions = [torch.arange(index * chunk, (index + 1) * chunk, device=q.device) for index in (query, key)]
        parts.append((rows, keys, False, block_bias(None, *positions, q.dtype, spec), key == query))
    return parts


def _blocks(q, documents, rank: int, owner: int, size: int, spec: AttentionMask = CAUSAL):
    """The parts of `owner`'s block of keys and values this rank attends to (of `size` ranks): [(query slice, key
    slice, causal, bias, first)]; the bias masks by document, position and the `spec`, where needed; `first`: the
    first part of these queries, in which each sees a key (itself). Under document masking, the chunk pairs
    `documents.plan` keeps, the rank's own two chunks' diagonal pairs first."""
    chunk = q.shape[2] // 2
    if documents is None:
        if spec != CAUSAL:
            return _declared_parts(q, rank, owner, size, spec)
        return [(*_block_slices(owner, rank, chunk), None, owner == rank)]
    plan, shares = documents.plan.tolist(), documents.shares
    pairs = sorted(((a, b) for a in range(2) for b in range(2) if plan[a][owner][b]),
                   key=lambda pair: pair[0] != pair[1])
    parts = []
    for a, b in pairs:
        rows, keys = slice(a * chunk, (a + 1) * chunk), slice(b * chunk, (b + 1) * chunk)
        bias = block_bias(documents.document_ids, shares[:, rank, rows], shares[:, owner, keys], q.dtype, spec)
        parts.append((rows, keys, False, bias, owner == rank and a == b))
    return parts


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, documents=None, repeats: int = 1, spec: AttentionMask = CAUSAL,
                sink_logits: torch.Tensor | None = None):
        """`repeats`: how many times each key/value head is repeated for the kernels (`head_repeats`)."""
        rank, size = ring.rank, ring.size
        kv = torch.stack([k, v])
        out = q.new_empty(q.shape, dtype=torch.float32)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        aux = None
        for step in range(size):
            pending = ring.start(kv) if step < size - 1 else None
            for rows, keys, causal, bias, first in _blocks(q, documents, rank, (rank - step) % size, size, spec):
                block_k, block_v = (_expand_heads(t[:, :, keys], repeats) for t in kv)
                block_out, block_lse, block_aux = block_forward(q[:, :, rows], block_k, block_v, causal, bias)
                aux = block_aux if aux is None else aux
                if first:  # copied, and merged into in place later: selective activation checkpointing may keep
                    # the kernel's outputs themselves
                    out[:, :, rows], lse[:, :, rows] = block_out, block_lse
                else:
                    merge_into(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if pending is not None:
                kv = ring.finish(pending)
        if sink_logits is not None:  # the output the sinks scale, and the log-sum-exp they join
            out = with_sink_logits(out, lse, sink_logits)
            lse = torch.logaddexp(lse, sink_logits.float()[:, None].expand_as(lse))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink_logits)
        ctx.ring, ctx.aux, ctx.documents, ctx.repeats, ctx.spec = ring, aux, documents, repeats, spec
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sink_logits = ctx.saved_tensors
        ring, documents, repeats = ctx.ring, ctx.documents, ctx.repeats
        rank, size = ring.rank, ring.size
        grad_out = grad_out.contiguous()
        kv = torch.stack([k, v])
        grad_q = torch.zeros_like(q, dtype=torch.float32)
        grad_kv = torch.zeros_like(kv, dtype=torch.float32)  # of the block this rank holds, travelling with it
        pending_grad = None
        for step in range(size):
            pending_kv = ring.start(kv) if step < size - 1 else None
            parts = []
            for rows, keys, causal, bias, _ in _blocks(q, documents, rank, (rank - step) % size, size, ctx.spec):
                block_k, block_v = (_expand_heads(t[:, :, keys], repeats) for t in kv)
                dq, dk, dv = block_backward(grad_out[:, :, rows], q[:, :, rows].contiguous(), block_k, block_v,
                                            out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), causal,
                                            ctx.aux, bias)
                grad_q[:, :, rows] += dq
                parts.append((keys, dk, dv))
            if pending_grad is not None:
                grad_kv = ring.finish(pending_grad)
            for keys, dk, dv in parts:
                grad_kv[0][:, :, keys] += _sum_heads(dk, repeats)
                grad_kv[1][:, :, keys] += _sum_heads(dv, repeats)
            pending_grad = ring.start(grad_kv, tag=1)  # after the last step, to the block's owner
            if pending_kv is not None:
                kv = ring.finish(pending_kv)
        grad_k, grad_v = ring.finish(pending_grad)
        grad_sinks = None
        if sink_logits is not None:  # the sink's share of each query's attention, times -rowsum(grad_out * out)
            sink_share = (sink_logits.float()[:, None] - lse).exp()
            grad_sinks = -(sink_share * (grad_out.float() * out.float()).sum(-1)).sum((0, 2)).to(sink_logits.dtype)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None, grad_sinks


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents=None, spec: AttentionMask = CAUSAL,
                   sink_logits: torch.Tensor | None = None, *, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Causal attention of this rank's zigzag share of queries, q (batch, n_heads, local_seq, head_dim), to the
    whole sequence, whose keys and values k, v (batch, n_kv_heads, local_seq, head_dim) the CP ranks hold in
    zigzag shares; n_kv_heads may divide n_heads. Given `documents` (the attention modules' mask under document
    masking, `ring_documents`: the shares are then by documents), within documents; under the layer's declared
    `spec` (window, sinks, mask_mod), skipping the blocks wholly outside a window; with learned `sink_logits`.
    Returns a tensor shaped like q, but for the head size, v's (values narrower than the queries travel padded: the
    kernels want one head size).

    Context parallelism leaves it out of compiled blocks (compile.enable): the ring's point-to-point sends are
    not traceable; the kernels it calls are fused already."""
    narrower = v.shape[-1] < q.shape[-1]  # multi-head latent attention's values: zeros pad them to the kernels' size
    padded = F.pad(v, (0, q.shape[-1] - v.shape[-1])) if narrower else v
    out = RingAttention.apply(q.contiguous(), k.contiguous(), padded.contiguous(), Ring(cp_mesh), documents,
                              head_repeats(q, k, q.device.type), spec, sink_logits)
    return out[..., :v.shape[-1]] if narrower else out
