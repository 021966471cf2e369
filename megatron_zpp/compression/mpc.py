"""The lossless ``mpc`` codec: MPC for float32, MPC16 for bfloat16/float16 (chosen by dtype).

Integer-only stages per 1024-value sub-chunk (LNVd, 32x32 bit transpose, LNV1, zero
elimination), after Yang, Mukka, Hesaaraki and Burtscher, "MPC: A Massively Parallel
Compression Algorithm for Scientific Data" (IEEE Cluster 2015), in the project's own
container. C++ (CPU), CUDA and pure-PyTorch implementations give the same bytes.
Format, ratios and what has not run on a GPU: ``lossless.md`` beside this file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_zpp.compression import container, mpc_reference, ops
from megatron_zpp.compression.base import Packed
from megatron_zpp.compression.container import ContainerCodec

FLOAT_DTYPES = ops.FLOAT_DTYPES


@dataclass(frozen=True, kw_only=True)
class MpcConfig:
    dim: int = 1
    """Stride of the first prediction (LNVd): value j is predicted by value j - dim of its sub-chunk.
    1 for flat tensors (the default, and what NN tensors want); 3 for interleaved xyz triples, etc.
    Valid: 1..32. Stored in the payload header and checked on decode."""

    def __post_init__(self) -> None:
        if not 1 <= self.dim <= 32:
            raise ValueError(f"dim={self.dim} is not valid; valid: an integer in 1..32")


def check_float(name: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: dtype {x.dtype} is not supported; valid: "
                        f"{', '.join(str(d).removeprefix('torch.') for d in FLOAT_DTYPES)}")


def container_checksum(payload: torch.Tensor) -> torch.Tensor:
    """ZPP-sum32 of a payload as an int64 0-d tensor on its device: the C++/CUDA op when built, else the
    PyTorch reference (on a GPU too: slower, but it never leaves the device)."""
    device = payload.device
    backend = "auto" if device.type == "cpu" or ops._has_kernel("container_checksum", device) else "reference"
    return ops._impl("container_checksum", device, backend, mpc_reference)(payload)


class MpcCodec(ContainerCodec):
    """``mpc[:dim=D]``: lossless; about 1.10x on float32 and 1.28x on bfloat16 Gaussian data (lossless.md)."""

    def __init__(self, config: MpcConfig, spec: str, *, backend: str = "auto") -> None:
        self.dim = config.dim
        self.spec = spec
        self.backend = backend

    def _op(self, name: str, device: torch.device):
        return ops._impl(name, device, self.backend, mpc_reference)

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        if numel < 0:
            raise ValueError(f"numel={numel} must be >= 0")
        return mpc_reference.max_payload_bytes(numel, mpc_reference.word_bits(dtype))

    def encode(self, x: torch.Tensor) -> Packed:
        check_float(self.spec, x)
        check_size(self.spec, x.numel(), x.dtype)
        payload = self._op("mpc_encode", x.device)(x.detach().contiguous(), self.dim)
        return Packed(payload=payload, shape=x.shape, dtype=x.dtype)

    def decode(self, packed: Packed) -> torch.Tensor:
        payload = self._checked_payload(packed)
        payload = payload.contiguous()
        checksum = self._op("container_checksum", payload.device)(payload)
        container.validate(payload, checksum, **self._expect(packed))
        return self._decode_body(payload, packed)

    def decode_deferred(self, packed: Packed) -> tuple[torch.Tensor, container.DeferredCheck]:
        """``decode`` with the container's validation deferred (no host read: ``ContainerCodec``).

        The decode kernels stay inside the payload buffer whatever its bytes (they take its length), so a
        corrupt payload decodes to garbage that the check then rejects. Where a kernel refuses the payload
        at once (the CPU kernels check the body), the output is NaN and the check raises later, as on a GPU:
        the container's own error when its header or checksum is bad, else the kernel's."""
        payload = self._checked_payload(packed)
        payload = payload.contiguous()
        checksum = self._op("container_checksum", payload.device)(payload)
        check = container.deferred_check(payload, checksum, **self._expect(packed))
        try:
            out = self._decode_body(payload, packed)
        except container.PayloadError as exc:
            out = torch.full(packed.shape, float("nan"), dtype=packed.dtype, device=payload.device)
            return out, dataclasses.replace(check, error=str(exc))
        # The check raises one progress point later; meanwhile a payload whose checksum does not match is
        # decoded to NaN on the device (no host read), so this iteration's found-inf check already sees it
        # and Megatron skips the step instead of applying garbage.
        if payload.numel() >= container.HEADER_BYTES:
            off = container.CHECKSUM_OFFSET
            stored = payload[off:off + 4].clone().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
            out.masked_fill_(stored.reshape(()) != (checksum.reshape(()).to(torch.int64) & 0xFFFFFFFF),
                             float("nan"))
        return out, check

    def _expect(self, packed: Packed) -> dict:
        return dict(codec="mpc", dtype=packed.dtype, numel=packed.numel, param=self.dim, param_name="dim",
                    what=f"{self.spec} payload")

    def _decode_body(self, payload: torch.Tensor, packed: Packed) -> torch.Tensor:
        out = torch.empty(packed.shape, dtype=packed.dtype, device=payload.device)
        try:
            self._op("mpc_decode_", payload.device)(payload, out, self.dim)
        except RuntimeError as exc:  # the kernels' own corruption checks (valid checksum, impossible body)
            raise container.PayloadError(f"{self.spec}: {exc}") from None
        return out


def check_size(spec: str, numel: int, dtype: torch.dtype) -> None:
    """Refuse, before any kernel runs, a tensor whose worst-case body segment overflows the container's
    uint32 sizes table (the plane words of about 4 GiB of values; ``container.MAX_SEGMENT_BYTES``)."""
    planes, bitmap = mpc_reference.geometry(numel, mpc_reference.word_bits(dtype))
    container.check_segment_sizes([4 * bitmap, 4 * planes], f"{spec}: {numel} {dtype} values")
