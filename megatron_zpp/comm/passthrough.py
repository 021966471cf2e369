"""Torch's own collectives, run unchanged, with their bytes recorded.

With the ``none`` policy the Megatron hooks call these so that training stays bit-identical
to Megatron without the plugin while the byte accounting still sees the traffic. Bytes follow
the algorithm each backend runs: ring all-gather and all-reduce; gloo's
``reduce_scatter_tensor`` is an all-reduce (twice the bytes of NCCL's ring reduce-scatter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_zpp.comm._common import check_pair, reduce_divisor
from megatron_zpp.comm.stats import comm_stats
from megatron_zpp.comm.topology import Topology

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _is_gloo(topology: Topology) -> bool:
    group = topology._groups.flat.group
    return group is not None and dist.get_backend(group) == "gloo"


def record_torch_collective(tag: str, kind: str, topology: Topology, chunk_bytes: int) -> None:
    """Record one torch collective over ``topology``'s group; ``chunk_bytes`` is one rank's shard
    (all-gather input, reduce-scatter output) or ``tensor bytes / size`` for an all-reduce."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; valid: {KINDS}")
    size = topology.size
    steps = size - 1
    if kind == "all_reduce" or (kind == "reduce_scatter" and _is_gloo(topology)):
        steps *= 2  # ring all-reduce = reduce-scatter + all-gather
    intra, inter = topology._groups.flat.split_ring(steps * chunk_bytes)
    comm_stats().record(tag, intra, inter)


def torch_reduce_scatter(output: torch.Tensor, input: torch.Tensor, topology: Topology, op="mean",
                         tag: str = "dp.grad") -> None:
    """``torch.distributed.reduce_scatter_tensor`` (sum, then divide for the mean) on the topology's
    private group, bytes recorded."""
    what = "torch_reduce_scatter"
    check_pair(output, input, what)
    flat = topology._groups.flat
    divisor = reduce_divisor(op, topology.size, what)
    record_torch_collective(tag, "reduce_scatter", topology, output.numel() * output.element_size())
    if flat.group is None:
        output.copy_(input.view(output.shape))
    else:
        dist.reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=flat.group)
    if divisor != 1:
        output.div_(divisor)
