"""Detector: is any tensor storage freed (resized) while a torch.distributed work that uses it is still pending?

On CUDA the caching allocator's stream semantics keep a buffer alive until the communication stream is past
it; on CPU with gloo nothing does: ``untyped_storage().resize_(0)`` frees the memory at once even though the
pending ``Work`` still holds a reference to the tensor, and gloo's worker thread then reads or writes freed
memory (heap corruption). A pending work keeps its tensors' storage objects alive, so plain deallocation
cannot free them early; a resize can. This module wraps every ``ProcessGroup`` collective to remember the
storages its pending works touch, and ``UntypedStorage.resize_`` to check them before any resize, so the race
is caught deterministically, whether or not the memory was actually in use at that instant.

Activate it in every process of a launch by putting ``tools/heapcheck`` first on ``PYTHONPATH`` and setting
``ZPP_INFLIGHT_CHECK=report`` (print each violation with both stacks and go on), ``=abort`` (abort on the
first) or ``=raise`` (raise ``InflightFreeError`` instead of resizing: the memory is never freed under the
collective, so a test can provoke the race safely). Each process prints one ``[inflight-check] ... checked N resizes, M violations`` line at exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback

import torch
import torch.distributed as dist

# The ProcessGroup methods that issue work on tensors (torch 2.15's names; absent ones are skipped).
COLLECTIVES = ("all_gather_single", "all_gather_single_coalesced", "allgather", "allgather_coalesced",
               "allgather_into_tensor_coalesced", "_allgather_base", "allreduce", "allreduce_coalesced",
               "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
               "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "all_to_all_single", "alltoall",
               "alltoall_base", "broadcast", "reduce", "gather", "scatter", "send", "recv", "recv_anysource")

_lock = threading.Lock()
_pending: list[tuple[object, list[tuple[int, int]], str, str]] = []  # (work, [(ptr, nbytes)], op, where issued)
_stats = {"resizes": 0, "violations": 0, "works": 0}
_mode = "report"
_installed = False


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _spans(args) -> list[tuple[int, int]]:
    spans = []
    for t in _tensors(list(args)):
        s = t.untyped_storage()
        if s.data_ptr():
            spans.append((s.data_ptr(), s.nbytes()))
    return spans


_waited: set[int] = set()  # ids of works whose wait() has returned


def _prune() -> None:
    # gloo's reduce-scatter works answer is_completed() == False even after wait() returned with the result
    # in place (torch 2.15, measured): a work counts as finished when either says so.
    _pending[:] = [p for p in _pending if id(p[0]) not in _waited and not p[0].is_completed()]
    _waited.intersection_update(id(p[0]) for p in _pending)


def _wrap(name: str) -> None:
    original = getattr(dist.ProcessGroup, name, None)
    if original is None:
        return

    def issue(self, *args, **kwargs):
        work = original(self, *args, **kwargs)
        if work is not None and hasattr(work, "is_completed"):
            spans = _spans(args) + _spans(kwargs.values())
            if spans:
                with _lock:
                    _stats["works"] += 1
                    _prune()
                    _pending.append((work, spans, name, "".join(traceback.format_stack(limit=14)[:-1])))
        return work

    setattr(dist.ProcessGroup, name, issue)


class InflightFreeError(RuntimeError):
    """A storage was about to be resized while a pending collective uses it (mode ``raise``)."""


def violations() -> int:
    return _stats["violations"]


def install(mode: str = "report") -> None:
    global _mode, _installed
    if mode not in ("report", "abort", "raise"):
        raise ValueError(f"ZPP_INFLIGHT_CHECK={mode!r}: use 'report', 'abort' or 'raise'")
    _mode = mode
    if _installed:
        return
    _installed = True
    for name in COLLECTIVES:
        _wrap(name)
    original_wait = dist.Work.wait

    def wait(self, *args, **kwargs):
        result = original_wait(self, *args, **kwargs)
        with _lock:
            _waited.add(id(self))
        return result

    dist.Work.wait = wait
    original_resize = torch.UntypedStorage.resize_

    def resize_(self, size):
        ptr, nbytes = self.data_ptr(), self.nbytes()
        if ptr and size != nbytes:
            with _lock:
                _stats["resizes"] += 1
                _prune()
                hits = [p for p in _pending if any(a < ptr + nbytes and ptr < a + n for a, n in p[1])]
            for work, _, op, issued in hits:
                _stats["violations"] += 1
                print(f"[inflight-check] pid {os.getpid()}: storage 0x{ptr:x} ({nbytes} bytes) resized to {size} "
                      f"bytes while a pending {op} work uses it\n--- work issued at:\n{issued}--- storage resized at:\n"
                      + "".join(traceback.format_stack(limit=14)[:-1]), file=sys.stderr, flush=True)
                if _mode == "abort":
                    os.abort()
                if _mode == "raise":
                    raise InflightFreeError(f"storage 0x{ptr:x} resized while a pending {op} work uses it")
        return original_resize(self, size)

    torch.UntypedStorage.resize_ = resize_
    atexit.register(_summary)


def _extension_mapped() -> bool:
    """Whether this process has megatron_zpp's C++ extension (or its JIT build) mapped."""
    try:
        with open("/proc/self/maps") as maps:
            return any("megatron_zpp" in line and ".so" in line for line in maps)
    except OSError:
        return "megatron_zpp._C" in sys.modules


def _summary() -> None:
    print(f"[inflight-check] pid {os.getpid()}: checked {_stats['resizes']} resizes against {_stats['works']} works, "
          f"{_stats['violations']} violations; megatron_zpp extension loaded: {_extension_mapped()}",
          file=sys.stderr, flush=True)
