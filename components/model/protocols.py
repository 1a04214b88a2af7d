"""Finding a model's parts by the interface they declare (a typing.Protocol), whatever their class.

isinstance against a runtime-checkable Protocol will not do for nn.Modules: since Python 3.12 it looks the
members up statically (inspect.getattr_static), which misses the parameters, buffers and submodules a module
keeps in its own dictionaries. An MoE layer, whose experts are a submodule and whose tallies are buffers, was
then found nowhere: no load balancing, no routing metrics, its block compiled as one graph. `provides` asks
the module itself (hasattr), as Python 3.11 did."""

from __future__ import annotations

import inspect
from functools import cache
from typing import Generic, Protocol


@cache
def members(protocol: type) -> frozenset[str]:
    """The names a Protocol declares: its annotated attributes and its public methods."""
    names: set[str] = set()
    for klass in protocol.__mro__:
        if klass not in (Protocol, Generic, object):
            names |= set(inspect.get_annotations(klass))
            names |= {name for name, value in vars(klass).items() if callable(value) and not name.startswith("_")}
    return frozenset(names)


def provides(obj: object, protocol: type) -> bool:
    """Whether `obj` has every member `protocol` declares."""
    return all(hasattr(obj, name) for name in members(protocol))
