"""Every CPU kernel of megatron_zpp._C once on small, awkward inputs, checked against the pure-PyTorch reference.

Small enough to run under valgrind's memcheck (docs/reliability/heap-corruption.md, section "valgrind"), which
sees what the ASan build does not: reads of uninitialised memory, and any invalid access by the *ordinary*
(uninstrumented, -O3) extension that users load. Each call also compares the kernel's bytes with the reference's,
so a run that valgrind lets through is a correctness check too.

    python tools/heapcheck/kernel_workout.py                      # plain: a few seconds
    python tools/heapcheck/valgrind.py                            # the same under memcheck, report filtered

Inputs: odd lengths (tails shorter than a block, an odd INT4 tail), every float dtype, NaN/Inf blocks,
stochastic rounding, and the fused qgZ ops with several chunks; ZFP at each dims and a fractional rate; MPC.
Exit status 1 if any kernel output differs from the reference.
"""

from __future__ import annotations

import sys

import torch

from megatron_zpp.compression import layout, ops
from megatron_zpp.compression.registry import get_codec

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LENGTHS = (1, 7, 129, 1000)


def _sample(n: int, dtype: torch.dtype, generator: torch.Generator, *, special: bool) -> torch.Tensor:
    x = torch.randn(n, generator=generator) * 3
    if special and n > 8:
        x[3], x[n // 2], x[-1] = float("nan"), float("inf"), float("-inf")
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors of one dtype and shape; NaN at the same positions (their payload bits
    may differ, as tests/test_kernels.py allows: the bf16 reference casts NaN with its sign)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a[~nan].view(bits), b[~nan].view(bits))


def quantization(failures: list[str], g: torch.Generator) -> int:
    calls = 0
    for bits, block in ((8, 64), (4, 32), (4, 128)):
        for dtype in DTYPES:
            for n in LENGTHS:
                for stochastic in (False, True):
                    x = _sample(2 * n, dtype, g, special=n > 100)
                    packed = {}
                    for backend in ("kernel", "reference"):
                        p = torch.empty(2, layout.row_bytes(n, bits, block), dtype=torch.uint8)
                        ops.quantize_rows_(x, p, bits, block, stochastic, 12345, backend=backend)
                        out = torch.empty(2 * n, dtype=dtype)
                        ops.dequantize_rows_(p, out, bits, block, backend=backend)
                        packed[backend] = (p, out)
                    calls += 2
                    what = f"quantize/dequantize bits={bits} block={block} {dtype} n={n} stochastic={stochastic}"
                    if not (_same(*(v[0] for v in packed.values())) and _same(*(v[1] for v in packed.values()))):
                        failures.append(what)
        # The fused qgZ ops: 2 nodes x 2 ranks x 2 stages, then a reduce over 3 chunks.
        for dtype in DTYPES:
            n = 8 * 37
            x = _sample(n, dtype, g, special=True)
            rows = {}
            for backend in ("kernel", "reference"):
                p = torch.empty(8, layout.row_bytes(37, bits, block), dtype=torch.uint8)
                ops.reorder_quantize_(x, p, bits, block, 2, 2, 2, True, 7, backend=backend)
                rows[backend] = p
            calls += 1
            if not _same(rows["kernel"], rows["reference"]):
                failures.append(f"reorder_quantize_ bits={bits} block={block} {dtype}")
            chunks = rows["reference"][:6].contiguous().view(3, 2, -1)  # [C=3 chunks, K=2 rows, row bytes]
            results = {}
            for backend in ("kernel", "reference"):
                requant = torch.empty(2, layout.row_bytes(37, 4, 32), dtype=torch.uint8)
                ops.dequant_reduce_quantize_(chunks, requant, 37, bits, block, 4, 32, False, 0, backend=backend)
                mean = torch.empty(2 * 37, dtype=dtype)
                ops.dequant_reduce_(chunks, mean, bits, block, 3.0, backend=backend)
                results[backend] = (requant, mean)
            calls += 2
            if not all(_same(a, b) for a, b in zip(results["kernel"], results["reference"])):
                failures.append(f"dequant_reduce(_quantize)_ bits={bits} block={block} {dtype}")
    return calls


def codecs(failures: list[str], g: torch.Generator) -> int:
    """ZFP (each dims, a fractional rate) and MPC through their codecs, kernel against reference."""
    from megatron_zpp.compression import zfp
    from megatron_zpp.compression.zfp_reference import maxbits_for_rate, payload_bytes

    calls = 0
    for dims in (1, 2, 3):
        for rate in (4, 8.5, 32):
            for dtype in DTYPES:
                for n in (5, 64, 300):
                    x = _sample(n, dtype, g, special=n > 100)
                    maxbits = maxbits_for_rate(rate, dims)
                    out = {}
                    for backend in ("kernel", "reference"):
                        payload = torch.empty(payload_bytes(n, dims, maxbits), dtype=torch.uint8)
                        zfp.zfp_encode_(x, payload, dims, maxbits, backend=backend)
                        y = torch.empty(n, dtype=dtype)
                        zfp.zfp_decode_(payload, y, dims, maxbits, backend=backend)
                        out[backend] = (payload, y)
                    calls += 2
                    if not all(_same(a, b) for a, b in zip(out["kernel"], out["reference"])):
                        failures.append(f"zfp dims={dims} rate={rate} {dtype} n={n}")
    for dim in (1, 3):
        for dtype in DTYPES:
            for n in (1, 31, 1000):
                x = _sample(n, dtype, g, special=n > 100)
                kernel = get_codec(f"mpc:dim={dim}")
                kernel.backend = "kernel"
                reference = get_codec(f"mpc:dim={dim}")
                reference.backend = "reference"
                pk, pr = kernel.encode(x), reference.encode(x)
                calls += 2
                if not (_same(pk.payload, pr.payload) and _same(kernel.decode(pk), x) and _same(kernel.decode(pr), x)):
                    failures.append(f"mpc dim={dim} {dtype} n={n}")
    return calls


def main() -> int:
    torch.set_num_threads(1)
    if not ops.kernels_available("cpu"):
        print("kernel_workout: the C++ extension did not load; build it first (pip install --no-build-isolation -e .)")
        return 2
    g = torch.Generator().manual_seed(0)
    failures: list[str] = []
    calls = quantization(failures, g) + codecs(failures, g)
    for f in failures:
        print(f"MISMATCH kernel vs reference: {f}")
    print(f"kernel_workout: {calls} kernel calls, {len(failures)} mismatches against the reference")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
