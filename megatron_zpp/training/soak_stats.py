"""Long-run health series for the run summary, and the checks a soak run applies to them.

Sampled by :class:`~megatron_zpp.training.log.IterationLogger` at every log interval, never per
iteration: one ``psutil`` call (this process's resident memory) and a walk over the comm scratch
pools' counters (``megatron_zpp.comm.scratch_pool_usage``: no communication, no tensor data). The
per-rank series are gathered once, at the end of the run, into ``summary["memory"]``;
the per-interval byte counters go to ``summary["traffic_intervals"]``.

The checks (used by ``tools/soak.py`` and its tests) are pure functions of the summary:

- :func:`rss_slope_mb_per_100`: least-squares slope of resident memory after warm-up;
- :func:`scratch_growth`: scratch pool bytes after warm-up above those at warm-up end;
- :func:`traffic_consistency`: every post-warm-up interval of the same length counted the same
  bytes per tag, and the intervals add up to the totals of the summary.
"""

from __future__ import annotations

import dataclasses

import psutil
import torch.distributed as dist

from megatron_zpp.comm import TagStats, scratch_pool_usage
from megatron_zpp.training.memory_trace import AllocationTracer, heap_usage, resident_split

MB = 1e6


class ResourceSampler:
    """This rank's resident memory, scratch pool and hpZ bytes at each log interval."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self.iterations: list[int] = []
        self.rss_bytes: list[int] = []
        self.scratch_held_bytes: list[int] = []
        self.scratch_allocated_bytes: list[int] = []
        self.scratch_cached_buffers: list[int] = []
        self.scratch_pools: list[int] = []
        self.hpz_bytes: list[int] = []
        # The C heap's counters (glibc): in use flat while RSS grows is the allocator, not a leak.
        self.heap_in_use_bytes: list[int] = []
        self.heap_held_bytes: list[int] = []
        # Resident memory by kind: anonymous (where a leak shows) and file-backed (library code paged in).
        self.rss_anon_bytes: list[int] = []
        self.rss_file_bytes: list[int] = []
        self._tracer = AllocationTracer.from_env(dist.get_rank() if dist.is_initialized() else 0)

    def sample(self, iteration: int, hpz_bytes: int = 0) -> None:
        if self._tracer is not None:
            self._tracer.sample(iteration)
        pools = scratch_pool_usage()
        heap = heap_usage() or {"in_use": 0, "held": 0}
        self.iterations.append(iteration)
        self.rss_bytes.append(self._process.memory_info().rss)
        self.heap_in_use_bytes.append(heap["in_use"])
        self.heap_held_bytes.append(heap["held"])
        split = resident_split() or {"anon": 0, "file": 0}
        self.rss_anon_bytes.append(split["anon"])
        self.rss_file_bytes.append(split["file"])
        self.scratch_held_bytes.append(pools["held_bytes"])
        self.scratch_allocated_bytes.append(pools["allocated_bytes"])
        self.scratch_cached_buffers.append(pools["cached_buffers"])
        self.scratch_pools.append(pools["pools"])
        self.hpz_bytes.append(hpz_bytes)

    def _local(self) -> dict[str, list[int]]:
        return {"rss_bytes": self.rss_bytes, "scratch_held_bytes": self.scratch_held_bytes,
                "scratch_allocated_bytes": self.scratch_allocated_bytes,
                "scratch_cached_buffers": self.scratch_cached_buffers, "scratch_pools": self.scratch_pools,
                "hpz_bytes": self.hpz_bytes, "heap_in_use_bytes": self.heap_in_use_bytes,
                "heap_held_bytes": self.heap_held_bytes, "rss_anon_bytes": self.rss_anon_bytes,
                "rss_file_bytes": self.rss_file_bytes}

    def gathered(self) -> dict:
        """The series of every rank (a collective, once at the end): the maximum over ranks per sample
        (the rank closest to running out decides), and each rank's own in ``per_rank``."""
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self._local())
        per_rank = {key: [ranks[key] for ranks in everyone] for key in everyone[0]}

        def worst(key: str) -> list[int]:
            return [max(values) for values in zip(*per_rank[key])]

        return {
            "iterations": self.iterations,
            "rss_mb": [b / MB for b in worst("rss_bytes")],
            "scratch_bytes": worst("scratch_held_bytes"),
            "scratch_allocated_bytes": worst("scratch_allocated_bytes"),
            "scratch_cached_buffers": worst("scratch_cached_buffers"),
            "scratch_pools": worst("scratch_pools"),
            "hpz_bytes": worst("hpz_bytes"),
            "heap_in_use_mb": [b / MB for b in worst("heap_in_use_bytes")],
            "heap_held_mb": [b / MB for b in worst("heap_held_bytes")],
            "rss_anon_mb": [b / MB for b in worst("rss_anon_bytes")],
            "rss_file_mb": [b / MB for b in worst("rss_file_bytes")],
            "per_rank": {"rss_mb": [[b / MB for b in series] for series in per_rank["rss_bytes"]],
                         "heap_in_use_mb": [[b / MB for b in series] for series in per_rank["heap_in_use_bytes"]],
                         "scratch_bytes": per_rank["scratch_held_bytes"]},
        }


