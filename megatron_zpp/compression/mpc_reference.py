"""Pure-PyTorch reference of the MPC ops: the test oracle of the C++ and CUDA kernels.

Same signatures and bytes as ``torch.ops.megatron_zpp.mpc_encode`` /
``mpc_decode_`` / ``container_checksum``; the format is in ``lossless.md`` and
the per-word rules in ``csrc/include/zpp/mpc_math.h``. Written for clarity, not
speed (tens of MB/s on CPU; several full-size int64 temporaries). It runs on any
device and gives the same bytes on each: the arithmetic is integer only.

Stages, per sub-chunk of 1024 values (``B`` = 32 bits for float32, 16 for
bfloat16/float16; all arithmetic on B-bit words is mod 2^B, on planes mod 2^32):

1. LNVd: ``d[j] = w[j] - w[j - dim]`` for ``j >= dim``, ``d[j] = w[j]`` below; 0 past the tensor's end.
2. BIT: per group of 32 values, plane word ``L`` (L < B) has bit ``i`` = bit ``L`` of ``d[32g + i]``.
3. LNV1: over the sub-chunk's plane words in (group, plane) order, ``e[0] = q[0]``, ``e[j] = q[j] - q[j-1]``.
4. ZE: a bitmap (bit ``b`` of word ``m`` = ``e[32m + b] != 0``) and the non-zero ``e`` words in order.
"""

from __future__ import annotations

import torch

from megatron_zpp.compression import container

SUBCHUNK = 1024
_MASK32 = 0xFFFFFFFF
_SWAPS = ((16, 0x0000FFFF), (8, 0x00FF00FF), (4, 0x0F0F0F0F), (2, 0x33333333), (1, 0x55555555))


def word_bits(dtype: torch.dtype) -> int:
    """B: 32 for float32 (MPC), 16 for bfloat16/float16 (MPC16)."""
    if dtype == torch.float32:
        return 32
    if dtype in (torch.bfloat16, torch.float16):
        return 16
    raise TypeError(f"mpc encodes float32, bfloat16 and float16; got {dtype}")


