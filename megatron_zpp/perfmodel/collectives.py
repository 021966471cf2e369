"""Cost of one collective: wire time (alpha-beta, two tiers), codec kernel time, and the bytes it sends.

Byte formulas follow ``megatron_zpp.comm``'s accounting exactly (what each rank *sends* under the algorithm
that runs, split by whether the peer shares its node); ``tests/test_perfmodel.py`` checks them against
``comm``'s ``split_ring`` / ``split_a2a`` / ``_hop_bytes``. Bytes here are summed over the members of *one*
group; the model multiplies by the number of such groups in the job. Every function is pure arithmetic.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from megatron_zpp.compression import get_codec, layout
from megatron_zpp.perfmodel.specs import ClusterSpec


@dataclass(frozen=True)
class Group:
    """One communicator of the job, seen as node-major members (as ``comm.Topology`` requires)."""

    member_nodes: tuple[int, ...]
    """Node index of each member, in group order."""
    concurrent: int
    """Groups of this kind whose members on one node communicate at the same time, sharing its NICs."""
    count: int
    """Groups of this kind in the job (data-parallel groups = tp x pp, ...), for job-wide byte totals."""

    @property
    def size(self) -> int:
        return len(self.member_nodes)

    @property
    def num_nodes(self) -> int:
        return len(set(self.member_nodes))

    @property
    def node_size(self) -> int:
        return self.size // self.num_nodes

    @property
    def ring_crossings(self) -> int:
        """Members whose ring successor is on another node: a node-major ring crosses once per node."""
        n = self.size
        return sum(1 for i in range(n) if n > 1 and self.member_nodes[i] != self.member_nodes[(i + 1) % n])


def make_group(ranks: list[int], ranks_per_node: int, count: int) -> Group:
    """The ``Group`` of global ``ranks``; ``ValueError`` when nodes hold unequal numbers of members."""
    nodes = tuple(r // ranks_per_node for r in ranks)
    per_node = {n: nodes.count(n) for n in nodes}
    if len(set(per_node.values())) != 1:
        raise ValueError(f"group {ranks[:8]}... puts {per_node} members on nodes (node: count) with "
                         f"ranks_per_node={ranks_per_node}; every node must hold the same number (as comm requires)")
    node_size = len(ranks) // len(per_node)
    # Every rank of a node belongs to one group of this kind, so ranks_per_node / node_size of them share it.
    return Group(nodes, max(1, ranks_per_node // node_size), count)


@dataclass
class Cost:
    """One or more collectives: seconds on the wire, seconds of codec/reduction kernels, bytes sent."""

    wire_s: float = 0.0
    """Latency + transfer time."""
    codec_s: float = 0.0
    """Quantize / dequantize / local-reduction kernels, serialized with the wire on the comm stream."""
    intra_bytes: int = 0
    """Bytes sent to same-node peers, summed over the group's members."""
    inter_bytes: int = 0
    """Bytes sent to other nodes, summed over the group's members."""

    @property
    def total_s(self) -> float:
        return self.wire_s + self.codec_s

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.wire_s + other.wire_s, self.codec_s + other.codec_s,
                    self.intra_bytes + other.intra_bytes, self.inter_bytes + other.inter_bytes)

    def alongside(self, other: Cost) -> Cost:
        """Both collectives in flight at once (issued together, waited together): the longer wire time, both
        codecs' kernels."""
        return replace(self + other, wire_s=max(self.wire_s, other.wire_s))

    def scaled(self, k: float) -> Cost:
        """Times ``k`` identical calls."""
        return Cost(self.wire_s * k, self.codec_s * k, round(self.intra_bytes * k), round(self.inter_bytes * k))


# ---------------------------------------------------------------------------------------------- wire bytes


@functools.lru_cache(maxsize=None)
def _codec(spec: str):
    return get_codec(spec)


def codec_name(spec: str) -> str:
    """The key of a codec's measured throughput in a cluster spec: its family (``int8``, ``zfp``, ...), and
    ``int4+hadamard`` / ``int8+hadamard`` for the rotated blockwise codecs (an extra fp32 pass per encode and
    decode; ``ClusterSpec.codec`` falls back to the plain family where a cluster has not measured it)."""
    family = spec.split(":")[0]
    if family in ("int8", "int4") and getattr(_codec(spec), "hadamard", 0):
        return f"{family}+hadamard"
    return family


