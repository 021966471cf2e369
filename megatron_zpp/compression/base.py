"""The codec interface: tensor <-> packed payload, with exact wire sizes.

A codec never communicates and knows nothing of processes or Megatron; the
compressed collectives in ``megatron_zpp.comm`` move its payloads.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packed:
    """An encoded tensor.

    ``payload`` is the flat ``uint8`` buffer that goes on the wire: exactly
    ``codec.wire_bytes(numel, dtype)`` bytes. ``shape`` and ``dtype`` are *not*
    sent: collectives agree on them out of band (every rank knows its buckets).
    """

    payload: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return self.shape.numel()


class Codec(abc.ABC):
    """Encodes float tensors (fp32 / bf16 / fp16, any shape and numel) for the wire."""

    #: The spec string this codec was built from, in canonical form (``"int8:block=256"``).
    spec: str
    #: True when ``decode(encode(x))`` is bit-identical to ``x``.
    lossless: bool

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> Packed:
        """Encode ``x``; the payload lives on ``x.device``."""

    @abc.abstractmethod
    def decode(self, packed: Packed) -> torch.Tensor:
        """Decode to a tensor of ``packed.shape`` and ``packed.dtype``."""

    @abc.abstractmethod
    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact payload bytes for ``numel`` elements of ``dtype``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"
