"""The codec interface: tensor <-> packed payload, with exact or bounded wire sizes.

A codec never communicates and knows nothing of processes or Megatron; the
compressed collectives in ``megatron_zpp.comm`` move its payloads.

Two kinds of codec share the interface, told apart by ``Codec.fixed_size``:

* **Fixed-size** (``fixed_size = True``: ``none``, ``int8``, ``int4``): the payload is exactly
  ``wire_bytes(numel, dtype)`` bytes, a function of the shape alone, so a receiver posts a
  buffer of that size and needs no size message.
* **Variable-size** (``fixed_size = False``: the lossless ``mpc``, ``zstd``, ``nvcomp``): the
  payload's length depends on the data. ``wire_bytes(numel, dtype)`` is then the *worst case*,
  an upper bound valid for every input, so a receiver can preallocate a buffer that fits any
  payload. The payload is a container (``container.py``, ``lossless.md``) whose header holds its
  true length, ``payload_nbytes(packed)``. ``encode`` on CPU returns exactly that many bytes; on
  a GPU it may return the whole worst-case buffer (finding the true length would cost a host
  sync), the bytes past the true length being unspecified. ``decode`` accepts any buffer that
  starts with a whole payload: trailing bytes are ignored, a short or corrupt one raises
  ``container.PayloadError`` (a ``ValueError``) naming what is wrong.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packed:
    """An encoded tensor.

    ``payload`` is the flat ``uint8`` buffer that goes on the wire: exactly
    ``codec.wire_bytes(numel, dtype)`` bytes for a fixed-size codec; for a variable-size one at
    most that many, of which the first ``codec.payload_nbytes(packed)`` are the payload (module
    docstring). ``shape`` and ``dtype`` are *not* sent: collectives agree on them out of band
    (every rank knows its buckets); variable-size payloads also carry them in their header, to
    check them on decode.
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
    #: True when every payload is exactly ``wire_bytes(numel, dtype)`` bytes; False when the length
    #: depends on the data and ``wire_bytes`` is an upper bound (module docstring).
    fixed_size: bool = True
    #: Device types the codec runs on (``zstd`` is CPU-only, ``nvcomp`` CUDA-only): policies check it
    #: when hooks are installed, not at the first collective, where one failing rank leaves peers waiting.
    devices: tuple[str, ...] = ("cpu", "cuda")

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> Packed:
        """Encode ``x``; the payload lives on ``x.device``."""

    @abc.abstractmethod
    def decode(self, packed: Packed) -> torch.Tensor:
        """Decode to a tensor of ``packed.shape`` and ``packed.dtype``."""

    @abc.abstractmethod
    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Payload bytes for ``numel`` elements of ``dtype``: exact when ``fixed_size``, else the
        worst case over all inputs (the size of a receive buffer that fits any payload)."""

    def payload_nbytes(self, packed: Packed) -> int:
        """The true length of ``packed``'s payload; ``<= wire_bytes``. Fixed-size codecs: the
        buffer's length. Variable-size codecs read it from the container header (on a GPU, one
        small device-to-host read)."""
        return packed.payload.numel()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"