def wire_bytes(spec: str, numel: int, dtype_bytes: int, cluster: ClusterSpec | None = None) -> int:
    """Payload bytes of ``numel`` elements under codec ``spec``: exact for fixed-size codecs (the codec's
    own ``wire_bytes``); for variable-size ones (lossless), the raw bytes over the cluster's measured ratio."""
    if spec == "none":
        return numel * dtype_bytes  # the identity codec's bytes, without building a torch dtype
    codec = _codec(spec)
    if codec.fixed_size:
        return codec.wire_bytes(numel)
    ratio = cluster.codec(codec_name(spec)).ratio(dtype_bytes) if cluster is not None else None
    if ratio is None:
        raise ValueError(f"codec {spec!r} has data-dependent payloads: the model needs its measured ratio on "
                         f"{'fp32' if dtype_bytes >= 4 else '16-bit'} data (codec_throughput.{codec_name(spec)}."
                         f"ratio_{'fp32' if dtype_bytes >= 4 else '16bit'} in the cluster file; tools/calibrate.py)")
    return math.ceil(numel * dtype_bytes / ratio)


def _codec_time(cluster: ClusterSpec, spec: str, quantize_bytes: float, dequantize_bytes: float) -> float:
    if spec == "none":
        return 0.0
    theta = cluster.codec(codec_name(spec))
    return quantize_bytes / theta.quantize + dequantize_bytes / theta.dequantize


# ---------------------------------------------------------------------------------------------- primitives


def ring(cluster: ClusterSpec, group: Group, steps: int, chunk: int) -> Cost:
    """``steps`` ring steps, each member sending ``chunk`` bytes to its successor (``split_ring``).

    A step lasts as long as its slowest hop. When the ring crosses nodes, each node has one outgoing flow per
    group and ``group.concurrent`` groups share the node's NICs (NCCL spreads a ring's channels over them).
    """
    if group.size == 1 or steps == 0:
        return Cost()
    crossings = group.ring_crossings
    if crossings:
        alpha = cluster.inter_alpha
        bandwidth = min(cluster.intra_bandwidth, cluster.inter_bandwidth / group.concurrent)
    else:
        alpha, bandwidth = cluster.intra_alpha, cluster.intra_bandwidth
    sent = steps * chunk
    return Cost(steps * (alpha + chunk / bandwidth), 0.0, (group.size - crossings) * sent, crossings * sent)


def _a2a_intra(cluster: ClusterSpec, peers: int, per_rank_bytes: int) -> float:
    return peers * cluster.intra_alpha + per_rank_bytes / cluster.intra_bandwidth


def _a2a_inter(cluster: ClusterSpec, group: Group, peers: int, per_rank_bytes: int, senders_per_node: int) -> float:
    # The node's NICs carry every sender's bytes; no rank sends faster than its own link (as in ring()).
    node_bytes = per_rank_bytes * senders_per_node * group.concurrent
    transfer = max(node_bytes / cluster.inter_bandwidth, per_rank_bytes / cluster.intra_bandwidth)
    return peers * cluster.inter_alpha + transfer


# ---------------------------------------------------------------------------------------------- collectives


def all_gather(cluster: ClusterSpec, group: Group, shard_numel: int, spec: str, dtype_bytes: int) -> Cost:
    """Ring all-gather of ``shard_numel``-element shards: torch's, or ``quantized_all_gather`` (qwZ) when
    ``spec`` compresses. Each rank quantizes its shard and decodes all ``size`` rows."""
    row = wire_bytes(spec, shard_numel, dtype_bytes, cluster)
    cost = ring(cluster, group, group.size - 1, row)
    raw = shard_numel * dtype_bytes
    cost.codec_s = _codec_time(cluster, spec, raw, group.size * raw)
    return cost


