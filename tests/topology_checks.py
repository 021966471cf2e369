"""Per-rank worker bodies for tests/test_topology.py: how Topology creates its process groups.

Every worker records each group-creation call torch sees (``new_group`` / ``split_group``, with
the parent's ranks and the requested lists), so the test can check, across ranks, the property
NCCL needs: a creation that splits a communicator is entered by every rank of that communicator,
with the same arguments, in the same order.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megatron_zpp.comm import Topology, qgz_reduce_scatter, quantized_all_gather


class CreationLog:
    """Wraps ``dist.new_group`` and ``dist.split_group``; ``calls``: what this rank called, in order;
    ``groups``: the distinct process groups it got back (``None`` / non-member results left out)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.groups: dict[int, dist.ProcessGroup] = {}
        self._originals = {"new_group": dist.new_group, "split_group": dist.split_group}

    def __enter__(self) -> CreationLog:
        log = self

        def new_group(ranks=None, *args, use_local_synchronization=False, **kwargs):
            log.calls.append(("new_group", tuple(ranks or ()), bool(use_local_synchronization)))
            return log._keep(log._originals["new_group"](ranks, *args,
                                                         use_local_synchronization=use_local_synchronization,
                                                         **kwargs))

        def split_group(parent_pg=None, split_ranks=None, *args, **kwargs):
            parent = tuple(dist.get_process_group_ranks(parent_pg or dist.group.WORLD))
            log.calls.append(("split_group", parent, tuple(tuple(s) for s in split_ranks)))
            return log._keep(log._originals["split_group"](parent_pg, split_ranks, *args, **kwargs))

        dist.new_group, dist.split_group = new_group, split_group
        return self

    def __exit__(self, *exc) -> None:
        dist.new_group, dist.split_group = self._originals["new_group"], self._originals["split_group"]

    def _keep(self, group):
        if isinstance(group, dist.ProcessGroup):
            self.groups[id(group)] = group
        return group


def rebind_world(store_dir: str) -> None:
    """Replace the spawner's default group by one bound to a device (``device_id``): gloo's is ``cpu:0``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/bound_store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cpu", 0))
    assert dist.group.WORLD.bound_device_id == torch.device("cpu", 0)


def megatron_layout(tp: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Megatron's TP and DP groups (TP fastest) for TP=``tp`` over the world, created on every rank as
    Megatron does, except that a device-bound default group is split (torch's ``new_group`` there calls
    a no-color split on non-members that gloo lacks)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    tps = [list(range(s, s + tp)) for s in range(0, world, tp)]
    dps = [list(range(t, world, tp)) for t in range(tp)]
    if dist.group.WORLD.bound_device_id is not None:
        return dist.split_group(split_ranks=tps), dist.split_group(split_ranks=dps)
    groups = {tuple(g): dist.new_group(g) for g in tps + dps}
    return groups[tuple(tps[rank // tp])], groups[tuple(dps[rank % tp])]


def _check_collectives(topo: Topology, seed: int) -> None:
    """codec="none" through the topology's subgroups equals the exact result (integers: no rounding)."""
    size, rank, n = topo.size, topo.rank, 6
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randint(-50, 50, (size * n,), generator=g).float() for _ in range(size)]
    out = torch.empty(n)
    qgz_reduce_scatter(out, inputs[rank], topo, codec="none", op="sum")  # intra hop, then inter hop
    assert torch.equal(out, sum(inputs)[rank * n:(rank + 1) * n]), (topo, out)
    gathered = torch.empty(size * n)
    quantized_all_gather(gathered, inputs[rank][:n], topo, codec="none")
    assert torch.equal(gathered, torch.cat([x[:n] for x in inputs])), topo


def bound_pipeline_worker(store_dir: str, bound: bool) -> dict:
    """TP=2 x PP=2 on 4 ranks (stage 0: ranks 0, 1; stage 1: ranks 2, 3), 2 ranks per node, as a
    pipeline starts: stage 0 builds its TP topology and sends its activations; stage 1 builds its own
    only after receiving them. A creation involving the world would deadlock here; ours involves the
    TP group only. Then TP=2 x DP=2 (ranks per node 2 and 4), with Megatron-FSDP's hpZ gather
    topology beside the reduce one, stage-dependent order of construction."""
    if bound:
        rebind_world(store_dir)
    rank = dist.get_rank()
    with CreationLog() as log:
        tp_group, dp_group = megatron_layout(tp=2)
        stage = rank // 2
        activations = torch.zeros(4)
        if stage == 0:
            tp = Topology(tp_group, ranks_per_node=2)
            _check_collectives(tp, 1)
            dist.send(activations + 1, dst=rank + 2)
        else:
            dist.recv(activations, src=rank - 2)
            tp = Topology(tp_group, ranks_per_node=2)
            _check_collectives(tp, 1)
        built = []
        for rpn in (2, 4):
            # Stage 0 starts with DP, stage 1 with TP: the order differs across ranks, not within a group.
            specs = [(dp_group, 1), (dp_group, 2 if rpn == 4 else 1), (tp_group, 1)]
            for group, hpz in (specs if stage == 0 else specs[::-1]):
                topo = Topology(group, ranks_per_node=rpn, hpz_partition_size=hpz)
                _check_collectives(topo, 2 + rpn)
                built.append((tuple(topo.members), rpn, hpz, {name: _ranks(g) for name, g in (
                    ("intra", topo.intra_group), ("inter", topo.inter_group), ("hpz", topo.hpz_group))}))
    return {"calls": log.calls, "bound": dist.group.WORLD.bound_device_id is not None, "received": activations.tolist(),
            "built": built}


def _ranks(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def shared_groups_worker(store_dir: str, bound: bool) -> dict:
    """Megatron-FSDP's pair over one data-parallel group (8 ranks, 2 nodes of 4): the reduce topology
    (hpZ 1) and the gather topology (hpZ 2), then hpZ 4 (the whole node), and a one-node group.
    Returns how many process groups their construction created on this rank, and which are shared."""
    if bound:
        rebind_world(store_dir)
    world = dist.get_world_size()
    with CreationLog() as log:
        reduce = Topology(None, ranks_per_node=4, hpz_partition_size=1)
        after_reduce = len(log.groups)
        gather = Topology(None, ranks_per_node=4, hpz_partition_size=2)
        after_gather = len(log.groups)
        whole_node = Topology(None, ranks_per_node=4, hpz_partition_size=4)
        after_whole_node = len(log.groups)
        one_node = Topology(None, ranks_per_node=world)  # flat, intra and hpZ: the same ranks
        after_one_node = len(log.groups)
    for topo in (reduce, gather, whole_node, one_node):
        _check_collectives(topo, 7)
    g = {name: topo._groups for name, topo in
         (("reduce", reduce), ("gather", gather), ("whole_node", whole_node), ("one_node", one_node))}
    return {
        "created": [after_reduce, after_gather, after_whole_node, after_one_node],
        "calls": len(log.calls),
        "gather_shares_flat_intra_inter": all(getattr(g["gather"], k).group is getattr(g["reduce"], k).group
                                              for k in ("flat", "intra", "inter")),
        "hpz4_is_intra": g["whole_node"].hpz.group is g["reduce"].intra.group,
        "one_node_intra_is_flat": g["one_node"].intra.group is g["one_node"].flat.group is g["reduce"].flat.group,
        "own_queues": len({id(x.in_flight) for x in g.values()}),
        "hpz2_ranks": _ranks(gather.hpz_group),
    }
