"""How a compressed collective runs: every hop issued from the caller's thread, in call order,
on a dedicated comm stream; scratch buffers tied to that stream.

A collective is a first step (encode, issue the first hop), zero or more middle steps (wait the
previous hop, re-encode, issue the next hop: qgZ's inter-node hop) and a finish (wait the last
hop, decode into the output, give the scratch back). Where each runs:

- **Backends whose ``work.wait()`` only orders streams (NCCL):** all steps are enqueued at the call,
  on the comm stream, after that stream has waited for the caller's current stream (the input is
  ready). Nothing blocks the host; the returned handle's ``wait()`` makes the caller's current
  stream wait for the call's done event. Hops reach NCCL in program order, identical on every rank.
- **Backends whose ``wait()`` blocks the host (gloo, CPU tensors or CUDA tensors):** the first step
  runs at the call; middle steps wait in this topology's FIFO and run at the next *progress point*:
  the start of the next collective on the same topology, or ``wait()`` of this or a later handle.
  Progress points are the same calls on every rank (SPMD), so hop 2 is issued at the same place
  in every rank's sequence of collectives, whatever the host timing: no thread ever issues a
  collective. ``finish`` runs at ``wait()``.

Scratch buffers come from the topology's pool keyed by (size, device, stream). Every kernel and
every collective that touches them is ordered on that one stream (NCCL's own stream is ordered
with it by ``work.wait()`` before the buffer is given back), so returning a buffer at the end of
a call's enqueued work is safe, as in PyTorch's caching allocator: the next user is later on the
same stream. Caller tensors used on the comm stream are ``record_stream``-ed to it.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

Step = Callable[[], None]

# One comm stream per (device, role): gathers (weights) and reductions (gradients) overlap each
# other, as FSDP2's all-gather and reduce-scatter streams do.
_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def comm_stream(device: torch.device, role: str) -> torch.cuda.Stream | None:
    """The dedicated stream of ``role`` ("gather" or "reduce") on a CUDA device; ``None`` on CPU."""
    if device.type != "cuda":
        return None
    key = (device.index if device.index is not None else torch.cuda.current_device(), role)
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.Stream(device=key[0], priority=-1)
    return stream


def blocks_host(group: dist.ProcessGroup | None) -> bool:
    """Whether ``work.wait()`` on ``group`` blocks the host (gloo, mpi) rather than ordering streams (NCCL)."""
    return group is not None and dist.get_backend(group) != "nccl"


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None, tensors: tuple[torch.Tensor, ...] = (), after_caller: bool = False):
    """Run the enclosed steps on ``stream``; with ``after_caller``, after the caller's current
    stream's work so far (the input is ready). ``tensors`` (the caller's) are recorded on it
    for the allocator."""
    if stream is None:
        yield
        return
    if after_caller:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    for t in tensors:
        if t.is_cuda:
            t.record_stream(stream)
    with torch.cuda.stream(stream):
        yield


class _Call:
    __slots__ = ("middles", "finish", "stream", "done", "finished")

    def __init__(self, middles: list[Step], finish: Step, stream) -> None:
        self.middles, self.finish, self.stream = deque(middles), finish, stream
        self.done = None
        self.finished = False

    def issue_middles(self) -> None:
        with on_stream(self.stream):
            while self.middles:
                self.middles.popleft()()


class InFlight:
    """The calls of one topology whose later hops are not issued yet, oldest first."""

    def __init__(self) -> None:
        self._queue: deque[_Call] = deque()

    def progress(self, until: _Call | None = None) -> None:
        """Issue the pending hops of every queued call, oldest first (up to ``until`` included)."""
        while self._queue:
            call = self._queue.popleft()
            call.issue_middles()
            if call is until:
                return

    def __len__(self) -> int:
        return len(self._queue)


class CommHandle:
    """Returned by ``async_op=True`` calls. ``wait()`` finishes the collective: on the host-blocking
    path it issues what is pending and decodes into the output; on the NCCL path it makes the
    current stream wait for the enqueued work. The output must not be read before it. Waiting
    twice is a no-op."""

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None


def launch(in_flight: InFlight, host_blocking: bool, stream, tensors: tuple[torch.Tensor, ...],
           first: Callable[[], tuple[list[Step], Step]], async_op: bool) -> CommHandle | None:
    """Run a collective under the execution model above.

    ``first()`` runs the first step (encode, issue hop 1) and returns ``(middles, finish)``.
    ``tensors``: the caller's input and output, used on ``stream``.
    """
    in_flight.progress()  # earlier calls' pending hops go first, on every rank
    with on_stream(stream, tensors, after_caller=True):
        middles, finish = first()
    call = _Call(middles, finish, stream)
    if not host_blocking:
        # Everything is enqueued now; the host never waits.
        with on_stream(stream):
            call.issue_middles()
            finish()
        if stream is not None:
            call.done = torch.cuda.Event()
            call.done.record(stream)
        call.finished = True

        def complete() -> None:
            if call.done is not None:
                torch.cuda.current_stream(stream.device).wait_event(call.done)
    else:
        if call.middles:
            in_flight._queue.append(call)

        def complete() -> None:
            if call.middles:
                in_flight.progress(until=call)
            with on_stream(stream):
                call.finish()
                if stream is not None:
                    call.done = torch.cuda.Event()
                    call.done.record(stream)
            call.finished = True
            if call.done is not None:
                torch.cuda.current_stream(stream.device).wait_event(call.done)

    handle = CommHandle(complete)
    if async_op:
        return handle
    handle.wait()
    return None
