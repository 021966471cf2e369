"""Step ``kernels``: every CUDA kernel against its CPU reference on the same inputs.

Bit-identical where the contract says so (all of it): the five blocked-quantization ops (INT8/INT4,
fp32/bf16/fp16 in and out, nearest and stochastic rounding), the qgZ reorder, the fused
dequant+reduce+requant and dequant+reduce, the same ops with the Hadamard rotation and qWD's
dequantize_add_rows_ (SDP4Bit), ZFP (the CUDA payload equals the C++ CPU payload and zfpy's
bitstream; decoded values equal zfpy's), MPC (CUDA bytes equal the CPU and reference bytes; decode
bit-exact, each side decoding the other's payload), the container checksum, and nvCOMP round trips
when ``nvidia.nvcomp`` imports. Sizes 0, 1, odd, block-unaligned, and (not in ``--quick``) one case
per kernel family over 2^31 bytes (int32 offsets would overflow there); those are skipped with the
reason when the GPU lacks the memory or the step its time.

The CPU side: the C++ CPU kernels (which equal the pure-PyTorch reference bit for bit, as the test
suite checks), and the pure-PyTorch reference itself up to 2^20 elements. Comparisons use NaN
positions, not NaN payload bits, for decoded floats (conversions may differ in NaN payloads only).

Also runs the test suite's CUDA cases (``pytest -k "cuda or gpu"`` over tests/test_kernels.py,
test_zfp.py, test_lossless.py; quick: test_kernels.py) when pytest imports.

``--device cpu``: the same comparisons with the C++ CPU kernels as the device under test and the
pure-PyTorch reference as the oracle, a sanity run of this script without a GPU. ``--sanitize-set``:
a small set of every CUDA kernel, for ``compute-sanitizer`` (the ``sanitizer`` step).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

from _common import REPO, StepOutcome, parser, require_cuda, run_step

SEED = 0x1234_5678_9ABC  # > 32 bits: both halves of the seed reach the hash
REF_MAX_NUMEL = 1 << 20  # the pure-PyTorch reference is slow and memory-hungry beyond this
BIG = 2**31  # bytes: beyond int32 offsets


class Checker:
    """Runs named checks, one row each; an exception in a check is that row's failure."""

    def __init__(self, deadline: float | None):
        self.rows: list[dict] = []
        self.deadline = deadline

    def time_left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.time()

    def run(self, check: str, fn, **labels) -> None:
        t0 = time.perf_counter()
        row = {"check": check, **labels}
        try:
            detail = fn()
            row["status"], row["detail"] = ("pass", detail or "") if not isinstance(detail, tuple) else detail
        except SkipCase as s:
            row["status"], row["detail"] = "skipped", str(s)
        except Exception as exc:  # noqa: BLE001  (one failing case must not hide the others)
            row["status"], row["detail"] = "fail", f"{type(exc).__name__}: {str(exc)[:800]}"
        row["seconds"] = round(time.perf_counter() - t0, 3)
        self.rows.append(row)
        if row["status"] == "fail":
            print(f"FAIL {check} {labels}: {row['detail']}", flush=True)


class SkipCase(Exception):
    pass


# ---------------------------------------------------------------- helpers ---
def sample(numel: int, dtype, seed: int, device="cpu", nonfinite=False):
    """Gaussian values of mixed magnitude, a zero block at the start, NaN/Inf when asked (CPU generator,
    so the inputs do not depend on the device); big inputs are generated on ``device``."""
    import torch

    if numel > 1 << 24:
        g = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(numel, generator=g, device=device)
        x.mul_(torch.exp(torch.randn(numel, generator=g, device=device)))
    else:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g))
    if numel > 3:
        x[: min(numel, 16)] = 0.0
    if nonfinite and numel > 40:
        x[20], x[-1] = float("nan"), float("inf")
    return x.to(dtype)


def same_bytes(got, want, what: str) -> None:
    import torch

    got = got.cpu()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if not torch.equal(got, want):
        diff = (got.reshape(-1) != want.reshape(-1)).nonzero()
        raise AssertionError(f"{what}: {diff.numel()} of {want.numel()} bytes differ, first at {int(diff[0])}")


def same_floats(got, want, what: str) -> None:
    """Same bits, NaN positions equal (NaN payloads may differ)."""
    import torch

    got = got.cpu().reshape(-1)
    want = want.reshape(-1)
    nan = torch.isnan(want)
    if not torch.equal(torch.isnan(got), nan):
        raise AssertionError(f"{what}: NaN positions differ ({int(torch.isnan(got).sum())} vs {int(nan.sum())})")
    ibits = {4: torch.int32, 2: torch.int16}[want.element_size()]
    keep = ~nan
    g, w = got[keep].view(ibits), want[keep].view(ibits)
    if not torch.equal(g, w):
        diff = (g != w).nonzero()
        raise AssertionError(f"{what}: {diff.numel()} of {w.numel()} values differ in their bits")


