"""qwZ: the quantized weight all-gather, and hpZ: the intra-node gather from a secondary partition.

``quantized_all_gather(output, input, topology, codec)`` has the contract of
``all_gather_into_tensor(output, input)``: every rank contributes ``input`` (its
shard, ``S`` elements) and receives all ``size`` shards in group-rank order in
``output``. With a blockwise codec each rank quantizes its shard once into one
packed row (scales + data), the rows are all-gathered as bytes, and every row,
the rank's own included, is dequantized into ``output``: all replicas then hold
bit-identical weights.

hpZ (ZeRO++ section 3.2) keeps, after the forward gather, a secondary copy of the
gathered weights partitioned over ``hpz_partition_size`` ranks of the node, so the
backward gather never leaves the node. Our secondary copy stores the *packed rows*
from the forward gather, not decoded weights: the backward gather then decodes the
very bytes the forward decoded (forward and backward see bit-identical weights) and
the copy costs ``~numel * bits / 8 / hpz_size`` bytes instead of ``numel * 2 / hpz_size``.
It is filled as a by-product of the forward gather (no extra communication, no host
synchronization) and refuses to serve a gather after ``invalidate()`` until refilled,
so a stale copy (DeepSpeed issues #5059, #7606) is an error, not silent wrong weights.
"""

from __future__ import annotations

import torch

from megatron_zpp.compression import Codec, layout
from megatron_zpp.comm import any_codec
from megatron_zpp.comm.execution import comm_stream, launch
from megatron_zpp.comm.stats import comm_stats
from megatron_zpp.comm.topology import Topology
from megatron_zpp.comm.wire import (CommHandle, WireFormat, agree, check_float, check_pair, codec_ops, wait,
                                   wire_format)


def _row_bytes(fmt: WireFormat, numel: int, dtype: torch.dtype) -> int:
    if fmt.compressed:
        return layout.row_bytes(numel, fmt.bits, fmt.block)
    return numel * torch.empty((), dtype=dtype).element_size()


class HpzShard:
    """This rank's part of the hpZ secondary partition of one flat buffer (e.g. a bucket).

    Holds the packed rows of primary shards ``[j * size / hpz, (j + 1) * size / hpz)`` where
    ``j`` is this rank's index in its hpZ group; the group together holds all rows.

    Args:
        topology: the topology whose ``hpz_partition_size`` sets the partition.
        shard_numel: elements of one primary shard (the ``input`` of the forward gather).
        dtype: the weights' dtype.
        codec: the forward gather's codec (the rows are stored in its format).
        device: where the copy lives.
    """

    def __init__(self, topology: Topology, shard_numel: int, dtype: torch.dtype,
                 codec: str | Codec | None = "int8:block=256", device: torch.device | str = "cpu") -> None:
        self.topology = topology
        self.format = wire_format(topology, codec, "HpzShard")
        if self.format.generic:
            # The secondary copy keeps the forward gather's packed rows, one fixed-size row per shard.
            raise ValueError(f"HpzShard: codec {self.format.spec!r} cannot back an hpZ secondary partition; "
                             "valid: none, int8, int4 (or hpz_size 1 to turn hpZ off)")
        if self.format.compressed:
            check_float("weights", torch.empty(0, dtype=dtype), "HpzShard")
        self.shard_numel = shard_numel
        self.dtype = dtype
        self.rows = topology.size // topology.hpz_size
        self.row_bytes = _row_bytes(self.format, shard_numel, dtype)
        self.payload = torch.empty(self.rows, self.row_bytes, dtype=torch.uint8, device=device)
        self.valid = False

    def invalidate(self) -> None:
        """Mark the copy stale (call after every change of the weights: optimizer step, checkpoint load)."""
        self.valid = False

    @property
    def nbytes(self) -> int:
        return self.payload.numel()

    def _fill_from(self, gathered_rows: torch.Tensor) -> None:
        first = self.topology.hpz_index * self.rows
        self.payload.copy_(gathered_rows[first:first + self.rows])
        self.valid = True