def geometry(numel: int, bits: int) -> tuple[int, int]:
    """(plane words E, bitmap words M) of a tensor of ``numel`` B-bit values."""
    groups = -(-numel // 32)
    planes = bits * groups
    return planes, -(-planes // 32)


def max_payload_bytes(numel: int, bits: int) -> int:
    """Worst case: every plane word non-zero (+3.1% of the plane words, plus the container)."""
    planes, bitmap = geometry(numel, bits)
    return container.header_bytes(2) + 4 * bitmap + 4 * planes


def transpose32(a: torch.Tensor) -> torch.Tensor:
    """32x32 bit transpose of each 32-word row of int64 ``a[..., 32]`` (values in [0, 2^32)).

    Output word ``L`` bit ``i`` = input word ``i`` bit ``L``; an involution. The masked-swap network
    (5 rounds), the same one ``mpc_math.h``'s ``transpose32`` runs.
    """
    a = a.clone()
    for j, m in _SWAPS:
        v = a.view(*a.shape[:-1], 32 // (2 * j), 2, j)
        lo, hi = v[..., 0, :], v[..., 1, :]
        t = ((lo >> j) ^ hi) & m
        lo ^= t << j
        hi ^= t
    return a


def _words(x: torch.Tensor, bits: int) -> torch.Tensor:
    flat = x.reshape(-1)
    if bits == 32:
        return flat.view(torch.int32).to(torch.int64) & _MASK32
    return flat.view(torch.int16).to(torch.int64) & 0xFFFF


def mpc_encode(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The whole container payload (``uint8``, exact length) of ``x``."""
    bits = word_bits(x.dtype)
    wmask = (1 << bits) - 1
    n = x.numel()
    k = -(-n // SUBCHUNK)
    planes, bitmap_words = geometry(n, bits)
    dev = x.device
    w = torch.zeros(k * SUBCHUNK, dtype=torch.int64, device=dev)
    w[:n] = _words(x.contiguous(), bits)
    w = w.view(k, SUBCHUNK)
    d = w.clone()
    d[:, dim:] = (w[:, dim:] - w[:, :-dim]) & wmask
    d.view(-1)[n:] = 0
    q = transpose32(d.view(k, 32, 32))[..., :bits].reshape(k, 32 * bits)
    e = q.clone()
    e[:, 1:] = (q[:, 1:] - q[:, :-1]) & _MASK32
    e = e.reshape(-1)[:planes]
    nz = e != 0
    nzp = torch.zeros(bitmap_words * 32, dtype=torch.bool, device=dev)
    nzp[:planes] = nz
    shifts = torch.arange(32, device=dev, dtype=torch.int64)
    bitmap = (nzp.view(bitmap_words, 32).to(torch.int64) << shifts).sum(1)
    nonzero = e[nz]
    sizes = [4 * bitmap_words, 4 * nonzero.numel()]
    head = torch.frombuffer(bytearray(container.pack_header("mpc", x.dtype, dim, n, sizes)), dtype=torch.uint8)
    body = torch.cat([bitmap, nonzero]).to(torch.int32).view(torch.uint8)  # int64 -> int32 keeps the low 32 bits
    payload = torch.cat([head.to(dev), body])
    container.write_checksum_(payload, container.checksum_tensor_reference(payload))
    return payload


def mpc_decode_(payload: torch.Tensor, out: torch.Tensor, dim: int) -> None:
    """Decode a *validated* container payload into ``out`` (its numel and dtype are the header's).

    Still checks that the bitmap and the body agree, so that a crafted payload with a valid checksum
    cannot make the decoder read out of bounds.
    """
    bits = word_bits(out.dtype)
    wmask = (1 << bits) - 1
    n = out.numel()
    k = -(-n // SUBCHUNK)
    planes, bitmap_words = geometry(n, bits)
    dev = out.device
    body_at = container.header_bytes(2)
    nonzero_words = _body_sizes(payload)[1] // 4
    body = payload[body_at: body_at + 4 * (bitmap_words + nonzero_words)]
    if body.numel() % 4 or body.numel() < 4 * bitmap_words:
        raise container.PayloadError(f"mpc payload body has {body.numel()} bytes; {n} values need a "
                                     f"{4 * bitmap_words}-byte bitmap")
    wds = body.view(torch.int32).to(torch.int64) & _MASK32
    bitmap, nonzero = wds[:bitmap_words], wds[bitmap_words:]
    shifts = torch.arange(32, device=dev, dtype=torch.int64)
    nz = ((bitmap.unsqueeze(1) >> shifts) & 1).bool().reshape(-1)[:planes]
    if int(nz.sum()) != nonzero.numel():
        raise container.PayloadError(f"mpc payload is corrupt: its bitmap marks {int(nz.sum())} non-zero words, "
                                     f"its body holds {nonzero.numel()}")
    e = torch.zeros(k * 32 * bits, dtype=torch.int64, device=dev)
    e[:planes][nz] = nonzero
    q = torch.cumsum(e.view(k, 32 * bits), dim=1) & _MASK32
    q = torch.nn.functional.pad(q.view(k, 32, bits), (0, 32 - bits))
    d = transpose32(q).view(k, SUBCHUNK)
    span = -(-SUBCHUNK // dim) * dim
    d = torch.nn.functional.pad(d, (0, span - SUBCHUNK)).view(k, span // dim, dim)
    w = (torch.cumsum(d, dim=1) & wmask).view(k, span)[:, :SUBCHUNK].reshape(-1)[:n]
    if bits == 32:
        out.view(-1).copy_(torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).view(torch.float32))
    else:
        out.view(-1).copy_(torch.where(w >= 2**15, w - 2**16, w).to(torch.int16).view(out.dtype))


def _body_sizes(payload: torch.Tensor) -> tuple[int, int]:
    raw = payload[container.HEADER_BYTES: container.header_bytes(2)].cpu().numpy().tobytes()
    if len(raw) < 8:
        raise container.PayloadError("mpc payload is truncated: no sizes table")
    return int.from_bytes(raw[:4], "little"), int.from_bytes(raw[4:], "little")


def container_checksum(payload: torch.Tensor) -> torch.Tensor:
    """The op's reference: ZPP-sum32 as an int64 0-d tensor on the payload's device."""
    return container.checksum_tensor_reference(payload)
