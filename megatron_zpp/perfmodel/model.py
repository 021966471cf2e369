"""``predict(cluster, workload, policy) -> Prediction``: one training iteration, analytically.

Agarwal et al. (MLSys'22) for overlap (``max(gamma * T_comp, comm) + exposed bucket``), generalized to the
distributed optimizer, ZeRO-3 and ZeRO++ as in ``shared/notes/perfmodel.md``; Narayanan et al. (SC'21) for
FLOPs, tensor-parallel all-reduces and the 1F1B bubble. Formulas and assumptions: ``README.md`` here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from megatron_zpp.compression import get_codec
from megatron_zpp.compression.layout import ceil_div
from megatron_zpp.perfmodel import collectives as C
from megatron_zpp.perfmodel.collectives import Cost, Group
from megatron_zpp.perfmodel.specs import ClusterSpec, WorkloadSpec
from megatron_zpp.policy import Policy, ZppConfig, available_presets, resolve_policy
from megatron_zpp.policy.policy import ZEROPP_WEIGHTS

# megatron_zpp.megatron.hooks' byte-accounting tags
TAGS = ("dp.grad", "dp.param", "dp.param.bwd", "tp", "pp", "ep.dispatch", "ep.dispatch.grad", "ep.combine",
        "ep.combine.grad")
# Policies the model knows by name besides the YAML presets: the two baselines and ZeRO++'s parts alone
# (their codecs and hpZ size taken from the zeropp preset, the one source of truth).
BUILTIN_POLICIES = ("megatron", "fair", "qwz", "hpz", "qgz", "qwd")
QWD_WEIGHTS = "int4:block=2048"  # SDP4Bit's weight-difference groups
DEFAULT_POLICIES = ("megatron", "fair", "qwz", "hpz", "qgz", "zeropp", "hybrid")


# ---------------------------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class ModelledPolicy:
    """A policy plus the algorithm its *uncompressed* dimensions run."""

    name: str
    """Label in the advisor's table."""
    policy: Policy
    """The project's resolved policy (codec per dimension, hpZ size, qgZ stages, dp.grad schedule)."""
    fair: bool = False
    """False: uncompressed dimensions call torch's collectives, as ``megatron_zpp.megatron.hooks`` does
    (Megatron's baseline). True: they run the project's uncompressed algorithms (hierarchical 2-hop
    reduce-scatter, ring all-gather), the fair baseline compression is measured against; the policy's
    ``dp_uncompressed: hierarchical`` (the ``fair`` preset) means the same."""


_FROM_FILES: dict[str, ModelledPolicy] = {}  # policies resolved from a YAML path, by name


