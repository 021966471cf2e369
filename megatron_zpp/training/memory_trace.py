"""Where resident memory goes: the C heap's own counters, and a debug-only allocation tracer.

:func:`heap_usage` reads glibc's ``mallinfo2``: the bytes the C heap has handed out and not taken back
(``in_use``) and what it holds from the kernel (``held``). Resident memory that grows while ``in_use``
stays flat is the allocator keeping freed memory (fragmentation, arena growth), not a leak; ``in_use``
that grows is something allocated and never freed (Python objects, tensors, C++ buffers alike, as they
all come from ``malloc`` on CPU).

:class:`AllocationTracer` is for hunting a leak, never on by default: with ``ZPP_TRACEMALLOC=<folder>``
in the environment every rank starts ``tracemalloc`` and, at each log interval, appends to
``<folder>/rank<r>.txt`` the Python allocation sites (``file:line``) that grew most since the first
sample and since the previous one, the object types whose count grew (``gc``), the live tensors' bytes
and the heap counters. It slows a run down several-fold (every Python allocation is traced).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import functools
import gc
import os
import tracemalloc
import warnings
from pathlib import Path

TRACEMALLOC_ENV = "ZPP_TRACEMALLOC"


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _load_mallinfo2():
    """glibc's mallinfo2, looked up on first use (``find_library`` runs ldconfig/gcc: not at import, per rank)."""
    try:
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
        fn = libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = _Mallinfo2
    fn.argtypes = []
    return fn


def heap_usage() -> dict[str, int] | None:
    """``{"in_use": bytes allocated and not freed, "held": bytes the heap holds from the kernel}`` (all
    arenas, mmapped chunks included), or ``None`` off glibc."""
    mallinfo2 = _load_mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return {"in_use": info.uordblks + info.hblkhd, "held": info.arena + info.hblkhd}


_STATUS_FIELDS = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}


def resident_split() -> dict[str, int] | None:
    """This process's resident bytes by kind (Linux ``/proc/self/status``): ``anon`` (heap, stacks,
    anonymous mappings: where a leak shows), ``file`` (pages of mapped files, such as the shared
    libraries' code faulted in as new paths run: bounded by the files' size) and ``shmem``; ``None``
    elsewhere."""
    try:
        with open("/proc/self/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        name, _, rest = line.partition(":")
        if name + ":" in _STATUS_FIELDS:
            out[_STATUS_FIELDS[name + ":"]] = int(rest.split()[0]) * 1024  # "RssAnon:\t  1234 kB"
    return out if len(out) == len(_STATUS_FIELDS) else None


def _tensor_bytes() -> tuple[int, int]:
    """(live tensors, bytes of their distinct storages) among the objects the garbage collector tracks."""
    import torch

    storages: dict[int, int] = {}
    count = 0
    with warnings.catch_warnings():  # isinstance on some deprecated module attributes warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            if not obj.is_meta:
                count += 1
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        except Exception:  # noqa: BLE001 - a debug walk: a tensor subclass that refuses is skipped
            continue
    return count, sum(storages.values())


class AllocationTracer:
    """Debug-only growth report per rank (see the module docstring); ``from_env`` gives ``None`` unless
    ``ZPP_TRACEMALLOC`` is set."""

    def __init__(self, folder: str | os.PathLike, rank: int, top: int = 25) -> None:
        self.path = Path(folder) / f"rank{rank}.txt"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.top = top
        self._first = self._previous = None
        self._first_types: collections.Counter | None = None
        if not tracemalloc.is_tracing():
            tracemalloc.start(1)

    @classmethod
    def from_env(cls, rank: int) -> AllocationTracer | None:
        folder = os.environ.get(TRACEMALLOC_ENV)
        return cls(folder, rank) if folder else None

    def sample(self, iteration: int) -> None:
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)])
        types = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
        tensors, tensor_bytes = _tensor_bytes()
        traced, _ = tracemalloc.get_traced_memory()
        heap = heap_usage() or {}
        lines = [f"== iteration {iteration}: traced {traced / 1e6:.3f} MB, heap in use "
                 f"{heap.get('in_use', 0) / 1e6:.3f} MB, held {heap.get('held', 0) / 1e6:.3f} MB, "
                 f"{tensors} tensors {tensor_bytes / 1e6:.3f} MB, {sum(types.values())} gc objects"]
        if self._first is None:
            self._first, self._first_types = snapshot, types
        else:
            for title, base in (("since the first sample", self._first), ("since the previous sample", self._previous)):
                lines.append(f"-- top growth {title} (file:line, size, count)")
                for stat in snapshot.compare_to(base, "lineno")[:self.top]:
                    if stat.size_diff <= 0:
                        break
                    frame = stat.traceback[0]
                    lines.append(f"  {frame.filename}:{frame.lineno}  {stat.size_diff:+d} B  {stat.count_diff:+d}")
            grown = sorted(((n - self._first_types.get(t, 0), t) for t, n in types.items()), reverse=True)
            lines.append("-- object types grown since the first sample: "
                         + ", ".join(f"{t} {d:+d}" for d, t in grown[:self.top] if d > 0))
        self._previous = snapshot
        with open(self.path, "a") as f:
            f.write("\n".join(lines) + "\n")
