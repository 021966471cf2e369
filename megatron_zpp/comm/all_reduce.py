"""Compressed all-reduce for plain data parallelism (no distributed optimizer).

``compressed_all_reduce(tensor, topology, codec)`` = a qgZ reduce-scatter of ``tensor`` into
a shard, then an all-gather of the reduced shards with the same codec, in place. Every rank
decodes every shard, its own included, so replicas stay bit-identical. Any length (padded
internally); cross-node bytes are qgZ's plus the quantized gather's.

With ``async_op=True`` the reduce-scatter is in flight on return and ``wait()`` runs the
gather: Megatron waits on its gradient all-reduce at the end of the backward pass, where the
second half then runs.
"""

from __future__ import annotations

import torch

from megatron_zpp.compression import Codec, layout
from megatron_zpp.comm._common import CommHandle, check_float
from megatron_zpp.comm.all_gather import quantized_all_gather
from megatron_zpp.comm.reduce_scatter import qgz_reduce_scatter
from megatron_zpp.comm.topology import Topology


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
    rs = qgz_reduce_scatter(shard, padded, topology, codec=codec, op=op, async_op=True, tag=tag,
                            intra_codec=intra_codec, stages=stages, residual=padded_residual)

    def finish() -> None:
        rs.wait()  # orders the caller's stream after hop 1, which wrote the residual
        if padded_residual is not residual:
            residual.view(-1).copy_(padded_residual[:numel])
        # The reduce-scatter read `padded` before writing `shard`, so it can receive the gather.
        quantized_all_gather(padded, shard, topology, codec=codec, tag=tag)
        if padded.data_ptr() != flat.data_ptr():
            if padded.is_cuda:  # read on the waiting stream, allocated on the calling one
                padded.record_stream(torch.cuda.current_stream(padded.device))
            flat.copy_(padded[:numel])
        scratch.release()

    if async_op:
        return CommHandle(finish)
    finish()
    return None
