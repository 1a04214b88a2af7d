"""Every way a block mixes tokens is carried or refused: the shared convolution and recurrence kernels against their
definitions; a fork of Llama 3 with a token shift, a convolution or a recurrent layer, declared, against one process
under context parallelism (each method, with and without documents) and tensor parallelism (with and without
sequence parallelism), in gloo processes and through train.py under every layout; the same shift written inline,
declared nowhere, refused by every layout that splits the sequence (tests/token_mixer_fork.py)."""

import copy
import importlib
import itertools
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import TINY, layout, losses, on_ranks, torchrun_runs
from test_context_parallel import _worker as cp_worker, assert_matches_one_process, packed_rows
from token_mixer_fork import token_mixer_fork
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from components.config import ConfigError, load_config
from components.distributed.mesh import ParallelDims
from components.model.layout_checks import check_token_mixing
from components.model.token_mixing import causal_conv, gated_delta_rule, gated_linear_recurrence
from components.model.undeclared_mixing import undeclared_mixing
from models import deepseek_v3, gpt_oss, llama3, qwen3
from models.families import model_config_class
from parallelisms.context_parallel import apply_context_parallel
from parallelisms.tensor_parallel import apply_tensor_parallel

TOL = dict(atol=1e-5, rtol=1e-5)
DECLARED = ("shift", "conv", "recurrence")


def recurrence_token_by_token(q, k, v, log_decay, document_ids=None):
    """The recurrence's definition: S_t = exp(log_decay_t) S_(t-1) + k_t v_t^T, zero at a document's start."""
    state = torch.zeros(*k.shape[:1], k.shape[2], k.shape[3], v.shape[3], dtype=q.dtype)
    outputs = []
    for t in range(k.shape[1]):
        if t == 0 or document_ids is not None:
            starts = document_ids[:, t] != document_ids[:, t - 1] if t else torch.ones(len(k), dtype=torch.bool)
        else:
            starts = torch.zeros(len(k), dtype=torch.bool)
        decay = torch.where(starts[:, None], 0.0, log_decay[:, t].exp())
        state = decay[..., None, None] * state + k[:, t, ..., None] * v[:, t, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outputs, dim=1)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_the_chunked_recurrence_is_its_token_by_token_definition_forward_and_backward(chunk):
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 37, 3, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 37, 3, 5, generator=generator, dtype=torch.float64)
    log_decay = -torch.rand(2, 37, 3, generator=generator, dtype=torch.float64)
    for ids in (None, packed_rows(2, 37, 6)):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, log_decay)]
        reference = [t.clone().requires_grad_() for t in (q, k, v, log_decay)]
        got = gated_linear_recurrence(*inputs, document_ids=ids, chunk=chunk)
        expected = recurrence_token_by_token(*reference, document_ids=ids)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        got.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        for name, a, b in zip(("q", "k", "v", "log_decay"), inputs, reference):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-9, msg=name)


def delta_rule_token_by_token(q, k, v, log_decay, beta, document_ids=None):
    """The gated delta rule's definition, as transformers' reference recurrence computes it: the state decayed, the
    value it predicts for k_t corrected by beta_t towards v_t, then read by q_t; zero at a document's start."""
    state = torch.zeros(*k.shape[:1], k.shape[2], k.shape[3], v.shape[3], dtype=q.dtype)
    outputs = []
    for t in range(k.shape[1]):
        starts = torch.full((len(k),), t == 0) if document_ids is None or t == 0 else \
            document_ids[:, t] != document_ids[:, t - 1]
        state = state * torch.where(starts[:, None], 0.0, log_decay[:, t].exp())[..., None, None]
        predicted = (state * k[:, t, ..., None]).sum(-2)
        state = state + k[:, t, ..., None] * ((v[:, t] - predicted) * beta[:, t, ..., None])[..., None, :]
        outputs.append((state * q[:, t, ..., None]).sum(-2))
    return torch.stack(outputs, dim=1)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_the_chunked_delta_rule_is_its_token_by_token_definition_forward_and_backward(chunk):
    generator = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(2, 37, 3, 4, generator=generator, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(2, 37, 3, 5, generator=generator, dtype=torch.float64)
    log_decay = -torch.rand(2, 37, 3, generator=generator, dtype=torch.float64)
    beta = torch.rand(2, 37, 3, generator=generator, dtype=torch.float64)
    for ids in (None, packed_rows(2, 37, 6)):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, log_decay, beta)]
        reference = [t.clone().requires_grad_() for t in (q, k, v, log_decay, beta)]
        got = gated_delta_rule(*inputs, document_ids=ids, chunk=chunk)
        expected = delta_rule_token_by_token(*reference, document_ids=ids)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        got.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        for name, a, b in zip(("q", "k", "v", "log_decay", "beta"), inputs, reference):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-9, msg=name)


