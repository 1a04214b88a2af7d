"""Muon (components/training/muon.py): the orthogonalisation, whole matrices under sharding, MoE experts one by
one, the optimizer container and schedule around it, the step guard, checkpoints, and every layout
training like one process (CPU, fp32 Newton-Schulz)."""

import shutil

import pytest
import torch
import torch.distributed as dist
from conftest import ON_HF, TINY, build_model, losses, on_ranks, tiny_model_args, torchrun_runs

from components.config import ConfigError, LRScheduler, Optimizer as OptimizerConfig
from components.training.muon import Muon, newton_schulz, orthogonalise
from components.training.optimizers import LRSchedule, Optimizers, lr_factor

STEPS = 6
MUON = [*TINY, "--training.steps", str(STEPS), "--metrics.log_freq", "1", "--training.global_batch_size", "8",
        "--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"]
MUON_CONFIG = OptimizerConfig(name="Muon", muon_ns_dtype="float32", lr=0.02)


def test_newton_schulz_brings_every_singular_value_near_one():
    g = torch.randn(64, 160, generator=torch.Generator().manual_seed(0)) * 3
    for matrix in (g, g.T):
        singular_values = torch.linalg.svdvals(newton_schulz(matrix, steps=5))
        assert 0.6 < singular_values.min() and singular_values.max() < 1.25, singular_values


