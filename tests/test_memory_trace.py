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


# ----------------------------------------------------------------------------- the flight recorder's ring

def test_flight_recorder_default_is_off_on_gloo_only_and_respects_the_user():
    from megatron_zpp.megatron.flight_recorder import flight_recorder_default

    env = {}
    flight_recorder_default("gloo", env)
    assert env == {"TORCH_FR_BUFFER_SIZE": "0"}
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}  # the user sized it: kept
    flight_recorder_default("gloo", env)
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}
    env = {}
    flight_recorder_default("nccl", env)  # NCCL keeps torch's default
    assert env == {}
    flight_recorder_default("gloo", env, dump_path="/tmp/fr")  # Megatron-LM's --flight-recorder-dump-path
    assert env == {}


def _collectives_heap_growth(rank: int, store: str, calls: int, user_buffer: str | None, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    from megatron_zpp.megatron.flight_recorder import flight_recorder_default

    if user_buffer is not None:
        os.environ["TORCH_FR_BUFFER_SIZE"] = user_buffer
    else:
        os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
        os.environ.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
    flight_recorder_default("gloo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    x = torch.ones(256)
    for _ in range(50):  # gloo's own first-call buffers
        dist.all_reduce(x)
    before = heap_usage()["in_use"]
    for _ in range(calls):
        dist.all_reduce(x, async_op=True).wait()
    grown = heap_usage()["in_use"] - before
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(grown))


@pytest.mark.slow
def test_many_collectives_leave_the_heap_bounded(tmp_path):
    """2500 collectives on gloo: with the recorder at torch's default (2000 entries) the heap in use grows
    by its ring (about 1.7 MB measured); with our default it stays within 0.3 MB. Slow: two spawned gloo
    worlds (~30 s on an idle 2-core machine, several minutes when it is loaded)."""
    import torch.multiprocessing as mp

    if heap_usage() is None:
        pytest.skip("not glibc: no mallinfo2")
    growth = {}
    for name, user_buffer in (("ours", None), ("torch default", "2000")):
        out = tmp_path / f"{name}.txt"
        mp.start_processes(_collectives_heap_growth, args=(str(tmp_path / f"store-{len(growth)}"), 2500, user_buffer,
                                                           str(out)), nprocs=2, start_method="spawn")
        growth[name] = int(out.read_text())
    assert growth["ours"] < 300_000, growth
    assert growth["torch default"] > 1_000_000, growth  # the ring the default fills: what this test would catch
