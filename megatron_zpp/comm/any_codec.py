"""Collectives for codecs without fused kernels: ZFP and the lossless codecs (MPC, zstd, nvCOMP).

The blockwise INT8/INT4 codecs have fused reorder+quantize and dequantize+reduce kernels
(``reduce_scatter.py``, ``all_gather.py``). Every other codec goes through the :class:`Codec`
interface here, whole payloads at a time, with the same algorithms and the same execution model
(``execution.py``):

- reduce-scatter: qgZ's two hops. Hop 1 (intra-node all-to-all) sends local peer ``j`` one payload
  holding the chunks that rank ``j`` of every node will own; each rank decodes what it received
  and sums it in fp32 (in source order, so the result does not depend on timing), encodes one
  payload of partial sums per node, hop 2 (inter-node all-to-all) sends them, and the owner decodes,
  sums in fp32 and divides.
- all-gather: every rank encodes its shard once; every rank decodes every payload, its own
  included, so all replicas hold bit-identical values.
- all-reduce (``all_reduce.py``): the reduce-scatter, then the all-gather of the reduced shards.

Payload sizes. A fixed-size codec (ZFP: ``codec.fixed_size``) has payloads of
``codec.wire_bytes(numel)`` bytes, known to both sides from the shapes: no size message. A
variable-size codec (lossless containers) sends only its true bytes, so the receiver must learn
them first: **one batched size exchange per hop**. The lengths are read from the container headers
on the device, exchanged (an all-to-all or all-gather of one int64 per rank) and read once by the
host, with the lengths sent: one host synchronization per hop of each call on a GPU, not one per
tensor. The all-gather pads every payload to the largest one (``all_gather_into_tensor`` needs
equal sizes), and the bytes counted are the padded ones, the bytes that really travel. Size
messages are counted too.

What this costs on a GPU (not run here: no GPU): that host read waits for the compute queued
before the call and for every peer to reach it, so with a variable-size codec a collective's
first step blocks the host (the CPU's run-ahead is lost where Megatron overlaps bucket
reductions with backward), and decoding validates each container's header with a small
device-to-host read per payload. Fixed-size codecs (ZFP, INT8/INT4) do neither.

NaN/Inf: ZFP decodes a block holding NaN or Inf to NaN and lossless codecs return the input
exactly, so a non-finite gradient stays non-finite through the sum and Megatron's found-inf
check sees it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_zpp.compression import Packed
from megatron_zpp.compression.container import payload_lengths
from megatron_zpp.comm._common import WireFormat, wait
from megatron_zpp.comm.stats import comm_stats, comm_timers
from megatron_zpp.comm.topology import Scratch, Topology, _GroupInfo

_SIZE_BYTES = 8  # one int64 per size message


def encode(fmt: WireFormat, x: torch.Tensor) -> torch.Tensor:
    """``x`` encoded: a flat uint8 tensor. Variable-size codecs may return a longer buffer than the
    payload (on a GPU, the worst case); the exchanges below read the true length from its header."""
    with comm_timers().codec():
        return fmt.codec.encode(x).payload.view(-1)


def decode(fmt: WireFormat, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """Decode one payload (a variable-size codec validates its container: a corrupt payload raises)."""
    with comm_timers().codec():
        return fmt.codec.decode(Packed(payload=payload, shape=torch.Size(shape), dtype=dtype))


def _a2a_bytes(group: _GroupInfo, send_sizes: list[int]) -> tuple[int, int]:
    """(intra, inter) bytes this rank sends in an all-to-all with ``send_sizes[p]`` bytes to member ``p``."""
    me = group.member_nodes[group.index]
    intra = inter = 0
    for p, n in enumerate(send_sizes):
        if p == group.index:
            continue
        if group.member_nodes[p] == me:
            intra += n
        else:
            inter += n
    return intra, inter


def all_to_all_payloads(group: _GroupInfo, payloads: list[torch.Tensor], fixed: bool, tag: str,
                        raw_bytes: int) -> tuple[object, list[torch.Tensor]]:
    """Send ``payloads[p]`` to member ``p``; returns ``(work, received)`` with ``received[p]`` from member
    ``p`` (valid after ``wait(work)``). ``fixed``: all payloads have one size, known to every member.
    ``raw_bytes``: one destination's uncompressed bytes, for the counters."""
    size = group.size
    device = payloads[0].device
    if group.group is None:
        return None, [payloads[0]]
    if fixed:
        send_sizes = recv_sizes = [p.numel() for p in payloads]
        size_bytes = 0
    else:
        sizes = payload_lengths(payloads)
        recv = torch.empty_like(sizes)
        dist.all_to_all_single(recv, sizes, group=group.group)
        both = torch.cat([sizes, recv]).tolist()  # the one host sync of this hop (module docstring)
        send_sizes, recv_sizes = both[:size], both[size:]
        payloads = [p[:n] for p, n in zip(payloads, send_sizes)]
        size_bytes = _SIZE_BYTES
    send = torch.cat(payloads)
    received = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    work = dist.all_to_all_single(received, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                                  group=group.group, async_op=True)
    intra, inter = _a2a_bytes(group, [n + size_bytes for n in send_sizes])
    comm_stats().record(tag, intra, inter, uncompressed=_a2a_bytes(group, [raw_bytes] * size))
    return work, list(received.split(recv_sizes))