def same_bits(got, want, what: str) -> None:
    """Lossless: every bit, NaN payloads included."""
    import torch

    got = got.cpu().reshape(-1)
    want = want.reshape(-1)
    ibits = {4: torch.int32, 2: torch.int16}[want.element_size()]
    if got.dtype != want.dtype or not torch.equal(got.view(ibits), want.view(ibits)):
        raise AssertionError(f"{what}: not bit-identical ({got.dtype} vs {want.dtype})")


def free_gpu_bytes(device) -> float:
    import torch

    if device.type != "cuda":
        return math.inf
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


# ---------------------------------------------------- blocked quantization ---
DTYPES = None  # filled in main (torch imported lazily so the CPU refusal is fast)
NAMES = {}


def quant_checks(ck: Checker, dev, small: bool, quick: bool) -> None:
    import torch

    from megatron_zpp.compression import layout, ops

    sizes = [(1, 0), (1, 1), (1, 7), (1, 4099), (3, 255), (2, 1000), (4, 65536)]
    if not quick and not small:
        sizes.append((1, 1_000_003))
    if small:
        sizes = [(1, 0), (1, 1), (1, 4099), (3, 255)]
    bitblocks = [(8, 256), (4, 128), (8, 64), (4, 40)] if not small else [(8, 256), (4, 40)]
    dtypes = DTYPES if not small else DTYPES[:2]
    for rows, length in sizes:
        for bits, block in bitblocks:
            for dtype in dtypes:
                for stochastic in (False, True) if not (quick and length > 10_000) else (True,):
                    numel = rows * length
                    x = sample(numel, dtype, seed=numel + bits, nonfinite=True)
                    rb = layout.row_bytes(length, bits, block)
                    state = {}

                    def quantize(x=x, rows=rows, rb=rb, bits=bits, block=block, stochastic=stochastic, state=state):
                        got = torch.full((rows, rb), 0xAB, dtype=torch.uint8, device=dev)  # padding overwritten?
                        ops.quantize_rows_(x.to(dev), got, bits, block, stochastic, SEED, backend="kernel")
                        want = oracle_quantize(x, rows, rb, bits, block, stochastic, dev)
                        for name, w in want.items():
                            same_bytes(got, w, f"quantize vs {name}")
                        state["packed"] = want["cpu_kernel" if "cpu_kernel" in want else "reference"]
                        return "pass", "equal to " + ", ".join(want)

                    labels = dict(dtype=NAMES[dtype], bits=bits, block=block, rows=rows, length=length,
                                  stochastic=stochastic)
                    ck.run("quantize_rows_", quantize, **labels)
                    if "packed" not in state:
                        continue
                    for out_dtype in dtypes:
                        def dequantize(packed=state["packed"], out_dtype=out_dtype, numel=numel, bits=bits,
                                       block=block):
                            got = torch.empty(numel, dtype=out_dtype, device=dev)
                            ops.dequantize_rows_(packed.to(dev), got, bits, block, backend="kernel")
                            for name, backend in oracles(dev, numel):
                                want = torch.empty(numel, dtype=out_dtype)
                                ops.dequantize_rows_(packed, want, bits, block, backend=backend)
                                same_floats(got, want, f"dequantize vs {name}")
                            return None

                        ck.run("dequantize_rows_", dequantize, **{**labels, "out_dtype": NAMES[out_dtype]})


def oracles(dev, numel: int):
    """(name, backend) of the CPU oracles for a device under test: on a GPU the C++ CPU kernels (and the
    reference when small), on CPU the reference."""
    out = []
    if dev.type != "cpu":
        out.append(("cpu_kernel", "kernel"))
    if numel <= REF_MAX_NUMEL or dev.type == "cpu":
        out.append(("reference", "reference"))
    return out


def oracle_quantize(x, rows, rb, bits, block, stochastic, dev) -> dict:
    import torch

    from megatron_zpp.compression import ops

    want = {}
    for name, backend in oracles(dev, x.numel()):
        w = torch.empty(rows, rb, dtype=torch.uint8)
        ops.quantize_rows_(x, w, bits, block, stochastic, SEED, backend=backend)
        want[name] = w
    return want


def reorder_checks(ck: Checker, dev, small: bool, quick: bool) -> None:
    import torch

    from megatron_zpp.compression import layout, ops

    topologies = [(2, 2, 1), (2, 4, 1), (3, 2, 2), (1, 4, 1)] if not small else [(2, 2, 1)]
    lengths = [0, 1, 200, 4099] if not small else [200]
    for nodes, node_size, stages in topologies:
        for length in lengths:
            for bits, block in ((8, 256), (4, 128)):
                for dtype in DTYPES if not small else DTYPES[1:2]:
                    rows = nodes * node_size * stages
                    x = sample(rows * length, dtype, seed=length + rows)

                    def reorder(x=x, rows=rows, length=length, bits=bits, block=block, topo=(nodes, node_size, stages)):
                        rb = layout.row_bytes(length, bits, block)
                        got = torch.full((rows, rb), 0xCD, dtype=torch.uint8, device=dev)
                        ops.reorder_quantize_(x.to(dev), got, bits, block, *topo, True, SEED, backend="kernel")
                        for name, backend in oracles(dev, x.numel()):
                            want = torch.empty(rows, rb, dtype=torch.uint8)
                            ops.reorder_quantize_(x, want, bits, block, *topo, True, SEED, backend=backend)
                            same_bytes(got, want, f"reorder_quantize vs {name}")
                        # and it is quantize-then-Algorithm-2 (same stochastic counter: rows only move)
                        plain = torch.empty(rows, rb, dtype=torch.uint8)
                        ops.quantize_rows_(x, plain, bits, block, True, SEED,
                                           backend="kernel" if dev.type != "cpu" else "reference")
                        slots = [layout.reorder_slot_of_input_row(i, topo[2], topo[1], topo[0]) for i in range(rows)]
                        same_bytes(got[slots], plain, "reorder_quantize rows vs quantize + Algorithm 2")
                        return None

                    ck.run("reorder_quantize_", reorder, nodes=nodes, node_size=node_size, stages=stages,
                           length=length, bits=bits, block=block, dtype=NAMES[dtype])


