"""Fitting L(N, D) = E + A / N^alpha + B / D^beta to the final losses of a ladder: approach 3 of
Hoffmann et al. (2022), with the corrections of Besiroglu et al. (2024).

- The loss is predicted in log space, log L = LSE(a - alpha log N, b - beta log D, e) with A = e^a,
  B = e^b, E = e^e (so A, B, E stay positive), and compared with the measured log loss through a
  Huber loss (delta 1e-3), which treats all but tiny residuals as absolute errors: one bad run moves
  the fit less than under least squares.
- The objective has many poor local minima, so it is started from a grid of points; the best grid
  points are run by L-BFGS to convergence (Besiroglu et al. found Hoffmann et al.'s optimiser stopped
  early), and the lowest minimum is kept.
- log N and log D are centred on their geometric means inside the fit: the grid then spans loss terms of
  a sensible size at the data, whatever the scale of N and D, and L-BFGS sees a well-conditioned problem.
- The uncertainty comes from refitting on bootstrap resamples of the runs (their spread, not a
  Hessian): with a handful of runs the parameters trade off against each other and the intervals
  say so.
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

HUBER_DELTA = 1e-3
EXPONENTS = (0.1, 0.35, 0.6, 0.85, 1.1)
"""Starting alpha and beta."""
TERM_SIZES = (0.1, 0.3, 1.0, 3.0)
"""Starting A / N^alpha, B / D^beta and E, in loss units at the centre of the data."""
STARTS = 32
"""Grid points (those of lowest objective) that L-BFGS is run from."""
MAX_ITER = 1000
"""L-BFGS iterations at most (a problem with a flat valley, such as E going to 0, may use them all)."""


@dataclass
class Law:
    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def loss(self, n, d):
        n, d = np.asarray(n, dtype=float), np.asarray(d, dtype=float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def compute_optimal(self, flops):
        """The N and D of least loss for C = 6 N D FLOPs: minimising over N gives
        N = G (C / 6)^(beta / (alpha + beta)) with G = (alpha A / (beta B))^(1 / (alpha + beta)).
        NaN where there is no such minimum: an exponent that is not positive."""
        c = np.asarray(flops, dtype=float) / 6
        if self.alpha <= 0 or self.beta <= 0:
            return np.full_like(c, np.nan), np.full_like(c, np.nan)
        s = self.alpha + self.beta
        n = (self.alpha * self.A / (self.beta * self.B)) ** (1 / s) * c ** (self.beta / s)
        return n, c / n


@dataclass
class Fit:
    law: Law
    objective: float
    """The Huber objective at the minimum (summed over the runs)."""
    theta: np.ndarray
    """The parameters (a, b, e, alpha, beta) centred on the geometric means of N and D: where the
    bootstrap's refits start."""


