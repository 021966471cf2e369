"""Step ``throughput``: codec throughput on the GPU as a ratio of a device-to-device copy of the same
bytes, measured in the same run.

For each op the bytes it moves (read + written) are timed against ``dst.copy_(src)`` of a uint8
buffer half that size (a copy reads and writes each byte: the same bytes moved), so
``x_copy = t_copy / t_op`` is the op's bandwidth as a fraction of the copy's. Timing: CUDA events
around ``inner`` back-to-back launches, after a warm-up and a synchronize, the median of
``repeats``; the copy and the op are interleaved per repeat so clock changes hit both alike.

Ops: INT8 (block 256) and INT4 (block 128) quantize and dequantize on bf16 and fp32 (the goal:
>= 0.8x the copy; met or missed goes in the figures, a miss does not fail the step), the qgZ
reorder and the fused reduce ops, ZFP (zfp:rate=8,dims=3) and MPC encode and decode (MPC's encode
reads its payload length: one host sync inside the timed region, as in use), and nvCOMP ANS when
it imports. The step fails only when an op raises.
"""

from __future__ import annotations

import statistics
import sys
import time

from _common import StepOutcome, parser, require_cuda, run_step

GOAL = 0.8
BLOCK = {8: 256, 4: 128}


def median_ms(fn, copy_fn, repeats: int, inner: int, cuda: bool = True) -> tuple[float, float]:
    """Median milliseconds of one ``fn()`` and of one ``copy_fn()``, CUDA events, interleaved
    (``cuda=False``: the wall clock, for the CPU self-check of this script)."""
    import torch

    for _ in range(2):  # warm-up: allocator, first-launch costs, clocks up
        fn()
        copy_fn()
    if cuda:
        torch.cuda.synchronize()
    op_ms, copy_ms = [], []
    for _ in range(repeats):
        for f, store in ((fn, op_ms), (copy_fn, copy_ms)):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
            for _ in range(inner):
                f()
            if cuda:
                end.record()
                end.synchronize()
                store.append(start.elapsed_time(end) / inner)
            else:
                store.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(op_ms), statistics.median(copy_ms)


