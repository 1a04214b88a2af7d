"""Finding, before the first step, a block that mixes positions in a way no module of it declares.

The layouts that split the sequence (sequence parallelism, context parallelism) carry exactly what a model declares:
attention (components/model/attention.py), causal convolutions and recurrent layers
(components/model/token_mixing.py). Anything
else that reads another position (a token shift written inline in a block's forward, an undeclared convolution)
would run on each rank's share alone and train another model without a word. So, for such a layout, each distinct
block is run twice on the CPU with random weights on a short sequence whose inputs differ at one position, every
declared mixer replaced by itself applied to one position at a time: an output that then differs at another
position was mixed by undeclared code. The module it is found in is the deepest one whose output differs at a
position where its input did not.

A block is materialized alone (its mixture-of-experts layers, which route each token alone, stood in for by the
identity), once per distinct structure: the cost is one block's weights in host memory and their random fill."""

from __future__ import annotations

import copy
from functools import partial

import torch
from torch import nn

from components.model.attention import attention_layers
from components.model.contract import blocks_name
from components.model.moe_layer import moe_layers
from components.model.token_mixing import convolution_layers, recurrent_layers

PROBE_LENGTH = 13
"""Tokens in the probe's sequence: prime, so that no other dimension of a block's tensors is likely this size."""
PERTURBED = PROBE_LENGTH // 2
"""The position whose input differs between the two runs."""
POOL = 1_000_003
"""Random values the probe's weights repeat (a prime count, so that no row of a matrix repeats another): a block of
8B's 218M weights filled in a tenth of the time of drawing each."""


class _Routed(nn.Module):
    """Stands in for a mixture-of-experts layer: each token is routed alone."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return x


def undeclared_mixing(model: nn.Module) -> str | None:
    """The name of a module of `model` (built on the meta device) that mixes positions outside its declared
    mixers, or None."""
    probe = copy.deepcopy(model)
    for name, _ in list(moe_layers(probe)):
        parent, _, child = name.rpartition(".")
        setattr(probe.get_submodule(parent), child, _Routed())
    blocks = probe.transformer_blocks()
    distinct: dict[tuple, str] = {}
    for key, block in blocks.items():
        distinct.setdefault(_structure(block), key)
    calls: dict[str, tuple] = {}
    hooks = [blocks[key].register_forward_pre_hook(partial(_record_first, calls, key), with_kwargs=True)
             for key in distinct.values()]
    with torch.no_grad():
        probe(torch.zeros(1, PROBE_LENGTH, dtype=torch.long, device="meta"))  # the blocks' inputs, as shapes
    for hook in hooks:
        hook.remove()
    prefix = blocks_name(probe)
    for key in distinct.values():
        with torch.device("cpu"):  # whatever device the caller builds on
            found = _mixing_module(blocks[key], *calls[key])
        if found is not None:
            return ".".join(filter(None, (prefix, key, found)))
    return None


def _structure(block: nn.Module) -> tuple:
    """What makes two blocks compute alike: their modules' classes, their parameters' shapes, their declarations."""
    return tuple((name, type(m).__qualname__, getattr(m, "attention_mask", None),
                  tuple((p, tuple(t.shape)) for p, t in m.named_parameters(recurse=False)))
                 for name, m in block.named_modules())


def _record_first(calls: dict, key: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
    calls.setdefault(key, (args, kwargs))


def _one_position_at_a_time(kernel, dim: int):
    """`kernel` (its position-carrying arguments first, along `dim`) applied to each position alone."""

    def alone(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > dim and a.shape[dim] == PROBE_LENGTH]
        rest = args[len(tensors):]
        return torch.cat([kernel(*(t.narrow(dim, i, 1) for t in tensors), *rest, **kwargs)
                          for i in range(PROBE_LENGTH)], dim=dim)

    return alone


def _materialized(value, generator: torch.Generator):
    """A meta tensor (inside tuples, lists and dicts) as a CPU one: random if floating, zeros otherwise."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            return torch.randn(value.shape, generator=generator, dtype=value.dtype)
        return torch.zeros(value.shape, dtype=value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_materialized(v, generator) for v in value)
    if isinstance(value, dict):
        return {k: _materialized(v, generator) for k, v in value.items()}
    return value


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _differing(a: list[torch.Tensor], b: list[torch.Tensor]) -> set[int]:
    """The positions (dim 1 of the tensors that have the probe's length there) other than PERTURBED at which a
    tensor of `a` differs from its counterpart in `b`."""
    positions = set()
    for x, y in zip(a, b):
        if x.dim() >= 2 and x.shape[1] == PROBE_LENGTH and x.shape == y.shape:
            differs = (x != y).movedim(1, 0).flatten(1).any(1)
            positions |= set(differs.nonzero().flatten().tolist())
    return positions - {PERTURBED}


def _mixing_module(block: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """'' if `block`'s own forward mixes positions outside its declared mixers, the name of the module inside it that
    does, or None."""
    block.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(POOL, generator=generator)
    with torch.no_grad():
        for t in (*block.parameters(), *block.buffers()):
            if not t.is_floating_point():
                t.zero_()
                continue
            flat = t.view(-1)
            for start in range(0, len(flat), POOL):
                flat[start:start + POOL].copy_(pool[:len(flat) - start])
    block.eval()
    for _, layer in attention_layers(block):
        layer.sdpa = _one_position_at_a_time(layer.sdpa, dim=2)
    for _, layer in convolution_layers(block):
        layer.conv = _one_position_at_a_time(layer.conv, dim=1)
    for _, layer in recurrent_layers(block):
        layer.recurrence = _one_position_at_a_time(layer.recurrence, dim=1)
    args, kwargs = _materialized(args, generator), _materialized(kwargs, generator)
    perturbed = list(args)
    perturbed[0] = args[0].clone()
    perturbed[0][:, PERTURBED] += 1
    runs = []
    for inputs in (args, tuple(perturbed)):
        seen: list[tuple[str, list, list]] = []
        hooks = [m.register_forward_hook(partial(_record_call, seen, name), with_kwargs=True)
                 for name, m in block.named_modules()]
        with torch.no_grad():
            block(*inputs, **kwargs)
        for hook in hooks:
            hook.remove()
        runs.append(seen)
    leaking = {name for (name, inputs, outputs), (_, other_inputs, other_outputs) in zip(*runs)
               if _differing(outputs, other_outputs) - _differing(inputs, other_inputs)}
    deepest = [name for name in leaking if not any(other.startswith(f"{name}.") or (name == "" and other)
                                                   for other in leaking if other != name)]
    return deepest[0] if deepest else None


def _record_call(seen: list, name: str, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
    seen.append((name, _tensors((args, kwargs)), _tensors(output)))