def resolve(policy: str | Policy | ModelledPolicy) -> ModelledPolicy:
    """A name (``megatron``, ``fair``, ``qwz``, ``hpz``, ``qgz``, ``qwd``, a preset such as ``zeropp``/``hybrid``,
    or a policy YAML path), a ``Policy`` or a ``ModelledPolicy``."""
    if isinstance(policy, ModelledPolicy):
        return policy
    if isinstance(policy, Policy):
        return _modelled(policy.name, policy)
    if not isinstance(policy, str):
        raise ValueError(f"policy {policy!r} must be a name, a Policy or a ModelledPolicy")
    none, zeropp = resolve_policy(ZppConfig(policy="none")), resolve_policy(ZppConfig(policy="zeropp"))

    def on_fair(**changes) -> ModelledPolicy:
        # One ZeRO++ technique on the fair baseline (its other DP collectives on the project's uncompressed
        # algorithms), as tools/bench_training.py runs them: each component's effect is its own.
        fair = resolve_policy(ZppConfig(policy="fair"))
        codecs = {**fair.codecs, **changes.pop("codecs", {})}
        return _modelled(policy, dataclasses.replace(fair, name=policy, codecs=codecs, **changes))

    builtin = {
        "megatron": lambda: _modelled("megatron", dataclasses.replace(none, name="megatron")),
        # The fair preset itself (configs/policies/fair.yaml: no codec, dp_uncompressed: hierarchical).
        "fair": lambda: _modelled("fair", resolve_policy(ZppConfig(policy="fair"))),
        "qwz": lambda: on_fair(codecs={"dp.param": zeropp.codec("dp.param")}),
        "hpz": lambda: on_fair(hpz_size=None),
        "qgz": lambda: on_fair(codecs={"dp.grad": zeropp.codec("dp.grad")}),
        # zeropp with 4-bit weight differences instead of qwZ (distributed optimizer): the wire carries the
        # dp.param codec's rows either way; the resyncs (first gather, after a load) are not in the average.
        "qwd": lambda: _modelled("qwd", dataclasses.replace(
            zeropp, name="qwd", codecs={**zeropp.codecs, "dp.param": get_codec(QWD_WEIGHTS).spec},
            param_difference=True)),
    }
    if policy in builtin:
        return builtin[policy]()
    if policy in available_presets() or Path(policy).suffix in (".yaml", ".yml"):
        resolved = resolve_policy(ZppConfig(policy=policy))
        modelled = _modelled(resolved.name, resolved)
        if policy not in available_presets():
            _FROM_FILES[resolved.name] = modelled  # a prediction names it by its file's stem: resolvable by that
        return modelled
    if policy in _FROM_FILES:
        return _FROM_FILES[policy]
    raise ValueError(f"unknown policy {policy!r}; valid: {', '.join(BUILTIN_POLICIES + tuple(available_presets()))} "
                     "or a policy .yaml file")


def _modelled(name: str, policy: Policy) -> ModelledPolicy:
    """The policy's own ``dp_uncompressed`` decides who runs its uncompressed DP collectives."""
    return ModelledPolicy(name, policy, fair=policy.dp_uncompressed == "hierarchical")


# ---------------------------------------------------------------------------------------------- output


@dataclass
class TagBytes:
    """Bytes one parallel dimension sends per iteration, summed over all ranks of the job."""

    intra: int = 0
    inter: int = 0

    def scaled(self, k: int) -> TagBytes:
        return TagBytes(self.intra * k, self.inter * k)


@dataclass
class Prediction:
    """One iteration of one rank (the critical path), and the whole job's bytes."""

    policy: str
    cluster: str
    workload: str
    step_time_s: float
    """Predicted seconds per iteration = the sum of the breakdown fields below."""
    compute_s: float
    """Forward + backward math of all micro-batches (FLOPs / compute_flops, or measured layer times)."""
    tp_comm_s: float
    """Tensor-parallel all-reduces (on the critical path)."""
    pp_comm_s: float
    """Pipeline p2p sends (assumed not hidden)."""
    bubble_s: float
    """1F1B pipeline bubble: (pp - 1) x (forward + backward of one micro-batch)."""
    dp_exposed_comm_s: float
    """Data-parallel wire time not hidden behind compute, plus the overlap slowdown (gamma - 1) x compute."""
    codec_exposed_s: float
    """Codec / reduction kernel time on the exposed path (the exposed time's codec share)."""
    optimizer_s: float
    """Optimizer step."""
    dp_comm_total_s: float
    """All data-parallel wire time of the iteration, hidden or not."""
    codec_total_s: float
    """All codec / reduction kernel time of the iteration, hidden or not."""
    fwd_s: float
    """Forward of one micro-batch on one pipeline stage (with its TP all-reduces)."""
    bwd_s: float
    """Backward of one micro-batch on one pipeline stage (with recomputation and TP all-reduces)."""
    tokens_per_s: float
    """global_batch x seq_length / step_time_s."""
    tflops_per_rank: float
    """Model FLOPs (with recomputation, as Megatron/ZeRO++ report) / step time / ranks, in TFLOP/s."""
    nodes: int
    bytes: dict[str, TagBytes] = field(default_factory=dict)
    """Per dimension tag (dp.grad, dp.param, dp.param.bwd, tp, pp): job-wide intra/inter bytes per iteration,
    the quantity ``comm_stats().summed_over_ranks()`` counts."""

    @property
    def inter_bytes(self) -> int:
        return sum(b.inter for b in self.bytes.values())

    @property
    def inter_bytes_per_node(self) -> float:
        """Bytes leaving one node per iteration (the ZeRO++ paper's M / 3M accounting)."""
        return self.inter_bytes / self.nodes

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["inter_bytes_per_node"] = self.inter_bytes_per_node
        return d


