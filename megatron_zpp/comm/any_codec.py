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
them first: **one batched size exchange per hop, read by the host one step later**. The lengths
are read from the container headers on the device and exchanged (an all-to-all or all-gather of
one int64 per rank) in one step, and the host reads them (``compression.host_read.HostRead``: a
non-blocking copy to pinned memory and an event on a GPU) in the next step of the execution model
(``execution.py``), which sends the payloads: the host read happens a progress point later, when
the sizes have had the time between two calls to arrive. Size messages are counted.

Alignment. Every variable-size payload travels in a slot rounded up to ``ALIGN`` (16) bytes, so
every received payload starts 16-byte aligned (nvCOMP's streams, at offset 48 in the container,
need it; MPC needs 4). The all-gather pads every payload to the largest slot
(``all_gather_into_tensor`` needs equal sizes). The bytes counted are the slots, the bytes that
really travel.

Validation. A variable-size payload's container (header, sizes, checksum) is validated on the
device where the codec allows (``ContainerCodec.decode_deferred``: mpc); the records of a hop's
payloads come to the host in one read with the call's next host read (the next hop's sizes) or,
for the last hop, at the start of the first later collective or ``wait()`` on the topology at which
the read has arrived, and at the latest ``execution.MAX_CHECK_LAG`` of them later (``InFlight.defer``),
before that collective issues anything: a corrupt payload raises
:class:`~megatron_zpp.compression.PayloadError` naming the problem, and meanwhile decodes to NaN on
the device (``mpc``), which Megatron's found-inf check sees in the same iteration. The host waits for a
decode to finish only when a check is forced.
A bad hop-1 payload (two hops) raises within the same call, at its hop-2 step. zstd (host
payloads) and nvCOMP (its sizes are needed on the host) validate at decode.

NaN/Inf: ZFP decodes a block holding NaN or Inf to NaN and lossless codecs return the input
exactly, so a non-finite gradient stays non-finite through the sum and Megatron's found-inf
check sees it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_zpp.compression import Packed
from megatron_zpp.compression.container import DeferredCheck, payload_lengths
from megatron_zpp.compression.host_read import HostRead
from megatron_zpp.comm.error_feedback import compensate, drop_non_finite_
from megatron_zpp.comm.scratch import Scratch
from megatron_zpp.comm.stats import comm_stats, comm_timers
from megatron_zpp.comm.topology import Topology, _GroupInfo
from megatron_zpp.comm.wire import WireFormat, wait

_SIZE_BYTES = 8  # one int64 per size message
ALIGN = 16  # every variable-size payload's slot is a multiple of this (module docstring)