def test_the_convolution_is_torch_s_depthwise_one_restarted_at_each_document():
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 30, 6, generator=generator), torch.randn(6, 4, generator=generator)

    def conv1d(x):
        return F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), weight[:, None], groups=6).transpose(1, 2)

    torch.testing.assert_close(causal_conv(x, weight), conv1d(x))
    ids = packed_rows(2, 30, 5)
    got = causal_conv(x, weight, ids)
    for row in range(2):
        for document in ids[row].unique():
            inside = ids[row] == document
            torch.testing.assert_close(got[row, inside], conv1d(x[row:row + 1, inside])[0])


@pytest.fixture(scope="module")
def fork(tmp_path_factory):
    return token_mixer_fork(tmp_path_factory.mktemp("forks"))


def import_mixers(root):
    import models

    if str(root / "models") not in models.__path__:
        models.__path__.append(str(root / "models"))
    return importlib.import_module("models.mixers")


def fork_model(root, mixer: str, seq_len: int = 16):
    package = import_mixers(root)
    torch.manual_seed(0)
    args = package.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=seq_len,
                             multiple_of=32, token_mixer=mixer)
    model = package.Transformer(args)
    model.init_weights()
    return package, model


def test_the_probe_finds_the_inline_shift_in_the_block_and_passes_declared_mixers_and_every_family(fork):
    package = import_mixers(fork)
    for mixer in ("inline_shift", *DECLARED):
        with torch.device("meta"):
            model = package.Transformer(package.ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=97,
                                                          multiple_of=32, token_mixer=mixer))
        assert undeclared_mixing(model) == ("layers.0" if mixer == "inline_shift" else None), mixer
    for family in (llama3, qwen3, deepseek_v3, gpt_oss):
        for flavor in family.flavors:
            if flavor.startswith("debug"):
                with torch.device("meta"):
                    assert undeclared_mixing(family.Transformer(copy.deepcopy(family.flavors[flavor]))) is None


@pytest.mark.parametrize("layout_args, refused", [
    ({"tensor_parallel_degree": 2}, "tensor_parallel_degree 2 with sequence parallelism"),
    ({"context_parallel_degree": 2}, "context_parallel_degree 2"),
    ({"tensor_parallel_degree": 2, "sequence_parallel": False}, None),
    ({"pipeline_parallel_degree": 2}, None),
    ({"data_parallel_shard_degree": 2}, None),
])
def test_an_undeclared_shift_is_refused_by_each_layout_that_splits_the_sequence_naming_the_ways_out(
        fork, layout_args, refused):
    package = import_mixers(fork)
    config = load_config(["--job.config_file", "debug_model.toml", "--model.name", "mixers",
                          "--model.token_mixer", "inline_shift",
                          *[f"--parallelism.{key}={value}" for key, value in layout_args.items()]], model_config_class)
    with torch.device("meta"):
        model = package.Transformer(package.build_model_args(config, 97))
    dims = ParallelDims.from_config(config.parallelism, 2)
    if refused is None:
        check_token_mixing(config, dims, model)
        return
    with pytest.raises(ConfigError) as error:
        check_token_mixing(config, dims, model)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("model.name mixers: layers.0 mixes positions outside the attention, convolutions and "
                              "recurrent layers it declares, and parallelism.") and refused in message
    assert "declare it (docs/models.md" in message
    assert ("--parallelism.sequence_parallel false" in message) == ("tensor" in refused)
    assert ("without context parallelism" in message) == ("context" in refused)


