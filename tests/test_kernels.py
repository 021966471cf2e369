"""Compiled kernels (C++ CPU; CUDA where present) equal the pure-PyTorch reference bit for bit,
and the qgZ slice reordering is ZeRO++ Algorithm 2."""

import itertools
import math
import os
import platform
import re

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_zpp.compression import layout, ops

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SEED = 0x1234_5678_9ABC  # > 32 bits: both seed halves reach the hash


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def sample(numel: int, dtype, device, nonfinite=False):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g))
    if numel > 3:
        x[numel // 3] = 0.0
        x[: min(numel, 16)] = 0.0  # a zero (or partly zero) first block
    if nonfinite and numel > 40:
        x[20], x[-1] = float("nan"), float("inf")
    return x.to(dtype).to(device)


@pytest.mark.parametrize("bits,block", [(8, 8), (8, 256), (4, 64), (4, 128), (8, 24), (4, 40)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rows,length", [(1, 1), (1, 7), (1, 4099), (3, 255), (4, 512)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_dequantize_match_reference(bits, block, dtype, rows, length, stochastic, kernel_device):
    x = sample(rows * length, dtype, kernel_device, nonfinite=True)
    rb = layout.row_bytes(length, bits, block)
    got = torch.full((rows, rb), 0xAB, dtype=torch.uint8, device=kernel_device)  # padding must be overwritten
    want = torch.empty_like(got)
    ops.quantize_rows_(x, got, bits, block, stochastic, SEED, backend="kernel")
    ops.quantize_rows_(x, want, bits, block, stochastic, SEED, backend="reference")
    assert torch.equal(got, want)
    for out_dtype in FLOAT_DTYPES:
        y_got = torch.empty(rows * length, dtype=out_dtype, device=kernel_device)
        y_want = torch.empty_like(y_got)
        ops.dequantize_rows_(got, y_got, bits, block, backend="kernel")
        ops.dequantize_rows_(got, y_want, bits, block, backend="reference")
        nan = torch.isnan(y_want)
        assert torch.equal(torch.isnan(y_got), nan)  # NaN payload bits may differ; positions may not
        assert torch.equal(bits_of(y_got[~nan]), bits_of(y_want[~nan]))


@pytest.mark.parametrize("nodes,node_size,stages", [(2, 2, 1), (2, 4, 1), (3, 2, 1), (2, 2, 2), (4, 2, 3), (1, 4, 1)])
@pytest.mark.parametrize("bits,block", [(4, 64), (8, 128)])
def test_reorder_quantize_is_quantize_then_algorithm2(nodes, node_size, stages, bits, block, kernel_device):
    rows, length = nodes * node_size * stages, 200  # rows are not block multiples: partial blocks too
    x = sample(rows * length, torch.bfloat16, kernel_device)
    rb = layout.row_bytes(length, bits, block)
    got = torch.empty(rows, rb, dtype=torch.uint8, device=kernel_device)
    want = torch.empty_like(got)
    ops.reorder_quantize_(x, got, bits, block, nodes, node_size, stages, True, SEED, backend="kernel")
    ops.reorder_quantize_(x, want, bits, block, nodes, node_size, stages, True, SEED, backend="reference")
    assert torch.equal(got, want)
    plain = torch.empty_like(got)  # same counter (element index in x): reorder only moves rows
    ops.quantize_rows_(x, plain, bits, block, True, SEED, backend="kernel")
    for i in range(rows):
        assert torch.equal(got[layout.reorder_slot_of_input_row(i, stages, node_size, nodes)], plain[i])


def algorithm2_as_printed(partition_id, stages, node_size, nodes):
    """ZeRO++ Algorithm 2 line by line, with lines 2-3 labelled as the reading that is a permutation."""
    total_devices = node_size * nodes  # 1
    chunk_id = partition_id % total_devices  # 2 (text: stageID)
    stage_id = partition_id // total_devices  # 3 (text: chunkID)
    pipeline_offset = stage_id * total_devices  # 4
    chunk_offset = chunk_id // node_size  # 5
    chunk_base = (chunk_id % node_size) * nodes  # 6
    return pipeline_offset + chunk_base + chunk_offset  # 7


@pytest.mark.parametrize("nodes,node_size,stages", list(itertools.product([1, 2, 3, 4], [1, 2, 4, 8], [1, 2, 3])))
def test_algorithm2_formula_and_bijection(nodes, node_size, stages):
    total = nodes * node_size * stages
    mapped = [layout.alg2_mapped_partition(p, stages, node_size, nodes) for p in range(total)]
    assert mapped == [algorithm2_as_printed(p, stages, node_size, nodes) for p in range(total)]
    assert sorted(mapped) == list(range(total))
    # Eq. (2) of the paper for one stage: [0, X, 2X, ..., (Y-1)X, 1, X+1, ...] (X GPUs/node, Y nodes)
    eq2 = [n * node_size + d for d in range(node_size) for n in range(nodes)]
    first_stage = [None] * (nodes * node_size)
    for p in range(nodes * node_size):
        first_stage[mapped[p]] = p
    assert first_stage == eq2
    # qgZ correctness: after the intra-node all-to-all (slot block d*Y.. goes to local rank d), local
    # rank d holds exactly the partitions owned by rank d of every node, one per node, in node order.
    for d in range(node_size):
        held = first_stage[d * nodes : (d + 1) * nodes]
        assert held == [n * node_size + d for n in range(nodes)]


def test_paper_example_two_nodes_two_gpus():
    # Figure 9: swap slices 2 and 3 (1-indexed) before the intra-node all-to-all
    slots = [layout.alg2_mapped_partition(p, 1, 2, 2) for p in range(4)]
    assert slots == [0, 2, 1, 3]
    # DeepSpeed's swizzle comment, 2 nodes x 4 GPUs: |0|1|2|3|4|5|6|7| -> |0|4|1|5|2|6|3|7|
    order = [None] * 8
    for p in range(8):
        order[layout.alg2_mapped_partition(p, 1, 4, 2)] = p
    assert order == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("chunks,rows,length", [(2, 1, 256), (4, 2, 1000), (3, 3, 129), (8, 1, 64)])
@pytest.mark.parametrize("bits_in,block_in,bits_out,block_out", [(4, 128, 4, 128), (8, 64, 4, 128), (4, 32, 8, 256)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_dequant_reduce_quantize_matches_reference(chunks, rows, length, bits_in, block_in, bits_out, block_out,
                                                   stochastic, kernel_device):
    x = sample(chunks * rows * length, torch.float32, kernel_device, nonfinite=(chunks == 3))
    packed_in = ops.quantize(x, bits_in, block_in, rows=chunks * rows).view(chunks, rows, -1)
    rb_out = layout.row_bytes(length, bits_out, block_out)
    got = torch.full((rows, rb_out), 0xCD, dtype=torch.uint8, device=kernel_device)
    want = torch.empty_like(got)
    args = (length, bits_in, block_in, bits_out, block_out, stochastic, SEED)
    ops.dequant_reduce_quantize_(packed_in, got, *args, backend="kernel")
    ops.dequant_reduce_quantize_(packed_in, want, *args, backend="reference")
    assert torch.equal(got, want)


@pytest.mark.parametrize("chunks,rows,length", [(2, 1, 256), (4, 2, 1000), (3, 3, 129)])
@pytest.mark.parametrize("bits,block", [(4, 128), (8, 256)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("divisor", [1.0, 3.0, 8.0])
def test_dequant_reduce_matches_reference_and_is_the_mean(chunks, rows, length, bits, block, dtype, divisor,
                                                          kernel_device):
    x = sample(chunks * rows * length, torch.float32, kernel_device)
    packed = ops.quantize(x, bits, block, rows=chunks * rows)
    packed_in = packed.view(chunks, rows, -1)
    got = torch.empty(rows * length, dtype=dtype, device=kernel_device)
    want = torch.empty_like(got)
    ops.dequant_reduce_(packed_in, got, bits, block, divisor, backend="kernel")
    ops.dequant_reduce_(packed_in, want, bits, block, divisor, backend="reference")
    assert torch.equal(bits_of(got), bits_of(want))
    # semantics: (sum over chunks of the decoded chunks) / divisor, in fp32 then cast
    decoded = ops.dequantize(packed, (chunks, rows * length), torch.float32, bits, block)
    expect = (decoded.sum(0) / divisor).to(dtype)
    assert torch.allclose(got.float(), expect.float(), rtol=torch.finfo(dtype).eps * chunks, atol=1e-30)


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_reduce_ops_take_empty_rows(backend, kernel_device):
    """Length 0: the reference once viewed an empty per-chunk slice, which starts at an odd byte, as fp32."""
    chunks, rows = 3, 2
    packed_in = torch.empty(chunks, rows, 0, dtype=torch.uint8, device=kernel_device)
    out = torch.empty(0, dtype=torch.float32, device=kernel_device)
    ops.dequant_reduce_(packed_in, out, 4, 128, 2.0, backend=backend)
    packed_out = torch.empty(rows, 0, dtype=torch.uint8, device=kernel_device)
    ops.dequant_reduce_quantize_(packed_in, packed_out, 0, 4, 128, 8, 64, False, SEED, backend=backend)
    assert out.numel() == 0 and packed_out.numel() == 0


def test_reduce_propagates_nan_from_one_chunk(kernel_device):
    chunks, length = 4, 512
    x = sample(chunks * length, torch.float32, kernel_device)
    x[2 * length + 300] = float("nan")  # chunk 2, block 1 (block=256)
    packed = ops.quantize(x, 4, 256, rows=chunks).view(chunks, 1, -1)
    out = torch.empty(length, device=kernel_device)
    ops.dequant_reduce_(packed, out, 4, 256, 4.0, backend="kernel")
    assert torch.isnan(out[256:]).all() and torch.isfinite(out[:256]).all()
    requant = torch.empty(1, layout.row_bytes(length, 4, 256), dtype=torch.uint8, device=kernel_device)
    ops.dequant_reduce_quantize_(packed, requant, length, 4, 256, 4, 256, backend="kernel")
    y = ops.dequantize(requant, (length,), torch.float32, 4, 256)
    assert torch.isnan(y[256:]).all() and torch.isfinite(y[:256]).all()


def test_ops_validate_arguments(kernel_device):
    x = torch.randn(100, device=kernel_device)
    packed = torch.empty(1, layout.row_bytes(100, 8, 64), dtype=torch.uint8, device=kernel_device)
    with pytest.raises(ValueError, match="bits=5 is not supported"):
        ops.quantize_rows_(x, packed, 5, 64)
    with pytest.raises(ValueError, match="block=12 must be a positive multiple of 8"):
        ops.quantize_rows_(x, packed, 8, 12)
    with pytest.raises(ValueError, match="104 bytes; rows of 100 elements at bits=8, block=64 need 108"):
        ops.quantize_rows_(x, packed[:, :-4].contiguous(), 8, 64)
    with pytest.raises(TypeError, match="torch.int32"):
        ops.quantize_rows_(x.int(), packed, 8, 64)
    with pytest.raises(ValueError, match="do not split into 3 equal rows"):
        ops.quantize_rows_(x, torch.empty(3, 8, dtype=torch.uint8, device=kernel_device), 8, 64)
    with pytest.raises(ValueError, match="stages\\*nodes\\*node_size = 4"):
        ops.reorder_quantize_(x, packed, 8, 64, 2, 2, 1)
    # the C++ op checks too, for callers that bypass the Python wrapper
    with pytest.raises(RuntimeError, match="bits=5 is not supported"):
        torch.ops.megatron_zpp.quantize_rows_(x, packed, 5, 64, False, 0)


# --------------------------------------- the reference under CUDA's arithmetic ------
# PyTorch's CUDA true-division kernel (div_true_kernel_cuda) special-cases a divisor that is a CPU
# scalar (a Python number, or a 0-dim CPU tensor): it computes inv = opmath(1) / opmath(b) once on
# the host and then a * inv in opmath (fp32 for fp32/bf16/fp16), instead of dividing. CPU kernels
# divide. CudaScalarDivision replays CUDA's rule on CPU, so the reference's bits "as on CUDA" can be
# compared with the C++ kernels on any machine.
_DIVISIONS = {"div", "divide", "true_divide", "__truediv__", "__div__"}
_INPLACE_DIVISIONS = {"div_", "divide_", "true_divide_", "__itruediv__", "__idiv__"}


def _is_cpu_scalar(b) -> bool:
    if isinstance(b, torch.Tensor):  # on CPU every tensor is a CPU tensor: rewrite every 0-dim one
        return b.dim() == 0 and b.device.type == "cpu"
    return isinstance(b, (int, float))


class CudaScalarDivision(TorchFunctionMode):
    """Computes ``tensor / cpu_scalar`` as PyTorch's CUDA kernel does: ``a * (1 / b)`` in opmath."""

    def __init__(self):
        super().__init__()
        self.rewrites = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if (name in _DIVISIONS or name in _INPLACE_DIVISIONS) and len(args) == 2 \
                and isinstance(args[0], torch.Tensor) and _is_cpu_scalar(args[1]) \
                and kwargs.get("rounding_mode") is None:
            a, b = args
            dtype = torch.result_type(a, b)
            if not dtype.is_floating_point and not dtype.is_complex:
                dtype = torch.get_default_dtype()  # true division of integers
            if dtype.is_floating_point:
                opmath = torch.float64 if dtype == torch.float64 else torch.float32
                b = b.to(opmath) if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=opmath)
                inv = torch.ones((), dtype=opmath) / b  # 1 / b, correctly rounded, on the host
                result = (a.to(opmath) * inv.to(a.device)).to(dtype)
                self.rewrites += 1
                if name in _INPLACE_DIVISIONS:
                    return a.copy_(result)
                if kwargs.get("out") is not None:
                    return kwargs["out"].copy_(result)
                return result
        return func(*args, **kwargs)


def test_cuda_scalar_division_emulation_is_reciprocal_multiply():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 100
    divided = x / torch.full_like(x, 7.0)  # true division (tensor / tensor)
    inv7 = torch.tensor(1.0) / torch.tensor(7.0)
    with CudaScalarDivision() as mode:
        y = x / 7
        y_fn = torch.div(x, 7.0)
        y_out = torch.empty_like(x)
        torch.div(x, 7, out=y_out)
        y_inplace = x.clone()
        y_inplace /= 7
        y_bf16 = x.bfloat16() / 7
        y_int = torch.arange(1, 100) / 7
        # not CPU-scalar true divisions: left alone
        tensor_tensor = x / torch.full_like(x, 7.0)
        floored = torch.div(x, 7, rounding_mode="floor")
    assert mode.rewrites == 6
    expect = x * inv7
    for got in (y, y_fn, y_out, y_inplace):
        assert torch.equal(bits_of(got), bits_of(expect))
    assert torch.equal(bits_of(y_bf16), bits_of((x.bfloat16().float() * inv7).bfloat16()))
    assert torch.equal(y_int, torch.arange(1, 100).float() * inv7)
    assert torch.equal(bits_of(tensor_tensor), bits_of(divided))
    assert torch.equal(floored, torch.floor(divided))
    # the mode is not a no-op: a * fp32(1/7) != a / 7 for a good share of fp32 inputs
    differ = int((bits_of(y) != bits_of(divided)).view(-1, 4).any(1).sum())
    assert differ > 100, differ
    if torch.cuda.is_available():  # and on a GPU, the emulation is what CUDA computes
        assert torch.equal(bits_of((x.cuda() / 7).cpu()), bits_of(y))


def packed_diff(got: torch.Tensor, want: torch.Tensor, length: int, block: int) -> str:
    """How two packed outputs differ: block scales and data bytes."""
    nb = layout.num_blocks(length, block)
    g, w = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    scales = (g[:, : 4 * nb].reshape(-1, 4) != w[:, : 4 * nb].reshape(-1, 4)).any(1)
    data = g[:, 4 * nb :] != w[:, 4 * nb :]
    return (f"{int(scales.sum())} of {scales.numel()} block scales differ, "
            f"{int(data.sum())} of {data.numel()} data bytes differ")


def float_diff(got: torch.Tensor, want: torch.Tensor) -> int:
    """Number of elements whose bits differ (NaN positions must agree; NaN payloads may not)."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    return int((got[~nan].reshape(-1, 1).view(torch.uint8) != want[~nan].reshape(-1, 1).view(torch.uint8))
               .reshape(int((~nan).sum()), -1).any(1).sum())


CUDA_ARITH_OPS = ["quantize_rows_", "reorder_quantize_", "dequantize_rows_", "dequant_reduce_quantize_",
                  "dequant_reduce_"]


@pytest.mark.parametrize("op", CUDA_ARITH_OPS)
@pytest.mark.parametrize("bits,block", [(8, 64), (4, 32)])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_reference_with_cuda_arithmetic_matches_kernel(op, bits, block, stochastic, dtype, kernel_device):
    """The block scale (and every other rounding) is defined once: the reference computed with CUDA's
    tensor-by-scalar arithmetic still equals the kernels bit for bit. ~260 blocks per case, so a
    scale computed as absmax * (1/qmax) would show up (it differs for ~5% of INT8 blocks)."""
    nodes, node_size = 2, 2
    rows, length = nodes * node_size, 4099  # partial last block too
    x = sample(rows * length, dtype, kernel_device, nonfinite=True)
    rb = layout.row_bytes(length, bits, block)
    args = dict(bits=bits, block=block)

    def run(backend):
        if op == "quantize_rows_":
            out = torch.empty(rows, rb, dtype=torch.uint8, device=kernel_device)
            ops.quantize_rows_(x, out, bits, block, stochastic, SEED, backend=backend)
        elif op == "reorder_quantize_":
            out = torch.empty(rows, rb, dtype=torch.uint8, device=kernel_device)
            ops.reorder_quantize_(x, out, bits, block, nodes, node_size, 1, stochastic, SEED, backend=backend)
        elif op == "dequantize_rows_":
            packed = ops.quantize(x, bits, block, rows=rows, stochastic=stochastic, seed=SEED, backend="kernel")
            out = torch.empty(rows * length, dtype=dtype, device=kernel_device)
            ops.dequantize_rows_(packed, out, bits, block, backend=backend)
        elif op == "dequant_reduce_quantize_":  # C=4 chunks of K=1 row; re-quantize at the other width
            packed = ops.quantize(x, bits, block, rows=rows, backend="kernel").view(rows, 1, -1)
            bits_out, block_out = (4, 32) if bits == 8 else (8, 64)
            args.update(bits=bits_out, block=block_out)
            out = torch.empty(1, layout.row_bytes(length, bits_out, block_out), dtype=torch.uint8,
                              device=kernel_device)
            ops.dequant_reduce_quantize_(packed, out, length, bits, block, bits_out, block_out, stochastic, SEED,
                                         backend=backend)
        else:  # dequant_reduce_: the mean over 4 chunks (divisor 3 is not a power of two: inexact 1/d)
            packed = ops.quantize(x, bits, block, rows=rows, stochastic=stochastic, seed=SEED,
                                  backend="kernel").view(rows, 1, -1)
            out = torch.empty(length, dtype=dtype, device=kernel_device)
            ops.dequant_reduce_(packed, out, bits, block, 3.0, backend=backend)
        return out

    got = run("kernel")
    with CudaScalarDivision():
        want = run("reference")
    if want.dtype == torch.uint8:
        assert torch.equal(got, want), packed_diff(got, want, length, args["block"])
    else:
        n = float_diff(got, want)
        assert n == 0, f"{n} of {want.numel()} elements differ"


_ARITHMETIC = {"add", "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide", "rsub", "pow",
               "fmod", "remainder", "lerp", "addcmul", "addcdiv", "__add__", "__radd__", "__sub__", "__rsub__",
               "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__rdiv__", "__pow__", "__rpow__"}


class FloatScalarArithmetic(TorchFunctionMode):
    """Records fp arithmetic where one operand is a Python number (device-dependent in general)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "").rstrip("_") or getattr(func, "__name__", "")
        if name in _ARITHMETIC or name + "_" in _ARITHMETIC:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
            if numbers and any(t.is_floating_point() for t in tensors):
                self.seen.append((name, numbers))
        return func(*args, **(kwargs or {}))


def test_reference_float_arithmetic_has_no_python_number_operands_except_exact_powers_of_two():
    """The audit behind the test above: the only fp32 op with a Python-number operand in the
    reference is the exact multiply by 2^-24 in stochastic_uniform."""
    from megatron_zpp.compression import reference

    x = sample(2 * 300, torch.bfloat16, "cpu", nonfinite=True)
    with FloatScalarArithmetic() as mode:
        for bits, block in ((8, 64), (4, 32)):
            rb = layout.row_bytes(300, bits, block)
            packed = torch.empty(2, rb, dtype=torch.uint8)
            reference.quantize_rows_(x, packed, bits, block, True, SEED)
            reference.reorder_quantize_(x, packed, bits, block, 2, 1, 1, False, SEED)
            reference.dequantize_rows_(packed, torch.empty(600), bits, block)
            reference.dequant_reduce_quantize_(packed.view(2, 1, -1), torch.empty(1, rb, dtype=torch.uint8),
                                               300, bits, block, bits, block, True, SEED)
            reference.dequant_reduce_(packed.view(2, 1, -1), torch.empty(300), bits, block, 3.0)
    suspicious = [(name, nums) for name, nums in mode.seen
                  if not (name in ("mul", "__mul__", "__rmul__") and all(math.frexp(abs(v))[0] == 0.5 for v in nums))]
    assert mode.seen, "the recorder saw nothing: is stochastic_uniform's 2^-24 multiply gone?"
    assert not suspicious, f"fp arithmetic with Python-number operands (device-dependent rounding): {suspicious}"


# ------------------------------------------------------------ dispatch ------
def test_cuda_tensor_without_cuda_kernels_raises_instead_of_falling_back(monkeypatch):
    """backend="auto" on a GPU without CUDA kernels is an error naming the device, why and the fix;
    tested on the dispatch decision, so no GPU is needed."""
    from megatron_zpp.compression import _extension, reference

    monkeypatch.setattr(ops, "kernels_available", lambda device="cpu": torch.device(device).type == "cpu")
    for backend in ("auto", "kernel"):
        with pytest.raises(RuntimeError) as info:
            ops._impl("quantize_rows_", torch.device("cuda", 1), backend)
        msg = str(info.value)
        assert "cuda:1" in msg
        assert "ZPP_BUILD_CUDA=1 pip install --no-build-isolation -e ." in msg
        assert 'backend="reference"' in msg
    if _extension.load():  # why: the extension has no CUDA kernels
        assert "built without its CUDA kernels" in msg or "has no CUDA kernels" in msg
    # why: the extension did not load at all
    monkeypatch.setattr(_extension, "load", lambda: False)
    monkeypatch.setattr(_extension, "_load_error", "megatron_zpp._C is not built (test); ZPP_JIT=0 disables the JIT build")
    with pytest.raises(RuntimeError, match=r"cuda tensors .*megatron_zpp._C is not built \(test\).*ZPP_BUILD_CUDA=1"):
        ops._impl("dequant_reduce_", torch.device("cuda"), "auto")
    # explicit reference still works, on any device
    for name in CUDA_ARITH_OPS:
        assert ops._impl(name, torch.device("cuda"), "reference") is getattr(reference, name)


def test_cpu_without_kernels_falls_back_to_the_reference_with_a_warning(monkeypatch):
    from megatron_zpp.compression import _extension, reference

    x = sample(1000, torch.float32, "cpu")
    want = ops.quantize(x, 4, 128, backend="reference")
    monkeypatch.setattr(_extension, "load", lambda: False)  # as if neither _C nor the JIT build loaded
    monkeypatch.setattr(_extension, "_load_error", "megatron_zpp._C is not built (simulated)")
    assert not ops.kernels_available("cpu")
    with pytest.warns(UserWarning, match=r"unavailable for cpu tensors, using the pure-PyTorch reference") as rec:
        got = ops.quantize(x, 4, 128)
        assert ops._impl("quantize_rows_", torch.device("cpu"), "auto") is reference.quantize_rows_
    assert torch.equal(got, want)
    msg = str(rec[0].message)
    assert "megatron_zpp._C is not built (simulated)" in msg and "pip install --no-build-isolation -e ." in msg
    with pytest.raises(RuntimeError, match="no compiled kernels for cpu tensors"):
        ops.quantize(x, 4, 128, backend="kernel")


def test_cpu_fallback_warns_when_the_extension_is_missing_and_jit_is_off(tmp_path):
    """The real path (no megatron_zpp._C, ZPP_JIT=0) in a fresh interpreter."""
    import os
    import subprocess
    import sys

    code = """
import sys, warnings
sys.modules["megatron_zpp._C"] = None  # importing it raises ImportError, as when it is not built
import torch
from megatron_zpp.compression import ops, _extension
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    packed = ops.quantize(torch.linspace(-1, 1, 300), 8, 256)
assert not ops.kernels_available("cpu")
assert torch.equal(packed, ops.quantize(torch.linspace(-1, 1, 300), 8, 256, backend="reference"))
print("WARNINGS:", [str(w.message) for w in caught])
"""
    env = dict(os.environ, ZPP_JIT="0", ZPP_EXTENSION_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "using the pure-PyTorch reference" in proc.stdout, proc.stdout
    assert "ZPP_JIT=0 disables the JIT build" in proc.stdout


# ------------------------------------------- CPU instruction-set levels ------
CPU_ISAS = list(torch.ops.megatron_zpp._cpu_isas()) if ops.kernels_available("cpu") else []


@pytest.fixture
def cpu_isa(request):
    """Runs the CPU kernels at the given instruction-set level, then restores the previous one."""
    previous = torch.ops.megatron_zpp._set_cpu_isa(request.param)
    assert torch.ops.megatron_zpp._cpu_isa() == request.param
    yield request.param
    torch.ops.megatron_zpp._set_cpu_isa(previous)


@pytest.mark.parametrize("cpu_isa", CPU_ISAS, indirect=True)
@pytest.mark.parametrize("bits,block", [(8, 256), (4, 128), (8, 24), (4, 40), (4, 512)])
def test_every_cpu_level_matches_reference(cpu_isa, bits, block):
    """The portable build's loops for each instruction-set level (baseline, AVX2, AVX-512 on x86-64)
    give the reference's bits: all five ops, fp32/bf16/fp16, nearest and stochastic."""
    rows, length = 4, 1031  # partial last block, odd length (INT4 tail nibble)
    rb = layout.row_bytes(length, bits, block)
    for dtype, stochastic in itertools.product(FLOAT_DTYPES, (False, True)):
        x = sample(rows * length, dtype, "cpu", nonfinite=True)
        outs = {}
        for backend in ("kernel", "reference"):
            q = torch.empty(rows, rb, dtype=torch.uint8)
            ops.quantize_rows_(x, q, bits, block, stochastic, SEED, backend=backend)
            r = torch.empty_like(q)
            ops.reorder_quantize_(x, r, bits, block, 2, 2, 1, stochastic, SEED, backend=backend)
            y = torch.empty(rows * length, dtype=dtype)
            ops.dequantize_rows_(q, y, bits, block, backend=backend)
            red = torch.empty(1, layout.row_bytes(length, 4, 32), dtype=torch.uint8)
            ops.dequant_reduce_quantize_(q.view(rows, 1, -1), red, length, bits, block, 4, 32, stochastic, SEED,
                                         backend=backend)
            mean = torch.empty(length, dtype=dtype)
            ops.dequant_reduce_(q.view(rows, 1, -1), mean, bits, block, 3.0, backend=backend)
            outs[backend] = (q, r, y, red, mean)
        for name, got, want in zip(("quantize", "reorder", "dequantize", "reduce_quantize", "reduce"),
                                   outs["kernel"], outs["reference"]):
            if got.dtype == torch.uint8:
                assert torch.equal(got, want), (name, dtype, stochastic)
            else:
                assert float_diff(got, want) == 0, (name, dtype, stochastic)


@pytest.mark.parametrize("cpu_isa", CPU_ISAS, indirect=True)
@pytest.mark.parametrize("bits,block", [(4, 128), (4, 40), (4, 64), (8, 256), (8, 24)])
def test_every_code_decodes_as_the_reference_at_every_level(cpu_isa, bits, block):
    """Random payloads decode to the reference's bits, so every code occurs, also the two that quantize never
    writes (INT4 -8, INT8 -128: it clamps to +-7 and +-127), which a wrong entry of a decode table would turn
    into another value: dequantize (with and without the rotation), dequant_reduce and the fused op's sums."""
    rows, length = 4, 1031  # partial last block, odd length (INT4 tail nibble)
    nb, rb = layout.num_blocks(length, block), layout.row_bytes(length, bits, block)
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randint(0, 256, (rows, rb), generator=gen, dtype=torch.uint8)
    q[:, :4 * nb] = (torch.rand(rows, nb, generator=gen) + 0.5).view(torch.uint8)  # finite scales
    codes = q[:, 4 * nb:4 * nb + length * bits // 8]
    assert (codes == (0x88 if bits == 4 else 0x80)).any()  # -8 twice / -128 among them
    outs = {}
    for backend in ("kernel", "reference"):
        ys = []
        for dtype, h in itertools.product((torch.float32, torch.bfloat16), (0, 8)):
            y = torch.empty(rows * length, dtype=dtype)
            ops.dequantize_rows_(q, y, bits, block, hadamard=h, backend=backend)
            ys.append(y)
        mean = torch.empty(length)
        ops.dequant_reduce_(q.view(rows, 1, -1), mean, bits, block, 3.0, backend=backend)
        red = torch.empty(1, layout.row_bytes(length, 8, 8), dtype=torch.uint8)
        ops.dequant_reduce_quantize_(q.view(rows, 1, -1), red, length, bits, block, 8, 8, backend=backend)
        outs[backend] = (*ys, mean, red)
    for i, (got, want) in enumerate(zip(outs["kernel"], outs["reference"])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), i


def edge_sample(bits: int, block: int, dtype) -> torch.Tensor:
    """One block per hard case of the 16-bit conversions (widening inputs, narrowing outputs), then a
    partial block of 13 (not a multiple of any vector width): exact round-to-nearest-even ties when
    decoded values are narrowed to bf16 and to fp16 (the block is k * s for k in [-qmax, qmax], so
    scale == s and every decoded value is exactly k * s), fp16 overflow to Inf, fp16 and fp32/bf16
    subnormals, values near the fp32 maximum (their sums overflow), and NaN / +-Inf."""
    qmax = 127 if bits == 8 else 7
    k = (torch.arange(block) % (2 * qmax + 1) - qmax).float()
    g = torch.Generator().manual_seed(block)
    blocks = [k * (1 + 2.0 ** -8),  # ties for bf16 (8 significant bits)
              k * (1 + 2.0 ** -11),  # ties for fp16 (11 significant bits)
              torch.randn(block, generator=g) * 7e4,  # beyond fp16's 65504
              torch.randn(block, generator=g) * 3e-6,  # fp16 subnormals
              torch.randn(block, generator=g) * 1e-39,  # fp32 / bf16 subnormals
              torch.empty(block).uniform_(1.8e38, 3.3e38, generator=g),  # doubled, overflows fp32
              torch.randn(block, generator=g),
              torch.randn(block, generator=g), torch.randn(block, generator=g)]
    blocks[6][5], blocks[7][-1], blocks[8][block // 2] = float("inf"), float("-inf"), float("nan")
    tail = torch.randn(13, generator=g)
    tail[-1] = float("nan")  # in the scalar remainder of the conversion loops
    return torch.cat(blocks + [tail]).to(dtype)


@pytest.mark.parametrize("cpu_isa", CPU_ISAS, indirect=True)
@pytest.mark.parametrize("bits,block", [(8, 256), (4, 128), (4, 40)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_16bit_conversion_edge_cases_match_reference(cpu_isa, bits, block, dtype):
    """bf16/fp16 in and out of every op at every CPU level: same bits as the reference (torch's own
    round-to-nearest-even casts), NaN stays NaN and Inf stays Inf (never zeros)."""
    x = edge_sample(bits, block, dtype)
    length, chunks = x.numel(), 2
    rb = layout.row_bytes(length, bits, block)
    outs = {}
    for backend in ("kernel", "reference"):
        q = torch.empty(1, rb, dtype=torch.uint8)
        ops.quantize_rows_(x, q, bits, block, backend=backend)
        pair = torch.empty(2, rb, dtype=torch.uint8)  # two rows (2 nodes x 1 rank: the order stays)
        ops.reorder_quantize_(torch.cat([x, x]), pair, bits, block, 2, 1, 1, backend=backend)
        decoded = []
        for out_dtype in FLOAT_DTYPES:
            y = torch.empty(length, dtype=out_dtype)
            ops.dequantize_rows_(q, y, bits, block, backend=backend)
            decoded.append(y)
        mean = torch.empty(length, dtype=dtype)
        ops.dequant_reduce_(pair.view(chunks, 1, -1), mean, bits, block, 3.0, backend=backend)
        red = torch.empty(1, rb, dtype=torch.uint8)
        ops.dequant_reduce_quantize_(pair.view(chunks, 1, -1), red, length, bits, block, bits, block,
                                     backend=backend)
        outs[backend] = [q, pair, red, mean] + decoded
    for i, (got, want) in enumerate(zip(outs["kernel"], outs["reference"])):
        if got.dtype == torch.uint8:
            assert torch.equal(got, want), (i, packed_diff(got, want, length, block))
        else:
            assert float_diff(got, want) == 0, i
            assert torch.equal(torch.isinf(got), torch.isinf(want)), i
    # the sample does reach the cases it is for (else the comparison above proves little)
    y32, ybf, y16 = outs["kernel"][4:]
    low = y32[: 2 * block].view(torch.int32)
    if dtype == torch.float32:  # decoded values exactly halfway between bf16 / fp16 neighbours
        assert ((low & 0xFFFF) == 0x8000).any() and ((low & 0x1FFF) == 0x1000).any()
    assert ((y16 != 0) & (y16.abs() < 6.1e-5)).any() and ((ybf != 0) & (ybf.abs() < 1.2e-38)).any() \
        or dtype == torch.float16  # fp16 subnormals; bf16 ones (fp16 inputs flush 1e-39 to 0)
    assert torch.isnan(outs["kernel"][3]).any()
    if dtype != torch.float16:  # fp16 inputs cannot hold values past 65504
        assert torch.isinf(y16).any() and torch.isinf(outs["kernel"][3]).any()


def test_cpu_level_selection_errors():
    with pytest.raises(RuntimeError, match="unknown CPU kernel level 'sse9'"):
        torch.ops.megatron_zpp._set_cpu_isa("sse9")
    assert torch.ops.megatron_zpp._cpu_isa() in CPU_ISAS


def _disassembly_by_function(path: str) -> dict:
    import shutil
    import subprocess

    if shutil.which("objdump") is None:
        pytest.skip("objdump not installed")
    text = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", path], capture_output=True, text=True,
                          check=True).stdout
    functions, name = {}, None
    for line in text.splitlines():
        if line.endswith(">:") and " <" in line:
            name = line[line.index(" <") + 2 : -2]
            functions[name] = []
        elif name is not None and line.startswith(" ") and ":\t" in line:  # "  addr:\tmnemonic operands"
            functions[name].append(line.split(":\t", 1)[1].strip())
    assert sum(map(len, functions.values())) > 1000, "could not parse the disassembly"
    return functions


def test_extension_is_portable_and_never_contracts_to_fma():
    """No -march=native: outside the per-level copies of the loops (which run only where the CPU has
    the instructions) the extension uses baseline instructions only, and no level uses FMA (it would
    round differently from the reference's separate multiply and add)."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("the instruction-set levels are x86-64 only")
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "megatron_zpp" in line and ".so" in line}
    assert paths, "the kernel library is not loaded"
    for path in paths:
        functions = _disassembly_by_function(path)
        fma = sorted(f for f, insns in functions.items() if any(i.startswith(("vfmadd", "vfmsub", "vfnm")) for i in insns))
        assert not fma, f"FMA instructions in {path}: {fma[:5]}"
        leveled = ("isa_x86_64_v3", "isa_x86_64_v4")
        vex = sorted(f for f, insns in functions.items() if not any(n in f for n in leveled)
                     and any(i.startswith("v") and "mm" in i for i in insns))
        assert not vex, f"AVX instructions outside the per-level loops in {path}: {vex[:5]}"
        # The AVX2 level must not use AVX-512 (zmm registers, mask registers %k0-%k7): it runs on CPUs without it.
        avx512_in_v3 = sorted(f for f, insns in functions.items() if "isa_x86_64_v3" in f
                              and any("%zmm" in i or re.search(r"%k[0-7]\b", i) for i in insns))
        assert not avx512_in_v3, f"AVX-512 instructions in the x86-64-v3 loops of {path}: {avx512_in_v3[:5]}"
        assert any("isa_x86_64_v4" in f for f in functions), "the AVX-512 loops are missing"


# ------------------------------- the CUDA kernels' schedule, run on CPU ------
# csrc/include/zpp/quant_chunks.h holds the CUDA kernels' work decomposition (8-element chunks,
# lanes per quantization block, register staging, whole-word packing); the CPU build runs it
# through test-only ops. These tests pin it against the CPU kernels without a GPU. Not covered
# here (no GPU): the shuffles, the 16-byte vector loads and the launch itself.
needs_cpu_kernels = pytest.mark.skipif(not ops.kernels_available("cpu") or not hasattr(
    torch.ops.megatron_zpp, "_cuda_group_shape"), reason="the CPU extension is not built")

# One block size per group shape: warp slices of 1, 2, 4, 8, 16 lanes; a warp staging 1, 2, 4, 8
# chunks per lane; the CTA staging 2, 4, 8; the streamed CTA (> 16384 elements).
SCHEDULE_BLOCKS = {8: [1, 1], 16: [2, 1], 24: [4, 1], 40: [8, 1], 128: [16, 1], 256: [32, 1], 264: [32, 2],
                   1024: [32, 4], 2048: [32, 8], 2056: [256, 2], 8192: [256, 4], 16384: [256, 8],
                   16392: [256, 0]}


@needs_cpu_kernels
def test_cuda_group_shape_stages_every_block_with_the_fewest_lanes():
    for block, shape in SCHEDULE_BLOCKS.items():
        assert list(torch.ops.megatron_zpp._cuda_group_shape(block)) == shape, block
    for block in range(8, 40_000, 8):
        lanes, per_lane = torch.ops.megatron_zpp._cuda_group_shape(block)
        chunks = block // 8
        assert lanes in (1, 2, 4, 8, 16, 32, 256), block
        assert 256 % lanes == 0  # whole groups per 256-thread CTA
        if per_lane == 0:
            assert chunks > 256 * 8, block
            continue
        assert per_lane in (1, 2, 4, 8) and lanes * per_lane >= chunks, block  # staged whole
        if lanes < 32:
            assert lanes // 2 < chunks, block  # no smaller slice would do: at most half the lanes idle
        else:
            assert lanes * per_lane // 2 < chunks, block  # no fewer chunks per lane would do
    with pytest.raises(RuntimeError, match="block=12"):
        torch.ops.megatron_zpp._cuda_group_shape(12)


@needs_cpu_kernels
@pytest.mark.parametrize("block", list(SCHEDULE_BLOCKS))
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("stochastic", [False, True])
def test_cuda_schedule_gives_the_cpu_kernels_bytes(block, bits, stochastic):
    """The CUDA schedule of all four kernels, run on the host with the shared header, writes the CPU
    kernels' bytes: partial last blocks with a partial chunk (length = 2 * block + 13), the row
    padding written as part of the last chunk's word (the buffers start as 0xAB), NaN/Inf blocks,
    fp32/bf16/fp16 in and out."""
    rows, length, chunks = 2, 2 * block + 13, 3
    rb = layout.row_bytes(length, bits, block)
    for dtype in FLOAT_DTYPES:
        x = sample(rows * length, dtype, "cpu", nonfinite=True)
        got = torch.full((rows, rb), 0xAB, dtype=torch.uint8)
        want = torch.empty_like(got)
        torch.ops.megatron_zpp._cuda_schedule_quantize_rows_(x, got, bits, block, stochastic, SEED)
        ops.quantize_rows_(x, want, bits, block, stochastic, SEED, backend="kernel")
        assert torch.equal(got, want), ("quantize", dtype)
        y_got, y_want = torch.empty(rows * length, dtype=dtype), torch.empty(rows * length, dtype=dtype)
        torch.ops.megatron_zpp._cuda_schedule_dequantize_rows_(want, y_got, bits, block)
        ops.dequantize_rows_(want, y_want, bits, block, backend="kernel")
        assert float_diff(y_got, y_want) == 0, ("dequantize", dtype)
    # fused: input blocks of another size and width than the output's
    bits_in, block_in = 12 - bits, 40
    x = sample(chunks * rows * length, torch.float32, "cpu", nonfinite=True)
    packed_in = ops.quantize(x, bits_in, block_in, rows=chunks * rows).view(chunks, rows, -1)
    got = torch.full((rows, rb), 0xCD, dtype=torch.uint8)
    want = torch.empty_like(got)
    args = (length, bits_in, block_in, bits, block, stochastic, SEED)
    torch.ops.megatron_zpp._cuda_schedule_dequant_reduce_quantize_(packed_in, got, *args)
    ops.dequant_reduce_quantize_(packed_in, want, *args, backend="kernel")
    assert torch.equal(got, want), "dequant_reduce_quantize"
    packed_in = ops.quantize(x, bits, block, rows=chunks * rows).view(chunks, rows, -1)
    for dtype in FLOAT_DTYPES:
        m_got, m_want = torch.empty(rows * length, dtype=dtype), torch.empty(rows * length, dtype=dtype)
        torch.ops.megatron_zpp._cuda_schedule_dequant_reduce_(packed_in, m_got, bits, block, 3.0)
        ops.dequant_reduce_(packed_in, m_want, bits, block, 3.0, backend="kernel")
        assert float_diff(m_got, m_want) == 0, ("dequant_reduce", dtype)


@needs_cpu_kernels
@pytest.mark.parametrize("length", [1, 5, 7, 8, 9, 31])
@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_schedule_short_rows(length, bits):
    """Rows shorter than a chunk or a block: the only chunk is partial; INT8 writes one word for up to
    4 elements and two above, INT4 one word."""
    rows, block = 3, 16
    rb = layout.row_bytes(length, bits, block)
    x = sample(rows * length, torch.float32, "cpu")
    got = torch.full((rows, rb), 0xAB, dtype=torch.uint8)
    want = torch.empty_like(got)
    torch.ops.megatron_zpp._cuda_schedule_quantize_rows_(x, got, bits, block, False, SEED)
    ops.quantize_rows_(x, want, bits, block, False, SEED, backend="kernel")
    assert torch.equal(got, want)
    y = torch.empty(rows * length)
    torch.ops.megatron_zpp._cuda_schedule_dequantize_rows_(want, y, bits, block)
    assert float_diff(y, ops.dequantize(want, (rows * length,), torch.float32, bits, block)) == 0


# (block, hadamard): in-chunk runs only (h <= 8), runs across lanes (block 128: 16 lanes), a warp
# (256), across a lane's slots (block 512/1024/2048: 32 lanes x 2/4/8 chunks, h up to the block).
# Chunk counts that are not powers of two leave lanes or slots empty: (96, 32), (768, 256), (1536, 512).
ROTATED_SCHEDULES = [(24, 8), (40, 8), (16, 2), (64, 4), (128, 32), (128, 128), (256, 256), (512, 512), (1024, 64),
                     (1024, 1024), (2048, 2048), (2048, 32), (96, 32), (768, 256), (1536, 512)]


@needs_cpu_kernels
@pytest.mark.parametrize("block,hadamard", ROTATED_SCHEDULES)
@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_schedule_fused_rotation_gives_the_cpu_kernels_bytes(block, hadamard, bits):
    """The fused CUDA rotation (quant_chunks.h: in-chunk butterflies, lane shuffles, slot pairs; the
    elementwise kernels' rows padded to whole runs), run on the host with the shared header, gives the CPU
    kernels' bytes: every op, partial last blocks and runs (length 2 * block + 13), NaN/Inf, nearest and
    stochastic, every float type, and rotations in and out of the fused reduction. The host emulation also
    checks that every shuffle partner of the elementwise kernels is in the thread's warp and holds the
    partner chunk of the same row. The last block mixes whole runs with a partial one where runs are long
    enough (length 2 * block + h/2 + 13)."""
    rows, chunks = 3, 2
    length = 2 * block + (min(hadamard, block // 2) if hadamard >= 16 else 0) + 13
    rb = layout.row_bytes(length, bits, block)
    for dtype, stochastic in itertools.product(FLOAT_DTYPES, (False, True)):
        x = _heavy_tailed(rows * length, dtype, "cpu", nonfinite=True)
        got = torch.full((rows, rb), 0xAB, dtype=torch.uint8)
        want = torch.empty_like(got)
        torch.ops.megatron_zpp._cuda_schedule_quantize_rows_(x, got, bits, block, stochastic, SEED, hadamard)
        ops.quantize_rows_(x, want, bits, block, stochastic, SEED, hadamard, backend="kernel")
        assert torch.equal(got, want), ("quantize", dtype, stochastic)
    if hadamard <= 256:
        for dtype in FLOAT_DTYPES:
            y_got, y_want = torch.empty(rows * length, dtype=dtype), torch.empty(rows * length, dtype=dtype)
            torch.ops.megatron_zpp._cuda_schedule_dequantize_rows_(want, y_got, bits, block, hadamard)
            ops.dequantize_rows_(want, y_want, bits, block, hadamard, backend="kernel")
            assert float_diff(y_got, y_want) == 0, ("dequantize", dtype)
            base = _heavy_tailed(rows * length, dtype, "cpu")  # qWD's decode-and-add: base plays the weights
            a_got, a_want = base.clone(), base.clone()
            torch.ops.megatron_zpp._cuda_schedule_dequantize_rows_(want, a_got, bits, block, hadamard, True)
            ops.dequantize_add_rows_(want, a_want, bits, block, hadamard, backend="kernel")
            assert float_diff(a_got, a_want) == 0, ("dequantize_add", dtype)
    x = _heavy_tailed(chunks * rows * length, torch.float32, "cpu", nonfinite=True)
    packed_in = ops.quantize(x, bits, block, rows=chunks * rows).view(chunks, rows, -1)
    pairs = [(0, hadamard), (hadamard, 0), (hadamard, hadamard)]
    if hadamard > 2:  # two different rotations, in then out
        pairs.append((8 if hadamard > 8 else 2, hadamard))
    for h_in, h_out in pairs:
        got = torch.full((rows, rb), 0xCD, dtype=torch.uint8)
        want = torch.empty_like(got)
        args = (length, bits, block, bits, block, True, SEED, h_in, h_out)
        torch.ops.megatron_zpp._cuda_schedule_dequant_reduce_quantize_(packed_in, got, *args)
        ops.dequant_reduce_quantize_(packed_in, want, *args, backend="kernel")
        assert torch.equal(got, want), ("dequant_reduce_quantize", h_in, h_out)
    if hadamard <= 256:
        for dtype in FLOAT_DTYPES:
            m_got, m_want = torch.empty(rows * length, dtype=dtype), torch.empty(rows * length, dtype=dtype)
            torch.ops.megatron_zpp._cuda_schedule_dequant_reduce_(packed_in, m_got, bits, block, 3.0, hadamard)
            ops.dequant_reduce_(packed_in, m_want, bits, block, 3.0, hadamard, backend="kernel")
            assert float_diff(m_got, m_want) == 0, ("dequant_reduce", dtype)


@needs_cpu_kernels
def test_cuda_schedule_names_the_shapes_it_does_not_fuse():
    """Quantizing blocks over 2048 elements (CTA groups) and elementwise runs over 256 values are composed by
    the CUDA binding (fp32 passes), not rotated in registers: the host emulation of the fused kernels refuses
    them instead of checking a path the GPU does not take."""
    x = torch.randn(2 * 4096)
    packed = torch.empty(2, layout.row_bytes(4096, 4, 4096), dtype=torch.uint8)
    torch.ops.megatron_zpp._cuda_schedule_quantize_rows_(x, packed, 4, 4096, False, SEED, 0)
    with pytest.raises(RuntimeError, match="blocks of <= 2048"):
        torch.ops.megatron_zpp._cuda_schedule_quantize_rows_(x, packed, 4, 4096, False, SEED, 32)
    q = ops.quantize(x, 4, 512, rows=2)
    with pytest.raises(RuntimeError, match="runs of <= 256"):
        torch.ops.megatron_zpp._cuda_schedule_dequantize_rows_(q, torch.empty(2 * 4096), 4, 512, 512)


# ------------------------------------------ Hadamard smoothing in the ops ------
def _heavy_tailed(numel: int, dtype, device, nonfinite=False) -> torch.Tensor:
    """Student-t (3 degrees of freedom) values, what the rotation is for; NaN and Inf at fixed spots."""
    g = torch.Generator().manual_seed(numel + 1)
    x = torch.randn(numel, generator=g) / torch.randn(3, numel, generator=g).pow(2).mean(0).sqrt()
    if nonfinite and numel > 300:
        x[37], x[-200] = float("nan"), float("-inf")
    return x.to(dtype).to(device)


def _all_ops(x, rows, length, bits, block, hadamard, stochastic, dtype, device, backend, packed_in):
    """Every op with Hadamard smoothing on: outputs by name. ``packed_in``: [C, K, row] rows rotated with
    ``hadamard``, the reduce ops' input."""
    rb = layout.row_bytes(length, bits, block)
    out = {}
    q = torch.full((rows, rb), 0xAB, dtype=torch.uint8, device=device)
    ops.quantize_rows_(x, q, bits, block, stochastic, SEED, hadamard, backend=backend)
    out["quantize"] = q
    r = torch.empty_like(q)
    ops.reorder_quantize_(x, r, bits, block, 2, 2, 1, stochastic, SEED, hadamard, backend=backend)
    out["reorder"] = r
    y = torch.empty(rows * length, dtype=dtype, device=device)
    ops.dequantize_rows_(q, y, bits, block, hadamard, backend=backend)
    out["dequantize"] = y
    for h in (0, hadamard):  # qWD's decode-and-add, plain and rotated: x plays the held weights
        added = x.clone()
        ops.dequantize_add_rows_(q, added, bits, block, h, backend=backend)
        out[f"dequantize_add h={h}"] = added
    chunks, k = packed_in.shape[:2]
    # In and out rotations: off-on (qgZ's intra INT8 -> inter INT4 hop), on-off, on-on (stays rotated).
    for h_in, h_out in ((0, hadamard), (hadamard, 0), (hadamard, hadamard)):
        red = torch.empty(k, layout.row_bytes(length, 4, 2 * block), dtype=torch.uint8, device=device)
        ops.dequant_reduce_quantize_(packed_in, red, length, bits, block, 4, 2 * block, stochastic, SEED, h_in, h_out,
                                     backend=backend)
        out[f"reduce_quantize {h_in}->{h_out}"] = red
    mean = torch.empty(k * length, dtype=dtype, device=device)
    ops.dequant_reduce_(packed_in, mean, bits, block, 3.0, hadamard, backend=backend)
    out["reduce"] = mean
    return out


@pytest.mark.parametrize("bits,block,hadamard", [(4, 128, 32), (8, 512, 64), (4, 40, 8), (8, 256, 256), (4, 64, 2),
                                                 (8, 256, 8), (4, 128, 16), (4, 64, 4)])
def test_hadamard_ops_match_reference_at_every_level(bits, block, hadamard, kernel_device):
    """The five ops with the rotation give the reference's bits on every CPU level (and CUDA where built):
    fp32/bf16/fp16, nearest and stochastic, partial last blocks and a partial last run (length 1031 is
    not a multiple of any run), NaN/Inf blocks."""
    rows, length = 4, 1031
    levels = CPU_ISAS if kernel_device.type == "cpu" else [None]
    for level in levels:
        previous = torch.ops.megatron_zpp._set_cpu_isa(level) if level else None
        try:
            for dtype, stochastic in itertools.product(FLOAT_DTYPES, (False, True)):
                x = _heavy_tailed(rows * length, dtype, kernel_device, nonfinite=True)
                packed_in = ops.quantize(_heavy_tailed(rows * length, torch.float32, kernel_device), bits, block,
                                         rows=rows, hadamard=hadamard).view(2, 2, -1)
                got, want = (_all_ops(x, rows, length, bits, block, hadamard, stochastic, dtype, kernel_device, b,
                                      packed_in) for b in ("kernel", "reference"))
                for name in want:
                    where = (level, name, dtype, stochastic)
                    if want[name].dtype == torch.uint8:
                        assert torch.equal(got[name], want[name]), where
                    else:
                        assert float_diff(got[name], want[name]) == 0, where
        finally:
            if previous:
                torch.ops.megatron_zpp._set_cpu_isa(previous)


@pytest.mark.parametrize("bits,block,hadamard", [(4, 128, 32), (8, 256, 64)])
def test_hadamard_round_trip_and_mean_are_within_the_rotated_bound(bits, block, hadamard, kernel_device):
    """Quantizing rotated runs and rotating the decode back: the error of each run is bounded in L2 by the
    rotated block's own bound (the rotation is orthogonal), sqrt(h) * scale / 2 (+ fp32 slack); the mean of C
    rotated rows by dequant_reduce_ is within the average of those bounds; NaN/Inf reach the whole block."""
    rows, length, qmax = 3, 4096, layout.qmax_for_bits(bits)
    x = _heavy_tailed(rows * length, torch.float32, kernel_device).view(rows, length)
    q = ops.quantize(x, bits, block, rows=rows, hadamard=hadamard)
    y = ops.dequantize(q, (rows, length), torch.float32, bits, block, hadamard=hadamard)
    from megatron_zpp.compression.reference import hadamard_rows

    rotated_absmax = hadamard_rows(x.cpu(), hadamard).view(rows, -1, block).abs().amax(-1)
    run_bound = (rotated_absmax / qmax / 2 * math.sqrt(hadamard)).repeat_interleave(block // hadamard, 1)
    run_error = (y.cpu() - x.cpu()).view(rows, -1, hadamard).norm(dim=-1)
    slack = 1e-5 * x.abs().max().item()
    assert (run_error <= run_bound * 1.001 + slack).all(), (run_error / run_bound).max()
    mean = torch.empty(length, device=kernel_device)
    ops.dequant_reduce_(q.view(rows, 1, -1), mean, bits, block, float(rows), hadamard)
    mean_error = (mean.cpu() - x.cpu().mean(0)).view(-1, hadamard).norm(dim=-1)
    assert (mean_error <= run_bound.mean(0) * 1.001 + slack).all()
    x[1, 300] = float("nan")
    y = ops.dequantize(ops.quantize(x, bits, block, rows=rows, hadamard=hadamard), (rows, length), torch.float32,
                       bits, block, hadamard=hadamard)
    nan_blocks = torch.isnan(y).view(rows, -1, block).all(-1)
    assert nan_blocks.sum() == 1 and nan_blocks[1, 300 // block]  # the block, whole; nothing else


def test_hadamard_arguments_are_validated(kernel_device):
    x = torch.randn(256, device=kernel_device)
    packed = torch.empty(1, layout.row_bytes(256, 4, 128), dtype=torch.uint8, device=kernel_device)
    for bad in (3, 256, 1, 8192):
        with pytest.raises(ValueError, match=f"hadamard={bad} is not valid with block=128"):
            ops.quantize_rows_(x, packed, 4, 128, hadamard=bad)
    with pytest.raises(ValueError, match="hadamard=3 is not valid with block=128"):
        ops.dequantize_rows_(packed, x, 4, 128, hadamard=3)
    stacked = packed.view(1, 1, -1)
    out = torch.empty(1, layout.row_bytes(256, 4, 64), dtype=torch.uint8, device=kernel_device)
    with pytest.raises(ValueError, match="hadamard_in=128 must also divide block_out=64"):
        ops.dequant_reduce_quantize_(stacked, out, 256, 4, 128, 4, 64, hadamard_in=128)
    # the C++ checks, for callers that bypass the Python wrapper
    with pytest.raises(RuntimeError, match="hadamard=96 is not valid with block=128"):
        torch.ops.megatron_zpp.quantize_rows_(x, packed, 4, 128, False, 0, 96)
    with pytest.raises(RuntimeError, match="hadamard_in=128 must also divide block_out=64"):
        torch.ops.megatron_zpp.dequant_reduce_quantize_(stacked, out, 256, 4, 128, 4, 64, False, 0, 128, 0)


def test_dequantize_add_is_the_decode_plus_the_held_values_rounded_once(kernel_device):
    """dequantize_add_rows_ = cast(fp32 decode + fp32(out)), one rounding: for bf16, the same bits as decoding into
    fp32, adding the cast-up base in fp32 and casting once (what qWD did in three passes), not the sum of two
    roundings."""
    rows, length, bits, block = 3, 4099, 4, 2048
    base = (torch.randn(rows * length) * 3).to(torch.bfloat16).to(kernel_device)
    q = ops.quantize(torch.randn(rows * length, device=kernel_device) * 1e-2, bits, block, rows=rows)
    got = base.clone()
    ops.dequantize_add_rows_(q, got, bits, block)
    decoded = ops.dequantize(q, (rows * length,), torch.float32, bits, block)
    assert torch.equal(got, (decoded + base.float()).to(torch.bfloat16))
    twice = (ops.dequantize(q, (rows * length,), torch.bfloat16, bits, block).float() + base.float()).to(torch.bfloat16)
    assert not torch.equal(got, twice)  # the sample is large enough for double rounding to show


def _near_tie_block(bits: int, block: int, c: float) -> torch.Tensor:
    """One block whose quotients x / scale sit 0 to 3 ulps from half-integers: the first value is qmax * c, so
    scale ~= c, and the others are fl((k + 0.5) * c) nudged by -3..3 ulps. Multiplying by fl(1 / scale) instead
    of dividing lands on the other side of such a tie for some of them."""
    qmax = 127 if bits == 8 else 7
    n = block - 1
    k = torch.arange(n) % (2 * qmax) - qmax
    x = ((k.double() + 0.5) * c).float()
    steps = torch.arange(n) % 7 - 3
    for _ in range(3):
        up, down = steps > 0, steps < 0
        x = torch.where(up, torch.nextafter(x, torch.tensor(math.inf)), x)
        x = torch.where(down, torch.nextafter(x, torch.tensor(-math.inf)), x)
        steps = steps - up.long() + down.long()
    return torch.cat([torch.tensor([qmax * c], dtype=torch.float32), x])


@pytest.mark.parametrize("cpu_isa", CPU_ISAS, indirect=True)
@pytest.mark.parametrize("bits,block", [(8, 256), (4, 128), (8, 2048)])
def test_quotients_next_to_ties_round_as_the_division_does(cpu_isa, bits, block):
    """The AVX2 quantize loop takes x / scale from a multiply by the reciprocal where that provably rounds to the
    same integer and redoes the rest with the division (csrc/cpu/quant_cpu_avx2.h, ReciprocalCodes). On blocks
    built to sit next to ties, where the plain reciprocal gives other codes (checked here, so the sample can
    catch a wrong fallback), quantize gives the reference's bytes, plain and Hadamard-rotated (the fused
    dequant-reduce-quantize runs the same loop on its fp32 sums). The last block's scale is subnormal: there the
    whole block takes the division. The built ties are fp32's (casting to bf16/fp16 rounds most of them away);
    16-bit inputs sit on ties by themselves (random bf16 data has a lane near a tie in ~6% of 32-value groups),
    which the other tests at every level cover."""
    qmax = 127 if bits == 8 else 7
    # c = +-0.37: x * fl(1 / scale) overshoots +-qmax at the block's largest magnitude qmax * c (negative for
    # c < 0), and the reciprocal path has no clamp (quant_cpu_avx2.h, ReciprocalCodes): its codes must stay within.
    x = torch.cat([_near_tie_block(bits, block, c) for c in (1.1, 0.37, -0.37, 3.3e-3, 7.77, 1e-30, 1e-39)])
    blocks = x.view(-1, block)
    scale = blocks.abs().amax(dim=1, keepdim=True) / torch.tensor(float(qmax))
    by_division = torch.round((blocks / scale).clamp(-qmax, qmax))
    by_reciprocal = torch.round((blocks * (torch.tensor(1.0) / scale)).clamp(-qmax, qmax))
    assert (by_division != by_reciprocal).sum() > 0
    for dtype in FLOAT_DTYPES:
        xd = x.to(dtype)
        got, want = (ops.quantize(xd, bits, block, backend=b) for b in ("kernel", "reference"))
        assert torch.equal(got, want), dtype
        got, want = (ops.quantize(xd, bits, block, hadamard=32, backend=b) for b in ("kernel", "reference"))
        assert torch.equal(got, want), (dtype, "hadamard")


@pytest.mark.parametrize("cpu_isa", CPU_ISAS, indirect=True)
def test_blocks_of_ties_and_extremes_match_reference(cpu_isa):
    """Random blocks over 60 binades in which ~30% of the values are put on ties, (k + 1/2) * scale, and each
    block's largest magnitude also appears negated and one ulp below: quantize, plain and Hadamard-rotated,
    gives the reference's bytes for every dtype and both widths at every level. The vector loops round by a
    multiply with the reciprocal, check the distance to ties with a running maximum and drop the +-qmax clamp
    (quant_cpu_avx2.h, ReciprocalCodes); these are the values where those shortcuts could differ."""
    g = torch.Generator().manual_seed(7)
    for bits, dtype, hadamard in itertools.product((8, 4), FLOAT_DTYPES, (0, 32)):
        block, qmax, nblk = (256 if bits == 8 else 128), (127 if bits == 8 else 7), 16
        mag = torch.exp2(torch.randint(-30, 30, (nblk, 1), generator=g).float())
        x = torch.randn(nblk, block, generator=g) * mag
        absmax = x.abs().amax(1, keepdim=True)
        k = torch.randint(-qmax, qmax, (nblk, block), generator=g).float()
        x = torch.where(torch.rand(nblk, block, generator=g) < 0.3, (k + 0.5) * absmax / qmax, x)
        x[:, 0], x[:, 1] = absmax[:, 0], -absmax[:, 0] * (1 - 2 ** -23)
        x = x.reshape(-1).to(dtype)
        got, want = (ops.quantize(x, bits, block, hadamard=hadamard, backend=b) for b in ("kernel", "reference"))
        assert torch.equal(got, want), (bits, dtype, hadamard)


def _every_16bit_value_below(absmax: torch.Tensor, dtype, mantissa: int, binades: int = 5) -> torch.Tensor:
    """Blocks of 128 values of `dtype` (`mantissa` stored significand bits): each block's first value is +-absmax
    (so every block has that scale), the others are every value of `dtype` from absmax down to
    absmax / 2^binades, with both signs."""
    bits_of_max = int(absmax.to(dtype).view(torch.int16).item())
    count = binades << mantissa
    lower = torch.arange(bits_of_max - count, bits_of_max + 1, dtype=torch.int32).to(torch.int16).view(dtype)
    values = torch.cat([lower, -lower])
    pad = (-values.numel()) % 127
    values = torch.cat([values, values[:pad]]).view(-1, 127)
    head = absmax.to(dtype).expand(values.shape[0], 1).clone()
    head[1::2] = -head[1::2]
    return torch.cat([head, values], dim=1).reshape(-1)


@pytest.mark.parametrize("cpu_isa", CPU_ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_int4_codes_of_every_16bit_value_near_the_thresholds_match_the_division(cpu_isa, dtype):
    """INT4 of 16-bit values at x86-64-v3 and v4 takes each block's seven code boundaries exactly and compares
    the values with them (quant_cpu_avx512.h and quant_cpu_avx2.h, Int4Thresholds) instead of dividing. For a
    16-bit input the boundaries can be checked exhaustively: for absmax of every significand in a binade (and a few binades apart, down to the scales where
    the thresholds stop applying), every value from absmax down past the lowest boundary (absmax / 14), both
    signs, gives the reference's bytes. 16-bit values sit on INT4's ties by themselves (absmax / 2 gives
    x / scale ~= 3.5), which is why the thresholds exist."""
    mantissa = 7 if dtype == torch.bfloat16 else 10
    step = 1 if dtype == torch.bfloat16 else 8  # fp16: every 8th of its 1024 significands
    one = torch.tensor(1.0, dtype=dtype)
    base = int(one.view(torch.int16).item())
    absmaxes = [torch.tensor(base + m, dtype=torch.int16).view(dtype).float() for m in range(0, 1 << mantissa, step)]
    exponents = [2.0 ** -100, 2.0 ** -117, 2.0 ** -118, 2.0 ** 100] if dtype == torch.bfloat16 else [2.0 ** -9, 2.0 ** 12]
    absmaxes += [a * e for a in absmaxes[:: max(1, len(absmaxes) // 16)] for e in exponents]
    x = torch.cat([_every_16bit_value_below(a, dtype, mantissa) for a in absmaxes])
    got, want = (ops.quantize(x, 4, 128, backend=b) for b in ("kernel", "reference"))
    assert torch.equal(got, want)
    decoded = ops.dequantize(want, x.shape, torch.float32, 4, 128).view(-1, 128)
    codes = decoded / decoded[:, :1].abs() * 7  # the first value, +-absmax, has code +-7
    assert set(codes.round().unique().tolist()) == set(range(-7, 8))  # every code, so every boundary, was crossed


def test_the_widest_cpu_level_runs_here_or_says_why():
    """The AVX-512 loops (quant_cpu_avx512.h) are compiled into every x86-64 build but only run, and so are only
    checked against the reference by the tests above, on a CPU that has AVX-512: on one without, this test
    skips and says so, rather than the level silently going unchecked."""
    if not ops.kernels_available("cpu"):
        pytest.skip("no compiled CPU kernels")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"{platform.machine()}: one portable level only")
    if "x86-64-v4" not in CPU_ISAS:
        pytest.skip("this CPU has no AVX-512: the x86-64-v4 loops are compiled but not run or checked here "
                    f"(levels run: {', '.join(CPU_ISAS)})")
    if os.environ.get("ZPP_CPU_ISA"):
        pytest.skip(f"ZPP_CPU_ISA={os.environ['ZPP_CPU_ISA']} chooses the level")
    assert torch.ops.megatron_zpp._cpu_isa() == "x86-64-v4"  # the default picks the widest level


def fused_case(bits: int, block: int, rows: int, length: int) -> None:
    """dequant_reduce_quantize_ and dequant_reduce_ on 3 chunks of `rows` rows of `length` values: kernel == reference."""
    chunks = 3
    x = sample(chunks * rows * length, torch.float32, "cpu", nonfinite=True)
    packed = ops.quantize(x, bits, block, rows=chunks * rows).view(chunks, rows, -1)
    for hadamard in (0, 8):
        rb_out = layout.row_bytes(length, bits, block)
        got, want = (torch.empty(rows, rb_out, dtype=torch.uint8) for _ in range(2))
        for out, backend in ((got, "kernel"), (want, "reference")):
            ops.dequant_reduce_quantize_(packed, out, length, bits, block, bits, block, hadamard_out=hadamard,
                                         backend=backend)
        assert torch.equal(got, want), ("deq_red_quant", bits, block, rows, length, hadamard)
        got, want = (torch.empty(rows * length, dtype=torch.bfloat16) for _ in range(2))
        for out, backend in ((got, "kernel"), (want, "reference")):
            ops.dequant_reduce_(packed, out, bits, block, 3.0, hadamard=hadamard, backend=backend)
        assert float_diff(got, want) == 0, ("deq_reduce", bits, block, rows, length, hadamard)


@pytest.mark.parametrize("cpu_isa", CPU_ISAS, indirect=True)
def test_tasks_that_split_a_row_and_vector_sized_last_blocks_match_reference(cpu_isa):
    """Paths the small cases above do not reach. (1) Rows long enough that at::parallel_for splits one row
    between tasks (3 threads): the vector loop quantizes up to 8 blocks at once and must stop at a task's end
    and carry (row, block) on, with and without the qgZ reorder. (2) A partial last block whose length is a
    multiple of 32 (block 64 with a 32-value tail, block 40 with a 32-value tail), which takes the vector loop
    alone. (3) The fused ops on such rows: they sum and quantize up to 8 output blocks per step, which must stop
    at a row's and a task's end, with a partial last block, plain and with the Hadamard rotation."""
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for bits, block, rows, length in ((4, 128, 2, 150_016), (8, 256, 1, 300_032), (8, 64, 3, 96),
                                          (4, 40, 2, 72), (4, 64, 4, 32 * 1001)):
            for dtype in (torch.float32, torch.bfloat16):
                x = sample(rows * length, dtype, "cpu", nonfinite=True)
                for hadamard in (0, 8):
                    got, want = (ops.quantize(x, bits, block, rows=rows, hadamard=hadamard, backend=b)
                                 for b in ("kernel", "reference"))
                    assert torch.equal(got, want), (bits, block, rows, length, dtype, hadamard)
                if rows in (2, 4):
                    nodes, node_size = (2, rows // 2)
                    rb = layout.row_bytes(length, bits, block)
                    got, want = (torch.empty(rows, rb, dtype=torch.uint8) for _ in range(2))
                    ops.reorder_quantize_(x, got, bits, block, nodes, node_size, 1, backend="kernel")
                    ops.reorder_quantize_(x, want, bits, block, nodes, node_size, 1, backend="reference")
                    assert torch.equal(got, want), ("reorder", bits, block, rows, length, dtype)
            fused_case(bits, block, rows, length)
    finally:
        torch.set_num_threads(previous)


def test_quantize_raises_no_divide_by_zero_flag_at_any_level():
    """With the divide-by-zero trap on (feenableexcept), quantizing blocks that are all zero, a NaN block and
    fewer than 8 full blocks (the AVX2 loop computes 8 scales at once) must not divide by zero: the scalar
    path never computes 1 / scale for an unusable scale, and neither may the vector one. A trapped division
    kills the process with SIGFPE, so each level runs in a subprocess."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = """
import ctypes, sys, torch
from megatron_zpp.compression import layout, ops
torch.set_num_threads(1)  # the trap is per thread: keep every kernel on this one
assert ops.kernels_available("cpu")  # loads the extension and its ops
torch.ops.megatron_zpp._set_cpu_isa(sys.argv[1])
x = torch.randn(7 * 256)
x[256:768] = 0.0
x[1000] = float("nan")
packed_in = ops.quantize(torch.randn(4 * 512), 8, 256, rows=4).view(2, 2, -1)
libm = ctypes.CDLL("libm.so.6")
libm.feenableexcept(0x04)  # FE_DIVBYZERO
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for bits, block in ((8, 256), (4, 128)):
        ops.quantize(x.to(dtype), bits, block, backend="kernel")
        ops.quantize(x.to(dtype), bits, block, hadamard=32, backend="kernel")
out = torch.empty(2, layout.row_bytes(512, 4, 128), dtype=torch.uint8)
ops.dequant_reduce_quantize_(packed_in, out, 512, 8, 256, 4, 128, backend="kernel")
libm.fedisableexcept(0x04)
print("ok", sys.argv[1])
"""
    for level in CPU_ISAS:
        proc = subprocess.run([sys.executable, "-c", code, level], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
        assert proc.returncode == 0 and f"ok {level}" in proc.stdout, (level, proc.returncode, proc.stderr[-2000:])
