"""Heap-corruption guards (issue #22 item 1, docs/reliability/heap-corruption.md).

- The sanitizer build switch (``ZPP_SANITIZE``) names bad values.
- The in-flight free detector (``tools/heapcheck``) catches a storage resized under a pending gloo
  collective, the use-after-free that CUDA's caching allocator prevents and the CPU does not.
- Megatron-FSDP training (the launch that once died with ``malloc(): unaligned tcache chunk detected``)
  resizes no storage under a pending collective (slow: one 4-rank launch).
- The sanitizer run itself (slow, ~tens of minutes: ``python tools/sanitize.py``) is a tool with its committed
  results in docs/reliability/, not a test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_zpp.compression._extension import sanitizer_flags

REPO = Path(__file__).resolve().parents[1]
HEAPCHECK = REPO / "tools" / "heapcheck"


def test_sanitize_switch_flags_and_errors():
    assert sanitizer_flags(None) == [] and sanitizer_flags("") == []
    flags = sanitizer_flags("address,undefined")
    assert flags[0] == "-fsanitize=address,undefined" and "-g" in flags and "-fno-omit-frame-pointer" in flags
    assert "-fno-sanitize-recover=undefined" in flags
    with pytest.raises(SystemExit, match=r"unknown sanitizer 'adress'; choose from address, undefined"):
        sanitizer_flags("adress")
    with pytest.raises(SystemExit, match="'thread' cannot be combined with 'address'"):
        sanitizer_flags("thread,address")


def _resize_under_pending_gather():
    """Rank 0 resizes the output of an all-gather that cannot have finished (rank 1 joins it later)."""
    import time

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HEAPCHECK))
    import inflight_free_check as check

    check.install("raise")
    rank = dist.get_rank()
    out, shard = torch.zeros(2 * 4096), torch.full((4096,), float(rank + 1))
    if rank == 1:
        time.sleep(2)  # rank 0's gather stays pending meanwhile
    work = dist.all_gather_into_tensor(out, shard, async_op=True)
    caught = None
    if rank == 0:
        try:
            out.untyped_storage().resize_(0)
        except check.InflightFreeError as exc:
            caught = str(exc)
    work.wait()
    out.untyped_storage().resize_(out.untyped_storage().nbytes())  # after wait: allowed (no-op size)
    after = out.clone()
    out.untyped_storage().resize_(0)  # after wait: allowed
    return caught, check.violations(), after.tolist()[::4096]


@pytest.mark.slow  # two spawned gloo ranks: ~15 s idle, minutes on a loaded host
def test_inflight_free_detector_catches_a_resize_before_wait():
    from megatron_zpp.testing import run_distributed

    results = run_distributed(_resize_under_pending_gather, 2, timeout_s=300)
    caught, count, values = results[0]
    assert caught is not None and "all_gather" in caught, results[0]
    assert count == 1, results[0]
    assert values == [1.0, 2.0]  # the gather completed into memory that was never freed
    assert results[1][0] is None and results[1][1] == 0, results[1]


@pytest.mark.slow
def test_megatron_fsdp_launch_resizes_no_storage_under_a_pending_collective(tmp_path):
    """The smallest Megatron-FSDP launch of tools/launch_loop.py (policy none, 4 ranks as 2 x 2, 2
    iterations) with the detector raising on the first resize of a storage that a pending collective uses."""
    sys.path.insert(0, str(REPO / "tools"))
    from launch_loop import SMALLEST_FSDP_LAUNCH

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HEAPCHECK), str(REPO), os.environ.get("PYTHONPATH", "")]),
               ZPP_INFLIGHT_CHECK="raise", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(REPO / "pretrain_gpt.py"), *SMALLEST_FSDP_LAUNCH]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    lines = re.findall(r"\[inflight-check\] pid \d+: checked (\d+) resizes against (\d+) works, (\d+) violations", text)
    workers = [x for x in lines if int(x[1]) > 0]  # torchrun's agent issues no collectives
    assert len(workers) == 4, lines
    assert all(int(resizes) > 0 and int(v) == 0 for resizes, _, v in workers), lines
    print(f"\nMegatron-FSDP launch: {lines}")
