"""Context parallelism: zigzag sharding, and all-gather-KV attention and the Llama model on 2 and 4
gloo processes matching the full sequence on one process (outputs and gradients, fp32)."""

import contextlib
import copy
import gc
import itertools
import warnings
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import import_fork, on_ranks, sliding_window_fork
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention.flex_attention import BlockMask

import components.data.documents
from components.config import ConfigError
from components.model import attention
from components.model.attention import causal_attention, document_mask
from models import llama3
from models.llama3 import ModelArgs, Transformer
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.compile import compile_blocks
from parallelisms.context_parallel import (
    allgather_kv_attention,
    alltoall_attention,
    apply_context_parallel,
    documents_attention,
    shard_sequence,
    zigzag_attention,
    zigzag_masks,
    zigzag_positions,
)
from parallelisms.context_parallel_documents import (
    allgather_documents,
    alltoall_documents,
    ring_documents,
    share_positions,
    take,
)
from parallelisms.ring_attention import block_backward, block_bias, block_forward, merge_into, ring_attention

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_zigzag_positions_cover_the_sequence_once_with_equal_causal_work(cp_size):
    seq_len = 8 * cp_size
    shares = [zigzag_positions(seq_len, cp_size, rank) for rank in range(cp_size)]
    assert torch.cat(shares).sort().values.tolist() == list(range(seq_len))
    # A query at position p attends to p + 1 keys: every rank's total must be the same.
    assert len({int((share + 1).sum()) for share in shares}) == 1
    chunk = seq_len // (2 * cp_size)
    assert shares[0].tolist() == [*range(chunk), *range(seq_len - chunk, seq_len)]


def test_zigzag_positions_name_the_settings_when_the_sequence_does_not_split():
    with pytest.raises(ValueError, match=r"training\.seq_len 12 .*parallelism\.context_parallel_degree"):
        zigzag_positions(12, 4, 0)


def test_shard_sequence_takes_the_rank_positions_along_the_sequence_dim():
    mesh = SimpleNamespace(size=lambda: 2, get_local_rank=lambda: 1)
    tokens = torch.arange(12) + 100 * torch.arange(2)[:, None]
    assert shard_sequence(tokens, mesh).tolist() == [[3, 4, 5, 6, 7, 8], [103, 104, 105, 106, 107, 108]]
    hidden = torch.randn(12, 3, 5)
    assert torch.equal(shard_sequence(hidden, mesh, dim=0), hidden[zigzag_positions(12, 2, 1)])


def packed_rows(rows: int, seq: int, mean_length: int, seed: int = 0) -> torch.Tensor:
    """Document ids of `rows` rows of `seq` tokens packed with documents of random lengths."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, seq, generator=generator) < 1 / mean_length).long().cumsum(1)


def attention_work(document_ids: torch.Tensor, positions: torch.Tensor) -> int:
    """Queries x keys the attention computes for the queries at `positions` (one row, two chunks): each chunk's
    queries against the keys from its first query's document start to its end."""
    starts = components.data.documents.document_positions(document_ids[None])[0]
    return sum(len(chunk) * (int(chunk[-1]) + 1 - int(chunk[0] - starts[chunk[0]])) for chunk in positions.chunk(2))


