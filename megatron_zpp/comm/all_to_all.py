"""Compressed all-to-all with variable splits: MoE token dispatch and combine (the ``ep`` dimension).

``compressed_all_to_all(input, output_splits, input_splits, group, codec)`` is
``torch.distributed.all_to_all_single`` over the rows of ``input`` (``input_splits[p]`` rows go to member ``p``,
``output_splits[p]`` rows come from it) with every row block that leaves this rank encoded by ``codec``:

- the rows kept on this rank are copied exactly (no codec);
- each destination's rows are one payload (a codec block may span row boundaries inside it, never two
  destinations), padded to a multiple of ``any_codec.ALIGN`` bytes so every received payload starts aligned;
- fixed-size codecs (``int8``, ``int4``, ``zfp``): both sides know every payload's length from the split sizes,
  and the call reads nothing back to the host;
- variable-size codecs (``mpc``, ``zstd``, ``nvcomp``): their lengths are read from the container headers on the
  device, exchanged (one int64 per member) and read to the host once; every received payload is decoded with its
  validation deferred and the records of all of them read in one more host read at the end of the call: two host
  reads per call. A corrupt payload raises ``PayloadError`` naming it, in the same call;
- NaN and Inf travel: lossless codecs return them, blockwise and ZFP codecs decode a block holding one to NaN,
  so Megatron's found-inf check sees them.

It is synchronous, as Megatron-Core's ``_AllToAll`` it replaces; the split sizes are host lists (the dispatcher
already brought them to the host). Bytes are recorded under ``tag``: intra- or inter-node by each peer's node.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_zpp.comm.any_codec import _SIZE_BYTES, _a2a_bytes, _padded, slot_bytes
from megatron_zpp.comm.stats import comm_stats, comm_timers
from megatron_zpp.comm.topology import group_layout
from megatron_zpp.compression import Packed, get_codec
from megatron_zpp.compression.container import payload_lengths
from megatron_zpp.compression.host_read import HostRead


def _splits(splits, rows: int, size: int) -> list[int]:
    if splits is None:  # equal split, as all_to_all_single without sizes
        if rows % size:
            raise ValueError(f"all-to-all of {rows} rows over {size} members without split sizes: {rows} is not "
                             f"divisible by {size}")
        return [rows // size] * size
    out = [int(s) for s in splits]
    if len(out) != size or any(s < 0 for s in out):
        raise ValueError(f"split sizes {out} must be {size} non-negative row counts (one per group member)")
    return out


def compressed_all_to_all(input: torch.Tensor, output_splits, input_splits, group, codec: str, tag: str,
                          ranks_per_node: int | None = None, calls: int = 1) -> torch.Tensor:
    """``input``'s rows exchanged over ``group`` (module docstring); returns the received rows in member order,
    ``[sum(output_splits), *input.shape[1:]]``, in ``input``'s dtype. ``codec``: a spec (``none``: exact).
    ``calls``: what the call adds to the tag's call count (0 for a companion exchange, e.g. routing weights)."""
    layout = group_layout(group, ranks_per_node)
    size, me = layout.size, layout.index
    input = input.contiguous()
    row_shape = tuple(input.shape[1:])
    row_numel = math.prod(row_shape)
    elem = input.element_size()
    send_rows = _splits(input_splits, input.shape[0], size)
    if sum(send_rows) != input.shape[0]:
        raise ValueError(f"input split sizes {send_rows} add up to {sum(send_rows)} rows; the input has "
                         f"{input.shape[0]}")
    recv_rows = _splits(output_splits, input.shape[0], size)  # equal split: as many rows from each member
    raw_send = [n * row_numel * elem for n in send_rows]
    spec = get_codec(codec)
    output = input.new_empty((sum(recv_rows), *row_shape))
    if spec.spec == "none":
        dist.all_to_all_single(output, input, output_split_sizes=recv_rows, input_split_sizes=send_rows,
                                      group=group)
        comm_stats().record(tag, *_a2a_bytes(layout, raw_send), calls=calls)
        return output

    # Encode every destination's rows but our own (kept exact).
    empty = torch.empty(0, dtype=torch.uint8, device=input.device)
    payloads, lengths = [], []
    with comm_timers().codec():
        for p, chunk in enumerate(input.split(send_rows)):
            if p == me or chunk.shape[0] == 0:
                payloads.append(empty)
                lengths.append(0)
                continue
            payloads.append(spec.encode(chunk).payload.view(-1))
            lengths.append(payloads[-1].numel())  # a fixed-size payload's length; a container's is in its header
    size_bytes = 0
    if spec.fixed_size:
        recv_lengths = [0 if p == me or n == 0 else spec.wire_bytes(n * row_numel, input.dtype)
                        for p, n in enumerate(recv_rows)]
    else:  # the true lengths, from the headers on the device, exchanged, then read to the host once
        sent = torch.zeros(size, dtype=torch.int64, device=input.device)
        filled = [p for p, pl in enumerate(payloads) if pl.numel()]
        if filled:
            sent[filled] = payload_lengths([payloads[p] for p in filled])
        got = torch.empty_like(sent)
        work = dist.all_to_all_single(got, sent, group=group, async_op=True)
        lengths, recv_lengths = (t.tolist() for t in HostRead([sent, got], (work,)).values())
        size_bytes = _SIZE_BYTES
    send_slots = [slot_bytes(n) for n in lengths]
    recv_slots = [slot_bytes(n) for n in recv_lengths]
    send = torch.cat([_padded(pl, n, s) for pl, n, s in zip(payloads, lengths, send_slots)]) if sum(send_slots) \
        else empty
    received = torch.empty(sum(recv_slots), dtype=torch.uint8, device=input.device)
    dist.all_to_all_single(received, send, output_split_sizes=recv_slots, input_split_sizes=send_slots, group=group)
    comm_stats().record(tag, *_a2a_bytes(layout, [s + size_bytes for s in send_slots]), calls=calls,
                        uncompressed=_a2a_bytes(layout, raw_send))

    mine = input.split(send_rows)[me]
    parts, checks = [], []
    with comm_timers().codec():
        for p, (part, n, rows) in enumerate(zip(received.split(recv_slots), recv_lengths, recv_rows)):
            if p == me:
                parts.append(mine)
            elif rows == 0:
                parts.append(input.new_empty((0, *row_shape)))
            else:
                packed = Packed(payload=part[:n], shape=torch.Size((rows, *row_shape)), dtype=input.dtype)
                if spec.fixed_size:
                    parts.append(spec.decode(packed))
                else:  # validated below, all payloads in one host read
                    decoded, check = spec.decode_deferred(packed)
                    parts.append(decoded)
                    if check is not None:
                        checks.append(check)
    if checks:
        for check, record in zip(checks, HostRead([c.record for c in checks]).values()):
            check.raise_if_invalid(record)
    torch.cat(parts, out=output)
    return output