def _predict_log(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log L at centred log N (x) and log D (y) for each row of theta = (a, b, e, alpha, beta)."""
    a, b, e, alpha, beta = theta.unbind(-1)
    terms = torch.stack([a[:, None] - alpha[:, None] * x, b[:, None] - beta[:, None] * y,
                         e[:, None].expand(-1, x.shape[-1])], dim=-1)
    return torch.logsumexp(terms, dim=-1)


@dataclass
class _Data:
    x: torch.Tensor
    y: torch.Tensor
    log_loss: torch.Tensor

    def objective(self, theta: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The Huber objective of each row of theta, each run counted `weights` times (bootstrap counts)."""
        residual = _predict_log(theta, self.x, self.y) - self.log_loss
        huber = torch.nn.functional.huber_loss(residual, torch.zeros_like(residual), reduction="none",
                                               delta=HUBER_DELTA)
        return (huber * weights).sum(-1)

    def value_and_grad(self, theta: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        theta = theta.detach().requires_grad_(True)
        value = self.objective(theta, weights)
        (grad,) = torch.autograd.grad(value.sum(), theta)  # the problems are independent: one backward for all
        return value.detach(), grad


def _two_loop(g: torch.Tensor, s: torch.Tensor, y: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """The L-BFGS product H g of each problem, from its last steps s and gradient changes y (oldest
    first; rho = 1 / s.y, 0 for an empty slot, which then drops out)."""
    q, alphas = g.clone(), []
    for i in reversed(range(s.shape[1])):
        alpha = rho[:, i] * (s[:, i] * q).sum(-1)
        q = q - alpha[:, None] * y[:, i]
        alphas.append(alpha)
    sy, yy = (s[:, -1] * y[:, -1]).sum(-1), (y[:, -1] * y[:, -1]).sum(-1)
    r = torch.where(rho[:, -1] > 0, sy / yy.clamp_min(1e-300), 1.0)[:, None] * q
    for i, alpha in enumerate(reversed(alphas)):
        r = r + s[:, i] * (alpha - rho[:, i] * (y[:, i] * r).sum(-1))[:, None]
    return r


def _minimise(theta: torch.Tensor, weights: torch.Tensor, data: _Data, max_iter: int = MAX_ITER,
              history: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """L-BFGS with a backtracking (Armijo) line search on a batch of independent problems (one per row
    of theta and weights); each stops on its own, when its steps or its progress become negligible.
    Batched, so that the many starts and bootstrap resamples cost about as much as one problem."""
    theta = theta.clone()
    value, grad = data.value_and_grad(theta, weights)
    steps = torch.zeros(len(theta), history, 5, dtype=theta.dtype)  # the last steps of each problem, oldest first
    changes = torch.zeros_like(steps)  # ... and the changes of its gradient over them
    rho = torch.zeros(len(theta), history, dtype=theta.dtype)
    active = torch.arange(len(theta))
    for _ in range(max_iter):
        if not len(active):
            break
        th, f, g, w = theta[active], value[active], grad[active], weights[active]
        direction = -_two_loop(g, steps[active], changes[active], rho[active])
        slope = (g * direction).sum(-1)
        uphill = slope >= 0  # a poor curvature estimate: fall back on steepest descent
        direction = torch.where(uphill[:, None], -g, direction)
        slope = torch.where(uphill, -(g * g).sum(-1), slope)
        fresh = rho[active, -1] == 0  # no history yet: a first step of length at most 1
        t = torch.where(fresh, (1 / g.abs().sum(-1).clamp_min(1e-300)).clamp(max=1.0), 1.0)
        accepted, pending = torch.zeros(len(active), dtype=torch.bool), torch.arange(len(active))
        for _ in range(40):  # halve the step of each problem until it decreases its objective enough
            trial = th[pending] + t[pending, None] * direction[pending]
            trial_value = data.objective(trial, w[pending])
            ok = torch.isfinite(trial_value) & (trial_value <= f[pending] + 1e-4 * t[pending] * slope[pending])
            accepted[pending[ok]] = True
            pending = pending[~ok]
            if not len(pending):
                break
            t[pending] /= 2
        step = torch.where(accepted[:, None], t[:, None] * direction, 0.0)
        new_value, new_grad = data.value_and_grad(th + step, w)
        change = new_grad - g
        curvature = (step * change).sum(-1)
        keep = accepted & (curvature > 1e-20)
        idx = active[keep]
        steps[idx] = torch.cat([steps[idx, 1:], step[keep, None]], 1)
        changes[idx] = torch.cat([changes[idx, 1:], change[keep, None]], 1)
        rho[idx] = torch.cat([rho[idx, 1:], 1 / curvature[keep, None]], 1)
        theta[active], value[active], grad[active] = th + step, new_value, new_grad
        done = (~accepted | (step.abs().amax(-1) < 1e-10) | ((f - new_value).abs() <= 1e-12 * f.abs())
                | (new_grad.abs().amax(-1) < 1e-14))
        active = active[~done]
    return theta, value


@contextmanager
def _one_thread():
    """Tiny tensors: threads only add synchronisation, which costs dearly on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _grid() -> torch.Tensor:
    logs = [math.log(t) for t in TERM_SIZES]
    return torch.tensor(list(itertools.product(logs, logs, logs, EXPONENTS, EXPONENTS)), dtype=torch.float64)


def _prepare(n, d, loss) -> tuple[_Data, tuple[float, float]]:
    n, d, loss = (np.asarray(v, dtype=float) for v in (n, d, loss))
    if len(loss) < 2 or not (np.all(n > 0) and np.all(d > 0) and np.all(loss > 0)):
        raise ValueError("the fit needs at least two runs with positive N, D and loss")
    n0, d0 = math.exp(np.log(n).mean()), math.exp(np.log(d).mean())
    data = _Data(torch.tensor(np.log(n / n0)), torch.tensor(np.log(d / d0)), torch.tensor(np.log(loss)))
    return data, (n0, d0)


def _law(theta: torch.Tensor, scale: tuple[float, float]) -> Law:
    """Undo the centring: A / N^alpha = e^a (N / n0)^-alpha, so A = e^a n0^alpha."""
    a, b, e, alpha, beta = theta.tolist()
    return Law(E=math.exp(e), A=math.exp(a + alpha * math.log(scale[0])), alpha=alpha,
               B=math.exp(b + beta * math.log(scale[1])), beta=beta)


def _best_starts(data: _Data, weights: torch.Tensor, starts: int) -> torch.Tensor:
    """The `starts` grid points of least objective for each row of weights: (rows, starts, 5)."""
    grid = _grid()
    values = torch.stack([data.objective(grid, w.expand(len(grid), -1)) for w in weights])
    return grid[values.topk(starts, dim=-1, largest=False).indices]


def fit_law(n, d, loss, starts: int = STARTS) -> Fit:
    """The law of least Huber objective for losses `loss` measured at N = `n`, D = `d` (arrays),
    minimised from the `starts` best points of the grid."""
    data, scale = _prepare(n, d, loss)
    with _one_thread():
        weights = torch.ones(1, len(data.x), dtype=torch.float64)
        theta0 = _best_starts(data, weights, starts)[0]
        theta, value = _minimise(theta0, weights.expand(starts, -1), data)
    value = torch.where(torch.isfinite(value), value, math.inf)
    best = int(value.argmin())
    return Fit(_law(theta[best], scale), float(value[best]), theta[best].numpy())


def bootstrap(n, d, loss, full: Fit, resamples: int, seed: int = 0, starts: int = 4) -> list[Law]:
    """Laws fitted to `resamples` resamples of the runs (as many draws, with replacement, as there are
    runs), each minimised from the full fit and from its own `starts` best grid points, all at once.
    A resample that repeats one run only is drawn again: it cannot be fitted. A refit that ran away (a
    non-finite objective, or parameters whose law overflows a float) is dropped, so fewer laws may come back."""
    data, scale = _prepare(n, d, loss)
    rng = np.random.default_rng(seed)
    counts = []
    while len(counts) < resamples:
        draw = rng.multinomial(len(data.x), np.full(len(data.x), 1 / len(data.x)))
        if (draw > 0).sum() >= 2:
            counts.append(draw)
    weights = torch.tensor(np.array(counts), dtype=torch.float64)
    with _one_thread():
        theta0 = torch.cat([torch.tensor(full.theta)[None, None].expand(resamples, 1, 5),
                            _best_starts(data, weights, starts)], 1)
        theta, value = _minimise(theta0.reshape(-1, 5), weights.repeat_interleave(starts + 1, 0), data)
    value = torch.where(torch.isfinite(value), value, math.inf).reshape(resamples, starts + 1)
    best = theta.reshape(resamples, starts + 1, 5)[torch.arange(resamples), value.argmin(-1)]
    laws = []
    for row, objective in zip(best, value.min(-1).values.tolist()):
        try:
            law = _law(row, scale)
        except OverflowError:
            continue
        if math.isfinite(objective) and all(math.isfinite(x) for x in (law.E, law.A, law.alpha, law.B, law.beta)):
            laws.append(law)
    return laws


def spread(values) -> dict[str, float]:
    """std and the 5th, 50th and 95th percentiles (a 90% interval) of bootstrap values."""
    values = np.asarray(values, dtype=float)
    low, median, high = np.percentile(values, [5, 50, 95])
    return {"std": float(values.std(ddof=1)) if len(values) > 1 else 0.0, "p5": float(low),
            "median": float(median), "p95": float(high)}
