"""The one way device values reach the host on the communication path: auditable and counted.

A collective that needs a device value on the host (a variable-size payload's length, a container's
validation record) starts the copy with :class:`HostRead` where the value is produced and reads it
with :meth:`HostRead.values` at a later point of the execution model (``comm/execution.py``). On a
GPU the copy is a ``non_blocking`` copy into pinned memory followed by a CUDA event, so starting it
never blocks the host, and reading it blocks only if the event has not completed yet (the host
stalls at most for what is still queued before it, not for the whole device). On CPU the values are
the tensors themselves (a torch.distributed work that fills them is waited at the read).

Every :meth:`HostRead.values` is one host synchronization point on a GPU and increments
:func:`host_reads`, on CPU too, so tests count sync points per hop where no GPU is present.
"""

from __future__ import annotations

import threading

import torch

_counter = threading.local()


def host_reads() -> int:
    """Host reads of device values (sync points on a GPU) done by this thread so far."""
    return getattr(_counter, "n", 0)


class HostRead:
    """Device tensors on their way to the host. ``works``: torch.distributed works that fill them
    (waited here on a GPU, which only orders streams with NCCL; at :meth:`values` on CPU, where
    waiting blocks)."""

    __slots__ = ("_tensors", "_works", "_event", "_values")

    def __init__(self, tensors: list[torch.Tensor], works: tuple = ()) -> None:
        self._works = [w for w in works if w is not None]
        self._event = None
        self._values: list[torch.Tensor] | None = None
        if any(t.is_cuda for t in tensors):
            for w in self._works:
                w.wait()  # NCCL: the current stream waits; the host does not
            self._works = []
            pinned = []
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                host.copy_(t, non_blocking=True)
                pinned.append(host)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tensors[0].device))
            self._tensors = pinned
        else:
            self._tensors = list(tensors)

    def values(self) -> list[torch.Tensor]:
        """The tensors on the host (a sync point the first time; counted)."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            for w in self._works:
                w.wait()
            self._works = []
            _counter.n = host_reads() + 1
            self._values = self._tensors
        return self._values
