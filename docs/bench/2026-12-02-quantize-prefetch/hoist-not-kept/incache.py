import sys, time, torch
sys.path.insert(0, sys.argv[1])
from megatron_zpp.compression import ops, layout
torch.set_num_threads(int(sys.argv[2]))
n = 1 << 20
x32 = torch.randn(n); xb = x32.bfloat16()
def best(fn, k=200):
    fn(); b = 1e9
    for _ in range(k):
        t0 = time.perf_counter(); fn(); b = min(b, time.perf_counter() - t0)
    return b
out = []
p = ops.quantize(xb, 8, 256)
out.append(("q8b", n / best(lambda: ops.quantize_rows_(xb, p, 8, 256)) / 1e9))  # unchanged: the yardstick
for bits, block in ((8, 256), (4, 128)):
    ch = ops.quantize(x32, bits, block, rows=4).view(4, 1, -1)
    o = torch.empty(1, layout.row_bytes(n // 4, bits, block), dtype=torch.uint8)
    out.append((f"drq{bits}", n / 4 / best(lambda: ops.dequant_reduce_quantize_(ch, o, n // 4, bits, block, bits, block)) / 1e9))
    out.append((f"drqh{bits}", n / 4 / best(lambda: ops.dequant_reduce_quantize_(ch, o, n // 4, bits, block, bits, block, hadamard_out=32)) / 1e9))
    ch8 = ops.quantize(x32, bits, block, rows=8).view(8, 1, -1)
    o8 = torch.empty(1, layout.row_bytes(n // 8, bits, block), dtype=torch.uint8)
    out.append((f"drq{bits}x8", n / 8 / best(lambda: ops.dequant_reduce_quantize_(ch8, o8, n // 8, bits, block, bits, block)) / 1e9))
print(" ".join(f"{k}:{v:.3f}" for k, v in out), flush=True)
