"""Topology: a process group seen as nodes x ranks-per-node, with its intra/inter-node subgroups.

The compressed collectives need to know which peers share a node: qgZ reduces
inside a node before anything crosses the slow link, hpZ keeps its backward
gather inside a node, and byte accounting splits every send into intra- and
inter-node bytes. A node is a run of ``ranks_per_node`` consecutive *global*
ranks (torchrun / SLURM numbering), so on one box "nodes" can be simulated by
passing ``ranks_per_node``.

The group can be any process group, e.g. Megatron's strided data-parallel
group ``[0, 2, 4, 6]`` with TP=2 on 4-GPU nodes: its members ``0, 2`` form node
0 and ``4, 6`` node 1. Members must be node-major in group order (true for
every Megatron group, whose ranks are ascending) and every node must hold the
same number of them.

Subgroups are created lazily, at a Topology's construction, and only by the members of
``group``: construction is a collective over ``group`` (like the first collective on it, which is
where the hooks construct it), never over the world, so pipeline stages, which build their
topologies at different times, never wait for each other. Every member creates the subgroups of
every member (the flat copy, all intra-node, all inter-node and all hpZ groups of ``group``) in
one fixed order, so the calls match on every member whatever the backend needs:

- default group bound to a device (``init_process_group(device_id=...)``): torch's ``new_group``
  creates a subgroup by splitting the *default* communicator (``ncclCommSplit``), a collective
  over every rank of the world, so a members-only ``new_group(..., use_local_synchronization=True)``
  hangs its members. We split ``group`` itself instead (``torch.distributed.split_group`` with
  ``group`` as the parent: every member of ``group`` takes part, nobody else needs to);
- otherwise torch creates no communicator by splitting, and ``new_group(...,
  use_local_synchronization=True)`` among each subgroup's members is enough.

torch names a new group from a per-process creation counter, and members meet in the store under
that name (gloo, unbound NCCL): the members of ``group`` must have created equally many groups
before, which holds when every group of a kind has the same shape (Megatron's layouts).

Process groups are shared by member ranks (:func:`_subgroup`): two Topologies over the same ranks
with different hpZ sizes (Megatron-FSDP's gather and reduce), or a subgroup equal to another one
(intra == flat on one node, hpZ == intra), use one communicator. Each Topology shape keeps its
own in-flight queue, streams, scratch pool and codecs (:class:`_TopologyGroups`); sharing a
communicator needs no shared queue, as every hop is issued from the caller's thread at a point
of the call sequence that is the same on every rank (execution.py), whichever queue holds it.
The caller's own ``group`` is never reused (see :class:`_TopologyGroups`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_zpp.comm.execution import InFlight
from megatron_zpp.comm.scratch import BufferPool, topology_pool


@dataclass
class _GroupInfo:
    """A subgroup plus what byte accounting needs: its members' nodes."""

    group: dist.ProcessGroup | None  # None: a group of one (no communication)
    member_nodes: tuple[int, ...]  # node index of each member, in group order
    index: int  # this rank's index in the group

    @property
    def size(self) -> int:
        return len(self.member_nodes)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor):
        """Async all-gather into ``out`` on this group; for a group of one, a copy (returns ``None``)."""
        if self.group is None:
            out.view(-1).copy_(inp.view(-1))
            return None
        return dist.all_gather_into_tensor(out.view(-1), inp.view(-1), group=self.group, async_op=True)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor):
        """Async equal-split all-to-all; for a group of one, a copy (returns ``None``)."""
        if self.group is None:
            out.view(-1).copy_(inp.view(-1))
            return None
        return dist.all_to_all_single(out.view(-1), inp.view(-1), group=self.group, async_op=True)

    def split_a2a(self, chunk_bytes: int) -> tuple[int, int]:
        """(intra, inter) bytes this rank sends in an all-to-all of ``chunk_bytes`` per peer."""
        me = self.member_nodes[self.index]
        inter_peers = sum(1 for n in self.member_nodes if n != me)
        intra_peers = self.size - 1 - inter_peers
        return intra_peers * chunk_bytes, inter_peers * chunk_bytes

    def split_ring(self, total_bytes: int) -> tuple[int, int]:
        """(intra, inter) bytes when this rank sends ``total_bytes`` to its ring successor.

        Ring all-gather and ring reduce-scatter (gloo's and NCCL's algorithms, and
        ours) send everything to the next member in group order; a node-major ring
        crosses a node boundary once per node.
        """
        if self.size == 1:
            return 0, 0
        nxt = self.member_nodes[(self.index + 1) % self.size]
        return (0, total_bytes) if nxt != self.member_nodes[self.index] else (total_bytes, 0)


