"""The container every variable-size (lossless) payload travels in: header, sizes, checksum.

Layout (all integers little-endian; format and rationale in ``lossless.md``)::

    offset  bytes  field
     0      4      magic            b"ZPPC"
     4      1      version          1
     5      1      codec id         1 mpc, 2 zstd, 3 nvcomp
     6      1      dtype code       1 float32, 2 bfloat16, 3 float16
     7      1      codec parameter  mpc: dim; nvcomp: algorithm id; zstd: 0
     8      8      numel            elements of the encoded tensor
    16      8      payload bytes    the true length of the whole payload, header included
    24      4      num_sizes S      entries of the sizes table
    28      4      checksum         see :func:`checksum_reference`
    32      4*S    sizes            byte length of each body segment, in order (uint32: a segment
                                    holds at most MAX_SEGMENT_BYTES; encoders refuse larger ones)
    32+4S   ...    body             the segments, back to back; sum(sizes) bytes

A payload buffer may be longer than ``payload bytes`` (a preallocated worst-case
buffer on GPU); the bytes past it are not part of the payload.

The checksum is a position-keyed sum of hashed 32-bit words (ZPP-sum32): with
``w_i`` the payload's first ``payload bytes`` bytes read as little-endian
words (the last one zero-padded, word 7, the checksum itself, read as 0)::

    checksum = sum_i mix32(w_i ^ (i * 0x9E3779B9 mod 2^32))  mod 2^32

``mix32`` is the bijective integer hash of ``csrc/include/zpp/quant_math.h``.
Being a sum, it is one parallel reduction on a GPU (the CUDA encoder computes it
without leaving the device); being a bijection of each word, it catches every
change confined to one word (any number of flipped bits in it), and the index
key makes moved or swapped words count. Two independent word changes cancel with
probability about 2^-32. It is not cryptographic: it detects corruption, not
tampering.

:func:`parse_header` validates a payload and raises :class:`PayloadError`
naming what is wrong (truncation, magic, version, codec, dtype, numel, parameter,
sizes, checksum).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from megatron_zpp.compression.base import Codec, Packed
from megatron_zpp.compression.reference import _mix32, _mul32

MAGIC = b"ZPPC"
VERSION = 1
HEADER_BYTES = 32
LENGTH_OFFSET = 16  # the "payload bytes" field: int64 little-endian
CHECKSUM_OFFSET = 28
CHECKSUM_WORD = CHECKSUM_OFFSET // 4
GOLDEN32 = 0x9E3779B9

MAX_SEGMENT_BYTES = 0xFFFFFFFF  # a sizes-table entry is a uint32
CHECK_RECORD_SIZES = 8  # sizes a deferred check carries: all mpc/nvcomp payloads need (zstd validates eagerly)

CODEC_IDS = {"mpc": 1, "zstd": 2, "nvcomp": 3}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
DTYPE_BY_CODE = {v: k for k, v in DTYPE_CODES.items()}

_HEADER = struct.Struct("<4sBBBBQQII")
assert _HEADER.size == HEADER_BYTES


class PayloadError(ValueError):
    """A payload failed validation: truncated, corrupt, or not what the decoder expects."""


@dataclass(frozen=True)
class Header:
    codec: str
    dtype: torch.dtype
    param: int
    numel: int
    payload_bytes: int
    sizes: tuple[int, ...]
    checksum: int

    @property
    def body_offset(self) -> int:
        return HEADER_BYTES + 4 * len(self.sizes)


def header_bytes(num_sizes: int) -> int:
    """Bytes before the body: the fixed header plus the sizes table."""
    return HEADER_BYTES + 4 * num_sizes


def check_segment_sizes(sizes, what: str = "payload") -> None:
    """Refuse body segments the uint32 sizes table cannot hold, naming the size and the limit
    (encoders call it before any kernel runs, with their worst-case segment sizes)."""
    for i, n in enumerate(sizes):
        if n > MAX_SEGMENT_BYTES:
            raise ValueError(f"{what}: body segment {i} would hold {n} bytes ({n / 2**30:.2f} GiB); the container's "
                             f"sizes table holds at most {MAX_SEGMENT_BYTES} bytes (4 GiB - 1) per segment: "
                             "split the tensor into smaller ones")


def pack_header(codec: str, dtype: torch.dtype, param: int, numel: int, sizes: list[int] | tuple[int, ...],
                checksum: int = 0) -> bytes:
    """Header plus sizes table as bytes (``payload bytes`` computed from the sizes)."""
    check_segment_sizes(sizes, f"{codec} payload")
    payload_bytes = header_bytes(len(sizes)) + sum(sizes)
    head = _HEADER.pack(MAGIC, VERSION, CODEC_IDS[codec], DTYPE_CODES[dtype], param, numel, payload_bytes,
                        len(sizes), checksum)
    return head + struct.pack(f"<{len(sizes)}I", *sizes)


# ----------------------------------------------------------- checksum -------
def checksum_reference(payload: torch.Tensor) -> int:
    """ZPP-sum32 of a payload (pure PyTorch, any device; the oracle of the C++/CUDA ``container_checksum``).

    Covers ``payload bytes`` from the header, clamped to ``[0, len(payload)]`` as the kernels do.
    """
    return int(checksum_tensor_reference(payload).item())


def checksum_tensor_reference(payload: torch.Tensor) -> torch.Tensor:
    """:func:`checksum_reference` as an int64 0-d tensor on the payload's device (no host sync)."""
    flat = payload.reshape(-1)
    n = flat.numel()
    if n >= HEADER_BYTES:
        field = flat[16:24].to(torch.int64)
        length = (field << (8 * torch.arange(8, device=flat.device))).sum()  # wraps like uint64 -> int64
        length = torch.where((length < 0) | (length > n), torch.full_like(length, n), length)
    else:
        length = torch.tensor(n, device=flat.device)
    words_total = (n + 3) // 4
    padded = torch.zeros(words_total * 4, dtype=torch.uint8, device=flat.device)
    padded[:n] = flat
    byte_index = torch.arange(words_total * 4, device=flat.device)
    padded = torch.where(byte_index < length, padded, torch.zeros_like(padded))
    w = padded.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if words_total > CHECKSUM_WORD:
        w[CHECKSUM_WORD] = 0
    index = torch.arange(words_total, device=flat.device, dtype=torch.int64)
    key = _mul32(index & 0xFFFFFFFF, GOLDEN32)
    h = _mix32(w ^ key)
    # Only words that start before the length count (bytes past it in the last word were zeroed above).
    h = torch.where(index * 4 < length, h, torch.zeros_like(h))
    return h.sum() & 0xFFFFFFFF


