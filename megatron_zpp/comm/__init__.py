"""Compressed collectives on torch.distributed (layer 2: knows process groups, not Megatron).

    from megatron_zpp.comm import Topology, quantized_all_gather, qgz_reduce_scatter, comm_stats
    topo = Topology(group=None, ranks_per_node=2)      # any group, e.g. Megatron's DP group
    quantized_all_gather(output, input, topology=topo, codec="int8:block=256")            # qwZ
    qgz_reduce_scatter(output, input, topology=topo, codec="int4:block=128", op="mean")  # qgZ
    shard = HpzShard(topo, input.numel(), input.dtype, "int8:block=256")                 # hpZ
    quantized_all_gather(output, input, topology=topo, hpz_shard=shard)   # forward: fills it
    hpz_all_gather(output, shard)                                         # backward: intra-node only
    held = HeldShard(input.numel(), input.dtype)                          # qWD: 4-bit weight differences
    weight_difference_all_gather(output, input, held, topo, codec="int4:block=2048")
    hpz_weight_difference_all_gather(output, input, raw_shard, held, topo)  # qWD on ZeRO-3's hpZ copy
    comm_stats().get("dp.grad").inter_bytes                               # byte accounting

Semantics mirror ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; ``codec="none"``
gives the uncompressed algorithm, recorded the same way. Design notes: ``README.md`` here.
"""

from megatron_zpp.comm.all_gather import (HeldShard, HpzShard, hpz_all_gather, hpz_weight_difference_all_gather,
                                         quantized_all_gather, weight_difference_all_gather)
from megatron_zpp.comm.all_reduce import compressed_all_reduce
from megatron_zpp.comm.all_to_all import compressed_all_to_all
from megatron_zpp.comm.passthrough import record_torch_collective, torch_reduce_scatter
from megatron_zpp.comm.reduce_scatter import qgz_reduce_scatter, ring_reduce_scatter
from megatron_zpp.comm.scratch import release_buffers, scratch_pool_usage
from megatron_zpp.comm.stats import CommStats, CommTimers, TagStats, comm_stats, comm_timers
from megatron_zpp.comm.topology import Topology
from megatron_zpp.comm.wire import CommHandle, set_rounding_epoch

__all__ = [
    "CommHandle",
    "CommStats",
    "CommTimers",
    "HeldShard",
    "HpzShard",
    "TagStats",
    "Topology",
    "comm_stats",
    "comm_timers",
    "compressed_all_reduce",
    "compressed_all_to_all",
    "hpz_all_gather",
    "hpz_weight_difference_all_gather",
    "qgz_reduce_scatter",
    "quantized_all_gather",
    "record_torch_collective",
    "release_buffers",
    "scratch_pool_usage",
    "set_rounding_epoch",
    "ring_reduce_scatter",
    "torch_reduce_scatter",
    "weight_difference_all_gather",
]