def slot_bytes(n: int) -> int:
    """The bytes a variable-size payload of ``n`` bytes occupies on the wire."""
    return -(-n // ALIGN) * ALIGN


def encode(fmt: WireFormat, x: torch.Tensor) -> torch.Tensor:
    """``x`` encoded: a flat uint8 tensor. Variable-size codecs may return a longer buffer than the
    payload (on a GPU, the worst case); the exchanges below read the true length from its header."""
    with comm_timers().codec():
        return fmt.codec.encode(x).payload.view(-1)


def decode(fmt: WireFormat, payload: torch.Tensor, shape, dtype: torch.dtype, checks: list | None = None):
    """Decode one payload. With ``checks`` (a list), a variable-size codec that can defers its container
    validation and appends the check to it (module docstring); otherwise a corrupt payload raises here."""
    packed = Packed(payload=payload, shape=torch.Size(shape), dtype=dtype)
    with comm_timers().codec():
        if checks is None or fmt.codec.fixed_size:
            return fmt.codec.decode(packed)
        out, check = fmt.codec.decode_deferred(packed)
        if check is not None:
            checks.append(check)
        return out


class _Checks:
    """Deferred validations of one call: each batch travels with the call's next host read."""

    def __init__(self) -> None:
        self.pending: list[DeferredCheck] = []  # decoded, not yet on their way to the host
        self.reading: list[tuple[list[DeferredCheck], HostRead, int]] = []

    def records(self) -> list[torch.Tensor]:
        """Take the pending checks' records into the next host read (call :meth:`sent` with it)."""
        return [c.record for c in self.pending]

    def sent(self, read: HostRead, first: int) -> None:
        """The pending records went into ``read`` from its tensor ``first`` on."""
        if self.pending:
            self.reading.append((self.pending, read, first))
            self.pending = []

    def consume(self) -> None:
        """Raise the first invalid payload's error among the records already read."""
        reading, self.reading = self.reading, []
        for checks, read, first in reading:
            for check, record in zip(checks, read.values()[first:]):
                check.raise_if_invalid(record)

    def flush_later(self, in_flight) -> None:
        """Start the pending records' host read now; consume it at the topology's next progress point."""
        if self.pending:
            read = HostRead(self.records())
            self.sent(read, 0)
        if self.reading:
            reads = [read for _, read, _ in self.reading]
            in_flight.defer(self.consume, ready=lambda: all(read.ready() for read in reads))


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


def _padded(payload: torch.Tensor, n: int, slot: int) -> torch.Tensor:
    """``payload``'s first ``n`` bytes in a ``slot``-byte buffer (a worst-case buffer's own tail, or a
    zero-padded copy)."""
    if payload.numel() >= slot:
        return payload[:slot]
    padded = torch.zeros(slot, dtype=torch.uint8, device=payload.device)
    padded[:n].copy_(payload[:n])
    return padded


def start_sizes_a2a(group: _GroupInfo, payloads: list[torch.Tensor], checks: _Checks) -> HostRead:
    """Exchange the payloads' true lengths (one int64 per member) and start reading them (and the
    call's pending validation records) to the host; :func:`all_to_all_payloads` takes the read."""
    sizes = payload_lengths(payloads)
    recv = torch.empty_like(sizes)
    work = dist.all_to_all_single(recv, sizes, group=group.group, async_op=True)
    read = HostRead([sizes, recv] + checks.records(), (work,))
    checks.sent(read, 2)
    return read


def all_to_all_payloads(group: _GroupInfo, payloads: list[torch.Tensor], sizes: HostRead | None, tag: str,
                        raw_bytes: int, checks: _Checks | None = None) -> tuple[object, list[torch.Tensor]]:
    """Send ``payloads[p]`` to member ``p``; returns ``(work, received)`` with ``received[p]`` from member
    ``p`` (valid after ``wait(work)``). ``sizes``: ``None`` for a fixed-size codec (all payloads have one
    size, known to every member), else the read started by :func:`start_sizes_a2a` (read here).
    ``raw_bytes``: one destination's uncompressed bytes, for the counters."""
    size = group.size
    device = payloads[0].device
    if group.group is None:
        return None, [payloads[0]]
    if sizes is None:
        send_sizes = recv_sizes = send_slots = recv_slots = [p.numel() for p in payloads]
        size_bytes = 0
    else:
        sent, received_sizes = sizes.values()[:2]  # the one host read of this hop (module docstring)
        if checks is not None:
            checks.consume()
        send_sizes, recv_sizes = sent.tolist(), received_sizes.tolist()
        send_slots, recv_slots = [slot_bytes(n) for n in send_sizes], [slot_bytes(n) for n in recv_sizes]
        payloads = [_padded(p, n, m) for p, n, m in zip(payloads, send_sizes, send_slots)]
        size_bytes = _SIZE_BYTES
    send = torch.cat(payloads)
    received = torch.empty(sum(recv_slots), dtype=torch.uint8, device=device)
    work = dist.all_to_all_single(received, send, output_split_sizes=recv_slots, input_split_sizes=send_slots,
                                  group=group.group, async_op=True)
    intra, inter = _a2a_bytes(group, [n + size_bytes for n in send_slots])
    comm_stats().record(tag, intra, inter, uncompressed=_a2a_bytes(group, [raw_bytes] * size))
    return work, [part[:n] for part, n in zip(received.split(recv_slots), recv_sizes)]


def start_sizes_gather(group: _GroupInfo, payload: torch.Tensor) -> HostRead:
    """Gather every member's payload length and start reading them to the host."""
    everyone = torch.empty(group.size, dtype=torch.int64, device=payload.device)
    work = dist.all_gather_into_tensor(everyone, payload_lengths([payload]), group=group.group, async_op=True)
    return HostRead([everyone], (work,))


def all_gather_payload(group: _GroupInfo, payload: torch.Tensor, sizes: HostRead | None, tag: str,
                       raw_bytes: int) -> tuple[object, list[torch.Tensor]]:
    """Every member's ``payload``, in member order: ``(work, gathered)``, valid after ``wait(work)``.
    ``sizes``: as in :func:`all_to_all_payloads` (from :func:`start_sizes_gather`). Variable-size
    payloads are padded to the largest slot (the padding travels and is counted)."""
    size = group.size
    if group.group is None:
        return None, [payload]
    if sizes is None:
        lengths, padded_len, size_bytes = [payload.numel()] * size, payload.numel(), 0
    else:
        lengths = sizes.values()[0].tolist()  # the one host read of this gather (module docstring)
        padded_len, size_bytes = slot_bytes(max(lengths)), _SIZE_BYTES
        payload = _padded(payload, lengths[group.index], padded_len)
    gathered = torch.empty(size * padded_len, dtype=torch.uint8, device=payload.device)
    work = dist.all_gather_into_tensor(gathered, payload, group=group.group, async_op=True)
    intra, inter = group.split_ring((size - 1) * (padded_len + size_bytes))
    comm_stats().record(tag, intra, inter, uncompressed=group.split_ring((size - 1) * raw_bytes))
    rows = gathered.view(size, padded_len)
    return work, [rows[i, :lengths[i]] for i in range(size)]


# ------------------------------------------------------------------ reduce-scatter -----
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, topology: Topology, intra_fmt: WireFormat,
                   inter_fmt: WireFormat, divisor: int, scratch: Scratch, tag: str,
                   residual: torch.Tensor | None = None):
    """First step of the two-hop reduce-scatter (module docstring); returns ``(middles, finish)``.
    ``residual``: error feedback, as in ``reduce_scatter.qgz_reduce_scatter``."""
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
    checks = _Checks()
    state: dict = {}

    def hop(group: _GroupInfo, fmt: WireFormat, payloads: list[torch.Tensor], raw_bytes: int, key: str) -> list:
        """Issue one all-to-all hop into ``state[key]``: now (fixed size, or a group of one), or the size
        exchange now and the payloads at the returned step (variable size)."""
        if fmt.codec.fixed_size or group.group is None:
            state[key] = all_to_all_payloads(group, payloads, None, tag, raw_bytes)
            return []
        sizes = start_sizes_a2a(group, payloads, checks)

        def send() -> None:
            state[key] = all_to_all_payloads(group, payloads, sizes, tag, raw_bytes, checks)
        return [send]

    steps = hop(first, first_fmt, payloads, raw * (size // first.size), "hop1")

    def sum_decoded(fmt: WireFormat, received: list[torch.Tensor], rows: int) -> torch.Tensor:
        """fp32 sum over sources of the decoded payloads: the same reduction, in the same order, as the
        uncompressed algorithm's (``reduce_scatter._uncompressed``), so a lossless codec gives its
        result bit for bit."""
        parts = torch.stack([decode(fmt, payload, (rows, length), dtype, checks.pending) for payload in received])
        with comm_timers().codec():
            return torch.sum(parts, dim=0, dtype=torch.float32)

    def finish_from(fmt: WireFormat, key: str, rows: int) -> None:
        work, received = state.pop(key)
        wait(work)
        acc = sum_decoded(fmt, received, rows)
        with comm_timers().codec():
            if divisor != 1:
                acc.div_(divisor)
            output.view(-1).copy_(acc.view(-1))
        checks.consume()
        checks.flush_later(topology._groups.in_flight)
        scratch.release()

    if not two_hops:
        return steps, lambda: finish_from(first_fmt, "hop1", size // first.size)

    def middle() -> None:
        work, received1 = state.pop("hop1")
        wait(work)
        partial = sum_decoded(intra_fmt, received1, nodes)  # [nodes, length]: this node's partial sums
        with comm_timers().codec():
            partial = partial.to(dtype)  # partial sums travel in the input dtype, as uncompressed
        payloads2 = [encode(inter_fmt, partial[n]) for n in range(nodes)]
        steps2.extend(hop(groups.inter, inter_fmt, payloads2, raw, "hop2"))

    steps2: list = []

    def after_middle() -> None:
        steps2.pop(0)()

    # hop 2's size exchange is issued with the middle; its payloads one step later (variable size only).
    more = [] if inter_fmt.codec.fixed_size or groups.inter.group is None else [after_middle]
    return steps + [middle] + more, lambda: finish_from(inter_fmt, "hop2", 1)


# ------------------------------------------------------------------ all-gather -----
def all_gather(output: torch.Tensor, input: torch.Tensor, topology: Topology, fmt: WireFormat, scratch: Scratch,
               tag: str):
    """First step of the all-gather: encode the shard, gather every payload (variable size: the sizes
    first, the payloads at the next step); the finish decodes them all."""
    group = topology._groups.flat
    payload = encode(fmt, input.view(-1))
    raw_bytes = input.numel() * input.element_size()
    checks = _Checks()
    state: dict = {}
    steps: list = []
    if fmt.codec.fixed_size or group.group is None:
        state["gathered"] = all_gather_payload(group, payload, None, tag, raw_bytes)
    else:
        sizes = start_sizes_gather(group, payload)

        def send() -> None:
            state["gathered"] = all_gather_payload(group, payload, sizes, tag, raw_bytes)
        steps.append(send)

    def finish() -> None:
        work, gathered = state.pop("gathered")
        wait(work)
        rows = output.view(topology.size, -1)
        for i, p in enumerate(gathered):
            decoded = decode(fmt, p, (input.numel(),), input.dtype, checks.pending)
            with comm_timers().codec():
                rows[i].copy_(decoded)
        checks.flush_later(topology._groups.in_flight)
        scratch.release()

    return steps, finish
