"""The one way device values reach the host on the communication path: auditable and counted.

A collective that needs a device value on the host (a variable-size payload's length, a container's
validation record) starts the copy with :class:`HostRead` where the value is produced and reads it
with :meth:`HostRead.values` at a later point of the execution model (``comm/execution.py``). On a
GPU the copy is a ``non_blocking`` copy into pinned memory on a side stream followed by a CUDA event
(:class:`HostRead` says when it is enqueued), so starting it never blocks the host, and reading it blocks only if the event has not completed yet (the host
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


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream host reads are copied on: never a stream that other work is queued behind."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


class HostRead:
    """Device tensors on their way to the host. ``works``: torch.distributed works that fill them.

    On a GPU the copy runs on a side stream, after an event recorded where the tensors are produced
    (the current stream at construction) and after ``works``. Without works it is enqueued at once. With
    works (a size exchange) it is enqueued only at the first :meth:`values`, the next progress point,
    right before the host reads it: a stream wait for an exchange that needs every peer would otherwise
    sit in the hardware queue from the call on, and with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` hold back the
    compute queued behind it until the slowest peer arrives. On CPU the works are waited at the read."""

    __slots__ = ("_tensors", "_works", "_produced", "_event", "_values")

    def __init__(self, tensors: list[torch.Tensor], works: tuple = ()) -> None:
        self._tensors = list(tensors)
        self._works = [w for w in works if w is not None]
        self._produced = self._event = None
        self._values: list[torch.Tensor] | None = None
        cuda = [t for t in self._tensors if t.is_cuda]
        if cuda:
            self._produced = torch.cuda.Event()
            self._produced.record(torch.cuda.current_stream(cuda[0].device))
            if not self._works:
                self._start()

    def _start(self) -> None:
        device = next(t.device for t in self._tensors if t.is_cuda)
        side = _side_stream(device)
        with torch.cuda.stream(side):
            side.wait_event(self._produced)
            for w in self._works:
                w.wait()  # NCCL: the side stream waits; the host does not
            self._works = []
            pinned = []
            for t in self._tensors:
                t.record_stream(side)  # read here even if this read is dropped unread
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                host.copy_(t, non_blocking=True)
                pinned.append(host)
            self._event = torch.cuda.Event()
            self._event.record(side)
        self._tensors = pinned

    def ready(self) -> bool:
        """Whether :meth:`values` would not block now (it may still be called when this is False)."""
        if self._values is not None:
            return True
        if self._produced is not None:
            return self._event is not None and self._event.query()
        return all(w.is_completed() for w in self._works)

    def values(self) -> list[torch.Tensor]:
        """The tensors on the host (a sync point the first time; counted)."""
        if self._values is None:
            if self._produced is not None:
                if self._event is None:
                    self._start()
                self._event.synchronize()
            for w in self._works:
                w.wait()
            self._works = []
            _counter.n = host_reads() + 1
            self._values = self._tensors
        return self._values
