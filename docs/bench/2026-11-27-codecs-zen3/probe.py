# In-cache vs cold rates of the goal ops (GB/s as bench_codecs counts them).
# Usage: probe.py [CHECKOUT] [THREADS] [OPS] [SIZES]: CHECKOUT (default: this repository) has its extension built
# in place; OPS and SIZES comma-separated.
import sys, time, statistics, torch
from pathlib import Path
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[3]))
import megatron_zpp.compression.ops as ops  # noqa
from megatron_zpp.compression import layout
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
torch.set_num_threads(threads)
sel = sys.argv[3].split(",") if len(sys.argv) > 3 else None
def rate(fn, nbytes, numel):
    reps = max(3, int(2e8 // max(numel, 1)))
    fn()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps): fn()
        ts.append((time.perf_counter() - t) / reps)
    return nbytes / statistics.median(ts) / 1e9
for numel in [int(s) for s in (sys.argv[4] if len(sys.argv) > 4 else "1048576,16777216").split(",")]:
    for bits in (8, 4):
        block = 256 if bits == 8 else 128
        for dt in (torch.float32, torch.bfloat16):
            x = torch.randn(numel).to(dt)
            packed = ops.quantize(x, bits, block)
            rot = torch.empty_like(packed)
            xb, pb = numel * x.element_size(), packed.numel()
            cases = [("quantize", xb + pb, lambda: ops.quantize_rows_(x, packed, bits, block)),
                     ("quantize_h", xb + pb, lambda: ops.quantize_rows_(x, rot, bits, block, hadamard=32))]
            cases.append(("dequantize", pb + xb, lambda: ops.dequantize_rows_(packed, x, bits, block)))
            if dt == torch.float32:
                C = 4; cl = numel // C
                chunks = ops.quantize(x, bits, block, rows=C).view(C, 1, -1)
                ro = torch.empty(1, layout.row_bytes(cl, bits, block), dtype=torch.uint8)
                cases += [("deq_red_quant", chunks.numel() + ro.numel(), lambda: ops.dequant_reduce_quantize_(chunks, ro, cl, bits, block, bits, block)),
                          ("drq_h", chunks.numel() + ro.numel(), lambda: ops.dequant_reduce_quantize_(chunks, ro, cl, bits, block, bits, block, hadamard_out=32))]
            for name, nb, fn in cases:
                if sel and name not in sel: continue
                d = "-" if name in ("deq_red_quant", "drq_h") else str(dt).split(".")[1]
                print(f"{name:14s} {bits} {d:9s} {numel:>9d} {rate(fn, nb, numel):7.2f} GB/s", flush=True)