# --- Several gloo processes ------------------------------------------------------------------


METHODS_AND_MIXERS = (("allgather", "pass_state"), ("ring", "alltoall"), ("alltoall", "pass_state"),
                      ("alltoall", "alltoall"))
"""Each attention method, and each way the mixers see the sequence (parallelisms/sequence_mixers.py)."""


def check_under_context_parallelism(cp_mesh, root) -> None:
    """Logits, and parameter gradients summed over the ranks, of each declared mixer's fork under each method,
    with and without documents, are one process's (32 tokens: a chunk of 4 at degree 4 holds what the window-4
    convolution reads back)."""
    seq_len = 32
    inputs, labels = (t for t in torch.randint(0, 97, (2, seq_len + 1), generator=torch.Generator().manual_seed(1))
                      .split([seq_len, 1], dim=1)[:1] * 2)
    labels = inputs.roll(-1, dims=1)
    for mixer, documents in itertools.product(DECLARED, (None, packed_rows(2, seq_len, 5))):
        _, reference = fork_model(root, mixer, seq_len)
        logits = reference(inputs, documents)
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        for method, mixers in METHODS_AND_MIXERS:
            model = apply_context_parallel(copy.deepcopy(reference), cp_mesh, seq_len, method,
                                           document_masking=documents is not None, mixers=mixers)
            assert_matches_one_process(model, reference, inputs, labels, logits, cp_mesh, f"{mixer} {method} "
                                       f"{mixers}{'' if documents is None else ' documents'}", documents)


def check_under_tensor_parallelism(tp_mesh, root) -> None:
    """Logits and every parameter gradient of each declared mixer's fork under TP, with sequence parallelism and
    without, with and without documents, are one process's."""
    seq_len = 16
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 97, (2, seq_len), generator=generator)
    labels = inputs.roll(-1, dims=1)
    for mixer, documents, sequence_parallel in itertools.product(
            DECLARED, (None, packed_rows(2, seq_len, 5)), (True, False)):
        package, reference = fork_model(root, mixer, seq_len)
        logits = reference(inputs, documents)
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        model = copy.deepcopy(reference)
        model.zero_grad()
        apply_tensor_parallel(model, tp_mesh, package.tensor_parallel_plan(model, False), sequence_parallel)
        what = f"{mixer}{'' if documents is None else ' documents'} sequence_parallel {sequence_parallel}"
        local_logits = model(inputs, documents).full_tensor()
        torch.testing.assert_close(local_logits, logits, **TOL, msg=what)
        F.cross_entropy(local_logits.flatten(0, 1), labels.flatten()).backward()
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            torch.testing.assert_close(grad, expected.grad, **TOL, msg=f"{what} {name}")


def _tp_worker(rank: int, size: int, store_path: str, check) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, size), rank=rank, world_size=size)
    check(init_device_mesh("cpu", (size,), mesh_dim_names=("tp",)))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("cp_size", [2, 4])
def test_declared_mixers_under_every_context_parallel_method_match_one_process(cp_size, fork, tmp_path):
    on_ranks(cp_worker, cp_size, cp_size, str(tmp_path / "store"), partial(check_under_context_parallelism, root=fork))


@pytest.mark.slow
def test_declared_mixers_under_tensor_parallelism_with_and_without_sequence_parallelism_match_one_process(
        fork, tmp_path):
    on_ranks(_tp_worker, 2, 2, str(tmp_path / "store"), partial(check_under_tensor_parallelism, root=fork))


