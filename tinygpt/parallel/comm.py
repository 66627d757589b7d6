"""This process's collectives, timed and counted: the measured share of a step spent talking.

    CommStats   all_reduce and all_gather through torch.distributed, adding up their seconds,
                calls and bytes
    COMM        the one CommStats of this process: the parallel layers (tinygpt.parallel.layers)
                send through it; reset() before measuring (tinygpt.parallel.cost does)
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class CommStats:
    """Seconds, calls and bytes of this process's collectives (the measured all-reduce share)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0

    def all_reduce(self, x: torch.Tensor, group=None) -> None:
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += x.numel() * x.element_size()

    def all_gather(self, parts: list[torch.Tensor], x: torch.Tensor, group=None) -> None:
        t0 = time.perf_counter()
        dist.all_gather(parts, x, group=group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += x.numel() * x.element_size() * len(parts)


COMM = CommStats()          # this process's collectives; reset() before measuring
