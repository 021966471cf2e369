"""qgZ: the hierarchical (intra-node, then inter-node) all-to-all gradient reduce-scatter,
and the uncompressed reduce-scatters it is measured against.

``qgz_reduce_scatter(output, input, topology, codec)`` has the contract of
``reduce_scatter_tensor(output, input, op)``: ``input`` holds ``size`` chunks of
``output.numel()`` elements, chunk ``i`` destined to group rank ``i``; every rank
receives the sum (``op="sum"``) or mean (``op="mean"``) of its chunk over all ranks.

Compressed path (ZeRO++ section 3.3), per pipeline stage ``s`` (Algorithm 2):

1. fused reorder + quantize: chunk ``d = node * node_size + local`` goes to slot
   ``s * size + local * num_nodes + node``, so the intra-node all-to-all hands local
   rank ``local`` the chunks that rank ``local`` of *every* node will own;
2. intra-node all-to-all of the packed rows (``intra_codec``, default ``codec``);
3. fused dequantize + reduce (fp32) + quantize (``codec``): the node's partial sums,
   one row per destination node;
4. inter-node all-to-all: one row to each node;
5. dequantize + reduce (fp32) + divide, into ``output``.

Cross-node bytes per rank: ``(num_nodes - 1) * row_bytes(output.numel())`` -- each
node sends ``(num_nodes - 1) / num_nodes * M / Z`` where ring reduce-scatter sends
``~M``. One node: steps 2 and 5 only (still compressed); one rank per node: steps 1,
4 and 5. Any ``output.numel()`` works (no fallback, no divisibility condition);
``stages > 1`` splits every chunk into ``stages`` slices so the intra-node hop of
slice ``s + 1`` overlaps the inter-node hop of slice ``s``.

With ``codec="none"`` the same two hops run on raw values (summed in fp32, partial
sums sent in the input dtype): a hierarchical uncompressed reduce-scatter, the
uncompressed algorithm with the fewest cross-node bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_zpp.compression import Codec, layout
from megatron_zpp.comm import any_codec
from megatron_zpp.comm.error_feedback import check_residual, compensate, drop_non_finite_
from megatron_zpp.comm.execution import comm_stream, launch
from megatron_zpp.comm.scratch import Scratch
from megatron_zpp.comm.stats import comm_stats, comm_timers
from megatron_zpp.comm.topology import Topology
from megatron_zpp.comm.wire import (
    CommHandle, WireFormat, agree, check_float, check_pair, codec_ops, reduce_divisor, wait, wire_format)


def qgz_reduce_scatter(output: torch.Tensor, input: torch.Tensor, topology: Topology,
                       codec: str | Codec | None = "int4:block=128", op="mean", async_op: bool = False,
                       tag: str = "dp.grad", intra_codec: str | Codec | None = None, stages: int = 1,
                       residual: torch.Tensor | None = None):
    """Reduce-scatter ``input`` into ``output`` with ZeRO++'s quantized 2-hop all-to-all.

    Args:
        output: this rank's chunk, ``input.numel() / size`` elements; may alias ``input``
            (Megatron passes a view of its bucket): ``input`` is fully read at the call.
        input: ``size`` chunks, fp32 / bf16 / fp16 (any dtype with ``codec="none"``).
        topology: the group and its node layout.
        codec: codec of the inter-node hop (and of the intra-node hop unless ``intra_codec``).
        op: ``"mean"`` or ``"sum"``; accumulation is fp32 whatever the input dtype.
        async_op: return a :class:`CommHandle`. Hop 1 is issued at the call; hop 2 at the next
            progress point (the next collective on the topology) or ``wait()``, whichever comes
            first (``execution.py``); ``wait()`` delivers ``output``.
        tag: byte-accounting tag.
        intra_codec: codec of the intra-node hop, e.g. INT8 inside the node and INT4 across.
        stages: pipeline stages (Algorithm 2); each chunk is split into this many slices.
        residual: error feedback (off when None): this rank's fp32 residual, ``input.numel()``
            elements. Hop 1 sends ``input + residual`` and the residual becomes what hop 1's encoding
            lost of it (``error_feedback.md``); hop 2's error, on the node's partial sums, is not fed back.
    """
    what = "qgz_reduce_scatter"
    check_pair(output, input, what)
    size = topology.size
    length = output.numel()
    if input.numel() != size * length:
        raise ValueError(f"{what}: input has {input.numel()} elements; group size {size} x output "
                         f"{length} = {size * length}")
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"{what}: stages={stages!r} must be a positive integer")
    divisor = reduce_divisor(op, size, what)
    inter_fmt = wire_format(topology, codec, what)
    intra_fmt = wire_format(topology, intra_codec, what) if intra_codec is not None else inter_fmt
    if inter_fmt.compressed != intra_fmt.compressed:
        raise ValueError(f"{what}: codec={inter_fmt.spec!r} and intra_codec={intra_fmt.spec!r} must both be "
                         "'none' or both be compressing codecs")
    if inter_fmt.compressed and inter_fmt.generic != intra_fmt.generic:
        raise ValueError(f"{what}: codec={inter_fmt.spec!r} and intra_codec={intra_fmt.spec!r} must both be "
                         "blockwise (int8/int4, fused kernels) or both not (ZFP, lossless: any_codec.py)")
    if (inter_fmt.blockwise and intra_fmt.hadamard and topology.node_size > 1 and topology.num_nodes > 1
            and inter_fmt.block % intra_fmt.hadamard):
        raise ValueError(f"{what}: intra_codec={intra_fmt.spec!r} rotates runs of {intra_fmt.hadamard}, which must "
                         f"divide codec={inter_fmt.spec!r}'s block {inter_fmt.block}: the node's sums are rotated "
                         "back one inter-node block at a time")
    if inter_fmt.compressed:
        check_float("input", input, what)
    if residual is not None:
        check_residual(residual, input, inter_fmt, what)
    agree(topology, what, codec=inter_fmt.spec, intra_codec=intra_fmt.spec, stages=stages,
          dtype=str(input.dtype), divisor=divisor)
    if length == 0:
        return CommHandle(lambda: None) if async_op else None

    groups = topology._groups
    if inter_fmt.generic:
        # ZFP / lossless: whole payloads through the codec interface (any_codec.py), one stage.
        if stages != 1:
            raise ValueError(f"{what}: stages={stages} needs blockwise codecs (int8/int4); "
                             f"codec={inter_fmt.spec!r}, intra_codec={intra_fmt.spec!r} run one stage")
        stream = comm_stream(input.device, "reduce", groups.streams)
        scratch = groups.buffers.lease(input.device)
        return launch(groups.in_flight, stream, (input, output) + ((residual,) if residual is not None else ()),
                      lambda: any_codec.reduce_scatter(output, input, topology, intra_fmt, inter_fmt, divisor,
                                                       scratch, tag, residual), async_op)

    stages = min(stages, length)  # never a slice of zero elements
    slice_len = layout.ceil_div(length, stages)
    raw_row = slice_len * input.element_size()
    if inter_fmt.compressed:
        first_fmt = intra_fmt if topology.node_size > 1 else inter_fmt
        rows = (layout.row_bytes(slice_len, first_fmt.bits, first_fmt.block),
                layout.row_bytes(slice_len, inter_fmt.bits, inter_fmt.block))
    else:
        rows = (raw_row, raw_row)
    comm_stats().record(tag, *_hop_bytes(topology, stages, *rows),
                        uncompressed=_hop_bytes(topology, stages, raw_row, raw_row))
    stream = comm_stream(input.device, "reduce", groups.streams)
    scratch = groups.buffers.lease(input.device)
    site = f"{tag}/qgz"
    used = (input, output) + ((residual,) if residual is not None else ())
    if inter_fmt.compressed:
        return launch(groups.in_flight, stream, used,
                      lambda: _compressed(output, input, topology, intra_fmt, inter_fmt, stages, slice_len, divisor,
                                          scratch, site, residual), async_op)
    return launch(groups.in_flight, stream, used,
                  lambda: _uncompressed(output, input, topology, intra_fmt, inter_fmt, stages, slice_len, divisor,
                                        scratch, site), async_op)


def _hop_bytes(topology: Topology, stages: int, row1: int, row2: int) -> tuple[int, int]:
    """(intra, inter) bytes this rank sends in qgZ's hops with packed rows of ``row1`` / ``row2`` bytes."""
    groups, size = topology._groups, topology.size
    first = groups.intra if topology.node_size > 1 else groups.inter
    intra, inter = first.split_a2a(size // first.size * row1)
    if topology.node_size > 1 and topology.num_nodes > 1:
        intra2, inter2 = groups.inter.split_a2a(row2)
        intra, inter = intra + intra2, inter + inter2
    return intra * stages, inter * stages


def _staged_input(input: torch.Tensor, size: int, stages: int, slice_len: int, scratch: Scratch) -> torch.Tensor:
    """``input`` as ``[size, stages * slice_len]``, zero-padded through a scratch copy when needed."""
    length = input.numel() // size
    if stages * slice_len == length:
        return input.view(-1)
    staging = scratch.take(size * stages * slice_len * input.element_size())
    padded = staging.view(input.dtype).view(size, stages * slice_len)
    padded[:, length:].zero_()
    padded[:, :length].copy_(input.view(size, length))
    return padded.view(-1)


def _staged_output(output: torch.Tensor, stages: int, slice_len: int, scratch: Scratch):
    """Where the stages write: ``output`` itself, or a padded scratch copy (``copy_back`` True)."""
    if stages * slice_len == output.numel():
        return output.view(-1), False
    return scratch.take(stages * slice_len * output.element_size()).view(output.dtype), True


def _compressed(output, input, topology: Topology, intra_fmt: WireFormat, inter_fmt: WireFormat,
                stages: int, slice_len: int, divisor: int, scratch: Scratch, site: str,
                residual: torch.Tensor | None = None):
    groups = topology._groups
    size, nodes, node_size = topology.size, topology.num_nodes, topology.node_size
    two_hops = nodes > 1 and node_size > 1
    first_fmt = intra_fmt if node_size > 1 else inter_fmt
    first = groups.intra if node_size > 1 else groups.inter  # size-1 groups when size == 1

    if residual is not None:
        compensated, target = compensate(input, residual, scratch)
        x = _staged_input(compensated.view(input.shape), size, stages, slice_len, scratch)
    else:
        x = _staged_input(input, size, stages, slice_len, scratch)
    rb1 = layout.row_bytes(slice_len, first_fmt.bits, first_fmt.block)
    send1 = scratch.take(stages * size * rb1)
    recv1 = scratch.take(stages * size * rb1)
    codec_ops.reorder_quantize_(x, send1.view(stages * size, rb1), first_fmt.bits, first_fmt.block, nodes,
                          node_size, stages, first_fmt.stochastic, first_fmt.seed(topology.rank, site + ".hop1"),
                          first_fmt.hadamard)
    if residual is not None:
        # What hop 1 really sends, decoded: rows are [stage, local, node, slice] (the reorder above).
        sent = scratch.take(stages * size * slice_len * 4).view(torch.float32)
        codec_ops.dequantize_rows_(send1.view(stages * size, rb1), sent, first_fmt.bits, first_fmt.block,
                                   first_fmt.hadamard)
        with comm_timers().codec():
            length = input.numel() // size
            sent = sent.view(stages, node_size, nodes, slice_len).permute(2, 1, 0, 3).reshape(size, -1)[:, :length]
            torch.sub(target.view(size, length), sent, out=residual.view(size, length))
            drop_non_finite_(residual)
    send1_s, recv1_s = send1.view(stages, size * rb1), recv1.view(stages, size * rb1)
    hop1 = [first.all_to_all(recv1_s[s], send1_s[s]) for s in range(stages)]
    out, copy_back = _staged_output(output, stages, slice_len, scratch)

    if not two_hops:
        def finish() -> None:
            _dequant_reduce_stages(hop1, recv1_s, size, rb1, first_fmt, out, slice_len, divisor)
            _finish_output(output, out, copy_back)
            scratch.release()
        return [], finish

    rb2 = layout.row_bytes(slice_len, inter_fmt.bits, inter_fmt.block)
    send2 = scratch.take(stages * nodes * rb2)
    recv2 = scratch.take(stages * nodes * rb2)
    send2_s, recv2_s = send2.view(stages, nodes, rb2), recv2.view(stages, nodes, rb2)
    hop2: list = []

    def middle() -> None:
        for s in range(stages):
            wait(hop1[s])
            codec_ops.dequant_reduce_quantize_(recv1_s[s].view(node_size, nodes, rb1), send2_s[s], slice_len,
                                         intra_fmt.bits, intra_fmt.block, inter_fmt.bits, inter_fmt.block,
                                         inter_fmt.stochastic, inter_fmt.seed(topology.rank, site + ".hop2"),
                                         intra_fmt.hadamard, inter_fmt.hadamard)
            hop2.append(groups.inter.all_to_all(recv2_s[s], send2_s[s]))

    def finish() -> None:
        _dequant_reduce_stages(hop2, recv2_s, nodes, rb2, inter_fmt, out, slice_len, divisor)
        _finish_output(output, out, copy_back)
        scratch.release()
    return [middle], finish


def _dequant_reduce_stages(hops, received, sources: int, row_bytes: int, fmt: WireFormat, out, slice_len: int,
                           divisor: int) -> None:
    """The last step of each stage: wait its hop, sum the ``sources`` received rows in fp32, divide,
    write the stage's slice of ``out``."""
    for s, work in enumerate(hops):
        wait(work)
        codec_ops.dequant_reduce_(received[s].view(sources, 1, row_bytes), out[s * slice_len:(s + 1) * slice_len],
                            fmt.bits, fmt.block, divisor, fmt.hadamard)


def _finish_output(output, out, copy_back: bool) -> None:
    if copy_back:
        output.view(-1).copy_(out[:output.numel()])


def _uncompressed(output, input, topology: Topology, intra_fmt, inter_fmt, stages: int, slice_len: int,
                  divisor: int, scratch: Scratch, site: str):
    groups, dtype = topology._groups, input.dtype
    size, nodes, node_size = topology.size, topology.num_nodes, topology.node_size
    elt = input.element_size()
    two_hops = nodes > 1 and node_size > 1
    first = groups.intra if node_size > 1 else groups.inter

    x = _staged_input(input, size, stages, slice_len, scratch)
    send1 = scratch.take(stages * size * slice_len * elt).view(dtype).view(stages, node_size, nodes, slice_len)
    recv1 = scratch.take(stages * size * slice_len * elt).view(dtype).view(stages, size, slice_len)
    # The raw form of the reorder: [node, local, stage, slice] -> [stage, local, node, slice].
    with comm_timers().codec():
        send1.copy_(x.view(nodes, node_size, stages, slice_len).permute(2, 1, 0, 3))
    hop1 = [first.all_to_all(recv1[s], send1[s]) for s in range(stages)]
    out, copy_back = _staged_output(output, stages, slice_len, scratch)
    acc = scratch.take(max(nodes, 1) * slice_len * 4).view(torch.float32)

    def reduce_into(dst: torch.Tensor, chunks: torch.Tensor, div: int) -> None:
        with comm_timers().codec():  # the uncompressed algorithm's reduction: its share of "codec" time
            a = acc[:dst.numel()].view(dst.shape)
            torch.sum(chunks, dim=0, dtype=torch.float32, out=a)
            if div != 1:
                a.div_(div)
            dst.copy_(a)

    def reduce_stages(works, received) -> None:
        for s in range(stages):
            wait(works[s])
            reduce_into(out[s * slice_len:(s + 1) * slice_len], received[s], divisor)
        _finish_output(output, out, copy_back)
        scratch.release()

    if not two_hops:
        return [], lambda: reduce_stages(hop1, recv1)

    send2 = scratch.take(stages * nodes * slice_len * elt).view(dtype).view(stages, nodes, slice_len)
    recv2 = scratch.take(stages * nodes * slice_len * elt).view(dtype).view(stages, nodes, slice_len)
    hop2: list = []

    def middle() -> None:
        for s in range(stages):
            wait(hop1[s])
            # Partial sums travel in the input dtype, as in any uncompressed reduce-scatter.
            reduce_into(send2[s], recv1[s].view(node_size, nodes, slice_len), 1)
            hop2.append(groups.inter.all_to_all(recv2[s], send2[s]))

    return [middle], lambda: reduce_stages(hop2, recv2)


# ------------------------------------------------------------ uncompressed baselines -----
def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, topology: Topology, op="mean",
                        tag: str = "dp.grad") -> None:
    """Bandwidth-optimal flat ring reduce-scatter over send/recv: each rank sends ``size - 1``
    chunks to its successor (NCCL's algorithm). The fair baseline on gloo, whose own
    ``reduce_scatter_tensor`` is an all-reduce (twice the bytes and ``size`` x the output).
    Sums in fp32; partial sums travel in the input dtype."""
    what = "ring_reduce_scatter"
    check_pair(output, input, what)
    size, rank, flat = topology.size, topology.rank, topology._groups.flat
    length = output.numel()
    if input.numel() != size * length:
        raise ValueError(f"{what}: input has {input.numel()} elements; group size {size} x output "
                         f"{length} = {size * length}")
    divisor = reduce_divisor(op, size, what)
    intra, inter = flat.split_ring((size - 1) * length * input.element_size())
    comm_stats().record(tag, intra, inter)
    chunks = input.view(size, length)
    acc = chunks[rank].to(torch.float32)
    if size > 1 and length:
        send = chunks[(rank - 1) % size].clone()
        recv = torch.empty_like(send)
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        for step in range(size - 1):
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, send, group=flat.group, group_peer=nxt),
                dist.P2POp(dist.irecv, recv, group=flat.group, group_peer=prv)])
            for w in works:
                w.wait()
            acc = recv.to(torch.float32) + chunks[(rank - step - 2) % size].to(torch.float32)
            if step < size - 2:
                send.copy_(acc)
    if divisor != 1:
        acc = acc / divisor
    output.view(-1).copy_(acc.view(-1))
