"""GPU check step ``comm_cuda``: the compressed collectives (qwZ, hpZ, qgZ) on CUDA tensors.

    python tools/gpu_steps/comm_cuda.py --out DIR [--quick] [--device cpu]

Writes ``DIR/comm_cuda.json`` = {"status", "figures", "rows", "detail"}; exits 0 on pass / unsupported /
skipped, 1 on fail. Without a GPU it writes "skipped" unless ``--device cpu`` (a self-check of this
script's logic on CPU tensors, where CPU is compared with itself).

Backend. NCCL refuses two ranks on one device, so the multi-rank part runs 4 processes on the one GPU
(2 simulated nodes x 2, ``megatron_zpp.testing.run_distributed``) over gloo, whose
``all_gather_into_tensor`` and ``all_to_all_single`` (the only two backend calls the qwZ/hpZ/qgZ paths
make) take CUDA tensors: torch's ProcessGroupGloo stages them through pinned host memory on its own
stream (``all_gather_into_tensor`` is its ``allgather``, ``AsyncAllgatherCUDAWork``; ``all_to_all_single``
is ``AsyncAlltoallCUDAWork``). Each rank first probes both calls with CUDA tensors and reports the
outcome; a refusal makes the step "unsupported". NCCL at world size 1 would reach no
backend call at all (a one-member topology copies), so the NCCL-free size-1 part below covers what it
could: our own code's host syncs, strictly.

What is checked, on every rank:

1. Equality with the CPU path: each case runs with the same inputs on CPU and on the GPU (fresh codec
   objects and one rounding epoch per case, so stochastic rounding draws the same seeds) and the outputs
   must be bit-identical (the kernels' contract, ``compression/blockwise.md``: CPU and GPU agree bit for
   bit, reductions in a fixed order).
2. Ordering: async calls issued from a non-default caller stream while it is still busy producing their inputs
   (``torch.cuda._sleep`` before the producing kernel), waited out of order, outputs read right after
   ``wait()`` on the caller's stream; these and the same calls made synchronously must equal the same
   calls on CPU bit for bit (a stale read could otherwise repeat itself identically). A missing
   caller->comm or comm->caller stream dependency shows up as stale inputs or outputs. The host time of
   the first async launch is reported against the caller stream's busy time (the launch should not
   block the host; later launches do with gloo, whose ``work.wait()`` blocks the host by design).
3. Host syncs per collective in steady state: ``torch.cuda.set_sync_debug_mode("warn")`` around repeated
   calls, counting the warnings raised on the calling thread (gloo's worker threads synchronize their own
   staging streams; their warnings go to stderr, not to Python's warnings, so they are not counted, and
   "error" mode would break them). Then, on one-member topologies (no backend involved), the same calls
   under ``"error"`` mode: any host sync in our code raises and is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (the step scripts' shared result file and verdict line)

NAME = "comm_cuda"
WORLD_SIZE = 4
RANKS_PER_NODE = 2
# torch's sync-debug warning, exactly: the first switch to "warn" also warns, once per process, that the mode
# "is a prototype feature and does not yet detect all synchronizing operations" (no sync; it matched a looser text
# on the H100 and was miscounted as one).
SYNC_MESSAGE = "called a synchronizing CUDA operation"


# ----------------------------------------------------------------------------- result file
def write_result(out: Path, status: str, figures: dict, rows: list, detail: str) -> int:
    return _common.finish(out, NAME, status, figures, rows, detail)


# ----------------------------------------------------------------------------- per-rank body
def _bits(t):
    """A tensor's bit pattern, so NaNs compare equal to themselves and -0.0 differs from 0.0."""
    import torch

    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _cases(quick: bool, cpu: bool = False):
    """(name, kind, codec, intra codec, stages, dtype name, shard length) of every compared call. The CPU
    self-check's quick run keeps the small lengths: CPU against itself, only the logic is under test."""
    lengths = ((7, 1000) if cpu else (7, 1000, 65537)) if quick else (7, 1000, 65537, 1 << 20)
    cases = []
    for n in lengths:
        cases += [
            ("qwz int8 bf16", "qwz", "int8:block=256", None, 1, "bfloat16", n),
            ("qwz int4 fp32", "qwz", "int4:block=128", None, 1, "float32", n),
            ("qwz int8 stochastic fp32", "qwz", "int8:block=256,rounding=stochastic", None, 1, "float32", n),
            ("all_gather none bf16", "qwz", "none", None, 1, "bfloat16", n),
            ("hpz int8 bf16", "hpz", "int8:block=256", None, 1, "bfloat16", n),
            ("qgz int4 fp32", "qgz", "int4:block=128", None, 1, "float32", n),
            ("qgz int4/int8-intra bf16", "qgz", "int4:block=128", "int8:block=256", 1, "bfloat16", n),
            ("qgz int4 stages=2 fp32", "qgz", "int4:block=64", None, 2, "float32", n),
            ("qgz int4 stochastic fp32", "qgz", "int4:block=128,rounding=stochastic", None, 1, "float32", n),
            ("qgz none fp32", "qgz", "none", None, 1, "float32", n),
        ]
    return cases