def all_gather_payload(group: _GroupInfo, payload: torch.Tensor, fixed: bool, tag: str,
                       raw_bytes: int) -> tuple[object, list[torch.Tensor]]:
    """Every member's ``payload``, in member order: ``(work, gathered)``, valid after ``wait(work)``.
    Variable-size payloads are padded to the largest (the padding travels and is counted)."""
    size = group.size
    if group.group is None:
        return None, [payload]
    if fixed:
        sizes, padded_len, size_bytes = [payload.numel()] * size, payload.numel(), 0
    else:
        everyone = torch.empty(size, dtype=torch.int64, device=payload.device)
        dist.all_gather_into_tensor(everyone, payload_lengths([payload]), group=group.group)
        sizes = everyone.tolist()  # the one host sync of this gather (module docstring)
        padded_len, size_bytes = max(sizes), _SIZE_BYTES
        if payload.numel() >= padded_len:  # a worst-case buffer: the bytes past the payload are the padding
            payload = payload[:padded_len]
        else:
            padded = torch.zeros(padded_len, dtype=torch.uint8, device=payload.device)
            padded[:payload.numel()].copy_(payload)
            payload = padded
    gathered = torch.empty(size * padded_len, dtype=torch.uint8, device=payload.device)
    work = dist.all_gather_into_tensor(gathered, payload, group=group.group, async_op=True)
    intra, inter = group.split_ring((size - 1) * (padded_len + size_bytes))
    comm_stats().record(tag, intra, inter, uncompressed=group.split_ring((size - 1) * raw_bytes))
    rows = gathered.view(size, padded_len)
    return work, [rows[i, :sizes[i]] for i in range(size)]


# ------------------------------------------------------------------ reduce-scatter -----
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, topology: Topology, intra_fmt: WireFormat,
                   inter_fmt: WireFormat, divisor: int, scratch: Scratch, tag: str,
                   residual: torch.Tensor | None = None):
    """First step of the two-hop reduce-scatter (module docstring); returns ``(middles, finish)``.
    ``residual``: error feedback, as in ``reduce_scatter.qgz_reduce_scatter``."""
    from megatron_zpp.comm.reduce_scatter import compensate, drop_non_finite_

    groups = topology._groups
    size, nodes, node_size = topology.size, topology.num_nodes, topology.node_size
    length, dtype = output.numel(), input.dtype
    two_hops = nodes > 1 and node_size > 1
    first_fmt = intra_fmt if node_size > 1 else inter_fmt
    first = groups.intra if node_size > 1 else groups.inter  # size-1 groups when size == 1
    raw = length * input.element_size()

    # Reorder [node, local, length] -> [local, node, length]: local peer j gets one payload holding the
    # chunks of rank j of every node.
    x = input
    if residual is not None:
        x, target = compensate(input, residual, scratch)
    with comm_timers().codec():
        reordered = x.view(nodes, node_size, length).transpose(0, 1).contiguous()
    per_peer = reordered.view(first.size, -1)
    payloads = [encode(first_fmt, per_peer[p]) for p in range(first.size)]
    if residual is not None:  # what hop 1 really sends, decoded, back in [node, local] order
        sent = torch.stack([decode(first_fmt, p, (per_peer.shape[1],), dtype) for p in payloads])
        with comm_timers().codec():
            sent = sent.view(node_size, nodes, length).transpose(0, 1).reshape(-1)
            torch.sub(target.view(-1), sent, out=residual.view(-1))
            drop_non_finite_(residual)
    hop1, received1 = all_to_all_payloads(first, payloads, first_fmt.codec.fixed_size, tag,
                                          raw * (size // first.size))

    def sum_decoded(fmt: WireFormat, received: list[torch.Tensor], rows: int) -> torch.Tensor:
        """fp32 sum over sources of the decoded payloads: the same reduction, in the same order, as the
        uncompressed algorithm's (``reduce_scatter._uncompressed``), so a lossless codec gives its
        result bit for bit."""
        parts = torch.stack([decode(fmt, payload, (rows, length), dtype) for payload in received])
        with comm_timers().codec():
            return torch.sum(parts, dim=0, dtype=torch.float32)

    def finish_from(fmt: WireFormat, work, received, rows: int) -> None:
        wait(work)
        acc = sum_decoded(fmt, received, rows)
        with comm_timers().codec():
            if divisor != 1:
                acc.div_(divisor)
            output.view(-1).copy_(acc.view(-1))
        scratch.release()

    if not two_hops:
        return [], lambda: finish_from(first_fmt, hop1, received1, size // first.size)

    state: dict = {}

    def middle() -> None:
        wait(hop1)
        partial = sum_decoded(intra_fmt, received1, nodes)  # [nodes, length]: this node's partial sums
        with comm_timers().codec():
            partial = partial.to(dtype)  # partial sums travel in the input dtype, as uncompressed
        payloads2 = [encode(inter_fmt, partial[n]) for n in range(nodes)]
        state["hop2"] = all_to_all_payloads(groups.inter, payloads2, inter_fmt.codec.fixed_size, tag, raw)

    def finish() -> None:
        work, received = state.pop("hop2")
        finish_from(inter_fmt, work, received, 1)

    return [middle], finish


# ------------------------------------------------------------------ all-gather -----
def all_gather(output: torch.Tensor, input: torch.Tensor, topology: Topology, fmt: WireFormat, scratch: Scratch,
               tag: str):
    """First step of the all-gather: encode the shard, gather every payload; the finish decodes them all."""
    group = topology._groups.flat
    payload = encode(fmt, input.view(-1))
    work, gathered = all_gather_payload(group, payload, fmt.codec.fixed_size, tag,
                                        input.numel() * input.element_size())

    def finish() -> None:
        wait(work)
        rows = output.view(topology.size, -1)
        for i, p in enumerate(gathered):
            decoded = decode(fmt, p, (input.numel(),), input.dtype)
            with comm_timers().codec():
                rows[i].copy_(decoded)
        scratch.release()

    return [], finish
