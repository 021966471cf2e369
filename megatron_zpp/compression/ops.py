"""The blocked-quantization ops: validation plus dispatch to the kernels or the reference.

Six out-variant ops (write into caller-owned buffers, so collectives can reuse
them), each with a C++ CPU kernel, a CUDA kernel and a pure-PyTorch reference
that agree bit for bit:

==============================  =====================================================
``quantize_rows_``              x (R*L floats) -> packed uint8 [R, row_bytes(L)]
``reorder_quantize_``           same, rows permuted by ZeRO++ Algorithm 2 (qgZ)
``dequantize_rows_``            packed [R, row_bytes(L)] -> out (R*L, fp32/bf16/fp16)
``dequantize_add_rows_``        the same, added to what ``out`` holds (one rounding)
``dequant_reduce_quantize_``    packed [C, K, row_bytes] -> sum over C -> packed [K, ...]
``dequant_reduce_``             packed [C, K, row_bytes] -> sum over C / divisor -> out
==============================  =====================================================

``backend`` selects ``"auto"``, ``"kernel"`` (error if not built for the tensor's
device) or ``"reference"`` (the pure-PyTorch reference, on any device). ``"auto"``
uses the kernels when they are built for the tensor's device; without them it
falls back to the reference with a warning on CPU, and raises on CUDA: a silent
switch to the reference would make GPU training many times slower.
"""

from __future__ import annotations

import warnings

import torch

from megatron_zpp.compression import _extension, layout, reference

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "kernel", "reference")


def kernels_available(device: torch.device | str = "cpu") -> bool:
    device = torch.device(device)
    if device.type == "cpu":
        return _extension.load()
    if device.type == "cuda":
        return _extension.has_cuda_kernels()
    return False


CPU_BUILD_HINT = "pip install --no-build-isolation -e ."
CUDA_BUILD_HINT = "ZPP_BUILD_CUDA=1 pip install --no-build-isolation -e ."


def _why_unavailable(device: torch.device) -> str:
    if not _extension.load():
        return _extension.load_error() or "the kernel extension did not load"
    if device.type == "cuda":
        source = _extension.loaded_from()
        if source == "megatron_zpp._C":
            return ("megatron_zpp._C was built without its CUDA kernels (ZPP_BUILD_CUDA=0, or no CUDA "
                    "toolkit found at build time)")
        return f"the kernels in use come from {source}, which has no CUDA kernels"
    return f"no kernels exist for device type {device.type!r} (only cpu and cuda)"


def _unavailable_error(device: torch.device, backend: str) -> RuntimeError:
    why = _why_unavailable(device)
    if device.type == "cuda":
        todo = (f"build the CUDA kernels with `{CUDA_BUILD_HINT}` (needs nvcc for torch's CUDA version), "
                'or pass backend="reference" to run the slow pure-PyTorch reference on the GPU explicitly')
    else:
        todo = f'build the kernels with `{CPU_BUILD_HINT}`, or pass backend="reference"'
    implicit = "" if backend == "kernel" else " (backend='auto' does not fall back to the reference on GPUs)"
    return RuntimeError(f"megatron_zpp: no compiled kernels for {device} tensors{implicit}: {why}. To fix: {todo}.")


_HAS_KERNEL: set[tuple[str, str]] = set()  # positive answers only: the extension may load later


def _has_kernel(name: str, device: torch.device) -> bool:
    """Whether the loaded extension implements op ``name`` for ``device`` (an extension built before
    the op existed does not)."""
    if (name, device.type) in _HAS_KERNEL:
        return True
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    try:
        found = key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(f"megatron_zpp::{name}", key)
    except Exception:
        return False
    if found:
        _HAS_KERNEL.add((name, device.type))
    return found