def body(args):
    if args.device == "cuda":
        require_cuda("measuring GPU throughput")
    import torch

    from megatron_zpp.compression import get_codec, layout, ops

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if not ops.kernels_available(dev):
        raise StepOutcome("fail", f"no {dev} kernels: {ops._why_unavailable(dev)} (did the build step pass?)")
    numel = (1 << 25) if args.quick else (1 << 27)  # 128 MiB / 512 MiB of fp32: far past the L2 cache
    repeats, inner = (5, 3) if args.quick else (9, 5)
    if not cuda:  # the CPU self-check: the script's logic, not a measurement worth reporting
        numel, repeats, inner = 1 << 18, 3, 1
    rows, figures = [], {"device": torch.cuda.get_device_name(dev) if cuda else "cpu (self-check)", "numel": numel,
                         "repeats": repeats, "inner": inner, "goal_x_copy": GOAL}

    def measure(name: str, moved: int, fn, **labels):
        src = torch.empty(moved // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        try:
            op_ms, copy_ms = median_ms(fn, lambda: dst.copy_(src), repeats, inner, cuda)
            row = dict(op=name, **labels, bytes_moved=moved, ms=round(op_ms, 4), copy_ms=round(copy_ms, 4),
                       gbps=round(moved / op_ms / 1e6, 3), copy_gbps=round(moved / copy_ms / 1e6, 3),
                       x_copy=round(copy_ms / op_ms, 3), status="pass")
        except Exception as exc:  # noqa: BLE001
            row = dict(op=name, **labels, status="fail", detail=f"{type(exc).__name__}: {exc}"[:800])
        rows.append(row)
        print(row, flush=True)
        return row

    for dname, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32), ("fp16", torch.float16)):
        if args.quick and dname == "fp16":
            continue
        x = torch.randn(numel, device=dev).to(dtype)
        xb = x.numel() * x.element_size()
        for bits, block in BLOCK.items():
            packed = ops.quantize(x, bits, block, backend="kernel")
            out = torch.empty_like(x)
            pb = packed.numel()
            labels = dict(bits=bits, block=block, dtype=dname)
            q = measure("quantize", xb + pb, lambda: ops.quantize_rows_(x, packed, bits, block, backend="kernel"),
                        **labels)
            d = measure("dequantize", pb + xb, lambda: ops.dequantize_rows_(packed, out, bits, block, backend="kernel"),
                        **labels)
            if dname != "fp16":
                for r in (q, d):
                    if "x_copy" in r:
                        figures[f"int{bits}_{r['op']}_{dname}_x_copy"] = r["x_copy"]
            if dname == "bf16" and not args.quick:
                nodes, node_size = 2, 4
                rp = torch.empty(8, layout.row_bytes(numel // 8, bits, block), dtype=torch.uint8, device=dev)
                measure("reorder_quantize", xb + rp.numel(),
                        lambda: ops.reorder_quantize_(x, rp, bits, block, nodes, node_size, 1, backend="kernel"),
                        **labels)
                chunks = ops.quantize(x, bits, block, rows=4, backend="kernel").view(4, 1, -1)
                red = torch.empty(1, layout.row_bytes(numel // 4, bits, block), dtype=torch.uint8, device=dev)
                measure("dequant_reduce_quantize", chunks.numel() + red.numel(),
                        lambda: ops.dequant_reduce_quantize_(chunks, red, numel // 4, bits, block, bits, block,
                                                             backend="kernel"), **labels)
                mean = torch.empty(numel // 4, dtype=dtype, device=dev)
                measure("dequant_reduce", chunks.numel() + mean.numel() * mean.element_size(),
                        lambda: ops.dequant_reduce_(chunks, mean, bits, block, 4.0, backend="kernel"), **labels)
                del chunks, red, mean, rp
            del packed, out
        del x
        if cuda:
            torch.cuda.empty_cache()

    x = torch.randn(numel, device=dev)
    for spec in ("zfp:rate=8,dims=3", "mpc") + (() if args.quick else ("zfp:rate=16,dims=1",)):
        codec = get_codec(spec)
        try:
            packed = codec.encode(x)
            nbytes = codec.payload_nbytes(packed)
            labels = dict(spec=spec, dtype="fp32", ratio=round(x.numel() * 4 / nbytes, 3))
            e = measure("encode", x.numel() * 4 + nbytes, lambda: codec.encode(x), **labels)
            d = measure("decode", nbytes + x.numel() * 4, lambda: codec.decode(packed), **labels)
            tag = {"zfp:rate=8,dims=3": "zfp", "mpc": "mpc", "zfp:rate=16,dims=1": "zfp_r16d1"}[spec]
            for r in (e, d):
                if "gbps" in r:
                    figures[f"{tag}_{r['op']}_gbps"] = r["gbps"]
                    figures[f"{tag}_{r['op']}_x_copy"] = r["x_copy"]
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(op="encode/decode", spec=spec, status="fail", detail=f"{type(exc).__name__}: {exc}"[:800]))
    try:
        if not cuda:
            raise ImportError("nvCOMP runs on CUDA tensors only")
        from nvidia import nvcomp  # noqa: F401

        codec = get_codec("nvcomp:algo=ans")
        xb16 = x.to(torch.bfloat16)
        packed = codec.encode(xb16)
        nbytes = codec.payload_nbytes(packed)
        labels = dict(spec="nvcomp:algo=ans", dtype="bf16", ratio=round(xb16.numel() * 2 / nbytes, 3))
        measure("encode", xb16.numel() * 2 + nbytes, lambda: codec.encode(xb16), **labels)
        measure("decode", nbytes + xb16.numel() * 2, lambda: codec.decode(packed), **labels)
    except ImportError as exc:
        rows.append(dict(op="encode/decode", spec="nvcomp:algo=ans", status="skipped",
                         detail=f"nvidia.nvcomp does not import ({exc})"))

    goal_rows = [r for r in rows if r.get("op") in ("quantize", "dequantize") and r.get("dtype") in ("bf16", "fp32")]
    measured = [r for r in goal_rows if "x_copy" in r]
    missed = [r for r in measured if r["x_copy"] < GOAL]
    figures["goal_met"] = bool(measured) and not missed and len(measured) == len(goal_rows)
    figures["goal_missed_by"] = [f"int{r['bits']} {r['op']} {r['dtype']}: {r['x_copy']}x" for r in missed]
    figures["min_int_x_copy"] = min((r["x_copy"] for r in measured), default=None)
    failed = [r for r in rows if r.get("status") == "fail"]
    summary = ", ".join(f"int{r['bits']} {r['op'][:5]} {r['dtype']} {r['x_copy']}x" for r in measured)
    detail = (f"x_copy (op bandwidth / copy bandwidth, same bytes): {summary}; goal >= {GOAL}x "
              f"{'met' if figures['goal_met'] else 'MISSED'}")
    if failed:
        return "fail", figures, rows, f"{len(failed)} ops raised, first: {failed[0]}\n{detail}"
    return "pass", figures, rows, detail


if __name__ == "__main__":
    ap = parser("throughput", __doc__)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a self-check of this script's logic on small CPU tensors (no figures to report)")
    sys.exit(run_step("throughput", body, ap))
