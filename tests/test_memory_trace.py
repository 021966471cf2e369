"""The memory instruments of issue [22]: the C heap's counters and the debug-only allocation tracer."""

from __future__ import annotations

import tracemalloc

import pytest

from megatron_zpp.training.memory_trace import TRACEMALLOC_ENV, AllocationTracer, heap_usage


def test_heap_usage_sees_an_allocation_and_its_release():
    before = heap_usage()
    if before is None:
        pytest.skip("not glibc: no mallinfo2")
    block = bytearray(64 << 20)  # 64 MiB: malloc's mmap path, counted in use at once
    during = heap_usage()
    del block
    after = heap_usage()
    assert during["in_use"] - before["in_use"] >= 64 << 20
    assert during["in_use"] - after["in_use"] >= 64 << 20
    assert during["held"] >= during["in_use"]


def test_allocation_tracer_names_the_growing_line(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACEMALLOC_ENV, raising=False)
    assert AllocationTracer.from_env(rank=0) is None  # off unless asked for
    monkeypatch.setenv(TRACEMALLOC_ENV, str(tmp_path))
    was_tracing = tracemalloc.is_tracing()
    tracer = AllocationTracer.from_env(rank=3)
    try:
        kept = []
        for iteration in (10, 20, 30):
            kept.extend(str(i) * 50 for i in range(2000))  # the line that leaks
            tracer.sample(iteration)
    finally:
        if not was_tracing:
            tracemalloc.stop()
    report = (tmp_path / "rank3.txt").read_text()
    assert report.count("== iteration") == 3
    growth = report.split("-- top growth since the first sample")[-1].splitlines()[1]
    assert f"{__file__}:" in growth and "+" in growth, report
    assert "object types grown" in report