def _run_case(topo, case, device, epoch: int, x_cpu):
    """One case on ``device``: the output tensor (on ``device``). Fresh codec objects: their call counters
    start at zero, so both devices' runs draw the same stochastic-rounding seeds in ``epoch``."""
    import torch

    from megatron_zpp.comm import HpzShard, hpz_all_gather, qgz_reduce_scatter, quantized_all_gather, \
        set_rounding_epoch
    from megatron_zpp.compression import get_codec

    name, kind, codec, intra, stages, _, n = case
    set_rounding_epoch(epoch)
    x = x_cpu.to(device)
    c = get_codec(codec)
    if kind == "qwz":
        out = torch.full((topo.size * n,), float("nan"), dtype=x.dtype, device=device)
        quantized_all_gather(out, x, topo, codec=c)
        return out
    if kind == "hpz":
        shard = HpzShard(topo, n, x.dtype, c, device=device)
        fwd = torch.full((topo.size * n,), float("nan"), dtype=x.dtype, device=device)
        quantized_all_gather(fwd, x, topo, codec=c, hpz_shard=shard)
        bwd = torch.full_like(fwd, float("nan"))
        hpz_all_gather(bwd, shard)
        if not torch.equal(_bits(fwd), _bits(bwd)):
            raise AssertionError(f"{name} n={n} on {device}: the hpZ gather differs from the forward gather")
        return bwd
    out = torch.full((n,), float("nan"), dtype=x.dtype, device=device)
    qgz_reduce_scatter(out, x, topo, codec=c, intra_codec=get_codec(intra) if intra else None, stages=stages)
    return out


def _input(case, rank: int, size: int):
    import torch

    name, kind, *_, dtype, n = case
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{n}".encode()) * 16 + rank)
    numel = size * n if kind == "qgz" else n
    # Gradient-like: normal values times a per-element magnitude spread over ~4 decades.
    x = torch.randn(numel, generator=g) * torch.exp(4 * torch.rand(numel, generator=g) - 2)
    return x.to(getattr(torch, dtype))


def _compare(topo, device, quick: bool) -> list[dict]:
    import torch

    rows = []
    for i, case in enumerate(_cases(quick, cpu=device.type == "cpu")):
        x = _input(case, topo.rank, topo.size)
        ref = _run_case(topo, case, torch.device("cpu"), 1000 + i, x)
        got = _run_case(topo, case, device, 1000 + i, x)
        same = bool(torch.equal(_bits(ref), _bits(got)))
        finite = torch.isfinite(ref.float()) & torch.isfinite(got.float().cpu())
        diff = float((ref.float() - got.float().cpu())[finite].abs().max()) if finite.any() else 0.0
        rows.append({"check": "equal_to_cpu", "case": case[0], "length": case[6], "rank": topo.rank,
                     "bit_identical": same, "max_abs_diff": diff})
    return rows


