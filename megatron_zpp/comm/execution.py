"""How a compressed collective runs: every hop issued from the caller's thread, in call order,
on a dedicated comm stream ordered with the caller's by CUDA events.

A collective is a first step (encode, issue the first hop), zero or more middle steps (wait the
previous hop, re-encode, issue the next hop: qgZ's inter-node hop; with a variable-size codec also
"read the exchanged sizes, issue the payloads"; the all-reduce's gather half) and a finish (wait
the last hop, decode into the output). One path for every backend:

- The first step runs at the call, on the comm stream, after that stream has waited for the
  caller's current stream (the input is ready). It runs *before* anything else the call does, so
  a new collective's first hop is never queued behind older calls' waits (no head-of-line
  blocking: several first hops can be in flight per topology).
- Middle steps wait in this topology's FIFO. A *progress point* issues the next middle step of
  every queued call, oldest first: the start of the next collective on the same topology (after
  that collective's first step). ``wait()`` of a handle issues every remaining step of the calls
  queued before it and of its own, oldest first. Progress points are the same calls on every rank
  (SPMD) and each advances each call by exactly one step, so every collective is issued at the
  same place in every rank's sequence, whatever the host timing: no thread ever issues a
  collective, and NCCL sees the same order on all ranks.
- A step that needs device values on the host (a variable-size payload's lengths) reads them
  through ``compression.host_read.HostRead``, started by the step before: the value has had the
  time between two progress points to arrive, so the host rarely waits for it.
- ``finish`` runs at ``wait()`` on the comm stream; the caller's current stream then waits for the
  call's done event. With NCCL nothing here blocks the host (``work.wait()`` orders streams); with
  gloo ``work.wait()`` blocks, which is why hop 2 is not waited at the call. Deferring the middle
  step to the next call also keeps a "wait for hop 1" out of the stream queues until hop 1 has had
  the time between two calls to finish (with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` a pending stream
  wait can hold back other streams' kernels). That deferral assumes compute between two calls, as in
  a backward's reductions. Megatron-FSDP issues a forward's gathers back to back, so a gather there
  has no middle step: qWD's on the hpZ copy (``hpz_weight_difference_all_gather``) issues both of its
  hops at the call and combines them at ``wait()``.

One stream, one trade-off (not yet measured on a GPU): an older call's middle step issued at a new
call's progress point is queued on the comm stream after that call's wait for the caller's stream, so
qgZ's second hop of bucket i starts only once the compute up to bucket i+1's launch has run. The
alternative order (older steps first) put the new call's encode behind the older hop's wait instead.
Separate encode and transfer streams would avoid both but tie every scratch and receive buffer to two
streams; ``make gpu-check`` (comm_cuda, pretrain_gpt) is where to decide it.

Scratch memory: on CPU, the topology's pool (steady state allocates nothing). On CUDA, the caching
allocator, with every scratch tensor allocated, used and dropped under the comm stream: its
blocks are tied to that stream, so reuse is stream-ordered; NCCL's own stream is ordered before
by ``work.wait()`` on the comm stream. Caller tensors used on the comm stream are
``record_stream``-ed to it.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

Step = Callable[[], None]

def comm_stream(device: torch.device, role: str, streams: dict) -> torch.cuda.Stream | None:
    """The dedicated stream of ``role`` ("gather" or "reduce") on a CUDA device, one per topology
    (``streams`` is the topology's table), so weight gathers, gradient reductions and different
    parallel dimensions overlap each other, as FSDP2's all-gather and reduce-scatter streams do;
    ``None`` on CPU."""
    if device.type != "cuda":
        return None
    key = (device.index if device.index is not None else torch.cuda.current_device(), role)
    stream = streams.get(key)
    if stream is None:
        stream = streams[key] = torch.cuda.Stream(device=key[0], priority=-1)
    return stream


def backend_name(group: dist.ProcessGroup | None, device: torch.device | str = "cpu") -> str:
    """The backend that runs ``group``'s collectives on ``device``'s tensors: "gloo", "nccl", ...

    A group with one backend per device type (``"cpu:gloo,cuda:nccl"``) is resolved by device."""
    device = torch.device(device)
    try:
        name = str(dist.get_backend(group))
    except ValueError:  # several backend implementations: ask for the device's
        return group._get_backend(device).name().lower()
    if ":" in name:
        per_device = dict(part.split(":", 1) for part in name.split(","))
        name = per_device.get(device.type, name)
    return name.lower()


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
    __slots__ = ("middles", "finish", "stream")

    def __init__(self, middles: list[Step], finish: Step, stream) -> None:
        self.middles, self.finish, self.stream = deque(middles), finish, stream

    def step(self, in_flight: InFlight) -> None:
        in_flight._depth += 1
        try:
            with on_stream(self.stream):
                self.middles.popleft()()
        finally:
            in_flight._depth -= 1


# Progress points a deferred validation may wait for its host read before it is forced (a host sync).
MAX_CHECK_LAG = 8


class InFlight:
    """The calls of one topology whose middle steps are not all issued yet, oldest first."""

    def __init__(self) -> None:
        self._queue: deque[_Call] = deque()
        self._deferred: list[Callable[[], None]] = []
        self._depth = 0  # > 0 inside a first or middle step: a collective launched there is no progress point

    def defer(self, check: Callable[[], None], ready: Callable[[], bool] = lambda: True) -> None:
        """Run ``check`` (a finished call's deferred validation, which may raise) at the start of a later
        collective or ``wait()`` on this topology: the first one at which ``ready()`` (its host read has
        arrived), or the ``MAX_CHECK_LAG``-th, whichever comes first. Running it at the very next one would
        stall the host until the previous call's decode has finished on the device (Megatron waits bucket
        i's gather and at once starts bucket i+1's)."""
        self._deferred.append([check, ready, 0])

    def _run_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for i, entry in enumerate(deferred):
            check, ready, age = entry
            if age >= MAX_CHECK_LAG or ready():
                try:
                    check()
                except BaseException:
                    self._deferred = deferred[i + 1:] + self._deferred
                    raise
            else:
                entry[2] = age + 1
                self._deferred.append(entry)

    def progress(self, calls: list[_Call] | None = None) -> None:
        """A progress point: issue the next middle step of every queued call (of ``calls``, a snapshot of
        the queue, when given), oldest first.

        Calls queued while this runs (a step that launches a collective) wait for the next point."""
        self._run_deferred()
        for call in list(self._queue) if calls is None else calls:
            if call.middles:
                call.step(self)
            if not call.middles and call in self._queue:
                self._queue.remove(call)

    def drain(self, until: _Call) -> None:
        """Issue every pending step of every call queued before ``until``, and of ``until``, oldest first."""
        self._run_deferred()
        while until in self._queue:
            call = self._queue[0]
            while call.middles:
                call.step(self)
            if call in self._queue:
                self._queue.remove(call)

    def __len__(self) -> int:
        return len(self._queue)


class CommHandle:
    """Returned by ``async_op=True`` calls. ``wait()`` finishes the collective: it issues what is
    pending, decodes into the output and makes the caller's current stream wait for it. The output
    must not be read before it. Waiting twice is a no-op."""

    def __init__(self, finish: Callable[[], None], steps_left: Callable[[], int] = lambda: 0) -> None:
        self._finish: Callable[[], None] | None = finish
        self.steps_left = steps_left
        """Middle steps not issued yet (the same on every rank): a composite collective (the all-reduce)
        schedules its next part after them."""

    def wait(self) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None


def launch(in_flight: InFlight, stream, tensors: tuple[torch.Tensor, ...],
           first: Callable[[], tuple[list[Step], Step]], async_op: bool) -> CommHandle | None:
    """Run a collective under the execution model above.

    ``first()`` runs the first step (encode, issue hop 1) and returns ``(middles, finish)``.
    ``tensors``: the caller's input and output, used on ``stream``.
    """
    older = list(in_flight._queue)  # the calls this launch is a progress point for
    if in_flight._depth == 0:
        # Earlier calls' deferred validations (their host reads have had a call's time): a corrupt payload
        # raises here, before this call issues anything, so every rank that received it stops at one place.
        in_flight._run_deferred()
    in_flight._depth += 1
    try:
        with on_stream(stream, tensors, after_caller=True):
            middles, finish = first()
    finally:
        in_flight._depth -= 1
    # The new call's first hop goes before older calls' next steps (no head-of-line blocking behind
    # their waits), then this is a progress point for them; same order on every rank. A collective
    # launched from inside a step (the all-reduce's gather) is not one: its caller's point is.
    if in_flight._depth == 0:
        in_flight.progress(older)
    call = _Call(middles, finish, stream)
    if call.middles:
        in_flight._queue.append(call)

    def complete() -> None:
        in_flight.drain(until=call)
        with on_stream(stream):
            call.finish()
        if stream is not None:
            done = torch.cuda.Event()
            done.record(stream)
            torch.cuda.current_stream(stream.device).wait_event(done)

    handle = CommHandle(complete, steps_left=lambda: len(call.middles))
    if async_op:
        return handle
    handle.wait()
    return None
