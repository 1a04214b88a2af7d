import math

import pytest
import torch
from conftest import on_ranks

from components.config import LRScheduler, Optimizer as OptimizerConfig
from components.training.optimizers import LRSchedule, Optimizers, lr_factor


def test_warmup_then_linear_decay_over_all_remaining_steps():
    cfg = LRScheduler(warmup_steps=4, decay_type="linear", min_lr_factor=0.0)
    factors = [lr_factor(s, 12, cfg) for s in range(1, 13)]
    assert factors[:4] == [1 / 5, 2 / 5, 3 / 5, 4 / 5]
    assert factors[4:] == pytest.approx([7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8, 0.0])


def test_warmup_stable_decay_shapes():
    for decay_type, expected in [
        ("linear", [1.0, 1.0, 1.0, 0.1 + 0.9 * 2 / 3, 0.1 + 0.9 / 3, 0.1]),
        ("sqrt", [1.0, 1.0, 1.0, 0.1 + 0.9 * (1 - math.sqrt(1 / 3)), 0.1 + 0.9 * (1 - math.sqrt(2 / 3)), 0.1]),
        ("cosine", [1.0, 1.0, 1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.25, 0.1]),
        ("constant", [1.0] * 6),
    ]:
        cfg = LRScheduler(warmup_steps=2, decay_ratio=0.375, decay_type=decay_type, min_lr_factor=0.1)
        factors = [lr_factor(s, 8, cfg) for s in range(3, 9)]
        assert factors == pytest.approx(expected), decay_type


def optimizers_for(*parts):
    return Optimizers(list(parts), OptimizerConfig(lr=0.1))


def test_schedule_sets_every_optimizer_lr_per_step_and_resumes():
    optimizers = optimizers_for(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    schedule = LRSchedule(optimizers, 10, LRScheduler(warmup_steps=1, decay_type="linear"), peak_lr=0.1)
    seen = []
    for _ in range(10):
        assert len({group["lr"] for group in optimizers.param_groups}) == 1
        seen.append(optimizers.param_groups[0]["lr"])
        optimizers.step()
        schedule.step()
    assert seen == pytest.approx([0.1 * lr_factor(s, 10, LRScheduler(warmup_steps=1)) for s in range(1, 11)])
    assert seen[0] == pytest.approx(0.05) and seen[-1] == pytest.approx(0.0)
    resumed = LRSchedule(optimizers_for(torch.nn.Linear(2, 2)), 10, LRScheduler(warmup_steps=1), peak_lr=0.1)
    resumed.load_state_dict({"steps_taken": 4})
    assert resumed.optimizers.param_groups[0]["lr"] == pytest.approx(seen[4])


def test_impossible_schedule_is_rejected():
    with pytest.raises(ValueError, match="exceed training.steps"):
        LRSchedule(optimizers_for(torch.nn.Linear(2, 2)), 10, LRScheduler(warmup_steps=8, decay_ratio=0.5), peak_lr=0.1)


def _partial_gradients(rank: int, store_path: str) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from components.training.optimizers import clip_grad_norm

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    torch.manual_seed(0)
    x, probe = torch.randn(2, 8, 4, 16), torch.randn(2, 8, 4, 16)  # (batch, seq, heads, head_dim)
    reference, norm = torch.nn.RMSNorm(16), torch.nn.RMSNorm(16)
    (reference(x) * probe).sum().backward()
    # As the QK-norm of a tensor-parallel attention: each rank normalises its own heads.
    parallelize_module(norm, init_device_mesh("cpu", (2,)), SequenceParallel(sequence_dim=2, use_local_output=True))
    heads = slice(2 * rank, 2 * rank + 2)
    (norm(x[:, :, heads]) * probe[:, :, heads]).sum().backward()
    assert norm.weight.grad.placements[0].is_partial()
    grad_norm = clip_grad_norm(SimpleNamespace(param_groups=[{"params": [norm.weight]}]), 0.0)
    assert norm.weight.grad.placements == norm.weight.placements
    torch.testing.assert_close(norm.weight.grad.to_local(), reference.weight.grad)
    torch.testing.assert_close(grad_norm, reference.weight.grad.norm())
    dist.barrier()
    dist.destroy_process_group()


def test_partial_gradients_are_reduced_to_their_parameters_placements_before_the_norm_and_the_step(tmp_path):
    """The tensor-parallel QK-norm weights' gradients are Partial after backward; torch 2.11's foreach AdamW read
    their local shares as whole. clip_grad_norm reduces them first: each rank then holds the whole gradient."""
    on_ranks(_partial_gradients, 2, str(tmp_path / "store"))


def _clipped_shards(rank: int, store_path: str) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from components.training.optimizers import clip_grad_norm

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    whole = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    for p in whole:
        p.grad = torch.randn_like(p)
    shared = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [placement]))
              for p, placement in zip(whole, [Shard(0), Replicate()])]
    for p, q in zip(shared, whole):
        p.grad = distribute_tensor(q.grad.clone(), mesh, p.placements)
    norm = clip_grad_norm(SimpleNamespace(param_groups=[{"params": shared}]), 1.0)
    unclipped = [q.grad.clone() for q in whole]
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(whole, 1.0))
    assert norm > 2  # so the gradients were scaled down, each by the same factor on every rank
    for p, q, before in zip(shared, whole, unclipped):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad)
        assert torch.equal(p.grad.full_tensor(), before * (1.0 / (norm + 1e-6)))
    dist.barrier()
    dist.destroy_process_group()


def test_clipping_scales_sharded_and_replicated_gradients_exactly_as_one_process_does(tmp_path):
    """The norm over the whole gradients, and each rank's share scaled in place by the same factor."""
    on_ranks(_clipped_shards, 2, str(tmp_path / "store"))