@dataclass
class _TopologyGroups:
    """The groups of one Topology shape, and what its calls share (queue, streams, pool, codecs).

    ``flat`` is a private copy of the caller's group, never the caller's group itself, though the
    ranks are equal: (1) Megatron issues its bucket collectives inside ``_coalescing_manager`` on
    its group, and our hops are issued inside that block; torch captures every
    ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` / ``all_reduce`` on that group there (any
    backend), launches them only when the block ends and returns an unwaitable ``_IllegalWork``
    meanwhile, so our in-block waits (qgZ's second hop waits the first) would fail, and the block
    refuses a mix of op types (our gathers among its reduce-scatters); (2) the hooks tell our own inner
    collectives from Megatron's by their group (``MegatronHooks._is_private``): on Megatron's group
    Megatron's collectives would no longer be routed. Our groups are deduplicated among
    themselves only (:func:`_subgroup`)."""

    flat: _GroupInfo
    intra: _GroupInfo
    inter: _GroupInfo
    hpz: _GroupInfo
    # Calls whose later hops wait for a progress point, and this topology's comm streams (execution.py).
    in_flight: InFlight = field(default_factory=InFlight, repr=False)
    streams: dict = field(default_factory=dict, repr=False)
    buffers: BufferPool = field(default_factory=topology_pool, repr=False)
    codecs: dict = field(default_factory=dict, repr=False)  # spec -> WireFormat
    agreed: set = field(default_factory=set, repr=False)  # settings checked across ranks


_GROUP_CACHE: dict[tuple, _TopologyGroups] = {}  # (members, ranks_per_node, hpz size) -> groups

# Every subgroup this process took part in creating: member ranks (group order) -> [(the ranks
# that took part, the group or None when this rank is not a member)]. Kept on every participant,
# members or not, so that all participants of a later creation agree on what exists (below).
_SUBGROUPS: dict[tuple[int, ...], list[tuple[frozenset[int], dist.ProcessGroup | None]]] = {}


def _splits_default_communicator() -> bool:
    """Whether torch's ``new_group`` would create a subgroup by splitting the default group's
    communicator (a collective over the whole world): the default group is bound to a device."""
    return getattr(dist.group.WORLD, "bound_device_id", None) is not None


def _subgroup(members: tuple[int, ...], participants: frozenset[int]):
    """An existing group of ``members`` that every rank of ``participants`` knows, else ``None``.

    A group created by a collective over ranks ``Q`` is recorded on every rank of ``Q``; when ``Q``
    contains all of ``participants``, every one of them holds the record, so they all decide to reuse
    it (records made over other rank sets are ignored alike): all ranks of a creation agree on what
    to create, as the collective needs. Returns ``(group,)``, the group being ``None`` on non-members."""
    for took_part, group in _SUBGROUPS.get(members, ()):
        if participants <= took_part:
            return (group,)
    return None


def _create_round(parent: dist.ProcessGroup, parent_members: tuple[int, ...],
                  lists: list[tuple[int, ...]]) -> None:
    """Create the disjoint groups ``lists`` (global ranks) of ``parent``'s members, unless they exist.

    Called by every member of ``parent`` with the same ``lists`` (SPMD within ``parent``). Groups of one
    rank get no process group. With a device-bound default group: one ``split_group`` of ``parent``,
    every member of ``parent`` taking part (none when nothing is new: all members agree on it,
    see :func:`_subgroup`). Otherwise each new group's members call ``new_group`` with local
    synchronization, in ``lists`` order."""
    me = dist.get_rank()
    split = _splits_default_communicator()
    new = []
    for members in lists:
        if len(members) == 1:
            continue
        # Who takes part in creating it: the whole parent (split) or its members only.
        participants = frozenset(parent_members) if split else frozenset(members)
        if _subgroup(members, participants) is None:
            new.append(members)
    if not new:
        return
    if split:
        index = {r: i for i, r in enumerate(parent_members)}
        group = dist.split_group(parent_pg=parent, split_ranks=[[index[r] for r in m] for m in new])
        for members in new:
            mine = group if me in members else None
            _SUBGROUPS.setdefault(members, []).append((frozenset(parent_members), mine))
        return
    for members in new:
        if me in members:
            group = dist.new_group(list(members), use_local_synchronization=True)
            _SUBGROUPS.setdefault(members, []).append((frozenset(members), group))