def write_checksum_(payload: torch.Tensor, checksum: torch.Tensor) -> None:
    """Store an int64 0-d checksum tensor into the header's checksum field (on device, no sync)."""
    shifts = torch.arange(0, 32, 8, device=payload.device, dtype=torch.int64)
    payload[CHECKSUM_OFFSET: CHECKSUM_OFFSET + 4] = ((checksum.reshape(1) >> shifts) & 0xFF).to(torch.uint8)


# ---------------------------------------------------------- validation ------
def _describe_codec(codec_id: int) -> str:
    name = CODEC_NAMES.get(codec_id)
    return f"{name!r} (id {codec_id})" if name else f"an unknown codec (id {codec_id})"


def read_header(raw: bytes, buffer_bytes: int, *, what: str = "payload") -> Header:
    """Parse and structurally validate a header (``raw`` = at least the fixed header, plus the sizes table
    if available). Checks magic, version, codec id, dtype code and the size fields against ``buffer_bytes``.
    """
    if buffer_bytes < HEADER_BYTES or len(raw) < HEADER_BYTES:
        raise PayloadError(f"{what} is truncated: {buffer_bytes} bytes, but the container header alone is "
                           f"{HEADER_BYTES} bytes")
    magic, version, codec_id, dtype_code, param, numel, payload_bytes, num_sizes, checksum = _HEADER.unpack(
        raw[:HEADER_BYTES])
    if magic != MAGIC:
        raise PayloadError(f"{what} is not a megatron_zpp lossless container: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise PayloadError(f"{what} has container version {version}; this build reads version {VERSION} only")
    if codec_id not in CODEC_NAMES:
        raise PayloadError(f"{what} names an unknown codec id {codec_id}; valid: "
                           + ", ".join(f"{i} ({n})" for i, n in sorted(CODEC_NAMES.items())))
    if dtype_code not in DTYPE_BY_CODE:
        raise PayloadError(f"{what} names an unknown dtype code {dtype_code}; valid: "
                           + ", ".join(f"{c} ({d})" for d, c in DTYPE_CODES.items()))
    prefix = header_bytes(num_sizes)
    if payload_bytes < prefix:
        raise PayloadError(f"{what} header is inconsistent: payload bytes {payload_bytes} is less than its own "
                           f"header and sizes table ({prefix} bytes for {num_sizes} sizes)")
    if payload_bytes > buffer_bytes:
        raise PayloadError(f"{what} is truncated: the header says {payload_bytes} bytes, the buffer holds "
                           f"{buffer_bytes}")
    if len(raw) < prefix:
        raise PayloadError(f"{what}: sizes table not supplied ({len(raw)} of {prefix} bytes)")
    sizes = struct.unpack(f"<{num_sizes}I", raw[HEADER_BYTES:prefix])
    if prefix + sum(sizes) != payload_bytes:
        raise PayloadError(f"{what} header is inconsistent: its sizes add up to {sum(sizes)} body bytes, "
                           f"but payload bytes {payload_bytes} leaves {payload_bytes - prefix}")
    return Header(CODEC_NAMES[codec_id], DTYPE_BY_CODE[dtype_code], param, numel, payload_bytes, sizes, checksum)


def check_expected(header: Header, *, codec: str, dtype: torch.dtype, numel: int, param: int | None = None,
                   param_name: str = "parameter", what: str = "payload") -> None:
    """Raise :class:`PayloadError` when a valid header describes something other than what is expected."""
    if header.codec != codec:
        raise PayloadError(f"{what} was encoded by codec {_describe_codec(CODEC_IDS[header.codec])}, "
                           f"not {codec!r}")
    if header.dtype != dtype:
        raise PayloadError(f"{what} holds {header.dtype} values, expected {dtype}")
    if header.numel != numel:
        raise PayloadError(f"{what} holds {header.numel} elements, expected {numel}")
    if param is not None and header.param != param:
        raise PayloadError(f"{what} was encoded with {codec} {param_name}={header.param}, this codec has "
                           f"{param_name}={param}")


def check_checksum(header: Header, computed: int, *, what: str = "payload") -> None:
    if computed != header.checksum:
        raise PayloadError(f"{what} is corrupt: checksum mismatch (stored 0x{header.checksum:08x}, computed "
                           f"0x{computed:08x} over {header.payload_bytes} bytes)")


def validate(payload: torch.Tensor, computed_checksum: torch.Tensor | int | None = None, *, codec: str,
             dtype: torch.dtype, numel: int, param: int | None = None, param_name: str = "parameter",
             what: str = "payload") -> Header:
    """Validate a whole payload (any device) and return its header.

    Order: structure (truncation, magic, version, ids, size fields), then the checksum (so a flipped bit
    reads as corruption), then whether it is the expected codec/dtype/numel/parameter. On CUDA the header
    and the device-computed checksum come to the host in one small copy: a single sync, no payload bytes.
    The collectives defer this read instead (:func:`deferred_check`).
    """
    _check_flat(payload, what)
    n = payload.numel()
    if computed_checksum is None:
        computed_checksum = checksum_tensor_reference(payload)
    # The fixed header and up to 8 sizes (all mpc/nvcomp need) plus the checksum in one device->host copy.
    head = payload[: min(n, header_bytes(CHECK_RECORD_SIZES))]
    if isinstance(computed_checksum, torch.Tensor):
        both = torch.cat([computed_checksum.reshape(1).to(torch.int64).view(torch.uint8), head]).cpu()
        raw, computed = both[8:].numpy().tobytes(), int(both[:8].view(torch.int64).item())
    else:
        raw, computed = head.cpu().numpy().tobytes(), int(computed_checksum)
    if n >= HEADER_BYTES:
        prefix = header_bytes(struct.unpack_from("<I", raw, 24)[0])
        if len(raw) < prefix <= n:  # a long sizes table (zstd): a second read
            raw = payload[:prefix].cpu().numpy().tobytes()
    return _check_raw(raw, n, computed, dict(codec=codec, dtype=dtype, numel=numel, param=param,
                                             param_name=param_name, what=what))


def _check_flat(payload: torch.Tensor, what: str) -> None:
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise PayloadError(f"{what} must be a 1-D uint8 tensor, got {payload.dtype} of shape {tuple(payload.shape)}")


def _check_raw(raw: bytes, n: int, computed: int, expect: dict) -> Header:
    header = read_header(raw, n, what=expect["what"])
    check_checksum(header, computed, what=expect["what"])
    check_expected(header, **expect)
    return header


_RECORD_BYTES = 8 + header_bytes(CHECK_RECORD_SIZES)  # the checksum (int64), then the header bytes


@dataclass(frozen=True)
class DeferredCheck:
    """A payload's validation with its host read deferred: ``record`` (on the payload's device, no sync)
    holds the device-computed checksum and the header bytes; :meth:`raise_if_invalid` runs the checks of
    :func:`validate` on that record, once it is on the host (a collective reads every record of a hop in
    one :class:`~megatron_zpp.compression.host_read.HostRead`)."""

    record: torch.Tensor
    buffer_bytes: int
    expect: dict
    error: str | None = None  # the decoder refused the payload: raised if the container itself is valid

    def raise_if_invalid(self, record: torch.Tensor) -> Header:
        """Raise :class:`PayloadError` naming what is wrong, from ``record`` read to the host."""
        raw = record.numpy().tobytes()
        computed, raw = int.from_bytes(raw[:8], "little", signed=True), raw[8: 8 + min(self.buffer_bytes,
                                                                                        _RECORD_BYTES - 8)]
        n, what = self.buffer_bytes, self.expect["what"]
        if n >= HEADER_BYTES:
            num_sizes = struct.unpack_from("<I", raw, 24)[0]
            if len(raw) < header_bytes(num_sizes) <= n:
                # The fixed header's fields first, as validate(): a corrupt field reads as what it is.
                try:
                    read_header(raw, n, what=what)
                except PayloadError as exc:
                    if "sizes table not supplied" not in str(exc):
                        raise
                raise PayloadError(f"{what} is corrupt: its header names {num_sizes} body segments; "
                                   f"{self.expect['codec']} payloads have at most {CHECK_RECORD_SIZES}")
        header = _check_raw(raw, n, computed, self.expect)
        if self.error is not None:
            raise PayloadError(self.error)
        return header


def deferred_check(payload: torch.Tensor, computed_checksum: torch.Tensor, *, codec: str, dtype: torch.dtype,
                   numel: int, param: int | None = None, param_name: str = "parameter",
                   what: str = "payload") -> DeferredCheck:
    """:func:`validate` of ``payload`` without reading anything to the host now (see :class:`DeferredCheck`)."""
    _check_flat(payload, what)
    n = payload.numel()
    record = torch.zeros(_RECORD_BYTES, dtype=torch.uint8, device=payload.device)
    record[:8] = computed_checksum.reshape(1).to(torch.int64).view(torch.uint8)
    k = min(n, _RECORD_BYTES - 8)
    record[8: 8 + k] = payload[:k]
    return DeferredCheck(record, n, dict(codec=codec, dtype=dtype, numel=numel, param=param,
                                         param_name=param_name, what=what))


class ContainerCodec(Codec):
    """Base of the codecs whose payloads are containers: lossless, variable size (``base.py``)."""

    lossless = True
    fixed_size = False

    def _checked_payload(self, packed: Packed) -> torch.Tensor:
        """``packed``'s payload, contiguous, after the checks every container decode starts with."""
        if packed.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{self.spec}: dtype {packed.dtype} is not supported")
        payload = packed.payload
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise PayloadError(f"{self.spec}: payload must be a 1-D uint8 tensor, got {payload.dtype} "
                               f"of shape {tuple(payload.shape)}")
        return payload

    def decode_deferred(self, packed: Packed) -> tuple[torch.Tensor, DeferredCheck | None]:
        """``decode``, with the validation's host read deferred where the codec can (``mpc``): returns the
        output and a :class:`DeferredCheck` to run once its record is on the host, or ``None`` when the
        codec validated already (``zstd`` runs on the host; ``nvcomp`` needs the sizes on the host)."""
        return self.decode(packed), None

    def payload_nbytes(self, packed: Packed) -> int:
        raw = packed.payload[:HEADER_BYTES].cpu().numpy().tobytes()
        if len(raw) < HEADER_BYTES:
            raise PayloadError(f"{self.spec}: payload is truncated: {len(raw)} bytes, the container header alone "
                               f"is {HEADER_BYTES}")
        return int.from_bytes(raw[LENGTH_OFFSET:LENGTH_OFFSET + 8], "little")


def payload_lengths(payloads: list[torch.Tensor]) -> torch.Tensor:
    """The true lengths of container payloads as an int64 tensor on their device, read from their
    headers without a host synchronization (a collective can exchange it, then read it once)."""
    for p in payloads:
        if p.numel() < HEADER_BYTES:
            raise PayloadError(f"payload is truncated: {p.numel()} bytes, the container header alone is "
                               f"{HEADER_BYTES}")
    fields = torch.stack([p[LENGTH_OFFSET:LENGTH_OFFSET + 8] for p in payloads])
    return fields.view(torch.int64).view(-1)  # a native-order view: CPUs and GPUs we run on are little-endian