def _busy_cycles(ms: float) -> int:
    """GPU clock cycles of ``torch.cuda._sleep`` that keep a stream busy for about ``ms``."""
    import torch

    probe = 1 << 24
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / max(start.elapsed_time(end), 1e-3))


def _ordering(topo, device, quick: bool) -> tuple[list[dict], dict]:
    """Async calls whose inputs the caller's stream is still producing, waited out of order; their results
    and the synchronous ones against the same calls on CPU."""
    import torch

    from megatron_zpp.comm import qgz_reduce_scatter, quantized_all_gather, set_rounding_epoch
    from megatron_zpp.compression import get_codec

    size, n = topo.size, (1000 if quick else 65537)
    g = torch.Generator().manual_seed(77 + topo.rank)
    srcs = [torch.randn(size * n, generator=g) for _ in range(3)]
    specs = ("int4:block=128", "int8:block=256", "int4:block=128,rounding=stochastic")
    cuda = device.type == "cuda"
    busy_ms = 50.0
    cycles = _busy_cycles(busy_ms) if cuda else 0

    def issue(dev, async_op: bool):
        set_rounding_epoch(5000)
        codecs = [get_codec(s) for s in specs]
        on_dev = [s.to(dev) for s in srcs]
        outs = [torch.full((n,), float("nan"), device=dev), torch.full((size * n,), float("nan"), device=dev),
                torch.full((n,), float("nan"), device=dev)]
        if dev.type == "cuda":
            torch.cuda._sleep(cycles)  # the caller's stream is busy; the inputs below come after
        inputs = [s * 1.0 for s in on_dev]  # produced on the caller's stream after the busy period
        t0 = time.perf_counter()
        handles = [qgz_reduce_scatter(outs[0], inputs[0], topo, codec=codecs[0], async_op=async_op)]
        first_launch = time.perf_counter() - t0
        handles.append(quantized_all_gather(outs[1], inputs[1][:n], topo, codec=codecs[1], async_op=async_op))
        handles.append(qgz_reduce_scatter(outs[2], inputs[2], topo, codec=codecs[2], async_op=async_op))
        if async_op:
            for h in (handles[2], handles[0], handles[1]):  # out of issue order
                h.wait()
        # Read on the caller's stream right after wait(): must see the finished outputs.
        snapshot = [o.clone() for o in outs]
        del inputs  # freed while the comm stream may still use them: record_stream must keep them alive
        return snapshot, first_launch

    expected, _ = issue(torch.device("cpu"), False)
    # The caller runs on a stream of its own: gloo's worker thread makes the *default* stream wait for each
    # work's copy-back, which would hide a missing dependency of a caller on the default stream.
    with torch.cuda.stream(torch.cuda.Stream()) if cuda else contextlib.nullcontext():
        sync_outs, _ = issue(device, False)
        async_outs, first_launch = issue(device, True)
    if cuda:
        torch.cuda.synchronize()
    rows = []
    for mode, outs in (("sync", sync_outs), ("async_out_of_order", async_outs)):
        rows += [{"check": "ordering", "mode": mode, "call": i, "rank": topo.rank,
                  "bit_identical": bool(torch.equal(_bits(o), _bits(e)))} for i, (o, e) in enumerate(zip(outs,
                                                                                                          expected))]
    figures = {"first_async_launch_host_ms": first_launch * 1e3, "caller_stream_busy_ms": busy_ms if cuda else 0.0}
    return rows, figures


