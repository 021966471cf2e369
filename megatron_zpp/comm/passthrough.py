"""Torch's own collectives, run unchanged, with their bytes recorded.

With the ``none`` policy the Megatron hooks call these so that training stays bit-identical
to Megatron without the plugin while the byte accounting still sees the traffic. Bytes follow
the algorithm each backend runs: ring all-gather and all-reduce; gloo's
``reduce_scatter_tensor`` is an all-reduce (twice the bytes of NCCL's ring reduce-scatter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_zpp.comm.execution import backend_name
from megatron_zpp.comm.stats import comm_stats
from megatron_zpp.comm.topology import Topology, _GroupInfo, group_layout
from megatron_zpp.comm.wire import check_pair, reduce_divisor

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def record_torch_collective(tag: str, kind: str, group: dist.ProcessGroup | None, chunk_bytes: int,
                            ranks_per_node: int | None = None, device: torch.device | str = "cpu") -> None:
    """Record one torch collective over ``group`` from sizes alone (no group is created, nothing is
    sent); ``chunk_bytes`` is one rank's shard (all-gather input, reduce-scatter output) or
    ``tensor bytes / size`` for an all-reduce, of tensors on ``device``. ``ranks_per_node``: see
    :func:`group_layout`."""
    _record(tag, kind, group_layout(group, ranks_per_node), chunk_bytes,
            gloo=backend_name(group, device) == "gloo")


def _record(tag: str, kind: str, layout: _GroupInfo, chunk_bytes: int, gloo: bool) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; valid: {KINDS}")
    steps = layout.size - 1
    if kind == "all_reduce" or (kind == "reduce_scatter" and gloo):
        steps *= 2  # ring all-reduce = reduce-scatter + all-gather
    intra, inter = layout.split_ring(steps * chunk_bytes)
    comm_stats().record(tag, intra, inter)


def torch_reduce_scatter(output: torch.Tensor, input: torch.Tensor, topology: Topology, op="mean",
                         tag: str = "dp.grad") -> None:
    """``torch.distributed.reduce_scatter_tensor`` (sum, then divide for the mean) on the topology's
    private group, bytes recorded."""
    what = "torch_reduce_scatter"
    check_pair(output, input, what)
    flat = topology._groups.flat
    divisor = reduce_divisor(op, topology.size, what)
    _record(tag, "reduce_scatter", flat, output.numel() * output.element_size(),
            gloo=backend_name(flat.group, output.device) == "gloo")
    if flat.group is None:
        output.copy_(input.view(output.shape))
    else:
        dist.reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=flat.group)
    if divisor != 1:
        output.div_(divisor)