# ---------------------------------------------------------------------------------------------- model shape


def padded_vocab(workload: WorkloadSpec) -> int:
    m = workload.model
    multiple = m.make_vocab_size_divisible_by * workload.layout.tp
    return math.ceil(m.vocab / multiple) * multiple


def layer_params(workload: WorkloadSpec) -> int:
    """One dense transformer layer: QKV + projection + two MLP matrices, their biases, two LayerNorms."""
    h, f = workload.model.hidden, workload.model.ffn_hidden
    return 4 * h * h + 2 * h * f + 9 * h + f


def expert_params(workload: WorkloadSpec) -> int:
    """One expert (an MLP of moe_ffn_hidden, with biases)."""
    h, f = workload.model.hidden, workload.model.moe_ffn_hidden
    return 2 * h * f + f + h


def moe_layer_dense_params(workload: WorkloadSpec) -> int:
    """A MoE layer's parameters outside its experts: attention, norms, the router (h x experts)."""
    h = workload.model.hidden
    return 4 * h * h + 8 * h + h * workload.model.num_experts


def dense_and_expert_params(workload: WorkloadSpec) -> tuple[int, int]:
    """(parameters reduced over the data-parallel group, expert parameters over the expert-data-parallel one)."""
    m = workload.model
    positions = m.seq_length * m.hidden if m.learned_position_embeddings else 0
    moe = m.moe_layers
    dense = ((m.layers - moe) * layer_params(workload) + (moe * moe_layer_dense_params(workload) if moe else 0)
             + padded_vocab(workload) * m.hidden + positions + 2 * m.hidden)
    return dense, (moe * m.num_experts * expert_params(workload) if moe else 0)


def total_params(workload: WorkloadSpec) -> int:
    """All parameters (embeddings tied with the output layer, as Megatron's GPT by default)."""
    return sum(dense_and_expert_params(workload))


def forward_flops(workload: WorkloadSpec) -> tuple[float, float]:
    """(one layer, averaged over the dense and MoE layers; the output logits) forward FLOPs of one micro-batch
    (Narayanan et al.: 2 FLOPs per MAC, attention scores and values 4 b s^2 h; a MoE layer: its router and top-k
    experts per token)."""
    m, b = workload.model, workload.layout.micro_batch
    tokens = b * m.seq_length
    attention = 2 * tokens * 4 * m.hidden ** 2 + 4 * b * m.seq_length ** 2 * m.hidden
    dense = attention + 2 * tokens * 2 * m.hidden * m.ffn_hidden
    moe = m.moe_layers
    if moe:
        routed = attention + 2 * tokens * m.hidden * m.num_experts \
            + m.moe_topk * 2 * tokens * 2 * m.hidden * m.moe_ffn_hidden
        layer = ((m.layers - moe) * dense + moe * routed) / m.layers
    else:
        layer = dense
    return layer, 2 * tokens * m.hidden * padded_vocab(workload)


def iteration_flops(workload: WorkloadSpec) -> float:
    """Model FLOPs of one iteration, all ranks: forward + 2x backward (+1 forward of layers if recomputing)."""
    layer, logits = forward_flops(workload)
    lay = workload.layout
    per_microbatch = 3 * (workload.model.layers * layer + logits) + (workload.model.layers * layer
                                                                     if lay.activation_recompute else 0)
    return per_microbatch * lay.microbatches * lay.dp


