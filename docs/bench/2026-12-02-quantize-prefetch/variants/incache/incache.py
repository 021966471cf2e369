import sys, time, torch
sys.path.insert(0, sys.argv[1])
from megatron_zpp.compression import ops
torch.set_num_threads(int(sys.argv[2]))
n = int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 20
x32 = torch.randn(n); xb = x32.bfloat16()
def best(fn, k=200):
    fn(); b = 1e9
    for _ in range(k):
        t0 = time.perf_counter(); fn(); b = min(b, time.perf_counter() - t0)
    return b
out = []
for name, x, bits, h in (("q8f", x32, 8, 0), ("q8b", xb, 8, 0), ("q4f", x32, 4, 0), ("q4b", xb, 4, 0), ("qh8f", x32, 8, 32), ("qh4b", xb, 4, 32)):
    block = 256 if bits == 8 else 128
    p = ops.quantize(x, bits, block); kw = dict(hadamard=h) if h else {}
    out.append((name, n / best(lambda: ops.quantize_rows_(x, p, bits, block, **kw)) / 1e9))
from megatron_zpp.compression import layout
ch = ops.quantize(x32, 8, 256, rows=4).view(4, 1, -1)
o = torch.empty(1, layout.row_bytes(n // 4, 8, 256), dtype=torch.uint8)
out.append(("drq8 (unchanged)", n / 4 / best(lambda: ops.dequant_reduce_quantize_(ch, o, n // 4, 8, 256, 8, 256)) / 1e9))
print(" ".join(f"{k}:{v:.3f}" for k, v in out), flush=True)
