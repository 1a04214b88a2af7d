"""checkpoint.async_mode async_with_pinned_mem: staging a save into host memory for DCP's writing process."""

from __future__ import annotations

import torch


class Stager:
    """checkpoint.async_mode async_with_pinned_mem: DCP's DefaultStager copies the state in a background thread
    into shared host memory (pinned on CUDA, where the copy does not block the GPU), and a process of DCP's
    writes it. One stager serves every save and keeps its host buffers, except under torch releases whose
    stager cannot stage twice (torch 2.11 closes it after each staging: pytorch/pytorch#183413, a
    `KeyError: <class 'type'>` at the next save); there a stager is made for each save and closed after it."""

    def __init__(self, device: torch.device):
        from torch.distributed.checkpoint.staging import StagingOptions

        cuda = device.type == "cuda"
        self.options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True,
                                      use_non_blocking_copy=cuda)
        self.reusable = stager_can_stage_twice()
        self.current = None

    def for_save(self):
        from torch.distributed.checkpoint.staging import DefaultStager

        if self.current is None:
            self.current = DefaultStager(self.options)
        return self.current

    def staged(self) -> None:
        """After a save's staging: a stager that cannot stage again is closed now."""
        if not self.reusable:
            self.close()

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


def stager_can_stage_twice() -> bool:
    """Whether this torch's DefaultStager stages a second time (tried on a tiny CPU state dict)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                          use_non_blocking_copy=False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(2), "nested": {"step": 1}})
        return True
    except Exception:  # noqa: BLE001 - a closed stager fails in several ways (KeyError on 2.11)
        return False
    finally:
        stager.close()