# ---------------------------------------------------------------------------------------------- groups


def parallel_groups(cluster: ClusterSpec, workload: WorkloadSpec) -> dict[str, Group]:
    """The first tp / dp / pp group under Megatron's rank order (tp fastest, then dp, then pp)."""
    lay, g = workload.layout, cluster.ranks_per_node
    t, d, p = lay.tp, lay.dp, lay.pp
    if t * d * p != cluster.world_size:
        raise ValueError(f"layout tp x dp x pp = {t} x {d} x {p} = {t * d * p} but cluster {cluster.name!r} has "
                         f"{cluster.nodes} x {cluster.ranks_per_node} = {cluster.world_size} ranks")
    groups = {"tp": C.make_group(list(range(t)), g, d * p),
              "dp": C.make_group([t * j for j in range(d)], g, t * p),
              "pp": C.make_group([t * d * j for j in range(p)], g, t * d)}
    # MoE (expert tensor parallelism 1): Megatron's expert rank order puts ep innermost, then expert-dp.
    e = lay.ep
    edp = t * d // e
    groups["ep"] = C.make_group(list(range(e)), g, edp * p)
    groups["edp"] = C.make_group([e * j for j in range(edp)], g, e * p)
    return groups


def weight_buckets(workload: WorkloadSpec, groups: dict[str, Group]) -> list[tuple[int, Group]]:
    """(parameters, group) of every data-parallel bucket of one rank's (tp, pp) slice of the model: the dense
    parameters over the data-parallel group, MoE's expert parameters (ep of them per stage) in their own buckets over
    the expert-data-parallel group."""
    lay = workload.layout
    dense_params, moe_params = dense_and_expert_params(workload)
    kinds = [(math.ceil(dense_params / (lay.tp * lay.pp)), groups["dp"])]
    if moe_params:
        kinds.append((math.ceil(moe_params / (lay.ep * lay.pp)), groups["edp"]))
    bucket = lay.bucket_size or (math.ceil(layer_params(workload) / lay.tp) if lay.zero_mode == "fsdp"
                                 else max(40_000_000, 1_000_000 * lay.dp))  # Megatron's default
    buckets = []
    for params, group in kinds:
        k = math.ceil(params / bucket)
        buckets += [(n, group) for n in [bucket] * (k - 1) + [params - (k - 1) * bucket]]
    return buckets


def full_precision_weight_gather_s(cluster: ClusterSpec, workload: WorkloadSpec) -> float:
    """Seconds of one uncompressed all-gather of every weight bucket over its group, in the weights' dtype: what the
    first iteration after a switch into 4-bit weight differences (qWD) pays to start every replica's held copy
    from exact weights."""
    groups = parallel_groups(cluster, workload)
    return sum(C.all_gather(cluster, group, ceil_div(n, group.size), "none", workload.layout.param_bytes).wire_s
               for n, group in weight_buckets(workload, groups))


def _phase(gamma: float, compute: float, head: float, body: float, tail: float, overlap: bool) -> float:
    """Agarwal et al.'s overlap: the head's and tail's collectives cannot overlap (the first bucket is needed
    before compute starts, the last is ready only when it ends); the body hides behind gamma-slowed compute."""
    if not overlap:
        return compute + head + body + tail
    if body == 0:  # nothing runs beside the compute (e.g. a single bucket): no contention, no slowdown
        return head + compute + tail
    return head + max(gamma * compute, body) + tail


def _sum(costs: list[Cost]) -> Cost:
    out = Cost()
    for c in costs:
        out = out + c
    return out


# ---------------------------------------------------------------------------------------------- predict


