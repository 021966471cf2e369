"""The reference of the ZFP codec: zfpy (zfp 1.0.1's own C library), plus our layout and NaN rule.

``encode`` / ``decode`` here produce exactly the kernels' bytes and values (tests check it), on CPU
tensors only, at zfpy's speed. They are the test oracle and the fallback when the C++ kernels are not
built. The layout and the NaN rule: ``zfp.md`` beside this file.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _zfpy():
    try:
        import zfpy
    except ImportError as exc:  # a dependency of the package; only missing in broken environments
        raise ImportError(f"the ZFP reference needs zfpy ({exc}); install it with `pip install zfpy==1.0.1`") from exc
    return zfpy


def block_values(dims: int) -> int:
    return 4**dims


def maxbits_for_rate(rate: float, dims: int) -> int:
    """Bits per block as zfp_stream_set_rate computes them: floor(4^dims * rate + 0.5), in double."""
    return math.floor(block_values(dims) * rate + 0.5)


def num_blocks(numel: int, dims: int) -> int:
    return -(-numel // block_values(dims))


def payload_bytes(numel: int, dims: int, maxbits: int) -> int:
    """zfp's stream length: every block maxbits bits, then zero bits up to a whole 64-bit word."""
    return 8 * -(-(num_blocks(numel, dims) * maxbits) // 64)


def _pad4(v: np.ndarray, n: int) -> None:
    """zfp's rule for a run of n < 4 values (in place on a length-4 view): a a a a / a b b a / a b c a."""
    if n == 0:
        v[0] = 0
    if n <= 1:
        v[1] = v[0]
    if n <= 2:
        v[2] = v[1]
    if n <= 3:
        v[3] = v[0]


def zfp_array(x: np.ndarray, dims: int) -> np.ndarray:
    """The array zfpy compresses to give our payload: x flat, its tail completed to whole rows (2-D)
    or 4x4 planes (3-D) by zfp's padding rule, shaped (n,), (n, 4) or (n, 4, 4). zfp pads the last
    block's missing rows / planes itself, by the same rule."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if dims == 1:
        return flat
    row = 4 ** (dims - 1)
    full = flat.size - flat.size % row
    tail = flat[full:]
    if tail.size:
        w = tail.size
        if dims == 2:
            part = np.zeros(4, np.float32)
            part[:w] = tail
            _pad4(part, w)
        else:
            part = np.zeros((4, 4), np.float32)  # [y, x]
            part.reshape(-1)[:w] = tail
            if w % 4:
                _pad4(part[w // 4], w % 4)
            for xi in range(4):
                _pad4(part[:, xi], -(-w // 4))
        flat = np.concatenate([flat[:full], part.reshape(-1)])
    return flat.reshape((-1, 4) if dims == 2 else (-1, 4, 4))


def _block_bit_ranges(blocks: np.ndarray, maxbits: int) -> np.ndarray:
    """Indices of the bits of `blocks` in an unpacked (little-endian) bit array."""
    return (blocks[:, None] * maxbits + np.arange(maxbits)[None, :]).reshape(-1)


def encode(x: torch.Tensor, dims: int, maxbits: int) -> torch.Tensor:
    """The payload (uint8, CPU) of x: zfpy's stream, with non-finite blocks replaced by our marker."""
    if x.device.type != "cpu":
        raise ValueError(f"the zfpy reference runs on CPU tensors only, got a {x.device} tensor")
    numel = x.numel()
    nbytes = payload_bytes(numel, dims, maxbits)
    if numel == 0:
        return torch.empty(0, dtype=torch.uint8)  # (zfpy crashes on empty arrays)
    arr = x.detach().reshape(-1).float().numpy()
    rate = maxbits / block_values(dims)  # the exact maxbits back (zfp rounds floor(n * rate + 0.5))
    stream = _zfpy().compress_numpy(zfp_array(arr, dims), rate=rate, write_header=False)
    assert len(stream) == nbytes, (len(stream), nbytes)
    payload = np.frombuffer(stream, dtype=np.uint8).copy()
    bad = _nonfinite_blocks(arr, dims)
    if bad.size:  # marker: bit 1 (non-zero flag), exponent field 0, then zeros, over the whole block
        bits = np.unpackbits(payload, bitorder="little")
        bits[_block_bit_ranges(bad, maxbits)] = 0
        bits[bad * maxbits] = 1
        payload = np.packbits(bits, bitorder="little")
    return torch.from_numpy(payload)


def _nonfinite_blocks(arr: np.ndarray, dims: int) -> np.ndarray:
    bad = ~np.isfinite(arr)
    if not bad.any():
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.flatnonzero(bad) // block_values(dims))


def decode(payload: torch.Tensor, shape, dtype: torch.dtype, dims: int, maxbits: int) -> torch.Tensor:
    """zfpy's decode of the payload, NaN for our non-finite marker blocks, cast to dtype."""
    numel = math.prod(shape)
    if payload.device.type != "cpu":
        raise ValueError(f"the zfpy reference runs on CPU tensors only, got a {payload.device} payload")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    data = payload.numpy().tobytes()
    nb = num_blocks(numel, dims)
    zshape = {1: (nb * 4,), 2: (nb * 4, 4), 3: (nb * 4, 4, 4)}[dims]
    zfpy = _zfpy()
    rate = maxbits / block_values(dims)
    values = zfpy._decompress(data, zfpy.dtype_to_ztype(np.dtype(np.float32)), zshape, rate=rate).reshape(-1)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    starts = np.arange(nb) * maxbits
    head = np.zeros(nb, dtype=np.int64)
    for i in range(9):  # flag + 8 exponent bits of every block
        head |= bits[starts + i].astype(np.int64) << i
    out = values[:numel].copy()
    out[np.repeat(head == 1, block_values(dims))[:numel]] = np.nan  # our non-finite marker
    return torch.from_numpy(out).to(dtype).reshape(shape)


# ---------------------------------------------------------------- comparison helpers (tests, tools) -----
def zfpy_stream(x: np.ndarray, rate: float, dims: int) -> bytes:
    """zfpy's header-less stream of our layout (``zfp_array``: flat, tail padded by zfp's rule). For
    finite ``x`` our payload must equal it byte for byte (tests/test_zfp.py, tools/codec_quality.py)."""
    return _zfpy().compress_numpy(zfp_array(x, dims), rate=rate, write_header=False)


def zfpy_values(stream: bytes, numel: int, rate: float, dims: int) -> np.ndarray:
    """zfpy's decode of a header-less stream of ``numel`` values in our layout (fp32, flat)."""
    zfpy = _zfpy()
    nb = num_blocks(numel, dims)
    shape = {1: (4 * nb,), 2: (4 * nb, 4), 3: (4 * nb, 4, 4)}[dims]
    return zfpy._decompress(stream, zfpy.dtype_to_ztype(np.dtype(np.float32)), shape, rate=rate).reshape(-1)[:numel]


def bits_equal(a, b) -> bool:
    """Same float32 bits, except that any NaN equals any NaN (conversions differ in NaN payloads)."""
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    keep = ~np.isnan(a)
    return np.array_equal(a[keep].view(np.uint32), b[keep].view(np.uint32))