def quantized_all_gather(output: torch.Tensor, input: torch.Tensor, topology: Topology,
                         codec: str | Codec | None = "int8:block=256", async_op: bool = False,
                         tag: str = "dp.param", hpz_shard: HpzShard | None = None):
    """All-gather ``input`` shards into ``output`` over ``topology.group``, quantized on the wire.

    Args:
        output: ``size * input.numel()`` elements, same dtype and device as ``input``.
        input: this rank's shard (fp32 / bf16 / fp16; any dtype with ``codec="none"``).
        topology: the group and its node layout.
        codec: ``"int8:block=256"`` (qwZ), ``"int4:..."``, ``"none"`` (plain all-gather, bit-exact), or
            any other codec (ZFP, lossless: ``any_codec.py``; not with ``hpz_shard``).
        async_op: return a :class:`CommHandle` whose ``wait()`` decodes into ``output``.
        tag: byte-accounting tag.
        hpz_shard: if given, also keep this rank's hpZ secondary rows (see :class:`HpzShard`).

    Returns:
        ``None``, or a handle when ``async_op``.
    """
    what = "quantized_all_gather"
    check_pair(output, input, what)
    size = topology.size
    if output.numel() != size * input.numel():
        raise ValueError(f"{what}: output has {output.numel()} elements; group size {size} x input "
                         f"{input.numel()} = {size * input.numel()}")
    fmt = wire_format(topology, codec, what)
    if fmt.compressed:
        check_float("input", input, what)
    if hpz_shard is not None and (hpz_shard.topology._groups is not topology._groups
                                  or hpz_shard.shard_numel != input.numel() or hpz_shard.dtype != input.dtype
                                  or hpz_shard.format.spec != fmt.spec):
        raise ValueError(f"{what}: hpz_shard was made for {hpz_shard.shard_numel} {hpz_shard.dtype} elements "
                         f"with codec {hpz_shard.format.spec!r} on another topology or shape; this call gathers "
                         f"{input.numel()} {input.dtype} with {fmt.spec!r}")
    agree(topology, what, codec=fmt.spec, dtype=str(input.dtype))

    if fmt.generic:  # ZFP / lossless: whole payloads through the codec interface (any_codec.py)
        if input.numel() == 0:
            return CommHandle(lambda: None) if async_op else None
        groups = topology._groups
        stream = comm_stream(input.device, "gather", groups.streams)
        scratch = groups.buffers.lease(input.device)
        return launch(groups.in_flight, stream, (input, output),
                      lambda: any_codec.all_gather(output, input, topology, fmt, scratch, tag), async_op)

    flat = topology._groups.flat
    rb = _row_bytes(fmt, input.numel(), input.dtype)
    intra, inter = flat.split_ring((size - 1) * rb)
    raw = flat.split_ring((size - 1) * input.numel() * input.element_size())
    comm_stats().record(tag, intra, inter, uncompressed=raw)
    if input.numel() == 0:  # every rank's shard is empty (sizes are equal): nothing to move
        if hpz_shard is not None:
            hpz_shard.valid = True
        return CommHandle(lambda: None) if async_op else None

    groups = topology._groups
    stream = comm_stream(input.device, "gather", groups.streams)
    scratch = groups.buffers.lease(input.device)

    def first():
        if not fmt.compressed:
            work = flat.all_gather(output, input)

            def finish() -> None:
                wait(work)
                if hpz_shard is not None:
                    hpz_shard._fill_from(output.view(-1).view(torch.uint8).view(size, rb))
            return [], finish
        payload = scratch.take(rb)
        gathered = scratch.take(size * rb)
        codec_ops.quantize_rows_(input.view(-1), payload.view(1, rb), fmt.bits, fmt.block, fmt.stochastic,
                           fmt.seed(topology.rank, f"{tag}/qwz"))
        work = flat.all_gather(gathered, payload)

        def finish() -> None:
            wait(work)
            rows = gathered.view(size, rb)
            codec_ops.dequantize_rows_(rows, output.view(-1), fmt.bits, fmt.block)
            if hpz_shard is not None:
                hpz_shard._fill_from(rows)
            scratch.release()
        return [], finish

    used = (input, output) + ((hpz_shard.payload,) if hpz_shard is not None else ())
    return launch(groups.in_flight, stream, used, first, async_op)


def hpz_all_gather(output: torch.Tensor, hpz_shard: HpzShard, topology: Topology | None = None,
                   async_op: bool = False, tag: str = "dp.param.hpz"):
    """Rebuild the full gathered tensor from the hpZ secondary partition, inside the node only.

    ``output`` receives exactly what the forward ``quantized_all_gather`` that filled
    ``hpz_shard`` produced (same rows, same decode), with ``hpz_size - 1`` rows-parts sent
    per rank and none across nodes.
    """
    what = "hpz_all_gather"
    topology = topology or hpz_shard.topology
    if topology._groups is not hpz_shard.topology._groups:
        raise ValueError(f"{what}: hpz_shard belongs to {hpz_shard.topology}, not {topology}")
    if not hpz_shard.valid:
        raise RuntimeError(f"{what}: the hpZ secondary copy is stale (invalidated since it was filled); "
                           "refill it with a forward quantized_all_gather(..., hpz_shard=shard)")
    size = topology.size
    if output.numel() != size * hpz_shard.shard_numel or output.dtype != hpz_shard.dtype:
        raise ValueError(f"{what}: output is {output.numel()} {output.dtype}; the shard needs "
                         f"{size * hpz_shard.shard_numel} {hpz_shard.dtype}")
    if not output.is_contiguous():
        raise ValueError(f"{what}: output must be contiguous")
    fmt, hpz = hpz_shard.format, topology._groups.hpz
    part = hpz_shard.payload.view(-1)
    intra, inter = hpz.split_ring((hpz.size - 1) * part.numel())
    raw = hpz.split_ring((hpz.size - 1) * hpz_shard.rows * hpz_shard.shard_numel * output.element_size())
    comm_stats().record(tag, intra, inter, uncompressed=raw)
    if hpz_shard.shard_numel == 0:
        return CommHandle(lambda: None) if async_op else None

    groups = topology._groups
    stream = comm_stream(output.device, "gather", groups.streams)
    scratch = groups.buffers.lease(output.device)

    def first():
        if fmt.compressed:
            gathered = scratch.take(size * hpz_shard.row_bytes)
        else:
            gathered = output.view(-1).view(torch.uint8)
        work = hpz.all_gather(gathered, part)

        def finish() -> None:
            wait(work)
            if fmt.compressed:
                codec_ops.dequantize_rows_(gathered.view(size, hpz_shard.row_bytes), output.view(-1),
                                     fmt.bits, fmt.block)
            scratch.release()
        return [], finish

    return launch(groups.in_flight, stream, (hpz_shard.payload, output), first, async_op)