def predict(cluster: ClusterSpec, workload: WorkloadSpec,
            policy: str | Policy | ModelledPolicy = "megatron") -> Prediction:
    """Predict one iteration of ``workload`` on ``cluster`` under ``policy`` (see ``resolve``).

    A policy that compresses dp.grad for only a fraction of iterations (``dp_grad_until``) returns the
    iteration average: that fraction of compressed iterations, the rest uncompressed.
    """
    mp = resolve(policy)
    until = mp.policy.dp_grad_until
    if until >= 1 or not mp.policy.compresses("dp.grad"):
        return _predict(cluster, workload, mp)
    always = dataclasses.replace(mp, policy=dataclasses.replace(mp.policy, dp_grad_until=1.0))
    codecs = {**mp.policy.codecs, "dp.grad": "none"}
    never = dataclasses.replace(mp, policy=dataclasses.replace(mp.policy, codecs=codecs, dp_grad_intra=None))
    return _mix(_predict(cluster, workload, always), _predict(cluster, workload, never), until, workload)


def _predict(cluster: ClusterSpec, workload: WorkloadSpec, mp: ModelledPolicy) -> Prediction:
    lay, model, pol = workload.layout, workload.model, mp.policy
    if model.hidden % lay.tp or model.layers % lay.pp:
        raise ValueError(f"hidden={model.hidden} must divide by tp={lay.tp} and layers={model.layers} by pp={lay.pp}")
    if lay.ep > 1 and (model.num_experts is None or model.num_experts % lay.ep):
        raise ValueError(f"layout ep={lay.ep} needs a MoE model whose num_experts ({model.num_experts}) it divides")
    groups = parallel_groups(cluster, workload)
    m, layers = lay.microbatches, model.layers // lay.pp
    tag_costs: dict[str, Cost] = {tag: Cost() for tag in TAGS}  # one group's costs per iteration

    # Compute per micro-batch per stage (uniform split across stages; logits spread evenly too).
    layer_flops, logits_flops = forward_flops(workload)
    measured = [x for x in cluster.measured_layers if (x.hidden, x.seq_length, x.micro_batch, x.tp)
                == (model.hidden, model.seq_length, lay.micro_batch, lay.tp) and not model.moe_layers]
    if measured:
        layer_f, layer_b = measured[0].fwd_bwd_s / 3, 2 * measured[0].fwd_bwd_s / 3  # backward ~ 2x forward
    else:
        layer_f = layer_flops / (lay.tp * cluster.compute_flops)
        layer_b = 2 * layer_f
    logits_f = logits_flops / (lay.pp * lay.tp * cluster.compute_flops)
    math_f = layers * layer_f + logits_f
    math_b = layers * (layer_b + (layer_f if lay.activation_recompute else 0)) + 2 * logits_f
    whole = [x for x in cluster.measured_iterations
             if (x.layers, x.hidden, x.seq_length, x.micro_batch, x.vocab)
             == (model.layers, model.hidden, model.seq_length, lay.micro_batch, model.vocab) and not model.moe_layers]
    if whole and lay.tp == lay.pp == 1 and not lay.activation_recompute:
        # A measured micro-batch of this very model: logits, loss and framework overhead included.
        math_f, math_b = whole[0].fwd_bwd_s / 3, 2 * whole[0].fwd_bwd_s / 3

    # Tensor parallel: Megatron's 2 all-reduces per layer forward, 2 backward (2 more when recomputing).
    tp_f = tp_b = 0.0
    if lay.tp > 1:
        act = lay.micro_batch * model.seq_length * model.hidden
        spec = pol.codec("tp")
        ar = (C.torch_all_reduce(cluster, groups["tp"], ceil_div(act, lay.tp), lay.param_bytes)
              if spec == "none" else
              C.compressed_all_reduce(cluster, groups["tp"], act, spec, None, 1, lay.param_bytes))
        n_f, n_b = 2 * layers, (2 + (2 if lay.activation_recompute else 0)) * layers
        tp_f, tp_b = n_f * ar.total_s, n_b * ar.total_s
        tag_costs["tp"] = ar.scaled((n_f + n_b) * m)
    # Expert parallelism: per MoE layer and micro-batch, the token dispatch and combine exchanges forward and
    # their two backward ones, on the compute path (not overlapped: Megatron's dispatcher waits for them). alltoall:
    # each a chunk of tokens x top-k x h / ep per peer (uniform routing; sequence-parallel tokens with TP).
    # allgather: dispatch gathers every member's tokens x h (ring), combine reduce-scatters them back (qgZ's
    # algorithm when compressed), and each backward is the other collective.
    ep_f = ep_b = 0.0
    moe_here = model.moe_layers / lay.pp  # MoE layers per stage (uniform split)
    if moe_here and lay.ep > 1:
        tokens = math.ceil(lay.micro_batch * model.seq_length / lay.tp)
        sites = ("ep.dispatch", "ep.dispatch.grad", "ep.combine", "ep.combine.grad")
        if lay.moe_token_dispatcher == "alltoall":
            chunk = math.ceil(tokens * model.moe_topk * model.hidden / lay.ep)
            ep = {site: C.token_all_to_all(cluster, groups["ep"], chunk, pol.codec(site), lay.param_bytes)
                  for site in sites}
        else:
            shard = tokens * model.hidden
            gathers, scatters = ("ep.dispatch", "ep.combine.grad"), ("ep.combine", "ep.dispatch.grad")
            ep = {site: C.all_gather(cluster, groups["ep"], shard, pol.codec(site), lay.param_bytes)
                  for site in gathers}
            ep |= {site: C.token_reduce_scatter(cluster, groups["ep"], shard, pol.codec(site), lay.param_bytes)
                   for site in scatters}
        ep_f = moe_here * (ep["ep.dispatch"].total_s + ep["ep.combine"].total_s)
        ep_b = moe_here * (ep["ep.dispatch.grad"].total_s + ep["ep.combine.grad"].total_s)
        for site, cost in ep.items():
            tag_costs[site] = cost.scaled(moe_here * m)
    fwd, bwd = math_f + tp_f + ep_f, math_b + tp_b + ep_b

    # Pipeline: 1F1B bubble and one p2p per micro-batch slot each way, not hidden.
    pp_s = 0.0
    if lay.pp > 1:
        act = lay.micro_batch * model.seq_length * model.hidden
        stride = lay.tp * lay.dp  # ranks between consecutive stages
        crosses = stride >= cluster.ranks_per_node
        send = C.p2p(cluster, crosses, min(stride, cluster.ranks_per_node), act, pol.codec("pp"), lay.param_bytes)
        pp_s = 2 * (m + lay.pp - 1) * send.total_s
        # One pipeline group: each of its pp - 1 boundaries sends forward and backward, every micro-batch.
        tag_costs["pp"] = send.scaled(2 * m * (lay.pp - 1))
    bubble = (lay.pp - 1) * (fwd + bwd)

    # Data parallel: buckets of this rank's (tp, pp) slice of the model.
    if pol.param_difference and lay.zero_mode not in ("distopt", "fsdp"):
        raise ValueError(f"policy {mp.name!r} gathers weight differences (qWD), which needs the sharded weights of "
                         f"the distributed optimizer or Megatron-FSDP; the workload's zero_mode is "
                         f"{lay.zero_mode!r} (valid: distopt, fsdp)")
    buckets = weight_buckets(workload, groups)
    grad_spec, param_spec = pol.codec("dp.grad"), pol.codec("dp.param")
    stages = pol.qgz_stages
    dense = groups["dp"]
    if pol.param_difference and lay.zero_mode == "fsdp" and dense.node_size == 1 and dense.size > 1:
        raise ValueError(f"policy {mp.name!r}: qWD on Megatron-FSDP keeps the weights in the hpZ copy inside a node, "
                         f"and the data-parallel group has one member per node: no copy to hold them (the hooks "
                         f"refuse it; zeropp's INT8 weights run there)")

    def shard(numel: int, group) -> int:
        return ceil_div(numel, group.size)

    def grad_cost(numel: int, group) -> Cost:
        torch_path = grad_spec == "none" and not mp.fair
        if lay.zero_mode == "ddp":
            if torch_path:
                return C.torch_all_reduce(cluster, group, shard(numel, group), lay.grad_bytes)
            return C.compressed_all_reduce(cluster, group, numel, grad_spec, pol.dp_grad_intra, stages,
                                           lay.grad_bytes)
        if torch_path:
            return C.torch_reduce_scatter(cluster, group, shard(numel, group), lay.grad_bytes)
        return C.hierarchical_reduce_scatter(cluster, group, shard(numel, group), grad_spec, pol.dp_grad_intra,
                                             stages, lay.grad_bytes)

    def qwd_on_hpz(group) -> bool:
        """qWD on Megatron-FSDP keeps the weights in the group's hpZ copy (fsdp.py); a group whose hpZ partition
        is 1 has none and gathers with zeropp's INT8 weights instead, as the hooks do (an MoE expert group with
        one member per node, or a partition the ranks per node do not divide; a dense group with one member per
        node is refused above)."""
        return pol.param_difference and lay.zero_mode == "fsdp" and pol.hpz_partition(group.node_size) > 1

    def param_cost(numel: int, group, backward: bool) -> Cost:
        hpz = pol.hpz_partition(group.node_size)
        if qwd_on_hpz(group):  # every gather, forward and backward: the node's held copy, in the weights' dtype
            return C.hpz_gather(cluster, group, hpz, shard(numel, group), "none", lay.param_bytes)
        spec = ZEROPP_WEIGHTS if pol.param_difference and lay.zero_mode == "fsdp" else param_spec
        if backward and hpz > 1:  # a group with one member per node keeps no hpZ copy: its backward gathers again
            return C.hpz_gather(cluster, group, hpz, shard(numel, group), spec, lay.param_bytes)
        return C.all_gather(cluster, group, shard(numel, group), spec, lay.param_bytes)

    def difference_cost(numel: int, group) -> Cost:
        """qWD on the hpZ copy, once per weight update (the first gather of the bucket after it): every shard's
        difference, in the dp.param codec, all-gathered over the whole group."""
        if not qwd_on_hpz(group):
            return Cost()
        return C.hpz_difference_gather(cluster, group, shard(numel, group), param_spec, lay.param_bytes)

    def job_bytes(costs: list[Cost]) -> TagBytes:
        """Bytes of the whole job: each bucket's group's bytes times the groups of its kind."""
        return TagBytes(sum(c.intra_bytes * grp.count for c, (_, grp) in zip(costs, buckets)),
                        sum(c.inter_bytes * grp.count for c, (_, grp) in zip(costs, buckets)))

    g = cluster.gamma
    rs = [grad_cost(n, grp) for n, grp in buckets]
    dp_job: dict[str, TagBytes] = {"dp.grad": job_bytes(rs)}
    rs_overlaps = lay.overlap_grad_reduce and (lay.compressed_reduce_overlaps or grad_spec == "none"
                                               or lay.zero_mode != "fsdp")
    if lay.zero_mode == "fsdp":  # every micro-batch: gather forward, gather backward, reduce-scatter
        ag = [param_cost(n, grp, False) for n, grp in buckets]
        agb = [param_cost(n, grp, True) for n, grp in buckets]
        diff = [difference_cost(n, grp) for n, grp in buckets]  # qWD: once per update, in the first forward
        first = [a.alongside(d) for a, d in zip(ag, diff)]  # both hops issued at the gather's call
        dp_job.update({"dp.param": job_bytes([a.scaled(m) + d for a, d in zip(ag, diff)]),
                       "dp.param.bwd": job_bytes(agb).scaled(m), "dp.grad": job_bytes(rs).scaled(m)})
        opg = lay.overlap_param_gather
        f_ph = _phase(g, fwd, ag[0].total_s, _sum(ag[1:]).total_s, 0.0, opg)
        f_first = _phase(g, fwd, first[0].total_s, _sum(first[1:]).total_s, 0.0, opg)
        head = agb[0].total_s if opg else _sum(agb).total_s
        body = (_sum(agb[1:]).total_s if opg else 0.0) + (_sum(rs[:-1]).total_s if rs_overlaps else 0.0)
        tail = rs[-1].total_s if rs_overlaps else _sum(rs).total_s
        b_ph = _phase(g, bwd, head, body, tail, opg or rs_overlaps)
        dp_extra = (f_first - fwd) + (m - 1) * (f_ph - fwd) + m * (b_ph - bwd)
        tag_costs["dp.param"] = _sum(ag).scaled(m) + _sum(diff)
        tag_costs["dp.param.bwd"] = _sum(agb).scaled(m)
        tag_costs["dp.grad"] = _sum(rs).scaled(m)
    else:  # once per iteration: reduce in the last backward, gather (distopt) in the next first forward
        dp_extra = _phase(g, bwd, 0.0, _sum(rs[:-1]).total_s, rs[-1].total_s, rs_overlaps) - bwd
        tag_costs["dp.grad"] = _sum(rs)
        if lay.zero_mode == "distopt":
            ag = [param_cost(n, grp, False) for n, grp in buckets]
            dp_job["dp.param"] = job_bytes(ag)
            dp_extra += _phase(g, fwd, ag[0].total_s, _sum(ag[1:]).total_s, 0.0, lay.overlap_param_gather) - fwd
            tag_costs["dp.param"] = _sum(ag)

    dp_all = _sum([tag_costs[t] for t in ("dp.grad", "dp.param", "dp.param.bwd")])
    codec_share = dp_all.codec_s / dp_all.total_s if dp_all.total_s else 0.0
    params_per_rank = sum(n / (1 if lay.zero_mode == "ddp" else grp.size) for n, grp in buckets)
    optimizer = params_per_rank / cluster.optimizer_params_per_s + cluster.optimizer_overhead_s

    compute = m * (math_f + math_b)
    step = compute + m * (tp_f + tp_b) + bubble + pp_s + dp_extra + optimizer
    tokens = lay.global_batch * model.seq_length
    bytes_ = {t: dp_job.get(t) or TagBytes(c.intra_bytes * groups[t.split(".")[0]].count,
                                           c.inter_bytes * groups[t.split(".")[0]].count)
              for t, c in tag_costs.items()}
    return Prediction(
        policy=mp.name, cluster=cluster.name, workload=workload.name, step_time_s=step, compute_s=compute,
        tp_comm_s=m * (tp_f + tp_b), pp_comm_s=pp_s, bubble_s=bubble,
        dp_exposed_comm_s=dp_extra * (1 - codec_share), codec_exposed_s=dp_extra * codec_share,
        optimizer_s=optimizer, dp_comm_total_s=dp_all.wire_s,
        codec_total_s=sum(c.codec_s for c in tag_costs.values()), fwd_s=fwd, bwd_s=bwd,
        tokens_per_s=tokens / step, tflops_per_rank=iteration_flops(workload) / step / cluster.world_size / 1e12,
        nodes=cluster.nodes, bytes=bytes_)


def _mix(a: Prediction, b: Prediction, frac: float, workload: WorkloadSpec) -> Prediction:
    """``frac`` of iterations like ``a``, the rest like ``b`` (times and bytes averaged per iteration)."""
    out = dataclasses.replace(a)
    for f in dataclasses.fields(Prediction):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if isinstance(va, float):
            setattr(out, f.name, frac * va + (1 - frac) * vb)
    out.bytes = {t: TagBytes(round(frac * a.bytes[t].intra + (1 - frac) * b.bytes[t].intra),
                             round(frac * a.bytes[t].inter + (1 - frac) * b.bytes[t].inter)) for t in a.bytes}
    out.tokens_per_s = workload.layout.global_batch * workload.model.seq_length / out.step_time_s
    out.tflops_per_rank = a.tflops_per_rank * a.step_time_s / out.step_time_s
    return out