def interval_record(iteration: int, iterations: int, traffic: dict[str, TagStats]) -> dict:
    """One log interval's byte counters (summed over ranks), as stored in ``summary["traffic_intervals"]``."""
    return {"iteration": iteration, "iterations": iterations,
            "traffic": {tag: dataclasses.asdict(s) for tag, s in sorted(traffic.items())}}


# ----------------------------------------------------------------------------- checks

def rss_slope_mb_per_100(iterations: list[int], rss_mb: list[float], after: int) -> float | None:
    """Least-squares slope of resident memory over the samples at iterations > ``after``, in MB per 100
    iterations; ``None`` with fewer than 3 such samples (two points make a line whatever the noise)."""
    points = [(x, y) for x, y in zip(iterations, rss_mb) if x > after]
    if len(points) < 3:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return 100.0 * sxy / sxx


def value_at(iterations: list[int], values: list, iteration: int):
    """The last sample taken at or before ``iteration`` (``None`` when there is none)."""
    before = [v for x, v in zip(iterations, values) if x <= iteration]
    return before[-1] if before else None


def scratch_growth(iterations: list[int], scratch_bytes: list[int], warmup_end: int) -> tuple[int, int, int]:
    """(bytes at warm-up end, maximum after it, growth): a bounded pool has growth 0, as steady-state
    training repeats its bucket sizes and takes every scratch buffer from the pool."""
    at_end = value_at(iterations, scratch_bytes, warmup_end)
    at_end = 0 if at_end is None else at_end
    later = [v for x, v in zip(iterations, scratch_bytes) if x > warmup_end]
    peak = max(later) if later else at_end
    return at_end, peak, max(0, peak - at_end)


_FIELDS = ("intra_bytes", "inter_bytes", "calls", "uncompressed_intra_bytes", "uncompressed_inter_bytes")
# What a variable-size (lossless) codec's tag must still repeat: its payload sizes follow the data.
_SHAPE_FIELDS = ("calls", "uncompressed_intra_bytes", "uncompressed_inter_bytes")


def variable_size_tags(policy: dict, tags) -> set[str]:
    """The tags whose byte counts may differ between equal intervals: those whose dimension's codec
    (``policy`` as in ``summary["policy"]``) is variable-size, and ``dp.grad`` when it is compressed for
    part of the run only (``dp_grad_until`` < 1: its bytes change at the switch)."""
    from megatron_zpp.compression import get_codec

    codecs = dict(policy.get("codecs", {}))
    variable = set()
    for tag in tags:
        dimension = next((d for d in sorted(codecs, key=len, reverse=True)
                          if tag == d or tag.startswith(d + ".")), None)
        if dimension is None:
            continue
        specs = [codecs[dimension]]
        if dimension == "dp.grad":
            if policy.get("dp_grad_intra"):
                specs.append(policy["dp_grad_intra"])
            if policy.get("dp_grad_until", 1.0) < 1.0:
                variable.add(tag)
        if any(not get_codec(spec).fixed_size for spec in specs):
            variable.add(tag)
    return variable


def traffic_consistency(intervals: list[dict], totals: dict[str, dict], variable_tags=(),
                        warmup_intervals: int = 1) -> tuple[bool, str]:
    """(consistent, why): the byte counters of a run with fixed shapes (``summary["traffic_intervals"]``
    and ``summary["traffic"]``).

    1. The intervals add up, field by field, to the totals (nothing counted outside the intervals,
       nothing lost between them).
    2. After the first ``warmup_intervals`` (the first iterations differ: with overlapped parameter
       gathers the first step has none), every interval of the same length counted the same bytes per
       tag; for ``variable_tags`` (payload sizes follow the data) the same calls and uncompressed bytes.
    """
    if not intervals:
        return False, "no log intervals recorded"
    tags = set(totals) | {t for rec in intervals for t in rec["traffic"]}
    for tag in sorted(tags):
        for name in _FIELDS:
            summed = sum(rec["traffic"].get(tag, {}).get(name, 0) for rec in intervals)
            total = totals.get(tag, {}).get(name, 0)
            if summed != total:
                return False, f"{tag}.{name}: intervals add up to {summed}, the summary's total is {total}"
    reference: dict[int, dict] = {}  # interval length -> its first post-warm-up interval
    for rec in intervals[warmup_intervals:]:
        first = reference.setdefault(rec["iterations"], rec)
        if first is rec:
            continue
        for tag in sorted(tags):
            fields = _SHAPE_FIELDS if tag in variable_tags else _FIELDS
            for name in fields:
                want = first["traffic"].get(tag, {}).get(name, 0)
                got = rec["traffic"].get(tag, {}).get(name, 0)
                if got != want:
                    return False, (f"{tag}.{name}: {got} in the interval ending at iteration {rec['iteration']} vs "
                                   f"{want} in the one ending at {first['iteration']} ({rec['iterations']} "
                                   f"iterations each)")
    compared = sum(1 for _ in intervals[warmup_intervals:])
    if compared < 2:
        return True, f"totals match; only {compared} post-warm-up interval, nothing to compare"
    exact = sorted(tags - set(variable_tags))
    loose = sorted(tags & set(variable_tags))
    return True, (f"{compared} intervals equal ({', '.join(exact) or 'no tag'} byte-exact"
                  + (f"; {', '.join(loose)} same calls and uncompressed bytes, sizes follow the data" if loose else "")
                  + "), sum = totals")