def check_drq(dev, packed_in, args: tuple, what: str) -> None:
    """dequant_reduce_quantize_(packed_in [C, K, rb_in], out [K, rb_out], *args) on the device against the CPU
    oracles; args = (length, bits_in, block_in, bits_out, block_out, stochastic, seed[, hadamard_in, hadamard_out])."""
    import torch

    from megatron_zpp.compression import layout, ops

    rows, rb = packed_in.shape[1], layout.row_bytes(args[0], args[3], args[4])
    got = torch.full((rows, rb), 0xEF, dtype=torch.uint8, device=dev)  # padding overwritten?
    ops.dequant_reduce_quantize_(packed_in.to(dev), got, *args, backend="kernel")
    for name, backend in oracles(dev, packed_in.numel()):
        want = torch.empty(rows, rb, dtype=torch.uint8)
        ops.dequant_reduce_quantize_(packed_in, want, *args, backend=backend)
        same_bytes(got, want, f"{what} vs {name}")


def reduce_checks(ck: Checker, dev, small: bool, quick: bool) -> None:
    import torch

    from megatron_zpp.compression import ops

    shapes = [(2, 1, 0), (2, 1, 1), (4, 2, 1000), (3, 3, 129), (8, 1, 4099)] if not small else [(3, 3, 129)]
    combos = [(4, 128, 4, 128), (8, 64, 4, 128), (4, 32, 8, 256)] if not small else [(8, 64, 4, 128)]
    for chunks, rows, length in shapes:
        for bi, bli, bo, blo in combos:
            x = sample(chunks * rows * length, torch.float32, seed=length + chunks, nonfinite=(chunks == 3))
            packed_in = ops.quantize(x, bi, bli, rows=chunks * rows, backend="reference").view(chunks, rows, -1) \
                if length else torch.empty(chunks, rows, 0, dtype=torch.uint8)
            for stochastic in (False, True):
                def drq(packed_in=packed_in, length=length, c=(bi, bli, bo, blo), stochastic=stochastic):
                    return check_drq(dev, packed_in, (length, *c, stochastic, SEED), "dequant_reduce_quantize")

                ck.run("dequant_reduce_quantize_", drq, chunks=chunks, rows=rows, length=length, bits_in=bi,
                       block_in=bli, bits_out=bo, block_out=blo, stochastic=stochastic)
            if (bi, bli) == (bo, blo) or (bi, bli) == (8, 64):
                for dtype in DTYPES if not small else DTYPES[:1]:
                    for divisor in (1.0, 3.0):
                        def dr(packed_in=packed_in, rows=rows, length=length, b=(bi, bli), dtype=dtype,
                               divisor=divisor):
                            got = torch.empty(rows * length, dtype=dtype, device=dev)
                            ops.dequant_reduce_(packed_in.to(dev), got, *b, divisor, backend="kernel")
                            for name, backend in oracles(dev, packed_in.numel()):
                                want = torch.empty(rows * length, dtype=dtype)
                                ops.dequant_reduce_(packed_in, want, *b, divisor, backend=backend)
                                same_floats(got, want, f"dequant_reduce vs {name}")
                            return None

                        ck.run("dequant_reduce_", dr, chunks=chunks, rows=rows, length=length, bits=bi, block=bli,
                               dtype=NAMES[dtype], divisor=divisor)


