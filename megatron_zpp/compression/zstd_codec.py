"""The lossless CPU codec ``zstd[:level=L]``: byte grouping + zstd (the ``zstandard`` package).

Chosen over blosc2 (shuffle + zstd) and zipnn by the measured comparison in ``lossless.md``
(``tools/lossless_compare.py``): 1.47x on bf16 Gaussian data and 1.19x on fp32, within 3% of
zipnn on dense tensors, on a thin binding to the reference zstd library.

Payload: the container (``container.py``), codec ``zstd``, whose body is one zstd frame per
1 MiB chunk of each byte plane (plane-major, low byte first) and whose sizes table lists the
frames' lengths. Frames are independent, so they compress and decompress on several threads
(zstandard releases the GIL).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from dataclasses import dataclass

import torch

from megatron_zpp.compression import bytegroup, container
from megatron_zpp.compression.base import Packed
from megatron_zpp.compression.container import ContainerCodec, PayloadError
from megatron_zpp.compression.mpc import check_float, container_checksum

CHUNK = 1 << 20  # bytes of one plane per zstd frame; as good a ratio as whole planes (measured)
MIN_LEVEL, MAX_LEVEL = 1, 19


@dataclass(frozen=True, kw_only=True)
class ZstdConfig:
    level: int = 1
    """zstd compression level, 1..19. 1 is the measured best on float data: level 3 compresses bf16
    Gaussian planes *worse* (1.425x vs 1.470x) and is slower; higher levels cost much more time."""

    def __post_init__(self) -> None:
        if not MIN_LEVEL <= self.level <= MAX_LEVEL:
            raise ValueError(f"level={self.level} is not valid; valid: an integer in {MIN_LEVEL}..{MAX_LEVEL}")


def _zstandard():
    try:
        import zstandard
    except ImportError as exc:
        raise ImportError("the 'zstd' codec needs the zstandard package: pip install 'megatron_zpp[lossless]' "
                          "(or pip install zstandard)") from exc
    return zstandard


def compress_bound(n: int) -> int:
    """zstd's documented worst case for one frame of ``n`` bytes (ZSTD_COMPRESSBOUND in zstd.h)."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0)


def _chunks(numel: int, itemsize: int) -> list[tuple[int, int, int]]:
    """(plane, start, length) of every frame, in payload order."""
    return [(p, s, min(CHUNK, numel - s)) for p in range(itemsize) for s in range(0, numel, CHUNK)]


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()),
                                                 thread_name_prefix="zpp-zstd")


_local = threading.local()


def _compressor(level: int):
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = _zstandard().ZstdCompressor(level=level)
    return cache[level]


def _decompressor():
    if not hasattr(_local, "decompressor"):
        _local.decompressor = _zstandard().ZstdDecompressor()
    return _local.decompressor


def _map(fn, items):
    items = list(items)
    if len(items) <= 1:
        return [fn(i) for i in items]
    return list(_pool().map(fn, items))


class ZstdCodec(ContainerCodec):
    """``zstd[:level=L]``: lossless, CPU tensors only; byte grouping then zstd per 1 MiB plane chunk."""
    devices = ("cpu",)

    def __init__(self, config: ZstdConfig, spec: str) -> None:
        _zstandard()  # fail at construction, with the install hint, when the package is missing
        self.level = config.level
        self.spec = spec

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        if numel < 0:
            raise ValueError(f"numel={numel} must be >= 0")
        frames = _chunks(numel, torch.empty((), dtype=dtype).element_size())
        return container.header_bytes(len(frames)) + sum(compress_bound(n) for _, _, n in frames)

    def _check_cpu(self, t: torch.Tensor, what: str) -> None:
        if t.device.type != "cpu":
            raise RuntimeError(f"{self.spec}: {what} is on {t.device}; the zstd codec runs on CPU tensors only. "
                               "For CUDA tensors use 'nvcomp:algo=ans' (nvCOMP, byte-grouped ANS) or 'mpc'")

    def encode(self, x: torch.Tensor) -> Packed:
        check_float(self.spec, x)
        self._check_cpu(x, "the tensor")
        planes = bytegroup.group(x).numpy()
        level = self.level
        frames = _map(lambda f: _compressor(level).compress(planes[f[0], f[1]:f[1] + f[2]].data),
                      _chunks(x.numel(), x.element_size()))
        head = container.pack_header("zstd", x.dtype, 0, x.numel(), [len(f) for f in frames])
        payload = torch.frombuffer(bytearray(b"".join([head, *frames])), dtype=torch.uint8)
        container.write_checksum_(payload, container_checksum(payload))
        return Packed(payload=payload, shape=x.shape, dtype=x.dtype)

    def decode(self, packed: Packed) -> torch.Tensor:
        payload = self._checked_payload(packed)
        self._check_cpu(payload, "the payload")
        payload = payload.contiguous()
        checksum = container_checksum(payload)
        header = container.validate(payload, checksum, codec="zstd", dtype=packed.dtype, numel=packed.numel,
                                    what=f"{self.spec} payload")
        itemsize = packed.dtype.itemsize
        chunks = _chunks(packed.numel, itemsize)
        if len(header.sizes) != len(chunks):
            raise PayloadError(f"{self.spec} payload is corrupt: {len(header.sizes)} frames for {packed.numel} "
                               f"values, which need {len(chunks)}")
        buf = payload.numpy()
        starts = [header.body_offset + sum(header.sizes[:i]) for i in range(len(chunks))]
        planes = torch.empty(itemsize, packed.numel, dtype=torch.uint8)
        import numpy as np  # here, not at import: setup.py imports this package before numpy is installed

        out_np = planes.numpy()
        zstandard = _zstandard()

        def one(i: int) -> None:
            plane, start, length = chunks[i]
            frame = buf[starts[i]: starts[i] + header.sizes[i]].data
            try:
                raw = _decompressor().decompress(frame, max_output_size=length)
            except zstandard.ZstdError as exc:
                raise PayloadError(f"{self.spec} payload is corrupt: frame {i} does not decode ({exc})") from None
            if len(raw) != length:
                raise PayloadError(f"{self.spec} payload is corrupt: frame {i} holds {len(raw)} bytes, "
                                   f"expected {length}")
            out_np[plane, start: start + length] = np.frombuffer(raw, dtype=np.uint8)

        _map(one, range(len(chunks)))
        return bytegroup.ungroup(planes, packed.dtype).view(packed.shape)