def test_newton_schulz_is_torch_muons_iteration_in_bfloat16():
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(48, 80, generator=torch.Generator().manual_seed(1))
    for matrix in (g, g.T):
        expected = _zeropower_via_newtonschulz(matrix, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert torch.equal(newton_schulz(matrix.bfloat16(), steps=5), expected)


def test_a_muon_step_on_plain_matrices_is_torch_muons():
    mine, theirs = torch.nn.Linear(48, 80, bias=False), torch.nn.Linear(48, 80, bias=False)
    theirs.load_state_dict(mine.state_dict())
    settings = dict(lr=0.01, weight_decay=0.1, momentum=0.95, nesterov=True)
    optimizers = {
        mine: Muon(mine.parameters(), **settings, ns_steps=5, adjust_lr="match_rms_adamw", ns_dtype="bfloat16"),
        theirs: torch.optim.Muon(theirs.parameters(), **settings, adjust_lr_fn="match_rms_adamw"),
    }
    for _ in range(3):
        x = torch.randn(16, 48)
        for model, optimizer in optimizers.items():
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        assert torch.equal(mine.weight, theirs.weight)


def test_expert_weights_are_orthogonalised_expert_by_expert():
    experts = torch.randn(4, 48, 80, generator=torch.Generator().manual_seed(2))
    for stack in (experts, experts.mT):
        assert torch.equal(newton_schulz(stack, steps=5), torch.stack([newton_schulz(m, steps=5) for m in stack]))


def _sharded_equals_whole(rank: int, world_size: int, init_file: str) -> None:
    """On a 2 x 2 gloo mesh: for parameters sharded every way the trainer shards them, the local
    share of orthogonalise(...) is the shard of the whole matrix's newton_schulz, bit for bit."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    # FSDP over tensor parallel (uneven rows: 7 over 4 ranks), as parallelize.py composes them.
    model = nn.Sequential(nn.Linear(10, 7, bias=False), nn.Linear(7, 10, bias=False))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    params = list(model.parameters())
    stack = torch.randn(4, 6, 9)
    for placements in ([Shard(0), Shard(1)], [Shard(2), Replicate()], [Shard(0), Shard(0)]):  # the last: no gather
        params.append(distribute_tensor(stack, mesh, placements))
    with torch.no_grad():
        for param in params:
            whole = torch.randn(param.shape)  # the same on every rank
            mine = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
            got = orthogonalise(mine, param, steps=5, dtype=torch.float32)
            expected = distribute_tensor(newton_schulz(whole, steps=5), param.device_mesh, param.placements,
                                         src_data_rank=None).to_local()
            assert torch.equal(got, expected), (param.placements, (got - expected).abs().max())
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_sharded_matrix_is_orthogonalised_whole(tmp_path):
    on_ranks(_sharded_equals_whole, 4, 4, str(tmp_path / "init"))


def test_muon_takes_the_block_matrices_and_adamw_the_rest():
    model = build_model(tiny_model_args())
    optimizers = Optimizers([model], MUON_CONFIG)
    muon, adamw = optimizers.optimizers
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {p: name for name, p in model.named_parameters()}
    muon_names = {names[p] for group in muon.param_groups for p in group["params"]}
    adamw_names = {names[p] for group in adamw.param_groups for p in group["params"]}
    assert muon_names == {n for n in names.values() if n.startswith("layers.") and n.split(".")[-2].startswith("w")}
    assert adamw_names == set(names.values()) - muon_names
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.attention_norm.weight"} <= adamw_names


def test_adamw_alone_is_built_as_before():
    """optimizer.name AdamW: one AdamW per model part over all of it, with the configured settings."""
    model = build_model(tiny_model_args())
    cfg = OptimizerConfig()
    (adamw,) = Optimizers([model], cfg).optimizers
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["fused"]
    assert [p for group in adamw.param_groups for p in group["params"]] == list(model.parameters())
    assert adamw.defaults["lr"] == cfg.lr and adamw.defaults["weight_decay"] == cfg.weight_decay
    assert adamw.defaults["betas"] == (cfg.beta1, cfg.beta2) and adamw.defaults["eps"] == cfg.eps


def test_the_schedule_scales_each_groups_own_peak_lr():
    model = build_model(tiny_model_args())
    cfg = OptimizerConfig(name="Muon", lr=0.02, adamw_lr=0.003, adamw_weight_decay=0.0)
    optimizers = Optimizers([model], cfg)
    muon, adamw = optimizers.optimizers
    assert adamw.defaults["weight_decay"] == 0.0 and muon.defaults["weight_decay"] == cfg.weight_decay
    schedule_cfg = LRScheduler(warmup_steps=2, decay_type="linear")
    schedule = LRSchedule(optimizers, 10, schedule_cfg, cfg.lr)
    for step in range(1, 6):
        factor = lr_factor(step, 10, schedule_cfg)
        assert {group["lr"] for group in muon.param_groups} == {0.02 * factor}
        assert {group["lr"] for group in adamw.param_groups} == {0.003 * factor}
        assert schedule.lr == 0.02 * factor
        schedule.step()


def test_a_skipped_muon_step_leaves_weights_and_momentum_unchanged():
    model = build_model(tiny_model_args())
    optimizers = Optimizers([model], MUON_CONFIG)
    inputs = torch.randint(0, 97, (2, 16))

    def step(skip: bool):
        optimizers.zero_grad()
        model(inputs).square().mean().backward()
        optimizers.step(skip=torch.tensor(skip))

    def snapshot():
        state = [v.clone() for optimizer in optimizers.optimizers for s in optimizer.state.values() for v in s.values()]
        return [p.clone() for p in model.parameters()], state

    step(False)
    before = snapshot()
    step(True)
    after = snapshot()
    assert all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1]))
    step(False)
    assert not torch.equal(before[0][1], model.layers["0"].attention.wq.weight)


def test_a_parameter_muon_cannot_update_is_named():
    model = build_model(tiny_model_args())
    model.layers["1"].register_parameter("kernel", torch.nn.Parameter(torch.zeros(2, 3, 4, 5)))
    with pytest.raises(ConfigError, match=r"optimizer.name Muon cannot update layers.1.kernel of shape \(2, 3, 4, 5\)"):
        Optimizers([model], MUON_CONFIG)


def test_an_unknown_optimizer_name_lists_the_valid_ones(train_in_process, capsys):
    assert train_in_process([*TINY, "--optimizer.name", "Lion"]) == 2
    assert "config error: optimizer.name must be one of AdamW, Muon, got 'Lion'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="optimizer.name must be one of AdamW, Muon, got 'SGD'"):
        Optimizers([build_model(tiny_model_args())], OptimizerConfig(name="SGD"))


MOE = [*MUON, "--job.config_file", "debug_moe.toml", "--model.n_layers", "2", "--checkpoint.enable", "false"]


@pytest.mark.slow
def test_muon_trains_a_mixture_of_experts_model(tmp_path, train_in_process):
    args = [*MOE, *ON_HF, "--training.steps", "10", "--training.local_batch_size", "4",
            "--training.global_batch_size", "4"]
    assert train_in_process([*args, "--job.dump_folder", str(tmp_path)]) == 0
    curve = list(losses(tmp_path).values())
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.15, curve


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, global batch 8, checkpoints at steps 3 and 6: the run every other is compared with."""
    import train

    dump = tmp_path_factory.mktemp("muon_reference")
    args = [*MUON, "--training.local_batch_size", "8", "--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    assert train.main([*args, "--job.dump_folder", str(dump)]) == 0
    assert sorted(losses(dump)) == list(range(1, STEPS + 1))
    return dump, args


def resume_from_step_3(dump, args, train_main) -> dict[int, float]:
    """Rerun `dump` from its step-3 checkpoint in this process; the losses of steps 4 to 6."""
    shutil.rmtree(dump / "checkpoint" / f"step-{STEPS}")
    (dump / "metrics.jsonl").write_text("")
    assert train_main([*args, "--job.dump_folder", str(dump)]) == 0
    resumed = losses(dump)
    assert sorted(resumed) == list(range(4, STEPS + 1))
    return resumed


def test_muon_resumes_bit_for_bit(reference, tmp_path, train_in_process):
    """6 steps straight == 3 steps, then a resume from the step-3 checkpoint to 6."""
    dump, args = reference
    shutil.copytree(dump, tmp_path / "run")
    resumed = resume_from_step_3(tmp_path / "run", args, train_in_process)
    assert all(resumed[step] == losses(dump)[step] for step in resumed), (resumed, losses(dump))


def layout(dp_replicate=1, dp_shard=1, tp=1, pp=1):
    dp = dp_replicate * dp_shard
    args = ["--parallelism.data_parallel_replicate_degree", str(dp_replicate),
            "--parallelism.data_parallel_shard_degree", str(dp_shard), "--parallelism.tensor_parallel_degree", str(tp),
            "--parallelism.pipeline_parallel_degree", str(pp), "--training.local_batch_size", str(8 // dp)]
    if pp > 1:
        args += ["--parallelism.pipeline_parallel_microbatch_size", "2"]
    return dp * tp * pp, args


LAYOUTS = {"hsdp_2x2": layout(dp_replicate=2, dp_shard=2), "pp2": layout(pp=2),
           "dp_shard2_tp2": layout(dp_shard=2, tp=2)}


def assert_matches(got: dict[int, float], expected: dict[int, float]) -> None:
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-4), (step, loss, expected[step])


EP2 = ["--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "2",
       "--parallelism.expert_parallel_degree", "2"]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """The dump folder of every layout, of FSDP 2 saving checkpoints and of the MoE model under expert parallelism,
    and what went wrong ("" if nothing), by name."""
    runs = {name: (nproc, [*MUON, *args, "--checkpoint.enable", "false"]) for name, (nproc, args) in LAYOUTS.items()}
    runs["fsdp2_checkpoints"] = (2, [*MUON, *layout(dp_shard=2)[1], "--checkpoint.enable", "true",
                                     "--checkpoint.interval", "3"])
    runs["moe_ep2"] = (2, [*MOE, *ON_HF, *EP2])
    return torchrun_runs(runs, tmp_path_factory.mktemp("layouts"))


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_muon_under_a_layout_matches_one_process(name, reference, layout_runs):
    dump, problem = layout_runs[name]
    assert not problem, problem
    assert sorted(losses(dump)) == list(range(1, STEPS + 1))
    assert_matches(losses(dump), losses(reference[0]))


@pytest.mark.slow
def test_muon_under_fsdp2_matches_one_process_and_its_checkpoint_resumes_on_one(reference, layout_runs,
                                                                                train_in_process):
    """FSDP over 2 processes trains like one; its step-3 checkpoint (momentum sharded over 2 ranks)
    then resumes in one process, and the curve goes on as the single-process run's."""
    dump, problem = layout_runs["fsdp2_checkpoints"]
    assert not problem, problem
    assert sorted(losses(dump)) == list(range(1, STEPS + 1))
    assert_matches(losses(dump), losses(reference[0]))
    assert_matches(resume_from_step_3(dump, reference[1], train_in_process), losses(reference[0]))


@pytest.mark.slow
def test_muon_under_expert_parallelism_matches_one_process(tmp_path, layout_runs, train_in_process):
    """Experts split over 2 ranks (each holds whole expert matrices) train like one process, on the default
    config's data."""
    assert train_in_process([*MOE, *ON_HF, "--training.local_batch_size", "8", "--job.dump_folder",
                             str(tmp_path / "one")]) == 0
    ep2, problem = layout_runs["moe_ep2"]
    assert not problem, problem
    assert sorted(losses(ep2)) == list(range(1, STEPS + 1))
    assert_matches(losses(ep2), losses(tmp_path / "one"))