# ------------------------------------------- Hadamard rotation and qWD add ---
def hadamard_checks(ck: Checker, dev, small: bool, quick: bool) -> None:
    """SDP4Bit's ops (issue 23): the five blocked ops with the Hadamard rotation (hadamard=H; the fused
    reduce with the rotation on either side or both) and qWD's decode-and-add (dequantize_add_rows_), each
    against the CPU oracles. Block/run pairs that take the CPU's vector loops (runs of 8..32, blocks of 32k)
    and ones that do not (runs of 2, blocks of 40), lengths with a partial last block and a partial last run.
    On CUDA, blocks <= 2048 and runs <= 256 rotate in the kernels' registers; (4, 4096, 32) and (8, 1024, 512)
    take the composed fp32 passes (quantizing, resp. decoding), so both paths run."""
    import torch

    from megatron_zpp.compression import layout, ops

    cases = [(4, 128, 32), (8, 256, 64), (4, 2048, 32), (8, 512, 8), (4, 40, 8), (4, 64, 2), (4, 4096, 32),
             (8, 1024, 512)]
    shapes = [(4, 1031), (2, 4096)] + ([] if quick else [(1, 200_003)])
    if small:
        cases, shapes = [(4, 128, 32), (4, 40, 8), (4, 4096, 32)], [(4, 1031)]
    for bits, block, h in cases:
        for rows, length in shapes:
            for dtype in DTYPES if not small else DTYPES[:2]:
                x = sample(rows * length, dtype, seed=length + h, nonfinite=True)
                rb = layout.row_bytes(length, bits, block)
                labels = dict(bits=bits, block=block, hadamard=h, rows=rows, length=length, dtype=NAMES[dtype])
                for stochastic in (False, True):
                    def quantize(x=x, rows=rows, rb=rb, bits=bits, block=block, h=h, stochastic=stochastic):
                        got = torch.full((rows, rb), 0xAB, dtype=torch.uint8, device=dev)
                        ops.quantize_rows_(x.to(dev), got, bits, block, stochastic, SEED, h, backend="kernel")
                        for name, backend in oracles(dev, x.numel()):
                            want = torch.empty(rows, rb, dtype=torch.uint8)
                            ops.quantize_rows_(x, want, bits, block, stochastic, SEED, h, backend=backend)
                            same_bytes(got, want, f"quantize hadamard={h} vs {name}")
                        if rows == 4:  # qgZ's reordered quantize, 2 nodes x 2 ranks
                            got = torch.full((rows, rb), 0xAB, dtype=torch.uint8, device=dev)
                            ops.reorder_quantize_(x.to(dev), got, bits, block, 2, 2, 1, stochastic, SEED, h,
                                                  backend="kernel")
                            for name, backend in oracles(dev, x.numel()):
                                want = torch.empty(rows, rb, dtype=torch.uint8)
                                ops.reorder_quantize_(x, want, bits, block, 2, 2, 1, stochastic, SEED, h,
                                                      backend=backend)
                                same_bytes(got, want, f"reorder_quantize hadamard={h} vs {name}")
                        return None

                    ck.run("quantize_rows_+hadamard, reorder_quantize_", quantize, **labels, stochastic=stochastic)
                packed = ops.quantize(x.float(), bits, block, rows=rows, hadamard=h, backend="reference")

                def decode(packed=packed, x=x, bits=bits, block=block, h=h):
                    got = torch.empty(x.numel(), dtype=x.dtype, device=dev)
                    ops.dequantize_rows_(packed.to(dev), got, bits, block, hadamard=h, backend="kernel")
                    added = x.clone().nan_to_num_(0.0, 1.0, -1.0).to(dev)
                    ops.dequantize_add_rows_(packed.to(dev), added, bits, block, h, backend="kernel")
                    for name, backend in oracles(dev, x.numel()):
                        want = torch.empty(x.numel(), dtype=x.dtype)
                        ops.dequantize_rows_(packed, want, bits, block, hadamard=h, backend=backend)
                        same_floats(got, want, f"dequantize hadamard={h} vs {name}")
                        want = x.clone().nan_to_num_(0.0, 1.0, -1.0)
                        ops.dequantize_add_rows_(packed, want, bits, block, h, backend=backend)
                        same_floats(added, want, f"dequantize_add_rows_ vs {name}")
                    return None

                ck.run("dequantize_rows_+hadamard, dequantize_add_rows_", decode, **labels)
            if rows % 2:
                continue
            packed_in = ops.quantize(sample(rows * length, torch.float32, seed=h), bits, block, rows=rows,
                                     hadamard=h, backend="reference").view(2, rows // 2, -1)
            # in then out rotations (a different pair too: the fused kernel rotates twice)
            for h_in, h_out in ((0, h), (h, 0), (h, h)) + (((8 if h > 8 else 2), h),) * (h > 2):
                def drq(packed_in=packed_in, length=length, bits=bits, block=block, io=(h_in, h_out)):
                    return check_drq(dev, packed_in, (length, bits, block, 4, 2 * block, False, SEED, *io),
                                     f"dequant_reduce_quantize hadamard {io}")

                ck.run("dequant_reduce_quantize_+hadamard", drq, bits=bits, block=block, hadamard_in=h_in,
                       hadamard_out=h_out, rows=rows, length=length)

            def dr(packed_in=packed_in, length=length, bits=bits, block=block, h=h):
                k = packed_in.shape[1]
                got = torch.empty(k * length, dtype=torch.bfloat16, device=dev)
                ops.dequant_reduce_(packed_in.to(dev), got, bits, block, 2.0, h, backend="kernel")
                for name, backend in oracles(dev, packed_in.numel()):
                    want = torch.empty(k * length, dtype=torch.bfloat16)
                    ops.dequant_reduce_(packed_in, want, bits, block, 2.0, h, backend=backend)
                    same_floats(got, want, f"dequant_reduce hadamard={h} vs {name}")
                return None

            ck.run("dequant_reduce_+hadamard", dr, bits=bits, block=block, hadamard=h, rows=rows, length=length)


# ------------------------------------------------------------------- ZFP ---
def zfp_checks(ck: Checker, dev, small: bool, quick: bool) -> None:
    import numpy as np
    import torch

    from megatron_zpp.compression import get_codec, zfp_reference

    try:
        import zfpy  # noqa: F401
        no_zfpy = None
    except ImportError as exc:
        no_zfpy = f"zfpy does not import ({exc}): the kit installs it"
    sizes = [0, 1, 17, 4099, 100_003] if not small else [1, 4099]
    specs = [(r, d) for r in (4, 8, 16, 32) for d in (1, 2, 3)] if not small else [(8, 3), (16, 1)]
    for rate, dims in specs:
        codec = get_codec(f"zfp:rate={rate},dims={dims}")
        for n in sizes:
            for dtype in DTYPES if not small else DTYPES[:1]:
                for nonfinite in (False, True) if n > 40 else (False,):
                    x = sample(n, dtype, seed=n + rate + dims, nonfinite=nonfinite)

                    def zfp(x=x, codec=codec, n=n, rate=rate, dims=dims, dtype=dtype, nonfinite=nonfinite):
                        got = codec.encode(x.to(dev))
                        if got.payload.device.type != dev.type:
                            raise AssertionError(f"payload on {got.payload.device}, expected {dev}")
                        compared = []
                        if dev.type != "cpu":
                            same_bytes(got.payload, codec.encode(x).payload, "zfp payload vs C++ CPU kernel")
                            compared.append("cpu_kernel")
                        ref = zfp_reference.encode(x, dims, codec.maxbits) if no_zfpy is None else None
                        if ref is not None:
                            same_bytes(got.payload, ref, "zfp payload vs zfpy reference (with the NaN marker)")
                            compared.append("zfpy_reference")
                        y = codec.decode(got)
                        y_cpu = codec.decode(dataclass_replace(got, payload=got.payload.cpu()))
                        same_floats(y, y_cpu, "zfp decode vs C++ CPU decode")
                        if no_zfpy is None and not nonfinite and n and dtype == torch.float32:
                            stream = zfp_reference.zfpy_stream(x.numpy(), rate, dims)
                            same_bytes(got.payload, torch.frombuffer(bytearray(stream), dtype=torch.uint8),
                                       "zfp payload vs zfpy's bitstream")
                            vals = torch.from_numpy(np.asarray(zfp_reference.zfpy_values(stream, n, rate, dims)))
                            same_floats(y, vals, "zfp decode vs zfpy's decode")
                            compared.append("zfpy_bitstream")
                        return "pass", "equal to " + ", ".join(compared) + ("" if no_zfpy is None else f"; {no_zfpy}")

                    ck.run("zfp", zfp, rate=rate, dims=dims, numel=n, dtype=NAMES[dtype], nonfinite=nonfinite)


def dataclass_replace(packed, **changes):
    import dataclasses

    return dataclasses.replace(packed, **changes)


# ------------------------------------------------------------------- MPC ---
def mpc_inputs(kind: str, n: int, dtype, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    if kind == "bits":  # every bit pattern: NaN payloads, Inf, subnormals, -0.0
        width = 32 if dtype == torch.float32 else 16
        ints = {32: torch.int32, 16: torch.int16}[width]
        return torch.randint(-(1 << (width - 1)), 1 << (width - 1), (n,), generator=g).to(ints).view(dtype)
    x = torch.randn(n, generator=g)
    return (torch.relu(x) if kind == "relu" else x * 3).to(dtype)


def mpc_checks(ck: Checker, dev, small: bool, quick: bool) -> None:
    import torch

    from megatron_zpp.compression import container
    from megatron_zpp.compression.mpc import MpcCodec, MpcConfig

    sizes = [0, 1, 33, 1025, 70_001] + ([] if quick or small else [1_000_003])
    if small:
        sizes = [1, 5000]
    for dim in (1, 3) if not small else (1,):
        codec = MpcCodec(MpcConfig(dim=dim), f"mpc:dim={dim}", backend="kernel")
        ref = MpcCodec(MpcConfig(dim=dim), f"mpc:dim={dim}", backend="reference")
        for dtype in DTYPES if not small else DTYPES[:2]:
            for kind in ("randn", "relu", "bits") if not small else ("randn",):
                for n in sizes:
                    x = mpc_inputs(kind, n, dtype, seed=n + dim)

                    def mpc(x=x, codec=codec, ref=ref, n=n):
                        got = codec.encode(x.to(dev))
                        length = codec.payload_nbytes(got)
                        payload = got.payload[:length].cpu()
                        compared = []
                        if dev.type != "cpu":
                            same_bytes(payload, codec.encode(x).payload, "mpc payload vs C++ CPU kernel")
                            compared.append("cpu_kernel")
                        if n <= REF_MAX_NUMEL:
                            same_bytes(payload, ref.encode(x).payload, "mpc payload vs reference")
                            compared.append("reference")
                        same_bits(codec.decode(got), x, "mpc round trip")
                        cross = codec.decode(dataclass_replace(got, payload=codec.encode(x).payload.to(dev)))
                        same_bits(cross, x, "mpc decode of the C++ CPU kernel's bytes")
                        chk = int(torch.ops.megatron_zpp.container_checksum(got.payload[:length]))
                        if chk != container.checksum_reference(payload):
                            raise AssertionError("container_checksum differs from the reference")
                        return "pass", "equal to " + ", ".join(compared) + "; round trip bit-exact"

                    ck.run("mpc", mpc, dim=dim, dtype=NAMES[dtype], kind=kind, numel=n)


# ---------------------------------------------------------------- nvCOMP ---
def nvcomp_checks(ck: Checker, dev, small: bool, quick: bool) -> None:
    from megatron_zpp.compression import get_codec

    if dev.type != "cuda":
        ck.run("nvcomp", lambda: ("skipped", "nvCOMP runs on CUDA tensors only"))
        return
    try:
        from nvidia import nvcomp  # noqa: F401
    except ImportError as exc:
        ck.run("nvcomp", lambda: ("skipped", f"nvidia.nvcomp does not import ({exc}); pip install "
                                             "nvidia-nvcomp-cu13 (the 'gpu' extra) to check it"))
        return
    for algo in ("ans", "bitcomp", "cascaded", "lz4", "zstd", "gdeflate") if not small else ("ans",):
        codec = get_codec(f"nvcomp:algo={algo}")
        for dtype in DTYPES:
            for n in (0, 1, 33, 70_001) + (() if quick or small else (1_000_003,)):
                for kind in ("randn", "bits"):
                    x = mpc_inputs(kind, n, dtype, seed=n)

                    def nv(x=x, codec=codec, n=n, dtype=dtype):
                        packed = codec.encode(x.to(dev))
                        if packed.payload.device.type != "cuda":
                            raise AssertionError("payload left the GPU")
                        if packed.payload.numel() > codec.wire_bytes(n, dtype):
                            raise AssertionError(f"payload {packed.payload.numel()} > wire_bytes "
                                                 f"{codec.wire_bytes(n, dtype)}")
                        same_bits(codec.decode(packed), x, "nvcomp round trip")
                        ratio = x.numel() * x.element_size() / max(packed.payload.numel(), 1)
                        return "pass", f"round trip bit-exact, ratio {ratio:.3f}"

                    ck.run("nvcomp", nv, algo=algo, dtype=NAMES[dtype], numel=n, kind=kind)


# --------------------------------------------------------- > 2^31 bytes ---
def big_checks(ck: Checker, dev) -> None:
    """One case per kernel family whose buffers pass 2^31 bytes, against the C++ CPU kernels."""
    import torch

    from megatron_zpp.compression import get_codec, layout, ops

    def guarded(name, need_bytes, fn, **labels):
        def run():
            if ck.time_left() < 90:
                raise SkipCase(f"skipped: {ck.time_left():.0f} s left of the step's limit")
            free = free_gpu_bytes(dev)
            if free < need_bytes:
                raise SkipCase(f"skipped: needs ~{need_bytes / 2**30:.1f} GiB of GPU memory, {free / 2**30:.1f} free")
            try:
                return fn()
            finally:
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
        ck.run(name, run, big=True, **labels)

    def quant(dtype, bits, block, numel):
        x = sample(numel, dtype, seed=7, device=dev, nonfinite=True)
        assert x.numel() * x.element_size() > BIG
        rb = layout.row_bytes(numel, bits, block)
        got = torch.empty(1, rb, dtype=torch.uint8, device=dev)
        ops.quantize_rows_(x, got, bits, block, True, SEED, backend="kernel")
        xc = x.cpu()
        want = torch.empty(1, rb, dtype=torch.uint8)
        ops.quantize_rows_(xc, want, bits, block, True, SEED, backend="kernel")
        same_bytes(got, want, "quantize (big) vs C++ CPU kernel")
        del x, xc
        y = torch.empty(numel, dtype=dtype, device=dev)
        ops.dequantize_rows_(got, y, bits, block, backend="kernel")
        yc = torch.empty(numel, dtype=dtype)
        ops.dequantize_rows_(want, yc, bits, block, backend="kernel")
        same_floats(y, yc, "dequantize (big) vs C++ CPU kernel")
        return "pass", f"{numel} elements ({numel * torch.empty((), dtype=dtype).element_size() / 2**30:.2f} GiB)"

    n_fp32 = 2**29 + 12345  # 2 GiB + 48 KiB of fp32, odd, block-unaligned
    guarded("quantize_rows_+dequantize_rows_", 3.5 * 2**31, lambda: quant(torch.float32, 8, 256, n_fp32),
            dtype="fp32", bits=8, block=256, numel=n_fp32)
    n_bf16 = 2**30 + 4097  # 2 GiB + 8 KiB of bf16: also > 2^30 elements
    guarded("quantize_rows_+dequantize_rows_", 3.0 * 2**31, lambda: quant(torch.bfloat16, 4, 128, n_bf16),
            dtype="bf16", bits=4, block=128, numel=n_bf16)

    def reorder():
        nodes, node_size, length = 2, 4, 2**27 + 3  # 8 rows: 2^30 + 24 bf16 values, > 2 GiB
        x = sample(8 * length, torch.bfloat16, seed=8, device=dev)
        rb = layout.row_bytes(length, 8, 256)
        got = torch.empty(8, rb, dtype=torch.uint8, device=dev)
        ops.reorder_quantize_(x, got, 8, 256, nodes, node_size, 1, True, SEED, backend="kernel")
        want = torch.empty(8, rb, dtype=torch.uint8)
        ops.reorder_quantize_(x.cpu(), want, 8, 256, nodes, node_size, 1, True, SEED, backend="kernel")
        same_bytes(got, want, "reorder_quantize (big) vs C++ CPU kernel")

    guarded("reorder_quantize_", 2.5 * 2**31, reorder, dtype="bf16", bits=8, block=256, numel=8 * (2**27 + 3))

    def reduce():
        chunks, length = 4, 2**29 + 1001  # packed_in: 4 INT8 rows of ~2^29 bytes, > 2 GiB in all
        rb = layout.row_bytes(length, 8, 256)
        packed_in = torch.empty(chunks, 1, rb, dtype=torch.uint8, device=dev)
        for c in range(chunks):  # each chunk quantized on its own: never the 8 GiB fp32 input at once
            x = sample(length, torch.float32, seed=20 + c, device=dev)
            ops.quantize_rows_(x, packed_in[c], 8, 256, False, 0, backend="kernel")
            del x
        assert packed_in.numel() > BIG
        pc = packed_in.cpu()
        rbo = layout.row_bytes(length, 4, 128)
        got = torch.empty(1, rbo, dtype=torch.uint8, device=dev)
        ops.dequant_reduce_quantize_(packed_in, got, length, 8, 256, 4, 128, True, SEED, backend="kernel")
        want = torch.empty(1, rbo, dtype=torch.uint8)
        ops.dequant_reduce_quantize_(pc, want, length, 8, 256, 4, 128, True, SEED, backend="kernel")
        same_bytes(got, want, "dequant_reduce_quantize (big) vs C++ CPU kernel")
        del got, want
        y = torch.empty(length, dtype=torch.float32, device=dev)
        ops.dequant_reduce_(packed_in, y, 8, 256, 4.0, backend="kernel")
        yc = torch.empty(length, dtype=torch.float32)
        ops.dequant_reduce_(pc, yc, 8, 256, 4.0, backend="kernel")
        same_floats(y, yc, "dequant_reduce (big) vs C++ CPU kernel")

    guarded("dequant_reduce_quantize_+dequant_reduce_", 2.5 * 2**31, reduce, chunks=4, numel=2**29 + 1001)

    def zfp():
        n = 2**29 + 4099  # 2 GiB of fp32; at rate 16 the stream has 2^33 bits (32-bit bit offsets overflow)
        codec = get_codec("zfp:rate=16,dims=3")
        x = sample(n, torch.float32, seed=9, device=dev, nonfinite=True)
        got = codec.encode(x)
        xc = x.cpu()
        del x
        want = codec.encode(xc)
        same_bytes(got.payload, want.payload, "zfp (big) vs C++ CPU kernel")
        same_floats(codec.decode(got), codec.decode(want), "zfp decode (big) vs C++ CPU decode")

    guarded("zfp", 3.0 * 2**31, zfp, spec="zfp:rate=16,dims=3", numel=2**29 + 4099)

    def mpc():
        n = 2**29 + 33
        codec = get_codec("mpc")
        x = sample(n, torch.float32, seed=10, device=dev)
        got = codec.encode(x)
        length = codec.payload_nbytes(got)
        xc = x.cpu()
        want = codec.encode(xc)
        same_bytes(got.payload[:length], want.payload, "mpc (big) vs C++ CPU kernel")
        same_bits(codec.decode(got), xc, "mpc round trip (big)")

    guarded("mpc", 3.5 * 2**31, mpc, spec="mpc", numel=2**29 + 33)


# ---------------------------------------------------------------- pytest ---
def pytest_cases(ck: Checker, out, quick: bool) -> dict:
    """The suite's own CUDA cases; returns the counts."""
    try:
        import pytest  # noqa: F401
    except ImportError as exc:
        ck.run("pytest", lambda: ("skipped", f"pytest does not import ({exc}); the suite's CUDA cases did not run"))
        return {}
    files = ["tests/test_kernels.py"] + ([] if quick else ["tests/test_zfp.py", "tests/test_lossless.py"])
    xml = out / "kernels-pytest.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "not slow",
           "-k", "cuda or gpu", f"--junitxml={xml}", *files]
    print("+", " ".join(cmd), flush=True)
    timeout = max(30.0, min(ck.time_left() - 150, 150 if not quick else 60))
    counts: dict = {}

    def run():
        try:
            proc = subprocess.run(cmd, cwd=REPO, timeout=timeout, text=True, capture_output=True)
        except subprocess.TimeoutExpired as exc:
            print((exc.stdout or "")[-3000:] if isinstance(exc.stdout, str) else "", flush=True)
            raise AssertionError(f"pytest ran past {timeout:.0f} s") from None
        print(proc.stdout[-5000:], proc.stderr[-2000:], sep="\n", flush=True)
        if not xml.exists():
            raise AssertionError(f"pytest exit {proc.returncode}, no junit report: {proc.stderr[-1500:]}")
        suites = ET.parse(xml).getroot()
        suites = [suites] if suites.tag == "testsuite" else list(suites)
        for key in ("tests", "failures", "errors", "skipped"):
            counts[key] = sum(int(s.get(key, 0)) for s in suites)
        failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
                  if c.find("failure") is not None or c.find("error") is not None]
        counts["failed_tests"] = failed[:50]
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        summary = (f"{counts['tests']} tests: {passed} passed, {counts['failures']} failed, "
                   f"{counts['errors']} errors, {counts['skipped']} skipped")
        if counts["tests"] == 0:
            raise AssertionError("pytest selected no tests with -k 'cuda or gpu'")
        if failed or proc.returncode not in (0,):
            raise AssertionError(f"{summary}; failing: {failed[:10]} (exit {proc.returncode})")
        return "pass", summary

    ck.run("pytest", run, files=" ".join(files))
    return counts