def _impl(name: str, device: torch.device, backend: str, reference_module=reference):
    """The implementation of op ``name`` for tensors on ``device`` (the dispatch decision).

    ``reference_module`` holds the op's pure-PyTorch reference (``reference`` for the quantization
    ops, ``mpc_reference`` for the lossless ones)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    device = torch.device(device)
    if backend == "reference":
        return getattr(reference_module, name)
    if kernels_available(device):
        if _has_kernel(name, device):
            return getattr(torch.ops.megatron_zpp, name)
        stale = RuntimeError(f"megatron_zpp: the loaded kernels ({_extension.loaded_from()}) have no {name} op for "
                             f"{device.type}: they were built from older sources. To fix: rebuild with "
                             f"`{CUDA_BUILD_HINT if device.type == 'cuda' else CPU_BUILD_HINT}`.")
        if backend == "kernel" or device.type == "cuda":
            raise stale
        warnings.warn(f"{stale} Using the pure-PyTorch reference (slow).", stacklevel=3)
        return getattr(reference_module, name)
    if backend == "kernel" or device.type == "cuda":
        raise _unavailable_error(device, backend)
    todo = 'pass backend="reference" to choose the reference explicitly'
    if device.type == "cpu":
        todo = f"build the kernels with `{CPU_BUILD_HINT}` (needs a C++ compiler), or {todo}"
    warnings.warn(f"megatron_zpp: compiled kernels unavailable for {device.type} tensors, using the pure-PyTorch "
                  f"reference (slow): {_why_unavailable(device)}. To fix: {todo}.", stacklevel=3)
    return getattr(reference_module, name)


def _seed64(seed: int) -> int:
    """The signed int64 with the same 64 bits (op schemas take int64; kernels read it as uint64)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; valid: {', '.join(map(str, FLOAT_DTYPES))}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_packed(name: str, packed: torch.Tensor, ndim: int, device: torch.device) -> None:
    if packed.dtype != torch.uint8 or packed.dim() != ndim or not packed.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {ndim}-D uint8 tensor, got {packed.dtype} "
                         f"of shape {tuple(packed.shape)}")
    if packed.device != device:
        raise ValueError(f"{name} is on {packed.device}, expected {device}")


def _rows_length(total: int, rows: int, what: str) -> int:
    if rows <= 0 or total % rows:
        raise ValueError(f"{what}: {total} elements do not split into {rows} equal rows")
    return total // rows


def _check_row_bytes(name: str, packed: torch.Tensor, length: int, bits: int, block: int) -> None:
    expected = layout.row_bytes(length, bits, block)
    if packed.shape[-1] != expected:
        raise ValueError(f"{name} rows have {packed.shape[-1]} bytes; rows of {length} elements at "
                         f"bits={bits}, block={block} need {expected}")


def quantize_rows_(x, packed, bits, block, stochastic=False, seed=0, hadamard=0, *, backend="auto") -> None:
    _check_float("x", x)
    layout.check_bits_block(bits, block)
    layout.check_hadamard(hadamard, block)
    _check_packed("packed", packed, 2, x.device)
    length = _rows_length(x.numel(), packed.shape[0], "quantize_rows_")
    _check_row_bytes("packed", packed, length, bits, block)
    _impl("quantize_rows_", x.device, backend)(x, packed, bits, block, stochastic, _seed64(seed), hadamard)


def reorder_quantize_(x, packed, bits, block, nodes, node_size, stages=1, stochastic=False, seed=0, hadamard=0,
                      *, backend="auto") -> None:
    _check_float("x", x)
    layout.check_bits_block(bits, block)
    layout.check_hadamard(hadamard, block)
    _check_packed("packed", packed, 2, x.device)
    for what, v in (("nodes", nodes), ("node_size", node_size), ("stages", stages)):
        if v < 1:
            raise ValueError(f"{what}={v} must be >= 1")
    num_rows = nodes * node_size * stages
    if packed.shape[0] != num_rows:
        raise ValueError(f"packed has {packed.shape[0]} rows; stages*nodes*node_size = {num_rows}")
    length = _rows_length(x.numel(), num_rows, "reorder_quantize_")
    _check_row_bytes("packed", packed, length, bits, block)
    _impl("reorder_quantize_", x.device, backend)(
        x, packed, bits, block, nodes, node_size, stages, stochastic, _seed64(seed), hadamard)


