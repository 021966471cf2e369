"""Compressed all-reduce for plain data parallelism (no distributed optimizer).

``compressed_all_reduce(tensor, topology, codec)`` = a qgZ reduce-scatter of ``tensor`` into
a shard, then an all-gather of the reduced shards with the same codec, in place. Every rank
decodes every shard, its own included, so replicas stay bit-identical. Any length (padded
internally); cross-node bytes are qgZ's plus the quantized gather's.

One collective under the execution model (``execution.py``), on the topology's gather stream:
the first step launches the reduce-scatter; a middle step, issued at the progress point after the
reduce-scatter's own last step, finishes it and launches the all-gather of the reduced shard; the
handle's ``wait()`` only finishes the gather (decode, copy back). With ``async_op=True`` both
halves overlap what the caller does between the call and ``wait()`` (Megatron waits on its
gradient all-reduces at the end of the backward pass), and several all-reduces in flight each
progress at every later collective on the topology.
"""

from __future__ import annotations

import torch

from megatron_zpp.compression import Codec, layout
from megatron_zpp.comm.all_gather import quantized_all_gather
from megatron_zpp.comm.execution import comm_stream, launch
from megatron_zpp.comm.reduce_scatter import qgz_reduce_scatter
from megatron_zpp.comm.topology import Topology
from megatron_zpp.comm.wire import check_float


def compressed_all_reduce(tensor: torch.Tensor, topology: Topology, codec: str | Codec | None = "int4:block=128",
                          op="mean", async_op: bool = False, tag: str = "dp.grad",
                          intra_codec: str | Codec | None = None, stages: int = 1,
                          residual: torch.Tensor | None = None):
    """All-reduce ``tensor`` in place (``op`` mean or sum) with a quantized reduce-scatter + all-gather.
    ``residual``: error feedback of the reduce-scatter's first hop (``qgz_reduce_scatter``); the gather
    encodes the reduced mean, the same on every rank, and is not fed back."""
    what = "compressed_all_reduce"
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous")
    if codec not in (None, "none"):
        check_float("tensor", tensor, what)
    size, numel = topology.size, tensor.numel()
    chunk = layout.ceil_div(numel, size)
    elt = tensor.element_size()
    flat = tensor.view(-1)
    # The padded copy and the shard cross streams on CUDA (caller -> reduce -> gather -> caller):
    # a lease gives caching-allocator memory there, kept safe by the collectives' record_stream.
    scratch = topology.buffers.lease(tensor.device)
    if chunk * size != numel:
        padded = scratch.take(chunk * size * elt).view(tensor.dtype)
        padded[numel:].zero_()
        padded[:numel].copy_(flat)
    else:
        padded = flat
    padded_residual = residual
    if residual is not None and residual.numel() != padded.numel():
        if residual.numel() != numel:
            raise ValueError(f"{what}: residual has {residual.numel()} elements; tensor has {numel}")
        # A padded copy: the padding's own encoding error is dropped with it.
        padded_residual = scratch.take(chunk * size * 4).view(torch.float32)
        padded_residual[numel:].zero_()
        padded_residual[:numel].copy_(residual.view(-1))
    shard = scratch.take(max(chunk, 1) * elt).view(tensor.dtype)[:chunk]
    groups = topology._groups
    stream = comm_stream(tensor.device, "gather", groups.streams)
    state: dict = {}

    def first():
        rs = qgz_reduce_scatter(shard, padded, topology, codec=codec, op=op, async_op=True, tag=tag,
                                intra_codec=intra_codec, stages=stages, residual=padded_residual)
        state["rs"] = rs

        def idle() -> None:  # the reduce-scatter issues one of its own steps at this point
            pass

        def gather() -> None:
            state.pop("rs").wait()  # this (gather) stream waits for the reduce-scatter, which wrote the residual
            if padded_residual is not residual:
                residual.view(-1).copy_(padded_residual[:numel])
            # The reduce-scatter read `padded` before writing `shard`, so it can receive the gather.
            state["ag"] = quantized_all_gather(padded, shard, topology, codec=codec, tag=tag, async_op=True)

        def finish() -> None:
            state.pop("ag").wait()
            if padded.data_ptr() != flat.data_ptr():
                flat.copy_(padded[:numel])
            scratch.release()
        return [idle] * rs.steps_left() + [gather], finish

    used = tuple(t for t in (tensor, padded, shard, residual, padded_residual) if t is not None)
    return launch(groups.in_flight, stream, used, first, async_op)
