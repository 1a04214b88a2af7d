"""The peak of the memory a rank's step allocates, from its fake tensors: every storage an operator creates counts
from then until it is freed (its last tensor gone), at its size in bytes, from the tensors alive before the step
(the caller's: parameters and buffers).

FSDP gathers a unit's weights into storages it keeps and resizes (to the unit's size to gather, to 0 to free)
outside any operator; a storage an operator writes in place is therefore read again for its size whenever the count
would pass its peak, so that a unit freed since counts no longer. What DTensor allocates to work out shapes is left
out."""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from scripts.preflight.collectives import is_wrapper

SHARDING_PROPAGATION = os.path.join("distributed", "tensor", "_sharding_prop.py")


def _in_sharding_propagation() -> bool:
    """Whether DTensor is working out an operation's output shapes: it runs the operation on fake tensors of the
    global shapes, which under preflight's fake mode are tensors of the same kind as the step's (and some outlive the
    operation), but on a GPU no allocation."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(SHARDING_PROPAGATION):
            return True
        frame = frame.f_back
    return False


class PeakMemory(TorchDispatchMode):
    """While entered: `live`, the bytes of the storages alive, and `peak`, the most of them at once."""

    def __init__(self, alive: Iterable[torch.Tensor]):
        super().__init__()
        self.sizes: dict[int, int] = {}
        """Bytes of each storage alive, by its address."""
        self.resizable: dict[int, weakref.ref] = {}
        """The storages written in place, whose size may change unseen."""
        self.live = 0
        for tensor in alive:
            self._count(tensor)
        self.peak = self.live

    def _count(self, tensor: torch.Tensor, written: bool = False) -> None:
        if is_wrapper(type(tensor)):  # DTensor, torchao's float8 tensors: what they hold
            inner = [tensor.to_local()] if isinstance(tensor, DTensor) else vars(tensor).values()
            for held in inner:
                if isinstance(held, torch.Tensor):
                    self._count(held, written)
            return
        if tensor.device.type == "meta":  # shapes only: never allocated
            return
        storage = tensor.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        before = self.sizes.get(key)
        if before is None:
            if _in_sharding_propagation():
                return
            weakref.finalize(storage, self._free, key)
            before = 0
        self.sizes[key] = size
        self.live += size - before
        if written:
            self.resizable[key] = weakref.ref(storage)

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key)
        self.resizable.pop(key, None)

    def _reread(self) -> None:
        for key, storage in list(self.resizable.items()):
            if (alive := storage()) is not None:
                size = alive.nbytes()
                self.live += size - self.sizes[key]
                self.sizes[key] = size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(map(is_wrapper, types)):
            return NotImplemented  # the subclass runs it on the tensors it holds, which come here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._schema.is_mutable:
            for arg in (*args, *kwargs.values()):
                for tensor in arg if isinstance(arg, (list, tuple)) else (arg,):
                    if isinstance(tensor, torch.Tensor):
                        self._count(tensor, written=True)
        for tensor in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self._count(tensor)
        if self.live > self.peak:
            self._reread()
            self.peak = max(self.peak, self.live)
        return out