def hpz_difference_gather(cluster: ClusterSpec, group: Group, shard_numel: int, spec: str, dtype_bytes: int) -> Cost:
    """qWD on Megatron-FSDP's hpZ copy, once per weight update (``hpz_weight_difference_all_gather``): the ring
    all-gather of every shard's encoded difference over the whole group; each rank encodes its own and adds every
    decoded row to the node's gather of the stale copy (that gather is the bucket's ``hpz_gather``, in flight at
    the same time: :meth:`Cost.alongside`), as :func:`all_gather`'s codec time counts."""
    return all_gather(cluster, group, shard_numel, spec, dtype_bytes)


def hpz_gather(cluster: ClusterSpec, group: Group, hpz: int, shard_numel: int, spec: str, dtype_bytes: int) -> Cost:
    """hpZ backward gather (``hpz_all_gather``): a ring inside the ``hpz`` ranks of a node over their parts
    of the forward gather's rows (``size / hpz`` rows each); all intra-node, decode only."""
    if group.node_size % hpz:
        raise ValueError(f"hpz_size={hpz} must divide the {group.node_size} data-parallel ranks per node")
    part = (group.size // hpz) * wire_bytes(spec, shard_numel, dtype_bytes, cluster)
    sub = Group(tuple([0] * hpz), 1, 1)  # one node: what matters is that no step crosses nodes
    cost = ring(cluster, sub, hpz - 1, part)
    cost.intra_bytes = cost.intra_bytes * group.size // hpz  # every hpZ subgroup of the group sends
    raw = group.size * shard_numel * dtype_bytes
    cost.codec_s = _codec_time(cluster, spec, 0, raw)
    return cost


def torch_reduce_scatter(cluster: ClusterSpec, group: Group, shard_numel: int, dtype_bytes: int) -> Cost:
    """torch ``reduce_scatter_tensor``: NCCL's ring (size-1 steps), or gloo's ring all-reduce (twice that)."""
    steps = (group.size - 1) * (2 if cluster.reduce_scatter_is_all_reduce else 1)
    cost = ring(cluster, group, steps, shard_numel * dtype_bytes)
    cost.codec_s = (group.size - 1) * shard_numel * dtype_bytes / cluster.reduce_throughput
    return cost


def torch_all_reduce(cluster: ClusterSpec, group: Group, shard_numel: int, dtype_bytes: int) -> Cost:
    """torch ``all_reduce``: ring reduce-scatter + ring all-gather, 2 (size-1) steps of one shard
    (Agarwal et al.: 2 alpha (p-1) + 2 b (p-1) / (p BW))."""
    cost = ring(cluster, group, 2 * (group.size - 1), shard_numel * dtype_bytes)
    cost.codec_s = (group.size - 1) * shard_numel * dtype_bytes / cluster.reduce_throughput
    return cost


def hierarchical_reduce_scatter(cluster: ClusterSpec, group: Group, shard_numel: int, spec: str,
                                intra_spec: str | None, stages: int, dtype_bytes: int) -> Cost:
    """``qgz_reduce_scatter``: intra-node all-to-all, reduce, inter-node all-to-all, reduce.

    ``spec`` none is the fair uncompressed baseline (same two hops on raw values). With ``stages`` the
    slices pipeline: hop 1 of slice i+1 runs while hop 2 of slice i does.
    """
    intra_spec = intra_spec or spec
    size, node_size, nodes = group.size, group.node_size, group.num_nodes
    if size == 1:
        return Cost()
    stages = max(1, min(stages, shard_numel))
    slice_len = layout.ceil_div(shard_numel, stages)
    first_spec = intra_spec if node_size > 1 else spec
    row1, row2 = (wire_bytes(first_spec, slice_len, dtype_bytes, cluster),
                  wire_bytes(spec, slice_len, dtype_bytes, cluster))
    two_hops = node_size > 1 and nodes > 1
    cost = Cost()
    # Hop 1 runs inside the node, or, with one member per node, directly across nodes.
    first_size = node_size if node_size > 1 else nodes
    sent1 = (first_size - 1) * (size // first_size) * row1
    if node_size > 1:
        hop1 = _a2a_intra(cluster, first_size - 1, sent1)
        cost.intra_bytes += size * sent1 * stages
    else:
        hop1 = _a2a_inter(cluster, group, first_size - 1, sent1, 1)
        cost.inter_bytes += size * sent1 * stages
    hop2 = 0.0
    if two_hops:
        sent2 = (nodes - 1) * row2
        hop2 = _a2a_inter(cluster, group, nodes - 1, sent2, node_size)
        cost.inter_bytes += size * sent2 * stages
    cost.wire_s = hop1 + hop2 + (stages - 1) * max(hop1, hop2)  # two-stage pipeline of `stages` slices
    raw1 = size * shard_numel * dtype_bytes  # the whole input is encoded, and received back as partial rows
    raw2 = nodes * shard_numel * dtype_bytes if two_hops else 0
    cost.codec_s = ((raw1 + raw2) / cluster.reduce_throughput + _codec_time(cluster, first_spec, raw1, raw1)
                    + _codec_time(cluster, spec, raw2, raw2))
    return cost


def token_reduce_scatter(cluster: ClusterSpec, group: Group, shard_numel: int, spec: str, dtype_bytes: int) -> Cost:
    """The allgather MoE dispatcher's combine (or its dispatch's backward): Megatron's ring reduce-scatter
    (``none``), or ``qgz_reduce_scatter`` with ``spec`` on both hops."""
    if spec == "none":
        return torch_reduce_scatter(cluster, group, shard_numel, dtype_bytes)
    return hierarchical_reduce_scatter(cluster, group, shard_numel, spec, None, 1, dtype_bytes)


def compressed_all_reduce(cluster: ClusterSpec, group: Group, numel: int, spec: str, intra_spec: str | None,
                          stages: int, dtype_bytes: int) -> Cost:
    """``comm.compressed_all_reduce``: the hierarchical reduce-scatter, then a ring all-gather of the reduced
    shards with the same (inter-node) codec; ``spec`` none is the project's uncompressed all-reduce."""
    shard = layout.ceil_div(numel, group.size)
    return (hierarchical_reduce_scatter(cluster, group, shard, spec, intra_spec, stages, dtype_bytes)
            + all_gather(cluster, group, shard, spec, dtype_bytes))


def p2p(cluster: ClusterSpec, crosses_nodes: bool, senders_per_node: int, numel: int, spec: str,
        dtype_bytes: int) -> Cost:
    """One pipeline send of ``numel`` activations (``comm.p2p``), with ``senders_per_node`` ranks of a node
    sending at once across its NICs."""
    payload = wire_bytes(spec, numel, dtype_bytes, cluster)
    raw = numel * dtype_bytes
    codec = _codec_time(cluster, spec, raw, raw)
    if crosses_nodes:
        bandwidth = min(cluster.intra_bandwidth, cluster.inter_bandwidth / senders_per_node)
        return Cost(cluster.inter_alpha + payload / bandwidth, codec, 0, payload)
    return Cost(cluster.intra_alpha + payload / cluster.intra_bandwidth, codec, payload, 0)


def token_all_to_all(cluster: ClusterSpec, group: Group, chunk_numel: int, spec: str, dtype_bytes: int) -> Cost:
    """MoE token dispatch or combine (``comm.compressed_all_to_all``): every member sends ``chunk_numel``
    elements to every other member (uniform routing), each chunk one payload of ``spec``; its own rows stay.
    Same-node and cross-node chunks travel at once: the slower tier bounds the call."""
    if group.size == 1 or chunk_numel == 0:
        return Cost()
    payload = wire_bytes(spec, chunk_numel, dtype_bytes, cluster)
    if spec != "none":
        payload = -(-payload // 16) * 16  # each payload's slot is padded to 16 bytes (comm.any_codec.ALIGN)
    inter_peers = group.size - group.node_size
    intra_peers = group.node_size - 1
    wire = max(_a2a_intra(cluster, intra_peers, intra_peers * payload) if intra_peers else 0.0,
               _a2a_inter(cluster, group, inter_peers, inter_peers * payload, group.node_size) if inter_peers else 0.0)
    raw = (group.size - 1) * chunk_numel * dtype_bytes
    return Cost(wire, _codec_time(cluster, spec, raw, raw), group.size * intra_peers * payload,
                group.size * inter_peers * payload)
