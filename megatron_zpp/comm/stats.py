"""Byte accounting: what this rank puts on the wire, intra- vs inter-node, per tag.

Every collective of the project records here, compressed or not, at the moment it is
issued (sizes are known from shapes, so recording never touches tensor data or waits).
A record is two integer additions under a lock: cheap enough to stay on in training.

Tags name the traffic by parallel dimension and role: ``dp.param`` (weight all-gather),
``dp.param.hpz`` (the hpZ secondary gather), ``dp.grad`` (gradient reduce-scatter),
``tp``, ``pp``, or anything a caller passes.

Bytes are *sent* bytes of the algorithm that runs: all-to-all sends one chunk to each
peer; ring all-gather / reduce-scatter send ``size - 1`` chunks to the ring successor;
gloo's ``reduce_scatter_tensor`` is a ring all-reduce (``2 (size - 1)`` chunks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TagStats:
    """Bytes sent under one tag. ``uncompressed_*``: what the same algorithm would have sent with
    ``codec="none"`` (equal to the actual bytes for uncompressed collectives), so the
    compression ratio of a run comes from the same counters."""

    intra_bytes: int = 0
    inter_bytes: int = 0
    calls: int = 0
    uncompressed_intra_bytes: int = 0
    uncompressed_inter_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.intra_bytes + self.inter_bytes

    @property
    def inter_ratio(self) -> float:
        """Inter-node bytes over the uncompressed inter-node bytes (1.0 when nothing crossed)."""
        return self.inter_bytes / self.uncompressed_inter_bytes if self.uncompressed_inter_bytes else 1.0

    @property
    def total_ratio(self) -> float:
        base = self.uncompressed_intra_bytes + self.uncompressed_inter_bytes
        return self.total_bytes / base if base else 1.0

    def __add__(self, other: TagStats) -> TagStats:
        return TagStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


class CommStats:
    """Per-tag byte counters of this process. ``comm_stats()`` returns the process-wide one."""

    def __init__(self) -> None:
        self._tags: dict[str, TagStats] = {}
        self._lock = threading.Lock()
        self.enabled = True

    def record(self, tag: str, intra_bytes: int, inter_bytes: int, calls: int = 1,
               uncompressed: tuple[int, int] | None = None) -> None:
        """Add one call's bytes; ``uncompressed`` = (intra, inter) of the same call with codec none."""
        if not self.enabled:
            return
        base_intra, base_inter = uncompressed if uncompressed is not None else (intra_bytes, inter_bytes)
        with self._lock:
            s = self._tags.get(tag)
            if s is None:
                s = self._tags[tag] = TagStats()
            s.intra_bytes += intra_bytes
            s.inter_bytes += inter_bytes
            s.calls += calls
            s.uncompressed_intra_bytes += base_intra
            s.uncompressed_inter_bytes += base_inter

    def reset(self) -> None:
        with self._lock:
            self._tags.clear()

    def snapshot(self) -> dict[str, TagStats]:
        """A copy of the counters: ``{tag: TagStats}``."""
        with self._lock:
            return {t: dataclasses.replace(s) for t, s in self._tags.items()}

    def get(self, tag: str) -> TagStats:
        with self._lock:
            return dataclasses.replace(self._tags.get(tag, TagStats()))

    def total(self) -> TagStats:
        out = TagStats()
        for s in self.snapshot().values():
            out = out + s
        return out

    def summed_over_ranks(self, group: dist.ProcessGroup | None = None) -> dict[str, TagStats]:
        """Counters summed over the ranks of ``group`` (a collective; for reports, not the hot path)."""
        local = self.snapshot()
        gathered: list[dict[str, TagStats] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        out: dict[str, TagStats] = {}
        for per_rank in gathered:
            for tag, s in (per_rank or {}).items():
                out[tag] = out.get(tag, TagStats()) + s
        return out

    def __repr__(self) -> str:
        rows = ", ".join(f"{t}: intra={s.intra_bytes} inter={s.inter_bytes} calls={s.calls}"
                         for t, s in sorted(self.snapshot().items()))
        return f"CommStats({rows})"


_STATS = CommStats()


def comm_stats() -> CommStats:
    """This process's byte counters (``.snapshot()``, ``.get(tag)``, ``.total()``, ``.reset()``)."""
    return _STATS


class CommTimers:
    """Host seconds this process spends on the communication path, for the step-time breakdown.

    ``codec_s``: inside codec kernels (quantize, dequantize, fused reduce steps, the uncompressed
    algorithms' fp32 reductions). ``wait_s``: blocked in the data-parallel collectives' calls and
    waits as Megatron makes them (issue, ``finish_*_sync``, Megatron-FSDP's bucket waits), minus the
    codec time inside them, i.e. exposed communication. Nested waits count once.

    ``wait_s_by_site``: ``wait_s`` split by where the outermost wait was (``wait(site)``: the hook that issued
    or waited, e.g. ``finish_param_sync``), to tell which collective a step waits for.

    Host time is the real cost on CPU, where codec kernels run on the calling thread and gloo
    waits block it. On CUDA both are asynchronous: ``codec_s`` is launch overhead only and
    ``wait_s`` is host blocking, not stream time; use a profiler there.
    """

    def __init__(self) -> None:
        self.codec_s = 0.0
        self.wait_s = 0.0
        self.wait_s_by_site: dict[str, float] = {}
        self._depth = 0

    @contextlib.contextmanager
    def codec(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.codec_s += time.perf_counter() - t0

    @contextlib.contextmanager
    def wait(self, site: str = "other"):
        self._depth += 1
        if self._depth > 1:  # inside another timed wait: counted by the outer one
            try:
                yield
            finally:
                self._depth -= 1
            return
        t0, codec0 = time.perf_counter(), self.codec_s
        try:
            yield
        finally:
            self._depth -= 1
            exposed = (time.perf_counter() - t0) - (self.codec_s - codec0)
            self.wait_s += exposed
            self.wait_s_by_site[site] = self.wait_s_by_site.get(site, 0.0) + exposed

    def snapshot(self) -> tuple[float, float]:
        return self.codec_s, self.wait_s

    def sites(self) -> dict[str, float]:
        """``wait_s`` so far by site (a copy)."""
        return dict(self.wait_s_by_site)

    def reset(self) -> None:
        self.codec_s = self.wait_s = 0.0
        self.wait_s_by_site = {}


_TIMERS = CommTimers()


def comm_timers() -> CommTimers:
    """This process's communication-path timers (see :class:`CommTimers`)."""
    return _TIMERS


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