# --- train.py under every layout ----------------------------------------------------------------

STEPS = 3
FORK_RUN = [*TINY, "--model.name", "mixers", "--training.steps", str(STEPS), "--training.global_batch_size", "8",
            "--training.document_masking", "true"]
LAYOUTS = {
    "fsdp2": layout(dp_shard=2),
    "pp2": layout(pp=2),
    "tp2": layout(tp=2),
    "tp2_no_sequence_parallel": layout(tp=2, extra=["--parallelism.sequence_parallel", "false"]),
    "cp2_allgather": layout(cp=2),
    "cp2_ring": layout(cp=2, extra=["--parallelism.context_parallel_method", "ring"]),
    "cp2_alltoall": layout(cp=2, extra=["--parallelism.context_parallel_method", "alltoall"]),
}
TRAINED = {  # what each fork trains under besides; every method and TP both ways of each mixer run in gloo above
    "conv": ("pp2", "tp2", "tp2_no_sequence_parallel", "cp2_allgather"),
    "recurrence": ("cp2_alltoall",),
    "inline_shift": ("fsdp2", "pp2", "tp2_no_sequence_parallel"),
}
REFUSED = ("inline_shift_tp2", "inline_shift_cp2_alltoall")


@pytest.fixture(scope="module")
def fork_runs(fork, tmp_path_factory):
    runs = {f"{mixer}_one_process": (1, [*FORK_RUN, *layout()[1], "--model.token_mixer", mixer]) for mixer in TRAINED}
    runs["recurrence_cp2_compiled"] = (2, [*FORK_RUN, *LAYOUTS["cp2_allgather"][1], "--model.token_mixer",
                                           "recurrence", "--compile.enable", "true"])
    for run in [f"{mixer}_{name}" for mixer, names in TRAINED.items() for name in names] + list(REFUSED):
        mixer = next(m for m in TRAINED if run.startswith(f"{m}_"))
        nproc, args = LAYOUTS[run.removeprefix(f"{mixer}_")]
        runs[run] = (nproc, [*FORK_RUN, *args, "--model.token_mixer", mixer])
    moe = ["--job.config_file", "debug_moe.toml", *TINY[2:], "--training.steps", str(STEPS),
           "--training.global_batch_size", "8"]
    runs |= {"moe_one_process": (1, [*moe, *layout()[1]]),
             "moe_tp2_no_sequence_parallel": (2, [*moe, *LAYOUTS["tp2_no_sequence_parallel"][1]])}
    return torchrun_runs(runs, tmp_path_factory.mktemp("mixer_runs"), forks=fork)


@pytest.mark.slow
@pytest.mark.parametrize("run", [f"{mixer}_{name}" for mixer, names in TRAINED.items() for name in names]
                         + ["recurrence_cp2_compiled", "moe_tp2_no_sequence_parallel"])
def test_a_fork_trains_under_each_layout_that_carries_its_mixing_as_on_one_process(fork_runs, run):
    """(Declared mixers under every layout; an undeclared shift under the layouts that hand blocks whole sequences;
    a mixture-of-experts model without sequence parallelism, whose layers then route their slice of the sequence
    and gather their output.)"""
    dump, problem = fork_runs[run]
    assert not problem, problem
    mixer = next(m for m in (*TRAINED, "moe") if run.startswith(f"{m}_"))
    got, expected = losses(dump), losses(fork_runs[f"{mixer}_one_process"][0])
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), (run, step, got[step], loss)


@pytest.mark.slow
@pytest.mark.parametrize("run", REFUSED)
def test_train_py_refuses_an_undeclared_shift_under_sequence_splitting_layouts_with_exit_2_and_one_line(
        fork_runs, run):
    dump, problem = fork_runs[run]
    assert "exit statuses [2, 2]" in problem, problem
    assert "layers.0 mixes positions outside the attention, convolutions and recurrent layers it declares" in problem
    assert not (dump / "metrics.jsonl").exists()
