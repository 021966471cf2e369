"""ZFP fixed-rate codec (``zfp:rate=R,dims=D``): zfp 1.0.1's bitstream from our own C++ and CUDA kernels.

The payload is byte for byte what ``zfpy.compress_numpy(a, rate=R, write_header=False)`` writes for
the array ``a`` of our layout (the flat tensor as (n,), (n, 4) or (n, 4, 4)), and decoding gives
zfpy's values, except that a block holding NaN/Inf decodes to NaN (zfp has no rule for them).
Format, layout, NaN rule and costs: ``zfp.md`` beside this file. Kernels: ``csrc/cpu/zfp_cpu.cpp``,
``csrc/cuda/zfp_kernels.cu``, block math ``csrc/include/zpp/zfp_math.h``; reference:
``zfp_reference.py`` (zfpy).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from megatron_zpp.compression import _extension, ops, zfp_reference
from megatron_zpp.compression.base import Codec, Packed
from megatron_zpp.compression.zfp_reference import maxbits_for_rate, payload_bytes

MAX_RATE = 32
VALID_DIMS = (1, 2, 3)
#: zfp's block header (non-zero flag + 8-bit exponent); a smaller budget breaks zfp's own coder.
MIN_BLOCK_BITS = 9


@dataclass(frozen=True, kw_only=True)
class ZfpConfig:
    rate: float = 8
    """Bits per value, fixed: every block of 4^dims values takes floor(4^dims * rate + 0.5) bits, as
    zfp_stream_set_rate computes it (no word alignment, as zfpy sets it). A number in (0, 32] that
    leaves a block at least 9 bits (zfp's header), e.g. 4, 8, 16, 32. The payload is 32/rate times
    smaller than fp32 and 16/rate times smaller than bf16/fp16 (which are coded as fp32)."""
    dims: int = 3
    """Dimensionality of zfp's blocks (1, 2 or 3): the flat tensor is coded as zfp's array of shape
    (n,), (n, 4) or (n, 4, 4), so a block is 4, 16 or 64 consecutive values. zfp spends a 9-bit
    header per block: 3 (the default) pays it once per 64 values, 1 once per 4 values, which at rate
    8 leaves 23 of the 32 bits of a 1-D block for the values themselves."""

    def __post_init__(self) -> None:
        if isinstance(self.dims, bool) or self.dims not in VALID_DIMS:
            raise ValueError(f"dims={self.dims} is not valid; valid: {', '.join(map(str, VALID_DIMS))}")
        rate = self.rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (0 < rate <= MAX_RATE):
            raise ValueError(f"rate={rate} is not valid; valid: a number in (0, {MAX_RATE}]")
        n = 4**self.dims
        if maxbits_for_rate(rate, self.dims) < MIN_BLOCK_BITS:
            raise ValueError(f"rate={rate} is not valid at dims={self.dims}: it leaves "
                             f"{maxbits_for_rate(rate, self.dims)} bits per block of {n} values and zfp needs "
                             f"at least {MIN_BLOCK_BITS}; valid: rate >= {(MIN_BLOCK_BITS - 0.5) / n:g}")
        if float(rate).is_integer():  # canonical spec "zfp:rate=8,dims=3", not "rate=8.0"
            object.__setattr__(self, "rate", int(rate))


class ZfpCodec(Codec):
    """zfp fixed-rate mode on flat tensors (fp32; bf16/fp16 through fp32). Fixed size: ``wire_bytes``
    depends on numel only."""

    lossless = False

    def __init__(self, config: ZfpConfig, spec: str) -> None:
        self.rate = config.rate
        self.dims = config.dims
        self.maxbits = maxbits_for_rate(config.rate, config.dims)
        self.spec = spec

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        if numel < 0:
            raise ValueError(f"numel={numel} must be >= 0")
        return payload_bytes(numel, self.dims, self.maxbits)

    def encode(self, x: torch.Tensor) -> Packed:
        payload = torch.empty(self.wire_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        zfp_encode_(x.contiguous(), payload, self.dims, self.maxbits)
        return Packed(payload=payload, shape=x.shape, dtype=x.dtype)

    def decode(self, packed: Packed) -> torch.Tensor:
        expected = self.wire_bytes(packed.numel)
        if packed.payload.dtype != torch.uint8 or packed.payload.numel() != expected:
            raise ValueError(f"{self.spec}: payload has {packed.payload.numel()} {packed.payload.dtype} "
                             f"elements; {packed.numel} values need {expected} uint8 bytes")
        out = torch.empty(packed.shape, dtype=packed.dtype, device=packed.payload.device)
        zfp_decode_(packed.payload.contiguous().view(-1), out, self.dims, self.maxbits)
        return out


# ------------------------------------------------------------------ ops -----
def _has_zfp_kernels(device: torch.device) -> bool:
    if not ops.kernels_available(device) or not hasattr(torch.ops.megatron_zpp, "zfp_encode_"):
        return False
    if device.type == "cuda":
        try:
            return torch._C._dispatch_has_kernel_for_dispatch_key("megatron_zpp::zfp_encode_", "CUDA")
        except Exception:
            return False
    return True


def _why_no_kernels(device: torch.device) -> str:
    if ops.kernels_available(device) and not hasattr(torch.ops.megatron_zpp, "zfp_encode_"):
        return f"the kernels loaded from {_extension.loaded_from()} predate the zfp ops (rebuild them)"
    return ops._why_unavailable(device)


def _reference_encode_(x, payload, dims, maxbits):
    payload.copy_(zfp_reference.encode(x, dims, maxbits))


def _reference_decode_(payload, out, dims, maxbits):
    out.copy_(zfp_reference.decode(payload, out.shape, out.dtype, dims, maxbits))


def _impl(name: str, device: torch.device, backend: str):
    """The implementation of op ``name`` for ``device`` (as ops._impl decides for the quantization ops)."""
    if backend not in ops.BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {ops.BACKENDS}")
    reference = {"zfp_encode_": _reference_encode_, "zfp_decode_": _reference_decode_}[name]
    if backend == "reference":
        if device.type != "cpu":
            raise ValueError(f"the ZFP reference (zfpy) runs on CPU tensors only, got {device}")
        return reference
    if _has_zfp_kernels(device):
        return getattr(torch.ops.megatron_zpp, name)
    if backend == "kernel" or device.type != "cpu":
        hint = ops.CUDA_BUILD_HINT if device.type == "cuda" else ops.CPU_BUILD_HINT
        raise RuntimeError(f"megatron_zpp: no compiled ZFP kernels for {device} tensors: {_why_no_kernels(device)}. "
                           f"To fix: build them with `{hint}`" + ("" if device.type != "cpu" else
                                                                   ', or pass backend="reference"') + ".")
    warnings.warn(f"megatron_zpp: compiled ZFP kernels unavailable, using the zfpy reference (slow): "
                  f"{_why_no_kernels(device)}. To fix: build them with `{ops.CPU_BUILD_HINT}`.", stacklevel=3)
    return reference


def _check(dims: int, maxbits: int, payload: torch.Tensor, numel: int, device: torch.device) -> None:
    if dims not in VALID_DIMS:
        raise ValueError(f"dims={dims} is not valid; valid: {', '.join(map(str, VALID_DIMS))}")
    if not MIN_BLOCK_BITS <= maxbits <= 4**dims * 64:
        raise ValueError(f"maxbits={maxbits} is not valid at dims={dims}; valid: {MIN_BLOCK_BITS} to {4**dims * 64}")
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise ValueError(f"payload must be a contiguous 1-D uint8 tensor, got {payload.dtype} of shape "
                         f"{tuple(payload.shape)}")
    if payload.device != device:
        raise ValueError(f"payload is on {payload.device}, expected {device}")
    expected = payload_bytes(numel, dims, maxbits)
    if payload.numel() != expected:
        raise ValueError(f"payload has {payload.numel()} bytes; {numel} values at dims={dims}, "
                         f"maxbits={maxbits} need {expected}")


def zfp_encode_(x: torch.Tensor, payload: torch.Tensor, dims: int, maxbits: int, *, backend: str = "auto") -> None:
    """Write the zfp fixed-rate stream of x (any shape, read flat) into payload (uint8[payload_bytes])."""
    ops._check_float("x", x)
    _check(dims, maxbits, payload, x.numel(), x.device)
    _impl("zfp_encode_", x.device, backend)(x, payload, dims, maxbits)


def zfp_decode_(payload: torch.Tensor, out: torch.Tensor, dims: int, maxbits: int, *, backend: str = "auto") -> None:
    """Decode payload into out (its numel values, cast to its dtype)."""
    ops._check_float("out", out)
    _check(dims, maxbits, payload, out.numel(), out.device)
    _impl("zfp_decode_", out.device, backend)(payload, out, dims, maxbits)


__all__ = ["ZfpCodec", "ZfpConfig", "maxbits_for_rate", "payload_bytes", "zfp_decode_", "zfp_encode_"]
