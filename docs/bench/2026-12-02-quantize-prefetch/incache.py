"""One thread, 1M values held in cache: G values per second (outputs, for the fused ops) of a set of ops, the
fastest of 200 calls each, on one line. The A/Bs of this folder alternate builds and compare these lines.

    python docs/bench/2026-12-02-quantize-prefetch/incache.py {quantize,quantize+yardstick,fused} [threads]

quantize: the quantize ops (parent-ab); quantize+yardstick: the same and deq_red_quant INT8, which no variant there
changes, to normalize by (variants); fused: the fused ops, quantize INT8 bf16 the yardstick (hoist-not-kept).
"""
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[3]), str(Path(__file__).resolve().parents[3] / "tools")]
from bench_codecs import timed_seconds  # noqa: E402
from megatron_zpp.compression import layout, ops  # noqa: E402

op_set = sys.argv[1]
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
cpu = torch.device("cpu")
n = 1 << 20
x32 = torch.randn(n)
xb = x32.bfloat16()


def rate(fn, values):
    return values / timed_seconds(fn, 200, cpu, stat="best") / 1e9


def drq(bits, block, rows, **kw):
    ch = ops.quantize(x32, bits, block, rows=rows).view(rows, 1, -1)
    o = torch.empty(1, layout.row_bytes(n // rows, bits, block), dtype=torch.uint8)
    return rate(lambda: ops.dequant_reduce_quantize_(ch, o, n // rows, bits, block, bits, block, **kw), n // rows)


def quantize(x, bits, hadamard=0):
    block = 256 if bits == 8 else 128
    p = ops.quantize(x, bits, block)
    kw = dict(hadamard=hadamard) if hadamard else {}
    return rate(lambda: ops.quantize_rows_(x, p, bits, block, **kw), n)


out = []
if op_set in ("quantize", "quantize+yardstick"):
    for name, x, bits, h in (("q8f", x32, 8, 0), ("q8b", xb, 8, 0), ("q4f", x32, 4, 0), ("q4b", xb, 4, 0),
                             ("qh8f", x32, 8, 32), ("qh4b", xb, 4, 32)):
        out.append((name, quantize(x, bits, h)))
    if op_set == "quantize+yardstick":
        out.append(("drq8 (unchanged)", drq(8, 256, 4)))
elif op_set == "fused":
    out.append(("q8b", quantize(xb, 8)))
    for bits, block in ((8, 256), (4, 128)):
        out += [(f"drq{bits}", drq(bits, block, 4)), (f"drqh{bits}", drq(bits, block, 4, hadamard_out=32)),
                (f"drq{bits}x8", drq(bits, block, 8))]
else:
    raise SystemExit(f"op set {op_set!r} is not valid; valid: quantize, quantize+yardstick, fused")
print(" ".join(f"{k}:{v:.3f}" for k, v in out), flush=True)