@pytest.mark.parametrize("cp_size", [1, 2, 4, 8])
def test_the_shares_of_a_row_of_one_document_are_zigzag(cp_size):
    shares = share_positions(torch.zeros(1, 16 * cp_size, dtype=torch.long), cp_size)[0]
    assert [share.tolist() for share in shares] == [
        zigzag_positions(16 * cp_size, cp_size, rank).tolist() for rank in range(cp_size)]


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_shares_by_documents_cover_each_row_once_and_even_out_the_attention_work(cp_size):
    """The slowest rank's work over the mean (1: even), by documents and zigzag: 1.07 and 1.11 at CP 2, 1.14
    and 1.27 at CP 4, 1.28 and 1.47 at CP 8 (rows of about 8 documents)."""
    seq = 64 * cp_size
    ids = packed_rows(50, seq, mean_length=seq // 8)
    excess = {"documents": 0.0, "zigzag": 0.0}
    for row, row_shares in zip(ids, share_positions(ids, cp_size)):
        assert row_shares.flatten().sort().values.tolist() == list(range(seq))
        for name, shares in (("documents", row_shares),
                             ("zigzag", [zigzag_positions(seq, cp_size, rank) for rank in range(cp_size)])):
            work = [attention_work(row, share) for share in shares]
            excess[name] += max(work) / (sum(work) / cp_size) - 1
    assert excess["documents"] < 0.7 * excess["zigzag"]


def test_the_plans_of_allgather_and_ring_keep_every_key_a_query_sees_and_ring_skips_only_empty_blocks():
    cp_size, seq = 4, 64
    ids = packed_rows(3, seq, mean_length=12)
    allowed = (ids[:, :, None] == ids[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    chunk = seq // (2 * cp_size)
    for rank in range(cp_size):
        gather = allgather_documents(ids, cp_size=cp_size, cp_rank=rank)
        ring = ring_documents(ids, cp_size=cp_size, cp_rank=rank)
        mine = gather.shares[:, rank]
        for a, (start, end, _) in enumerate(gather.plan):
            queries = mine[:, a * chunk:(a + 1) * chunk]
            seen = torch.stack([allowed[row, queries[row]] for row in range(len(ids))]).any(1).any(0)
            keys = seen.nonzero().flatten()
            assert start == keys.min() and end == int(mine[:, (a + 1) * chunk - 1].max()) + 1 >= keys.max() + 1
            for owner in range(cp_size):
                for b in range(2):
                    theirs = ring.shares[:, owner, b * chunk:(b + 1) * chunk]
                    sees = any(allowed[row][queries[row]][:, theirs[row]].any() for row in range(len(ids)))
                    assert bool(ring.plan[a, owner, b]) == sees, (rank, a, owner, b)


def allgather_documents_against_sdpa(device: str, dtype: torch.dtype, cp_rank: int, flex: bool | None = None
                                     ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """allgather's attention under document masking of rank `cp_rank`'s queries (CP 4, two rows of packed
    documents) to the whole sequence, against the rows of SDPA under the model's whole boolean mask (fp32,
    grouped-query): (name, allgather's, SDPA's) for the output, and for the gradients of q, k, v where the
    inputs of `dtype` need them (not on CPU: torch 2.13's CPU FlexAttention has no backward)."""
    ids = packed_rows(2, 64, mean_length=12).to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    q, probe = (torch.randn(2, 4, 64, 32, device=device, generator=generator) for _ in range(2))
    k, v = (torch.randn(2, 2, 64, 32, device=device, generator=generator) for _ in range(2))
    documents = allgather_documents(ids, cp_size=4, cp_rank=cp_rank, flex=flex)
    positions = documents.shares[:, cp_rank]
    grad = device != "cpu"
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    expected = take(F.scaled_dot_product_attention(*leaves, attn_mask=document_mask(ids, flex=False),
                                                   enable_gqa=True), positions, dim=2)
    mine = [t.detach().to(dtype).requires_grad_(grad) for t in (take(q, positions, dim=2), k, v)]
    out = documents_attention(*mine, documents, cp_rank)
    if not grad:
        return [("output", out, expected)]
    (expected * take(probe, positions, dim=2)).sum().backward()
    (out.float() * take(probe, positions, dim=2)).sum().backward()
    dq = take(leaves[0].grad, positions, dim=2)
    return [("output", out, expected), ("dq", mine[0].grad, dq), ("dk", mine[1].grad, leaves[1].grad),
            ("dv", mine[2].grad, leaves[2].grad)]


def test_allgather_under_documents_takes_flex_masks_built_once_where_flex_runs_and_matches_boolean_ones():
    """On CUDA allgather's mask builder gives each query chunk a FlexAttention mask, built once for every layer;
    the attention under them (forward: eager flex on CPU, as tests/test_document_masking.py) matches SDPA under the
    model's whole mask, as do the boolean masks built per chunk elsewhere (every rank of CP 4)."""
    for rank in range(4):
        assert all(keys.block_mask is None for keys in allgather_documents(packed_rows(2, 64, 12), cp_size=4,
                                                                          cp_rank=rank).plan)
        for name, got, expected in allgather_documents_against_sdpa("cpu", torch.float32, rank):
            torch.testing.assert_close(got, expected, **TOL, msg=f"boolean, rank {rank}: {name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        for rank in range(4):
            plan = allgather_documents(packed_rows(2, 64, 12), cp_size=4, cp_rank=rank, flex=True).plan
            assert all(isinstance(keys.block_mask, BlockMask) for keys in plan)
            for name, got, expected in allgather_documents_against_sdpa("cpu", torch.float32, rank, flex=True):
                torch.testing.assert_close(got, expected, **TOL, msg=f"flex, rank {rank}: {name}")


def test_alltoall_refuses_heads_that_the_degree_does_not_divide_naming_the_way_out():
    from components.config import ConfigError

    mesh = SimpleNamespace(size=lambda: 4, get_local_rank=lambda: 0, device_type="cpu")
    model = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=6, n_kv_heads=2, vocab_size=32, max_seq_len=16))
    expected = r"alltoall splits the 6 query heads .*context_parallel_degree 4 ranks.*pick ring"
    with pytest.raises(ConfigError, match=expected):
        apply_context_parallel(model, mesh, 16, "alltoall", heads_per_rank=6)
    apply_context_parallel(model, mesh, 16, "ring", heads_per_rank=6)


DOCUMENTS = torch.tensor([0] * 20 + [1] * 30 + [2] * 14)
"""Documents of 64 positions for ring_blocks_against_sdpa: the queries of document 2 (50-63) have no key of
their document among the first 32."""


def ring_blocks_against_sdpa(device: str, dtype: torch.dtype, around=contextlib.nullcontext(), documents=False
                             ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The ring's arithmetic in one process: the second half of 64 queries attends to the first half of the keys
    (whole) and to the second (causally) in two fused-kernel calls merged by log-sum-exp; the backward of each
    call, given the merged output and log-sum-exp, adds up to the gradients. With `documents`, within DOCUMENTS:
    each call under its block's mask. (name, ring's, SDPA's) each for the output and the gradients of q, k and v.
    The ring's calls run inside the context manager `around`."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, probe = (torch.randn(2, 8, 64, 32, device=device, generator=generator).to(dtype) for _ in range(4))
    probe = probe[:, :, 32:].contiguous()
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ids = DOCUMENTS.to(device).expand(2, 64)
    if documents:
        expected = F.scaled_dot_product_attention(*leaves, attn_mask=document_mask(ids, flex=False))[:, :, 32:]
    else:
        expected = F.scaled_dot_product_attention(*leaves, is_causal=True)[:, :, 32:]
    (expected * probe.float()).sum().backward()

    rows, before, own = q[:, :, 32:], slice(0, 32), slice(32, 64)
    positions = torch.arange(64, device=device)
    blocks = [(keys, causal, block_bias(ids, positions[32:], positions[keys], dtype) if documents else None)
              for keys, causal in ((before, False), (own, not documents))]
    with around:
        (_, _, bias), (_, causal, own_bias) = blocks
        out, lse, aux = block_forward(rows, k[:, :, before], v[:, :, before], False, bias)
        out_own, lse_own, _ = block_forward(rows, k[:, :, own], v[:, :, own], causal, own_bias)
        out, lse = out.float(), lse.clone()
        merge_into(out, lse, out_own, lse_own)
        out = out.to(dtype)
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (rows, k, v))
        for keys, causal, bias in blocks:
            grads = block_backward(probe, rows, k[:, :, keys], v[:, :, keys], out, lse, causal, aux, bias)
            dq += grads[0]
            dk[:, :, keys], dv[:, :, keys] = grads[1], grads[2]
    return [("output", out, expected), ("dq", dq, leaves[0].grad[:, :, 32:]), ("dk", dk, leaves[1].grad),
            ("dv", dv, leaves[2].grad)]


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_ring_blocks_merged_by_log_sum_exp_are_causal_attention_forward_and_backward(documents):
    for name, got, expected in ring_blocks_against_sdpa("cpu", torch.float32, documents=documents):
        torch.testing.assert_close(got.float(), expected, **TOL, msg=name)


def zigzag_attention_against_sdpa(device: str, dtype: torch.dtype, attend=zigzag_attention,
                                  around=contextlib.nullcontext()) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """allgather's attention of one rank's queries (CP 4, rank 1: chunks 1 and 6 of 8) to the whole sequence under
    `zigzag_masks` through `attend`, run inside the context manager `around`, against the rows of full causal
    SDPA (fp32, grouped-query): (name, allgather's, SDPA's) for the output and the gradients of q, k, v."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, probe = (torch.randn(2, 4, 64, 32, device=device, generator=generator) for _ in range(2))
    k, v = (torch.randn(2, 2, 64, 32, device=device, generator=generator) for _ in range(2))
    positions = zigzag_positions(64, 4, 1).to(device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = causal_attention(*leaves)[:, :, positions]
    (expected * probe[:, :, positions]).sum().backward()
    mine = [t.detach().to(dtype).requires_grad_() for t in (q[:, :, positions], k, v)]
    with around:
        out = attend(*mine, zigzag_masks(64, 4, 1))
        (out.float() * probe[:, :, positions]).sum().backward()
    return [("output", out, expected), ("dq", mine[0].grad, leaves[0].grad[:, :, positions]),
            ("dk", mine[1].grad, leaves[1].grad), ("dv", mine[2].grad, leaves[2].grad)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_allgather_attention_of_a_rank_s_zigzag_chunks_is_causal_attention_forward_and_backward(compiled):
    """Bottom-right causal masks, no mask tensor of ours; compiled, one graph (the masks are made outside it)."""
    attend = torch.compile(zigzag_attention, fullgraph=True) if compiled else zigzag_attention
    for name, got, expected in zigzag_attention_against_sdpa("cpu", torch.float32, attend):
        torch.testing.assert_close(got, expected, **TOL, msg=name)


# --- Several gloo processes ------------------------------------------------------------------


def run_ranks(check, cp_size: int, tmp_path) -> None:
    """Run `check(cp_mesh)` on cp_size gloo processes; a failure on any rank fails the test."""
    on_ranks(_worker, cp_size, cp_size, str(tmp_path / "store"), check)


def _worker(rank: int, cp_size: int, store_path: str, check) -> None:
    torch.set_num_threads(1)
    # A FileStore in the test's folder: no port to pick.
    store = dist.FileStore(store_path, cp_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cp_size)
    check(init_device_mesh("cpu", (cp_size,), mesh_dim_names=("cp",)))
    # Free the check's tensors (and the collectives' work they hold) while gloo still runs: freed
    # at interpreter exit instead, they sometimes abort the process (SIGABRT).
    gc.collect()
    dist.destroy_process_group()


def unshard(local: torch.Tensor, cp_mesh, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's (batch, local_seq, ...) share put back together in sequence order (shared out by the rows'
    documents given their `document_ids`)."""
    cp_size = cp_mesh.size()
    shares = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(shares, local.contiguous(), group=cp_mesh.get_group())
    gathered = torch.cat(shares, dim=1)
    if document_ids is None:
        positions = torch.cat([zigzag_positions(gathered.shape[1], cp_size, rank) for rank in range(cp_size)])
        positions = positions.expand(len(gathered), -1)
    else:
        positions = share_positions(document_ids, cp_size).flatten(1)
    full = torch.empty_like(gathered)
    for row, row_positions in enumerate(positions):
        full[row, row_positions] = gathered[row]
    return full


def check_attention(cp_mesh) -> None:
    """Outputs and q/k/v gradients of each method's CP attention are this rank's share of full causal
    attention (grouped-query: 4 query heads, 2 key/value heads)."""
    torch.manual_seed(0)  # the same full tensors on every rank
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    projection = torch.randn(2, 4, 16, 8)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    full_out = causal_attention(*full)
    (full_out * projection).sum().backward()

    masks = zigzag_masks(16, cp_mesh.size(), cp_mesh.get_local_rank())
    methods = {"allgather": partial(allgather_kv_attention, cp_mesh=cp_mesh, masks=masks),
               "ring": partial(ring_attention, cp_mesh=cp_mesh),
               "alltoall": partial(alltoall_attention, cp_mesh=cp_mesh, attend=causal_attention)}
    for method, attend in methods.items():
        local = [shard_sequence(t, cp_mesh, dim=2).requires_grad_() for t in (q, k, v)]
        out = attend(*local)
        torch.testing.assert_close(out, shard_sequence(full_out.detach(), cp_mesh, dim=2), **TOL, msg=method)
        # Summed over the ranks these losses are the full one; the backward's communication adds the
        # other ranks' contributions to this rank's key and value gradients.
        (out * shard_sequence(projection, cp_mesh, dim=2)).sum().backward()
        for name, t_local, t_full in zip("qkv", local, full):
            torch.testing.assert_close(t_local.grad, shard_sequence(t_full.grad, cp_mesh, dim=2), **TOL,
                                       msg=f"{method} {name}")


def every_third_key(q_idx, kv_idx):
    """A mask_mod (positions in the whole sequence): no query sees the keys 1, 4, 7, ... positions before it."""
    return (q_idx - kv_idx) % 3 != 1


DECLARED = {"window_sinks": (attention.AttentionMask(window=3, sinks=2), False),
            "mask_mod": (attention.AttentionMask(mask_mod=every_third_key), False),
            "window_mask_mod": (attention.AttentionMask(window=5, mask_mod=every_third_key), False),
            "learned_sinks": (attention.CAUSAL, True),
            "window_learned_sinks": (attention.AttentionMask(window=5), True)}
"""Declarations beyond a plain window, each cutting through the chunks at CP 2 and 4 (sequence 16), and whether the
layer passes learned sink logits (gpt-oss's)."""


def check_declared_masks(cp_mesh) -> None:
    """Outputs and q/k/v gradients of each method's attention under attention sinks and mask_mods, and with learned
    sink logits (their gradients summed over the ranks too), with and without documents, are this rank's share of
    one process's attention under the same declaration."""
    cp_size, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    torch.manual_seed(0)  # the same full tensors on every rank
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    projection = torch.randn(2, 4, 16, 8)
    masks = zigzag_masks(16, cp_size, cp_rank)
    methods = {"allgather": (partial(allgather_kv_attention, cp_mesh=cp_mesh, masks=masks),
                             partial(allgather_documents, cp_size=cp_size, cp_rank=cp_rank)),
               "ring": (partial(ring_attention, cp_mesh=cp_mesh),
                        partial(ring_documents, cp_size=cp_size, cp_rank=cp_rank)),
               "alltoall": (partial(alltoall_attention, cp_mesh=cp_mesh, attend=causal_attention),
                            partial(alltoall_documents, cp_size=cp_size, whole_mask=document_mask))}
    sink_logits = torch.randn(4)
    for (name, (spec, learned)), ids in itertools.product(DECLARED.items(), (None, packed_rows(2, 16, 5))):
        sinks = {"sink_logits": sink_logits.clone().requires_grad_()} if learned else {}
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        full_out = causal_attention(*full, None if ids is None else document_mask(ids, spec), spec, **sinks)
        (full_out * projection).sum().backward()
        share = partial(shard_sequence, cp_mesh=cp_mesh, dim=2, document_ids=ids)
        for method, (attend, documents) in methods.items():
            what = f"{method} {name}{'' if ids is None else ' documents'}"
            local = [share(t).requires_grad_() for t in (q, k, v)]
            local_sinks = {key: t.detach().clone().requires_grad_() for key, t in sinks.items()}
            out = attend(*local, None if ids is None else documents(ids, spec), spec, **local_sinks)
            torch.testing.assert_close(out, share(full_out.detach()), **TOL, msg=what)
            (out * share(projection)).sum().backward()
            for grad, t_local, t_full in zip("qkv", local, full):
                torch.testing.assert_close(t_local.grad, share(t_full.grad), **TOL, msg=f"{what} d{grad}")
            if learned:  # each rank's queries give their part of the sinks' gradient
                grad = local_sinks["sink_logits"].grad.clone()
                dist.all_reduce(grad, group=cp_mesh.get_group())
                torch.testing.assert_close(grad, sinks["sink_logits"].grad, **TOL, msg=f"{what} dsinks")


WINDOW = 5
"""The fork's window in these checks: at CP 2 (chunks of 4) and 4 (chunks of 2) it cuts through chunks."""


def check_model(cp_mesh, fork: str | None = None) -> None:
    """The Llama model under CP with each method: logits, and parameter gradients summed over the ranks,
    match one process on the full sequence; so do the hidden states of a pipeline stage; and so do the logits and
    gradients with document masking (at CP 4 some of the ring's blocks hold no key of a query's document).
    Given the `fork` folder of `sliding_window_fork`, the same of the fork, whose first block sees WINDOW keys
    (its second all), after checking that the window changes the logits, at CP 2 also with compiled blocks
    checkpointed selectively by op; and a fork that computes attention with its own function is refused by
    allgather and ring, whose own would drop its mask, and runs under alltoall."""
    seq_len = 16
    package = llama3 if fork is None else import_fork(fork)
    torch.manual_seed(0)
    args = package.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=seq_len,
                             multiple_of=32, **({} if fork is None else {"sliding_window": WINDOW}))
    reference = package.Transformer(args)
    reference.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    logits = reference(inputs)
    if fork is not None:
        check_the_window_counts_and_an_undeclared_kernel_is_refused(reference, inputs, logits, cp_mesh, seq_len)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    # A first pipeline stage: the embeddings and block 0, returning hidden states.
    stage = copy.deepcopy(reference)
    del stage.layers["1"]
    stage.norm = stage.output = None
    with torch.no_grad():
        hidden = stage(inputs)

    for method in ("allgather", "ring", "alltoall"):
        model = apply_context_parallel(copy.deepcopy(reference), cp_mesh, seq_len, method)
        assert_matches_one_process(model, reference, inputs, labels, logits, cp_mesh, method)
        with torch.no_grad():
            local_hidden = apply_context_parallel(copy.deepcopy(stage), cp_mesh, seq_len, method)(
                shard_sequence(inputs, cp_mesh))
        torch.testing.assert_close(local_hidden, shard_sequence(hidden, cp_mesh), **TOL, msg=method)
    if fork is not None and cp_mesh.size() == 2:
        check_the_window_compiled_and_checkpointed_by_op(reference, inputs, labels, cp_mesh, seq_len)

    # Document masking, RoPE restarting at each document: each row's documents cross the ranks' shares, which
    # are shared out by them, row by row (at CP 4 the first row's are not zigzag).
    documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 11 + [1] * 5])
    reference.args.rope_per_document = True
    reference.zero_grad()
    logits = reference(inputs, documents)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    for method in ("allgather", "ring", "alltoall"):
        model = apply_context_parallel(copy.deepcopy(reference), cp_mesh, seq_len, method, document_masking=True)
        assert_matches_one_process(model, reference, inputs, labels, logits, cp_mesh, f"{method} documents",
                                   documents)


