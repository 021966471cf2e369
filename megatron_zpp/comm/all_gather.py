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
synchronization; fresh only if not invalidated between that gather's call and its wait) and
refuses to serve a gather after ``invalidate()`` until refilled, so a stale copy (DeepSpeed
issues #5059, #7606) is an error, not silent wrong weights.
"""

from __future__ import annotations

import torch

from megatron_zpp.compression import Codec, layout
from megatron_zpp.comm import any_codec
from megatron_zpp.comm.execution import comm_stream, launch
from megatron_zpp.comm.stats import comm_stats, comm_timers
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
        self.generation = 0  # invalidations so far: a refresh dispatched before one must not mark the copy fresh
        self.refreshing = None  # qWD: the handle of the last gather that updates the copy at its wait (an exchange
        # or a resync; possibly waited already): a later call on the copy waits for it first

    def invalidate(self) -> None:
        """Mark the copy stale (call after every change of the weights: optimizer step, checkpoint load)."""
        self.valid = False
        self.generation += 1

    @property
    def nbytes(self) -> int:
        return self.payload.numel()

    def _fill_from(self, gathered_rows: torch.Tensor, generation: int) -> None:
        """Keep this rank's rows of a gather dispatched at ``generation``: fresh only if the weights have not
        changed since (an ``invalidate()`` between the gather's call and its wait leaves the copy stale)."""
        first = self.topology.hpz_index * self.rows
        self.payload.copy_(gathered_rows[first:first + self.rows])
        self.valid = self.generation == generation


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
    generation = hpz_shard.generation if hpz_shard is not None else 0

    def first():
        if not fmt.compressed:
            work = flat.all_gather(output, input)

            def finish() -> None:
                wait(work)
                if hpz_shard is not None:
                    hpz_shard._fill_from(output.view(-1).view(torch.uint8).view(size, rb), generation)
            return [], finish
        payload = scratch.take(rb)
        gathered = scratch.take(size * rb)
        codec_ops.quantize_rows_(input.view(-1), payload.view(1, rb), fmt.bits, fmt.block, fmt.stochastic,
                                 fmt.seed(topology.rank, f"{tag}/qwz"), fmt.hadamard)
        work = flat.all_gather(gathered, payload)

        def finish() -> None:
            wait(work)
            rows = gathered.view(size, rb)
            codec_ops.dequantize_rows_(rows, output.view(-1), fmt.bits, fmt.block, fmt.hadamard)
            if hpz_shard is not None:
                hpz_shard._fill_from(rows, generation)
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
                                           fmt.bits, fmt.block, fmt.hadamard)
            scratch.release()
        return [], finish

    return launch(groups.in_flight, stream, (hpz_shard.payload, output), first, async_op)


class HeldShard:
    """qWD's base (SDP4Bit's weight differences): this rank's shard of one flat buffer as *every replica holds
    it*, the base its next difference is taken against.

    The owner cannot read that base from the gathered buffer: Megatron's optimizer step writes the new weights
    into the owner's slice of it before the gather. Until :func:`weight_difference_all_gather` fills it with a
    full-precision gather (``valid`` False: the first gather, after :meth:`invalidate`), no difference is sent.
    Costs one shard of the weights' dtype.
    """

    def __init__(self, shard_numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.value = torch.empty(shard_numel, dtype=dtype, device=device)
        self.valid = False

    def invalidate(self) -> None:
        """Resynchronize at the next gather, in full precision (after a checkpoint load, or every N steps)."""
        self.valid = False

    @property
    def nbytes(self) -> int:
        return self.value.numel() * self.value.element_size()


def _check_difference_gather(output, input, held: HeldShard, topology: Topology, what: str) -> tuple[int, int]:
    """The argument checks of both qWD gathers; returns ``(size, shard)``."""
    check_pair(output, input, what)
    check_float("input", input, what)
    size, shard = topology.size, input.numel()
    if output.numel() != size * shard:
        raise ValueError(f"{what}: output has {output.numel()} elements; group size {size} x input {shard} = "
                         f"{size * shard}")
    if held.value.numel() != shard or held.value.dtype != input.dtype or held.value.device != input.device:
        raise ValueError(f"{what}: held shard is {held.value.numel()} {held.value.dtype} on {held.value.device}; "
                         f"the input is {shard} {input.dtype} on {input.device}")
    return size, shard


def _send_difference(input, held: HeldShard, fmt: WireFormat, scratch, flat, size: int, rb: int, me: int, tag: str):
    """qWD's first step: quantize ``input - held`` (fp32) into one packed row and all-gather every rank's
    (``gathered``: ``size`` rows of ``rb`` bytes). Returns ``(gathered, work)``."""
    payload = scratch.take(rb)
    gathered = scratch.take(size * rb)
    with comm_timers().codec():
        difference = scratch.take(input.numel() * 4).view(torch.float32)
        torch.sub(input.view(-1).float(), held.value.float(), out=difference)
    codec_ops.quantize_rows_(difference, payload.view(1, rb), fmt.bits, fmt.block, fmt.stochastic,
                             fmt.seed(me, f"{tag}/qwd"), fmt.hadamard)
    return gathered, flat.all_gather(gathered, payload)


def weight_difference_all_gather(output: torch.Tensor, input: torch.Tensor, held: HeldShard, topology: Topology,
                                 codec: str | Codec | None = "int4:block=2048", async_op: bool = False,
                                 tag: str = "dp.param"):
    """qWD: all-gather the quantized *difference* of every shard from what all replicas hold, not the weights.

    Same contract as ``all_gather_into_tensor(output, input)`` up to quantization, for a buffer gathered every
    step (ZeRO's parameter all-gather): each rank quantizes ``input - held.value`` (its new shard minus what
    every replica holds of it), the packed rows are all-gathered, and every rank, the owner included, adds the
    same decoded differences to the shards it holds: ``output[j] = cast(fp32(base[j]) + decoded[j])`` with
    ``base[j]`` the previous ``output[j]`` (``held.value`` on its owner, whose slice ``input`` may alias). All
    replicas thus hold bit-identical weights, and the quantization error is not lost: the next difference is
    taken against what replicas hold, not against the exact weights. When ``held`` is not valid the gather is
    a plain full-precision one, which (re)establishes the base.

    Precondition, kept by calling this for every gather of the buffer: outside the owner's slice, ``output``
    holds what the previous call (or the resync) left there on every rank.

    Args:
        output: ``size * input.numel()`` elements, same dtype and device as ``input``.
        input: this rank's new shard (fp32 / bf16 / fp16).
        held: this rank's :class:`HeldShard` for this buffer; updated to the new held shard.
        topology: the group and its node layout.
        codec: a blockwise codec (``int4:block=2048``: SDP4Bit's weights; ``int8:...``).
        async_op: return a :class:`CommHandle` whose ``wait()`` applies the differences to ``output``.
        tag: byte-accounting tag.
    """
    what = "weight_difference_all_gather"
    size, shard = _check_difference_gather(output, input, held, topology, what)
    fmt = wire_format(topology, codec, what)
    if not fmt.blockwise:
        raise ValueError(f"{what}: codec {fmt.spec!r} is not a blockwise quantizer; valid: int4, int8 "
                         "(a difference of weights needs the fused decode-and-add)")
    # Resync is collective by construction: the hooks invalidate every rank's held shards at the same step.
    agree(topology, what, codec=fmt.spec, dtype=str(input.dtype))
    if not held.valid:
        handle = quantized_all_gather(output, input, topology, codec="none", async_op=async_op, tag=tag)
        held.value.copy_(input)  # before any wait: the gather copied input when it was launched, or is done
        held.valid = True
        return handle

    flat = topology._groups.flat
    rb = layout.row_bytes(shard, fmt.bits, fmt.block)
    intra, inter = flat.split_ring((size - 1) * rb)
    raw = flat.split_ring((size - 1) * shard * input.element_size())
    comm_stats().record(tag, intra, inter, uncompressed=raw)
    if shard == 0:
        return CommHandle(lambda: None) if async_op else None
    groups = topology._groups
    stream = comm_stream(input.device, "gather", groups.streams)
    scratch = groups.buffers.lease(input.device)
    me = topology.rank

    def first():
        gathered, work = _send_difference(input, held, fmt, scratch, flat, size, rb, me, tag)

        def finish() -> None:
            wait(work)
            rows = output.view(size, shard)
            with comm_timers().codec():
                rows[me].copy_(held.value)  # the owner's base: what the replicas hold, not the new weights
            # decoded + fp32(base), one rounding to the weights' dtype: the same operation on the same bits on
            # every rank, in one pass
            codec_ops.dequantize_add_rows_(gathered.view(size, rb), output.view(-1), fmt.bits, fmt.block,
                                           fmt.hadamard)
            with comm_timers().codec():
                held.value.copy_(rows[me])
            scratch.release()
        return [], finish

    return launch(groups.in_flight, stream, (input, output, held.value), first, async_op)


def hpz_weight_difference_all_gather(output: torch.Tensor, input: torch.Tensor, hpz_shard: HpzShard,
                                     held: HeldShard, topology: Topology,
                                     codec: str | Codec | None = "int4:block=2048", async_op: bool = False,
                                     tag: str = "dp.param"):
    """qWD for ZeRO-3 (Megatron-FSDP), on the hpZ secondary partition: ``output`` gets every shard's weights as
    the replicas hold them, gathered *inside the node*; what crosses nodes is one 4-bit difference per shard
    and weight update.

    ``hpz_shard`` holds, in the weights' dtype (codec ``none``), the shards ``[j * R, (j + 1) * R)`` of this
    rank's hpZ index ``j`` (``R = size / hpz_size``); each node holds them all across its hpZ group. Three cases:

    * ``held`` not valid (the first gather, after a checkpoint load or a resync): a full-precision all-gather,
      which fills the secondary copy at its wait (fresh unless ``invalidate()`` ran since the call); ``held``
      becomes this rank's shard.
    * ``hpz_shard`` valid (gathered since the weights last changed): :func:`hpz_all_gather`, inside the node.
    * ``hpz_shard`` stale (``invalidate()`` after an optimizer step): two collectives, both issued at the call:
      every rank's quantized ``input - held`` all-gathered across all ranks (with ``codec``), and the stale copy
      gathered inside the node. At ``wait()`` every rank adds the decoded differences of *every* shard to the
      gathered copy (``cast(fp32(held row) + decoded)``), then keeps its secondary rows and ``held`` from the result.

    Every replica thus computes with bit-identical weights (the same operation on the same bits everywhere: the
    secondary copies are identical across nodes), and the quantization error is not lost: the next difference is
    taken against what the replicas hold. ``input``'s padding must be zero (or finite). As for any asynchronous
    gather, neither ``input`` nor ``output`` may be written before ``wait()``: the copy and ``held`` are taken
    from ``output`` there.

    Why both hops at the call: Megatron-FSDP issues a forward's bucket gathers back to back and waits each right
    before its layer. Gathering the *refreshed* copy inside the node needs the differences first, so that hop
    started either at a later call (a middle step, which on gloo blocked the host at each issue until the previous
    bucket's differences arrived) or at the wait (a rendezvous of the node's ranks right before each layer: the
    forward waited 138-144 ms per iteration on the emulated cluster at 100 Mbit/s and unshaped, zeropp's 35-48, and
    30-46 since; docs/bench/2026-11-28-fsdp-both-hops). Decoding every shard instead
    of the node's share decodes ``size`` rows where it decoded ``size / hpz_size + 1``, as many as qwZ's decode
    of the whole bucket at each gather.
    """
    what = "hpz_weight_difference_all_gather"
    size, shard = _check_difference_gather(output, input, held, topology, what)
    if hpz_shard.format.compressed or hpz_shard.shard_numel != shard or hpz_shard.dtype != input.dtype \
            or hpz_shard.topology._groups is not topology._groups:
        raise ValueError(f"{what}: hpz_shard must hold {shard} {input.dtype} elements per shard in the weights' "
                         f"dtype (codec 'none') on this topology; it has {hpz_shard.shard_numel} "
                         f"{hpz_shard.dtype} with codec {hpz_shard.format.spec!r}")
    fmt = wire_format(topology, codec, what)
    if not fmt.blockwise:
        raise ValueError(f"{what}: codec {fmt.spec!r} is not a blockwise quantizer; valid: int4, int8")
    agree(topology, what, codec=fmt.spec, dtype=str(input.dtype), hpz=topology.hpz_size)
    if hpz_shard.refreshing is not None:
        # An exchange dispatched earlier has not updated the copy and ``held`` yet (that runs at its wait()):
        # finish it first, or this call would send the same difference again and apply it twice. The same on
        # every rank, as both calls are.
        pending, hpz_shard.refreshing = hpz_shard.refreshing, None
        pending.wait()
    if not held.valid:
        handle = quantized_all_gather(output, input, topology, codec="none", async_op=True, tag=tag,
                                      hpz_shard=hpz_shard)
        held.value.copy_(input)
        held.valid = True
        # Its wait fills the copy: a stale gather issued before it (an update in between) must gather the filled
        # copy, not the one before the resync, so the guard above waits for it too.
        hpz_shard.refreshing = handle
        if async_op:
            return handle
        handle.wait()
        return None
    if hpz_shard.valid:
        return hpz_all_gather(output, hpz_shard, topology, async_op=async_op, tag=tag)

    flat, hpz = topology._groups.flat, topology._groups.hpz
    rb = layout.row_bytes(shard, fmt.bits, fmt.block)
    part = hpz_shard.payload.view(-1)
    # One call: the difference rows' all-gather and the intra-node gather of the (stale) copy.
    intra, inter = flat.split_ring((size - 1) * rb)
    hpz_intra, hpz_inter = hpz.split_ring((hpz.size - 1) * part.numel())
    raw = flat.split_ring((size - 1) * shard * input.element_size())
    comm_stats().record(tag, intra + hpz_intra, inter + hpz_inter, uncompressed=raw)
    if shard == 0:
        hpz_shard.valid = True
        return CommHandle(lambda: None) if async_op else None
    groups = topology._groups
    stream = comm_stream(input.device, "gather", groups.streams)
    scratch = groups.buffers.lease(input.device)
    me, rows = topology.rank, hpz_shard.rows
    first_row = topology.hpz_index * rows
    generation = hpz_shard.generation
    gather_out = output.view(-1).view(torch.uint8)
    secondary = hpz_shard.payload.view(-1).view(input.dtype).view(rows, shard)

    def first():
        gathered, work = _send_difference(input, held, fmt, scratch, flat, size, rb, me, tag)
        # after the difference is taken: ``input`` may be the owner's slice of ``output``
        stale = hpz.all_gather(gather_out, part)

        def finish() -> None:
            wait(stale)
            wait(work)
            # decoded + fp32(held row), one rounding, every row: the same operation on the same bits on every rank
            codec_ops.dequantize_add_rows_(gathered.view(size, rb), output.view(-1), fmt.bits, fmt.block,
                                           fmt.hadamard)
            rows_out = output.view(size, shard)
            with comm_timers().codec():
                secondary.copy_(rows_out[first_row:first_row + rows])
                held.value.copy_(rows_out[me])
            hpz_shard.refreshing = None
            # fresh, unless the weights changed again since the dispatch (then the next gather exchanges anew)
            hpz_shard.valid = hpz_shard.generation == generation
            scratch.release()
        return [], finish

    handle = launch(groups.in_flight, stream, (input, output, held.value, hpz_shard.payload), first, True)
    # The copy and ``held`` are updated at ``handle``'s wait.
    hpz_shard.refreshing = handle
    if async_op:
        return handle
    handle.wait()
    return None
