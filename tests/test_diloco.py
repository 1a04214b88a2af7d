"""DiLoCo's outer step (components/distributed/diloco.py) on one process: what replica groups under
fault_tolerance.semi_sync_method diloco do at each synchronisation (tests/test_fault_tolerance.py runs them)."""

import torch
from torch import nn

from components.config import FaultTolerance
from components.distributed.diloco import OuterStep


def test_the_outer_step_is_torch_s_nesterov_sgd_on_the_pseudo_gradient_from_the_interval_s_start():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    outer = OuterStep([model], FaultTolerance(outer_lr=0.7, outer_momentum=0.9))
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for step in (4, 8, 12):
        with torch.no_grad():  # an interval of training: the weights move
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        moved = [p.detach().clone() for p in model.parameters()]
        outer.step(outer.pseudo_gradients(), step)
        for r, start, now in zip(reference, reference, moved):
            r.grad = start.detach() - now  # the pseudo-gradient: the start minus where the group went
        sgd.step()
        assert all(torch.equal(p, r) for p, r in zip(model.parameters(), reference))
        assert outer.last_sync == step
    outer.snapshot()
    assert all(torch.equal(outer.start[name], value) for name, value in model.state_dict().items())


def test_an_interval_not_committed_goes_back_to_its_start_and_the_state_round_trips():
    model = nn.Linear(4, 3)
    outer = OuterStep([model], FaultTolerance())
    start = {name: value.clone() for name, value in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    outer.restore()
    assert all(torch.equal(value, start[name]) for name, value in model.state_dict().items())

    with torch.no_grad():
        model.weight.add_(1.0)
    outer.step(outer.pseudo_gradients(), 5)
    other = OuterStep([nn.Linear(4, 3)], FaultTolerance())
    other.load_state_dict({k: ({n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v)
                           for k, v in outer.state_dict().items()})
    assert other.last_sync == 5 and all(torch.equal(other.velocity[n], outer.velocity[n]) for n in outer.velocity)
    assert all(torch.equal(other.start[n], outer.start[n]) for n in outer.start)