def _steady_calls(topo, device, n: int):
    """name -> a closure running one steady-state call (sync, then an async one waited)."""
    import torch

    from megatron_zpp.comm import HpzShard, hpz_all_gather, qgz_reduce_scatter, quantized_all_gather

    size = topo.size
    x = torch.randn(size * n, device=device)
    xb = x.to(torch.bfloat16)
    y = torch.empty(n, device=device)
    gb = torch.empty(size * n, dtype=torch.bfloat16, device=device)
    shard = HpzShard(topo, n, torch.bfloat16, "int8:block=256", device=device)
    quantized_all_gather(gb, xb[:n], topo, codec="int8:block=256", hpz_shard=shard)

    def both(fn):
        def run():
            fn(False)
            fn(True).wait()
        return run

    return {
        "qwz int8": both(lambda a: quantized_all_gather(gb, xb[:n], topo, codec="int8:block=256", async_op=a,
                                                        hpz_shard=shard)),
        "hpz int8": both(lambda a: hpz_all_gather(gb, shard, async_op=a)),
        "qgz int4": both(lambda a: qgz_reduce_scatter(y, x, topo, codec="int4:block=128", async_op=a)),
        "qgz int4/int8-intra stages=2": both(lambda a: qgz_reduce_scatter(
            y, x, topo, codec="int4:block=128", intra_codec="int8:block=256", stages=2, async_op=a)),
        "qgz none": both(lambda a: qgz_reduce_scatter(y, x, topo, codec="none", async_op=a)),
        "all_gather none": both(lambda a: quantized_all_gather(gb, xb[:n], topo, codec="none", async_op=a)),
    }


def _device_sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _sync_debug(device, mode: str):
    """torch's CUDA sync debug mode for the enclosed calls; nothing on CPU (the self-check runs the calls)."""
    import torch

    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _count_syncs(topo, device, repeats: int) -> tuple[dict[str, float], dict[str, dict[str, int]], dict[str, float]]:
    """Host syncs per call on the calling thread, in "warn" mode (counted from Python's warnings), and where
    each came from: ``{case: {"file:line in function <- caller <- ...": count}}``, the Python frames that
    called into the synchronizing operation (torch turns its C++ warning into a Python one there)."""
    calls = _steady_calls(topo, device, 4099)
    for run in calls.values():  # warm-up: settings handshake, codec and stream creation
        run()
    _device_sync(device)
    counts, sites, printed_counts = {}, {}, {}
    for name, run in calls.items():
        seen: dict[str, int] = {}

        def record(message, category, filename, lineno, file=None, line=None, seen=seen):
            if SYNC_MESSAGE in str(message):
                frames = [f for f in traceback.extract_stack()[:-1]
                          if not f.filename.endswith(("warnings.py", "contextlib.py"))][-4:]
                key = " <- ".join(f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(frames))
                seen[key] = seen.get(key, 0) + 1

        # The mode is set before recording starts (its one-time prototype notice is no sync), and C++ warnings
        # raised outside Python's handler (gloo's worker threads, which stage CUDA tensors through host memory
        # on their own streams; possibly c10d's own calls) are printed to fd 2: counted there, separately.
        with _sync_debug(device, "warn"), _captured_fd2() as printed:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                for _ in range(repeats):
                    run()
        counts[name] = sum(seen.values()) / (2 * repeats)
        printed_counts[name] = printed["text"].count(SYNC_MESSAGE) / (2 * repeats)
        if seen:
            sites[name] = seen
    _device_sync(device)
    return counts, sites, printed_counts


@contextlib.contextmanager
def _captured_fd2():
    """What native code writes to fd 2 inside the block, as ``box["text"]`` afterwards (fd 2 restored)."""
    sys.stderr.flush()
    saved = os.dup(2)
    box: dict[str, str] = {}
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box["text"] = tmp.read().decode(errors="replace")