def _group_of(members: tuple[int, ...], parent_members: tuple[int, ...]) -> dist.ProcessGroup | None:
    """This rank's group of ``members`` after :func:`_create_round` (``None``: a group of one)."""
    if len(members) == 1:
        return None
    participants = frozenset(parent_members) if _splits_default_communicator() else frozenset(members)
    found = _subgroup(members, participants)
    if found is None or found[0] is None:
        raise RuntimeError(f"megatron_zpp: subgroup {list(members)} of {list(parent_members)} was not created on "
                           f"rank {dist.get_rank()}")
    return found[0]


def ranks_per_node_from_env() -> int | None:
    """Ranks per node from torchrun's ``LOCAL_WORLD_SIZE`` (or SLURM's), ``None`` when neither is set."""
    value = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE")
    if not value:
        return None
    try:
        return int(value.split("(")[0])
    except ValueError:
        raise ValueError(f"cannot read ranks per node from LOCAL_WORLD_SIZE={value!r}") from None


_LAYOUT_CACHE: dict[tuple, _GroupInfo] = {}


def group_layout(group: dist.ProcessGroup | None, ranks_per_node: int | None = None) -> _GroupInfo:
    """The node of each member of an existing ``group``, for byte accounting only.

    Creates no process group and communicates nothing (a lookup of the group's ranks), so it
    is safe wherever Megatron's own collectives run unchanged. ``ranks_per_node``: given, else
    ``LOCAL_WORLD_SIZE``, else unknown, in which case every rank counts as its own node (all
    traffic is counted as inter-node: an upper bound).
    """
    group = group if group is not None else dist.group.WORLD
    members = tuple(dist.get_process_group_ranks(group))
    if ranks_per_node is None:
        ranks_per_node = ranks_per_node_from_env() or 1
    key = (members, ranks_per_node)
    info = _LAYOUT_CACHE.get(key)
    if info is None:
        info = _GroupInfo(None, tuple(r // ranks_per_node for r in members), members.index(dist.get_rank()))
        _LAYOUT_CACHE[key] = info
    return info


class Topology:
    """A process group as ``num_nodes`` x ``node_size`` members (node-major), with cached subgroups.

    Args:
        group: the process group the collectives run over (``None``: the world).
        ranks_per_node: global ranks per physical (or simulated) node; default ``LOCAL_WORLD_SIZE``.
        hpz_partition_size: members per hpZ secondary partition; divides ``node_size``; default
            ``node_size`` (the secondary copy is spread over the whole node).

    Attributes:
        size, rank: the group's size and this rank's index in it.
        num_nodes, node_size: nodes spanned by the group and members of the group per node.
        node, local: this rank's node index (0..num_nodes-1) and index within its node.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, ranks_per_node: int | None = None,
                 hpz_partition_size: int | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
        group = group if group is not None else dist.group.WORLD
        members = dist.get_process_group_ranks(group)
        if ranks_per_node is None:
            ranks_per_node = ranks_per_node_from_env()
            if ranks_per_node is None:
                raise ValueError("ranks_per_node was not given and LOCAL_WORLD_SIZE is not set; pass "
                                 "Topology(..., ranks_per_node=N) with the number of ranks per node")
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={ranks_per_node!r} must be a positive integer")

        physical_nodes = [r // ranks_per_node for r in members]
        order: list[int] = []  # physical node ids in group order, each once
        for i, n in enumerate(physical_nodes):
            if not order or order[-1] != n:
                if n in order:
                    raise ValueError(
                        f"group ranks {members} are not node-major for ranks_per_node={ranks_per_node}: "
                        f"rank {members[i]} returns to node {n} after other nodes; order the group by node")
                order.append(n)
        counts = {n: physical_nodes.count(n) for n in order}
        if len(set(counts.values())) != 1:
            raise ValueError(f"group ranks {members} put {counts} members on nodes (node: count) with "
                             f"ranks_per_node={ranks_per_node}; every node must hold the same number")

        self.group = group
        self.ranks_per_node = ranks_per_node
        self.members = tuple(members)
        self.size = len(members)
        self.rank = dist.get_group_rank(group, dist.get_rank())
        self.num_nodes = len(order)
        self.node_size = self.size // self.num_nodes
        self.node, self.local = divmod(self.rank, self.node_size)

        if hpz_partition_size is None:
            hpz_partition_size = self.node_size
        if not isinstance(hpz_partition_size, int) or hpz_partition_size < 1 \
                or self.node_size % hpz_partition_size:
            valid = [d for d in range(1, self.node_size + 1) if self.node_size % d == 0]
            raise ValueError(f"hpz_partition_size={hpz_partition_size!r} must divide the {self.node_size} "
                             f"group members per node; valid: {valid}")
        self.hpz_size = hpz_partition_size
        self._groups = self._build_groups()

    # ------------------------------------------------------------------ groups
    def _build_groups(self) -> _TopologyGroups:
        key = (self.members, self.ranks_per_node, self.hpz_size)
        cached = _GROUP_CACHE.get(key)
        if cached is not None:
            return cached
        n, k, size = self.node_size, self.hpz_size, self.size
        node_of = tuple(i // n for i in range(size))  # by group index
        # Every group of every member, by group index, in one fixed order (flat, intra, inter, hpz):
        # creation is a collective over self.group, so every member makes the same calls.
        kinds = {
            "flat": [list(range(size))],
            "intra": [[m * n + j for j in range(n)] for m in range(self.num_nodes)],
            "inter": [[m * n + j for m in range(self.num_nodes)] for j in range(n)],
            "hpz": [list(range(first, first + k)) for first in range(0, size, k)],
        }
        infos = {}
        for kind, index_lists in kinds.items():
            _create_round(self.group, self.members, [tuple(self.members[i] for i in idx) for idx in index_lists])
            mine = next(idx for idx in index_lists if self.rank in idx)
            group = _group_of(tuple(self.members[i] for i in mine), self.members)
            infos[kind] = _GroupInfo(group, tuple(node_of[i] for i in mine), mine.index(self.rank))
        groups = _TopologyGroups(**infos)
        _GROUP_CACHE[key] = groups
        return groups

    @property
    def private_group(self) -> dist.ProcessGroup | None:
        """Our own copy of the caller's group (``None`` for a group of one): for setup-time collectives
        that must not interleave with the caller's on its communicator."""
        return self._groups.flat.group

    def owns(self, group) -> bool:
        """Whether ``group`` is one of this topology's own subgroups (not the caller's group)."""
        g = self._groups
        return group is not None and any(group is info.group for info in (g.flat, g.intra, g.inter, g.hpz))

    @property
    def intra_group(self) -> dist.ProcessGroup | None:
        """This rank's node's members (``None`` when it is alone on its node)."""
        return self._groups.intra.group

    @property
    def inter_group(self) -> dist.ProcessGroup | None:
        """The members with this rank's local index on every node (``None`` on one node)."""
        return self._groups.inter.group

    @property
    def hpz_group(self) -> dist.ProcessGroup | None:
        """This rank's hpZ secondary partition: ``hpz_size`` consecutive members of its node."""
        return self._groups.hpz.group

    @property
    def hpz_index(self) -> int:
        return self._groups.hpz.index

    @property
    def buffers(self) -> BufferPool:
        return self._groups.buffers

    def node_of(self, group_rank: int) -> int:
        return group_rank // self.node_size

    def __repr__(self) -> str:
        return (f"Topology(nodes={self.num_nodes}, node_size={self.node_size}, hpz={self.hpz_size}, "
                f"rank={self.rank}/{self.size}, members={list(self.members)})")