def assert_matches_one_process(model, reference, inputs, labels, logits, cp_mesh, msg: str, documents=None):
    """`model` (under CP) on this rank's share of `inputs`: its logits are this rank's of `logits`, and its
    parameter gradients summed over the ranks `reference`'s (whose backward has run)."""
    model.zero_grad()
    local_logits = model(shard_sequence(inputs, cp_mesh, document_ids=documents), documents)
    torch.testing.assert_close(unshard(local_logits.detach(), cp_mesh, documents), logits.detach(), **TOL, msg=msg)
    local_labels = shard_sequence(labels, cp_mesh, document_ids=documents)
    loss = F.cross_entropy(local_logits.flatten(0, 1), local_labels.flatten(), reduction="sum") / labels.numel()
    loss.backward()
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        dist.all_reduce(param.grad, group=cp_mesh.get_group())
        torch.testing.assert_close(param.grad, ref_param.grad, **TOL, msg=f"{msg} {name}")


def check_the_window_compiled_and_checkpointed_by_op(reference, inputs, labels, cp_mesh, seq_len):
    """allgather builds the window's masks inside the compiled graph: the windowed block alone (a second block
    would double the compile time), compiled and checkpointed selectively by op, against one process, eager.
    (alltoall runs the model's own kernel as one process does; ring runs eagerly, and is refused with compiled
    checkpointed blocks.)"""
    windowed = copy.deepcopy(reference)
    del windowed.layers["1"]
    windowed.zero_grad()
    logits = windowed(inputs)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    model = apply_context_parallel(copy.deepcopy(windowed), cp_mesh, seq_len, "allgather")
    apply_activation_checkpointing(model.layers, "selective", "op", compiled=True)
    compile_blocks(model.layers)
    assert_matches_one_process(model, windowed, inputs, labels, logits, cp_mesh, "allgather compiled, AC by op")