def _strict_size1(device) -> dict[str, str]:
    """The same calls on one-member topologies (no backend call) under sync debug mode "error"."""
    import torch.distributed as dist

    from megatron_zpp.comm import Topology

    me = dist.get_rank()
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    topo = Topology(groups[me], ranks_per_node=1)
    calls = _steady_calls(topo, device, 4099)
    for run in calls.values():
        run()
    _device_sync(device)
    result = {}
    for name, run in calls.items():
        try:
            with _sync_debug(device, "error"):
                run()
            result[name] = "no host sync"
        except RuntimeError as e:
            result[name] = f"host sync: {str(e).splitlines()[0]}"
    _device_sync(device)
    return result


def _probe_gloo_cuda(device) -> dict[str, str]:
    """Whether this gloo build takes CUDA tensors in the two calls the collectives make."""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size()
    outcome = {}
    for name, fn in (
            ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(
                torch.empty(size * 4, device=device), torch.full((4,), float(dist.get_rank()), device=device))),
            ("all_to_all_single", lambda: dist.all_to_all_single(
                torch.empty(size * 4, device=device), torch.full((size * 4,), float(dist.get_rank()), device=device)))):
        try:
            fn()
            outcome[name] = "ok"
        except Exception as e:  # noqa: BLE001 (the probe reports whatever the backend raised)
            outcome[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return outcome


def rank_main(device_name: str, quick: bool) -> dict:
    import torch

    from megatron_zpp.comm import Topology

    device = torch.device(device_name)
    result: dict = {"rank": None, "rows": [], "figures": {}, "probe": {}}
    if device.type == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
        device = torch.device("cuda", 0)
    topo = Topology(None)  # 2 nodes x 2 from LOCAL_WORLD_SIZE (run_distributed)
    result["rank"] = topo.rank
    if device.type == "cuda":
        result["probe"] = _probe_gloo_cuda(device)
        if any(v != "ok" for v in result["probe"].values()):
            return result
    result["rows"] += _compare(topo, device, quick)
    rows, figures = _ordering(topo, device, quick)
    result["rows"] += rows
    result["figures"].update(figures)
    # On CPU the same calls run (no sync debug mode there): the self-check covers their code.
    syncs, sites, printed = _count_syncs(topo, device, repeats=3 if quick else 10)
    strict = _strict_size1(device)
    if device.type == "cuda":
        result["figures"]["host_syncs_per_call"], result["figures"]["strict_size1"] = syncs, strict
        result["figures"]["host_sync_sites"] = sites
        result["figures"]["native_sync_warnings_per_call"] = printed
    else:
        result["figures"]["steady_calls_run"] = sorted(syncs)
    return result


# ----------------------------------------------------------------------------- driver
def summarize(results: list[dict], device: str) -> tuple[str, dict, list, str]:
    rows = [r for res in results for r in res["rows"]]
    probe = results[0]["probe"] if results else {}
    figures: dict = {"device": device, "world_size": len(results), "ranks_per_node": RANKS_PER_NODE,
                     "backend": "gloo", "gloo_cuda_probe": probe}
    if probe and any(v != "ok" for v in probe.values()):
        return "unsupported", figures, rows, f"gloo refuses CUDA tensors in this torch build: {probe}"
    compared = [r for r in rows if r["check"] == "equal_to_cpu"]
    ordered = [r for r in rows if r["check"] == "ordering"]
    mismatched = sorted({(r["case"], r["length"]) for r in compared if not r["bit_identical"]})
    disordered = [r for r in ordered if not r["bit_identical"]]
    figures.update({"cases_compared": len(compared), "cases_bit_identical": len(compared) - len(
        [r for r in compared if not r["bit_identical"]]), "ordering_checks": len(ordered),
        "ordering_mismatches": len(disordered)})
    per_rank = [res["figures"] for res in results]
    if per_rank and "first_async_launch_host_ms" in per_rank[0]:
        figures["first_async_launch_host_ms_max"] = max(f["first_async_launch_host_ms"] for f in per_rank)
        figures["caller_stream_busy_ms"] = per_rank[0]["caller_stream_busy_ms"]
    if per_rank and "steady_calls_run" in per_rank[0]:
        figures["steady_calls_run"] = per_rank[0]["steady_calls_run"]
    syncs = [f["host_syncs_per_call"] for f in per_rank if "host_syncs_per_call" in f]
    if syncs:
        figures["host_syncs_per_call"] = {k: max(s[k] for s in syncs) for k in syncs[0]}
        figures["strict_size1"] = per_rank[0]["strict_size1"]
        figures["host_sync_sites"] = {f"rank{i}": f["host_sync_sites"] for i, f in enumerate(per_rank)
                                      if f.get("host_sync_sites")}
        native = [f["native_sync_warnings_per_call"] for f in per_rank if "native_sync_warnings_per_call" in f]
        if native:  # reported, not judged: they include gloo's own staging syncs, which NCCL does not have
            figures["native_sync_warnings_per_call"] = {k: max(n[k] for n in native) for k in native[0]}
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} (case, length) pairs differ from the CPU path: {mismatched[:6]}")
    if disordered:
        problems.append(f"{len(disordered)} results of calls issued behind a busy caller stream differ from the "
                        f"CPU path (stream ordering): {[(r['mode'], r['call']) for r in disordered][:6]}")
    if syncs and any(v for v in figures["host_syncs_per_call"].values()):
        problems.append(f"host syncs on the hot path: {figures['host_syncs_per_call']}, from "
                        f"{figures['host_sync_sites']}")
    if syncs and any(v != "no host sync" for v in figures["strict_size1"].values()):
        problems.append(f"host syncs on one-member topologies: {figures['strict_size1']}")
    if problems:
        return "fail", figures, rows, "; ".join(problems)
    return "pass", figures, rows, (
        f"{len(compared)} calls bit-identical to the CPU path on {len(results)} ranks (gloo, {device} tensors); "
        f"{len(ordered)} results of calls behind a busy caller stream (sync, and async waited out of order) equal "
        "to the CPU path; " + ("no host syncs raised on the calling thread through Python (sync warnings printed "
                               f"by native code, gloo's worker threads included, per call: "
                               f"{figures.get('native_sync_warnings_per_call')})" if syncs else "sync counting needs CUDA"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: self-check of this script's logic on CPU tensors (CPU compared with itself)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before every rank is stopped (default 170, --quick 85: the step's limits are 3 "
                        "and ~1.5 minutes)")
    a = p.parse_args(argv)

    import torch

    if a.device == "cuda":
        if not torch.cuda.is_available():
            return write_result(a.out, "skipped", {}, [], "no CUDA device (torch.cuda.is_available() is False)")
        from megatron_zpp.compression import ops

        if not ops.kernels_available("cuda"):
            return write_result(a.out, "fail", {}, [], "the CUDA kernels are not built: "
                                + ops._why_unavailable(torch.device("cuda")))
    from megatron_zpp.testing import run_distributed

    wall = a.timeout or (85.0 if a.quick else 170.0) * (3 if a.device == "cpu" else 1)
    start = time.monotonic()
    try:
        results = run_distributed(rank_main, WORLD_SIZE, a.device, a.quick, ranks_per_node=RANKS_PER_NODE,
                                  timeout_s=60.0, wall_limit_s=wall)
    except Exception as e:  # noqa: BLE001 (a failing rank's traceback is the step's detail)
        return write_result(a.out, "fail", {"device": a.device, "seconds": time.monotonic() - start}, [],
                            f"{type(e).__name__}: {e}"[-4000:])
    status, figures, rows, detail = summarize(results, a.device)
    figures["seconds"] = time.monotonic() - start
    if a.device == "cpu":
        detail = "self-check on CPU (CPU compared with itself): " + detail
    return write_result(a.out, status, figures, rows, detail)


if __name__ == "__main__":
    sys.exit(main())
