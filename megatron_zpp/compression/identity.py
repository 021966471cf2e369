"""The ``none`` codec: the tensor's own bytes, zero-copy. Identity policies use it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_zpp.compression.base import Codec, Packed


@dataclass(frozen=True, kw_only=True)
class NoneConfig:
    """``none`` takes no parameters."""


class IdentityCodec(Codec):
    lossless = True
    spec = "none"

    def __init__(self, config: NoneConfig | None = None) -> None:
        pass

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        if numel < 0:
            raise ValueError(f"numel={numel} must be >= 0")
        return numel * torch.empty((), dtype=dtype).element_size()

    def encode(self, x: torch.Tensor) -> Packed:
        return Packed(payload=x.contiguous().view(-1).view(torch.uint8), shape=x.shape, dtype=x.dtype)

    def decode(self, packed: Packed) -> torch.Tensor:
        if packed.payload.numel() != self.wire_bytes(packed.numel, packed.dtype):
            raise ValueError(f"none: payload has {packed.payload.numel()} bytes; {packed.numel} "
                             f"{packed.dtype} values need {self.wire_bytes(packed.numel, packed.dtype)}")
        return packed.payload.view(packed.dtype).view(packed.shape)