def _decode_op(name: str, packed, out, bits, block, hadamard, backend) -> None:
    _check_float("out", out)
    layout.check_bits_block(bits, block)
    layout.check_hadamard(hadamard, block)
    _check_packed("packed", packed, 2, out.device)
    length = _rows_length(out.numel(), packed.shape[0], name)
    _check_row_bytes("packed", packed, length, bits, block)
    _impl(name, out.device, backend)(packed, out, bits, block, hadamard)


def dequantize_rows_(packed, out, bits, block, hadamard=0, *, backend="auto") -> None:
    _decode_op("dequantize_rows_", packed, out, bits, block, hadamard, backend)


def dequantize_add_rows_(packed, out, bits, block, hadamard=0, *, backend="auto") -> None:
    """``out = cast(decode(packed) + fp32(out))`` in one pass, one rounding (qWD's decode-and-add)."""
    _decode_op("dequantize_add_rows_", packed, out, bits, block, hadamard, backend)


def dequant_reduce_quantize_(packed_in, packed_out, row_numel, bits_in, block_in, bits_out, block_out,
                             stochastic=False, seed=0, hadamard_in=0, hadamard_out=0, *, backend="auto") -> None:
    layout.check_bits_block(bits_in, block_in)
    layout.check_bits_block(bits_out, block_out)
    layout.check_hadamard(hadamard_in, block_in)
    if hadamard_in and block_out % hadamard_in:
        raise ValueError(f"hadamard_in={hadamard_in} must also divide block_out={block_out}: the kernels rotate the "
                         "sum in runs that start at output block starts")
    layout.check_hadamard(hadamard_out, block_out)
    _check_packed("packed_in", packed_in, 3, packed_in.device)
    _check_packed("packed_out", packed_out, 2, packed_in.device)
    if packed_out.shape[0] != packed_in.shape[1]:
        raise ValueError(f"packed_out has {packed_out.shape[0]} rows, packed_in chunks have {packed_in.shape[1]}")
    _check_row_bytes("packed_in", packed_in, row_numel, bits_in, block_in)
    _check_row_bytes("packed_out", packed_out, row_numel, bits_out, block_out)
    _impl("dequant_reduce_quantize_", packed_in.device, backend)(
        packed_in, packed_out, row_numel, bits_in, block_in, bits_out, block_out, stochastic, _seed64(seed),
        hadamard_in, hadamard_out)


def dequant_reduce_(packed_in, out, bits, block, divisor=1.0, hadamard=0, *, backend="auto") -> None:
    _check_float("out", out)
    layout.check_bits_block(bits, block)
    layout.check_hadamard(hadamard, block)
    _check_packed("packed_in", packed_in, 3, out.device)
    length = _rows_length(out.numel(), packed_in.shape[1], "dequant_reduce_")
    _check_row_bytes("packed_in", packed_in, length, bits, block)
    if not divisor > 0:
        raise ValueError(f"divisor={divisor} must be > 0")
    _impl("dequant_reduce_", out.device, backend)(packed_in, out, bits, block, float(divisor), hadamard)


# ------------------------------------------------- allocating helpers -------
def quantize(x: torch.Tensor, bits: int, block: int, *, rows: int = 1, stochastic: bool = False,
             seed: int = 0, hadamard: int = 0, backend: str = "auto") -> torch.Tensor:
    """Allocate and fill packed ``uint8[rows, row_bytes(numel / rows)]`` for ``x``."""
    length = _rows_length(x.numel(), rows, "quantize") if x.numel() else 0
    packed = torch.empty(rows, layout.row_bytes(length, bits, block), dtype=torch.uint8, device=x.device)
    quantize_rows_(x.contiguous(), packed, bits, block, stochastic, seed, hadamard, backend=backend)
    return packed


def dequantize(packed: torch.Tensor, shape, dtype: torch.dtype, bits: int, block: int, *, hadamard: int = 0,
               backend: str = "auto") -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    dequantize_rows_(packed, out, bits, block, hadamard, backend=backend)
    return out