def check_the_window_counts_and_an_undeclared_kernel_is_refused(reference, inputs, logits, cp_mesh, seq_len):
    assert reference.layers["0"].attention.attention_mask.window == WINDOW
    assert reference.layers["1"].attention.attention_mask.window is None
    every_key = copy.deepcopy(reference)
    every_key.layers["0"].attention.attention_mask = attention.CAUSAL
    assert (every_key(inputs) - logits).abs().max() > 1e-3, "the window changes nothing: the checks would pass anyway"

    def own_sliding_window(q, k, v, mask=None, spec=attention.CAUSAL):
        return causal_attention(q, k, v, mask, attention.AttentionMask(window=WINDOW))

    own = copy.deepcopy(every_key)
    own.layers["0"].attention.sdpa = own_sliding_window
    torch.testing.assert_close(own(inputs), logits, **TOL)
    for method in ("allgather", "ring"):
        with pytest.raises(ConfigError, match=rf"context_parallel_method {method} replaces the attention of "
                                              r"layers.0.attention, whose sdpa is the model's own \(.*own_sliding_"
                                              r"window\), and would drop its mask"):
            apply_context_parallel(copy.deepcopy(own), cp_mesh, seq_len, method)
    local = apply_context_parallel(own, cp_mesh, seq_len, "alltoall")(shard_sequence(inputs, cp_mesh))
    torch.testing.assert_close(unshard(local.detach(), cp_mesh), logits.detach(), **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("cp_size", [2, 4])
def test_a_sliding_window_fork_under_every_method_matches_one_process(cp_size, tmp_path):
    """docs/assets/fork_sliding_window.patch applied to a copy of Llama 3: logits and every parameter gradient,
    with and without document masking, as one process computes them."""
    run_ranks(partial(check_model, fork=sliding_window_fork(tmp_path)), cp_size, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("cp_size", [2, 4])
def test_attention_of_every_method_matches_the_full_sequence(cp_size, tmp_path):
    run_ranks(check_attention, cp_size, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("cp_size", [2, 4])
def test_attention_sinks_mask_mods_and_learned_sinks_under_every_method_match_one_process(cp_size, tmp_path):
    run_ranks(check_declared_masks, cp_size, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("cp_size", [2, 4])
def test_llama_under_every_method_matches_one_process(cp_size, tmp_path):
    run_ranks(check_model, cp_size, tmp_path)


@pytest.mark.slow
def test_the_memory_benchmark_prints_a_row_per_method_and_degree():
    """(Its --documents run: docs/parallelisms.md's command, which the docs runner runs.)"""
    import subprocess
    import sys

    from conftest import REPO

    result = subprocess.run([sys.executable, "-m", "scripts.benchmark.cp_attention_memory", "--seq", "512",
                             "--degrees", "1", "2"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|")[1:3] for line in result.stdout.splitlines() if line.startswith("| ")][2:]
    assert [(method.strip(), degree.strip()) for method, degree in rows] == [
        ("(one process)", "1"), ("allgather", "2"), ("ring", "2"), ("alltoall", "2")]