# ------------------------------------------------------------------ main ---
def body(args):
    global DTYPES
    deadline = float(os.environ["ZPP_GPU_CHECK_DEADLINE"]) if os.environ.get("ZPP_GPU_CHECK_DEADLINE") else None
    if args.device == "cuda":
        require_cuda("checking the CUDA kernels")
    import torch

    from megatron_zpp.compression import ops

    DTYPES = [torch.float32, torch.bfloat16, torch.float16]
    NAMES.update({torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"})
    dev = torch.device(args.device)
    if not ops.kernels_available("cpu"):
        raise StepOutcome("fail", f"the C++ CPU kernels (the oracle) are not loaded: {ops._why_unavailable(dev)}")
    if not ops.kernels_available(dev):
        raise StepOutcome("fail", f"no compiled kernels for {dev}: {ops._why_unavailable(dev)} (did the build step "
                          "pass?)")
    quick, small = args.quick, args.sanitize_set
    ck = Checker(deadline)
    t0 = time.perf_counter()
    families = [quant_checks, reorder_checks, reduce_checks, hadamard_checks, zfp_checks, mpc_checks, nvcomp_checks]
    for fam in families:
        fam(ck, dev, small, quick)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"{fam.__name__}: {len(ck.rows)} rows so far, {time.perf_counter() - t0:.1f} s", flush=True)
    counts = {}
    if dev.type == "cuda" and not small and not args.no_pytest:
        if quick:
            ck.run("pytest", lambda: ("skipped", "left out of --quick: the cases above cover the same ops"))
        else:
            counts = pytest_cases(ck, args.out, quick)
    if quick or small:
        ck.run("big (> 2^31 bytes)", lambda: ("skipped", "left out of --quick / --sanitize-set"), big=True)
    elif dev.type == "cpu":
        ck.run("big (> 2^31 bytes)", lambda: ("skipped", "the > 2^31-byte cases compare a GPU with the CPU; "
                                                         "on CPU alone they would test nothing new"), big=True)
    else:
        big_checks(ck, dev)
    by = {s: sum(r["status"] == s for r in ck.rows) for s in ("pass", "fail", "skipped")}
    figures = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "cases": len(ck.rows),
               "passed": by["pass"], "failed": by["fail"], "skipped": by["skipped"],
               "big_cases_passed": sum(r["status"] == "pass" for r in ck.rows if r.get("big")),
               "seconds": round(time.perf_counter() - t0, 1)}
    if counts:
        figures["pytest"] = {k: v for k, v in counts.items() if k != "failed_tests"}
    fails = [r for r in ck.rows if r["status"] == "fail"]
    checks = sorted({r["check"] for r in ck.rows})
    detail = (f"{by['pass']} of {len(ck.rows)} cases bit-identical to the CPU reference on {figures['device']} "
              f"({', '.join(checks)}); {by['skipped']} skipped")
    skipped_reasons = sorted({r["detail"] for r in ck.rows if r["status"] == "skipped"})
    if skipped_reasons:
        detail += ": " + "; ".join(skipped_reasons)[:1500]
    if fails:
        detail = f"{len(fails)} cases FAILED, first: {fails[0]['check']} {fails[0]['detail']}\n" + detail
        return "fail", figures, ck.rows, detail
    return "pass", figures, ck.rows, detail


def main(argv=None) -> int:
    ap = parser("kernels", __doc__)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="the device under test (cpu: C++ CPU kernels vs the reference, a sanity run)")
    ap.add_argument("--sanitize-set", action="store_true", help="a small set of every kernel (compute-sanitizer)")
    ap.add_argument("--no-pytest", action="store_true", help="leave out the test suite's CUDA cases")
    ap.add_argument("--name", default="kernels", help="result file name (the sanitizer step runs this script)")
    args, _ = ap.parse_known_args(argv)
    return run_step(args.name, body, ap, argv)


if __name__ == "__main__":
    sys.exit(main())
