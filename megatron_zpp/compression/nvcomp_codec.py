"""The lossless GPU codec ``nvcomp[:algo=A]``: NVIDIA nvCOMP on CUDA tensors (``nvidia.nvcomp``).

NOT RUN: no GPU was available where this was written; the code follows nvCOMP 6.0's Python
docstrings (``nvidia-nvcomp-cu13``, the ``gpu`` extra) and its tests skip without a GPU.
``lossless.md`` says what is untested.

Data path, all on the tensor's device: byte-oriented algorithms (``ans``, ``lz4``, ``zstd``,
``gdeflate``) get the byte planes of ``bytegroup.group`` (exponent bytes apart from mantissa
bytes: what lets an order-0 coder like ANS approach the 1.5x entropy bound of bf16 Gaussian
data), typed ones (``bitcomp``, ``cascaded``) the raw words. Tensors reach nvCOMP through DLPack /
``__cuda_array_interface__`` (``nvcomp.as_array``) and come back through ``torch.from_dlpack``:
no host copies of the data. The payload is the container (``container.py``): header, sizes
``[8, n]`` (8 zero bytes so the nvCOMP stream starts 16-byte aligned at offset 48), then nvCOMP's
own stream. Host syncs: encode reads the compressed length (one sync), decode reads the header
and checksum (one) and nvCOMP parses its stream header (one).

On a CPU tensor, without a GPU or without the package, it raises an error saying why and what to
use instead (``zstd`` on CPU, ``mpc`` anywhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_zpp.compression import bytegroup, container
from megatron_zpp.compression.base import Packed
from megatron_zpp.compression.container import ContainerCodec, PayloadError
from megatron_zpp.compression.mpc import check_float, container_checksum

# Algorithm -> (nvCOMP name, id in the container's parameter byte, byte-grouped input?)
ALGOS = {
    "ans": ("ANS", 1, True),
    "bitcomp": ("Bitcomp", 2, False),
    "cascaded": ("Cascaded", 3, False),
    "lz4": ("LZ4", 4, True),
    "zstd": ("Zstd", 5, True),
    "gdeflate": ("GDeflate", 6, True),
}
ALIGN_PAD = 8  # sizes [8, n]: the nvCOMP stream starts at 32 + 2*4 + 8 = 48, a multiple of 16
STREAM_OFFSET = container.header_bytes(2) + ALIGN_PAD
INSTALL_HINT = "pip install 'megatron_zpp[gpu]' (nvidia-nvcomp-cu13, matching torch's CUDA 13)"


@dataclass(frozen=True, kw_only=True)
class NvcompConfig:
    algo: Literal["ans", "bitcomp", "cascaded", "lz4", "zstd", "gdeflate"] = "ans"
    """nvCOMP algorithm. ``ans`` (default): order-0 entropy coder on the byte planes, the natural
    lossless choice for bf16/fp16. ``bitcomp``: nvCOMP's float/integer bit-packer, lossless mode, on
    the raw words. ``cascaded``: RLE/delta/bit-packing on the raw words (integer-minded; rarely
    gains on floats). ``lz4``, ``zstd``, ``gdeflate``: LZ coders on the byte planes."""


def _nvcomp():
    try:
        from nvidia import nvcomp
    except ImportError as exc:
        raise ImportError(f"the 'nvcomp' codec needs NVIDIA nvCOMP's Python package: {INSTALL_HINT}; "
                          "without a GPU use 'zstd' (CPU) or 'mpc'") from exc
    return nvcomp


def _word_type(dtype: torch.dtype) -> str:
    return "<u4" if dtype == torch.float32 else "<u2"


class NvcompCodec(ContainerCodec):
    """``nvcomp[:algo=A]``: lossless, CUDA tensors only (see the module docstring; not run here)."""
    devices = ("cuda",)

    def __init__(self, config: NvcompConfig, spec: str) -> None:
        # No nvCOMP import here: a policy naming nvcomp must still parse on a machine without it.
        self.algo = config.algo
        self.nv_name, self.algo_id, self.grouped = ALGOS[config.algo]
        self.spec = spec
        self._codecs: dict = {}

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """A bound computed without nvCOMP (which needs a GPU): raw bytes + 1/8 + 68 KiB. An estimate of
        nvCOMP's worst-case expansion, NOT checked against its ``get_max_comp_buffer_size`` (no GPU here);
        ``encode`` raises if a payload ever exceeds it."""
        if numel < 0:
            raise ValueError(f"numel={numel} must be >= 0")
        raw = numel * torch.empty((), dtype=dtype).element_size()
        return STREAM_OFFSET + raw + raw // 8 + (64 << 10) + 4096

    def _check_device(self, t: torch.Tensor, what: str) -> None:
        if t.device.type != "cuda":
            raise RuntimeError(f"{self.spec}: {what} is on {t.device}; nvCOMP compresses CUDA tensors only. "
                               "For CPU tensors use 'zstd' (byte grouping + zstd) or 'mpc'")
        if not torch.cuda.is_available():
            raise RuntimeError(f"{self.spec}: no CUDA GPU is available; nvCOMP needs one. Use 'zstd' or 'mpc'")

    def _codec(self, device: torch.device, dtype: torch.dtype):
        nvcomp = _nvcomp()
        stream = torch.cuda.current_stream(device).cuda_stream
        key = (device.index, stream, dtype)
        if key not in self._codecs:
            opts = {} if self.grouped else {"data_type": _word_type(dtype)}
            self._codecs[key] = nvcomp.Codec(algorithm=self.nv_name, device_id=device.index, cuda_stream=stream,
                                             **opts)
        return self._codecs[key], stream

    def _source(self, x: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            return bytegroup.group(x).reshape(-1)
        return x.detach().contiguous().reshape(-1).view(torch.uint8)

    def encode(self, x: torch.Tensor) -> Packed:
        check_float(self.spec, x)
        self._check_device(x, "the tensor")
        nvcomp = _nvcomp()
        codec, stream = self._codec(x.device, x.dtype)
        src = self._source(x)
        if src.numel():
            encoded = codec.encode(nvcomp.as_array(src, cuda_stream=stream))
            stream_bytes = torch.from_dlpack(encoded).reshape(-1).view(torch.uint8)  # copy-free; the size syncs
        else:
            stream_bytes = torch.empty(0, dtype=torch.uint8, device=x.device)
        head = container.pack_header("nvcomp", x.dtype, self.algo_id, x.numel(), [ALIGN_PAD, stream_bytes.numel()])
        payload = torch.zeros(STREAM_OFFSET + stream_bytes.numel(), dtype=torch.uint8, device=x.device)
        payload[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(x.device, non_blocking=True)
        payload[STREAM_OFFSET:] = stream_bytes
        checksum = container_checksum(payload)
        container.write_checksum_(payload, checksum)
        return Packed(payload=payload, shape=x.shape, dtype=x.dtype)

    def decode(self, packed: Packed) -> torch.Tensor:
        payload = self._checked_payload(packed)
        self._check_device(payload, "the payload")
        payload = payload.contiguous()
        checksum = container_checksum(payload)
        header = container.validate(payload, checksum, codec="nvcomp", dtype=packed.dtype, numel=packed.numel,
                                    param=self.algo_id, param_name="algorithm id", what=f"{self.spec} payload")
        if len(header.sizes) != 2 or header.sizes[0] != ALIGN_PAD:
            raise PayloadError(f"{self.spec} payload is corrupt: sizes {header.sizes}, expected [{ALIGN_PAD}, n]")
        nbytes = packed.numel * packed.dtype.itemsize
        if nbytes == 0:
            return torch.empty(packed.shape, dtype=packed.dtype, device=payload.device)
        nvcomp = _nvcomp()
        codec, stream = self._codec(payload.device, packed.dtype)
        src = payload[STREAM_OFFSET: STREAM_OFFSET + header.sizes[1]]
        try:
            decoded = codec.decode(nvcomp.as_array(src, cuda_stream=stream), data_type="|u1")
        except (RuntimeError, ValueError) as exc:
            raise PayloadError(f"{self.spec} payload is corrupt: nvCOMP cannot decode it ({exc})") from None
        raw = torch.from_dlpack(decoded).reshape(-1).view(torch.uint8)
        if raw.numel() != nbytes:
            raise PayloadError(f"{self.spec} payload is corrupt: nvCOMP decoded {raw.numel()} bytes, "
                               f"{packed.numel} {packed.dtype} values are {nbytes}")
        if self.grouped:
            out = bytegroup.ungroup(raw.view(packed.dtype.itemsize, packed.numel), packed.dtype)
        else:
            out = raw.view(packed.dtype)
        return out.reshape(packed.shape)
