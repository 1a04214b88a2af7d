"""Context parallelism: zigzag sharding, and all-gather-KV attention and the Llama model on 2 and 4
gloo processes matching the full sequence on one process (outputs and gradients, fp32)."""

import copy
import gc
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from models.attention import causal_attention
from models.llama3 import ModelArgs, Transformer
from parallelisms.context_parallel import (
    allgather_kv_attention,
    apply_context_parallel,
    shard_sequence,
    zigzag_positions,
)

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


# --- Several gloo processes ------------------------------------------------------------------


def run_ranks(check, cp_size: int, tmp_path) -> None:
    """Run `check(cp_mesh)` on cp_size gloo processes; a failure on any rank fails the test."""
    mp.spawn(_worker, args=(cp_size, str(tmp_path / "store"), check), nprocs=cp_size)


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


def unshard(local: torch.Tensor, cp_mesh) -> torch.Tensor:
    """Every rank's (batch, local_seq, ...) share put back together in sequence order."""
    cp_size = cp_mesh.size()
    shares = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(shares, local.contiguous(), group=cp_mesh.get_group())
    gathered = torch.cat(shares, dim=1)
    positions = torch.cat([zigzag_positions(gathered.shape[1], cp_size, rank) for rank in range(cp_size)])
    full = torch.empty_like(gathered)
    full[:, positions] = gathered
    return full


def check_attention(cp_mesh) -> None:
    """Outputs and q/k/v gradients of CP attention are this rank's share of full causal attention."""
    torch.manual_seed(0)  # the same full tensors on every rank
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    projection = torch.randn(2, 4, 16, 8)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    full_out = causal_attention(*full)
    (full_out * projection).sum().backward()

    local = [shard_sequence(t, cp_mesh, dim=2).requires_grad_() for t in (q, k, v)]
    positions = zigzag_positions(16, cp_mesh.size(), cp_mesh.get_local_rank())
    out = allgather_kv_attention(*local, cp_mesh, positions)
    torch.testing.assert_close(out, shard_sequence(full_out.detach(), cp_mesh, dim=2), **TOL)
    # Summed over the ranks these losses are the full one; the backward's reduce-scatter adds the
    # other ranks' contributions to this rank's key and value gradients.
    (out * shard_sequence(projection, cp_mesh, dim=2)).sum().backward()
    for name, t_local, t_full in zip("qkv", local, full):
        torch.testing.assert_close(t_local.grad, shard_sequence(t_full.grad, cp_mesh, dim=2), **TOL, msg=name)


def check_model(cp_mesh) -> None:
    """The Llama model under CP: logits, and parameter gradients summed over the ranks, match one
    process on the full sequence; so do the hidden states of a pipeline stage."""
    seq_len = 16
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=seq_len, multiple_of=32)
    reference = Transformer(args)
    reference.init_weights()
    model = apply_context_parallel(copy.deepcopy(reference), cp_mesh, seq_len)
    tokens = torch.randint(0, args.vocab_size, (2, seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    logits = reference(inputs)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    local_logits = model(shard_sequence(inputs, cp_mesh))
    torch.testing.assert_close(unshard(local_logits.detach(), cp_mesh), logits.detach(), **TOL)
    local_labels = shard_sequence(labels, cp_mesh)
    loss = F.cross_entropy(local_logits.flatten(0, 1), local_labels.flatten(), reduction="sum") / labels.numel()
    loss.backward()
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        dist.all_reduce(param.grad, group=cp_mesh.get_group())
        torch.testing.assert_close(param.grad, ref_param.grad, **TOL, msg=name)

    # A first pipeline stage: the embeddings and block 0, returning hidden states.
    stage = copy.deepcopy(reference)
    del stage.layers["1"]
    stage.norm = stage.output = None
    with torch.no_grad():
        hidden = stage(inputs)
        local_hidden = apply_context_parallel(stage, cp_mesh, seq_len)(shard_sequence(inputs, cp_mesh))
    torch.testing.assert_close(local_hidden, shard_sequence(hidden, cp_mesh), **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("cp_size", [2, 4])
def test_attention_matches_full_sequence(cp_size, tmp_path):
    run_ranks(check_attention, cp_size, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("cp_size", [2, 4])
def test_llama_matches_one_process(cp_size, tmp_path):
    run_ranks(check_model, cp_size, tmp_path)
