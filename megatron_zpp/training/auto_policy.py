"""``--zpp-policy auto``: measure the job's cluster, let the performance model choose, re-check while training.

What happens, on every rank at the same points (every collective here is on the whole world, at an iteration
boundary, never inside a step):

1. **Startup calibration** (before the first iteration, bounded by ``--zpp-auto-calibration-s``): the node-major
   ring step that crosses nodes and the intra-node all-to-all on the job's own ranks (alpha-beta fits over sizes
   up to the job's bucket), the codec kernels on the job's device and dtype, the fp32 reduction and an Adam step
   (``calibration.Probe``, the code ``tools/calibrate.py`` runs). Rank 0 writes them as a cluster YAML the advisor
   reads (``--zpp-auto-cluster-yaml``).
2. **Warm-up** (``--zpp-auto-warmup-iters``): the job trains with the candidate the model ranks first on the
   measured links with a matmul's FLOP rate as compute (a provisional estimate: an uncompressed warm-up on a slow
   link would cost more than the calibration); each iteration's compute, its time less exposed communication and
   codec time (``comm_timers``; on CUDA, less the model's prediction of them), is the model's measured compute
   (the slowest rank's).
3. **Choice**: rank 0 ranks every candidate the user allows (``--zpp-auto-allow``: per-dimension combinations of
   the presets' codecs) with ``perfmodel.predict`` on the measured numbers and broadcasts its decision; every rank
   switches at the same iteration boundary, through :meth:`MegatronHooks.switch_policy`, confirmed by the same
   agreement step as the divergence guard's switches. Rank 0's numbers decide, so ranks whose own measurements
   differ still take the same decision.
4. **Re-check** every ``--zpp-auto-recheck-interval`` iterations: the window's measured step time (the slowest
   rank's) against the model's prediction for the running policy, relative to that ratio when the choice was
   made. A drift beyond ``--zpp-auto-recheck-tolerance`` means the link changed: the inter-node link is measured
   again (cheaply) and the candidates re-ranked; another policy is taken only if predicted faster by more than
   ``--zpp-auto-hysteresis``. When runners-up are predicted within ``--zpp-auto-explore-margin``, up to two of
   them (the best of each other gradient scheme first, :func:`runners_up`; and the best uncompressed candidate
   within ``--zpp-auto-explore-baseline-margin`` of a compressing choice) run for
   ``--zpp-auto-explore-iters`` iterations each, once per decision (taking at most
   ``--zpp-auto-explore-share`` of the iterations left) and the measured fastest is kept (measured beats
   predicted), net of its switch's one-off cost spread over the iterations left (a switch into 4-bit weight
   differences starts from a full-precision gather), unless that net gain is within
   ``--zpp-auto-explore-keep-margin`` of the policy running when the exploration ends.

Every decision after the warm-up is a log line on rank 0 and a W&B event, with the measured inputs, each
candidate's predicted step time, the choice and, at its first window's end, the choice's measured step time;
``summary()`` lists them and every switch taken (the same on every rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_zpp.policy.auto import (START, AutoPolicyConfig, candidates, parse_allow, parse_script,  # noqa: F401
                                      preset_for_job)

EXPLORE_MAX = 2  # runners-up tried after a decision, at most (each costs --zpp-auto-explore-iters iterations)


# ---------------------------------------------------------------------------------------------- the job as the model sees it


def workload_from_args(args, vocab: int, world: int):
    """The running job as a ``perfmodel.WorkloadSpec``."""
    from megatron_zpp.perfmodel import LayoutSpec, ModelSpec, WorkloadSpec

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    zero_mode = "fsdp" if args.use_megatron_fsdp else "distopt" if args.use_distributed_optimizer else "ddp"
    model = ModelSpec(layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
                      seq_length=args.seq_length, vocab=vocab,
                      make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                      ffn_hidden=args.ffn_hidden_size or 4 * args.hidden_size,
                      learned_position_embeddings=getattr(args, "position_embedding_type", "learned_absolute")
                      == "learned_absolute", **_moe_model_fields(args))
    layout = LayoutSpec(micro_batch=args.micro_batch_size, global_batch=args.global_batch_size, tp=tp, pp=pp,
                        ep=getattr(args, "expert_model_parallel_size", 1) if getattr(args, "num_experts", None) else 1,
                        moe_token_dispatcher=getattr(args, "moe_token_dispatcher_type", "allgather"),
                        dp=world // (tp * pp), param_bytes=2 if (args.bf16 or args.fp16) else 4,
                        grad_bytes=2 if args.fp16 else 4, zero_mode=zero_mode, bucket_size=args.ddp_bucket_size,
                        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
                        activation_recompute=args.recompute_granularity == "full",
                        compressed_reduce_overlaps=zero_mode != "fsdp")
    return WorkloadSpec(name="this job", model=model, layout=layout)


def _moe_model_fields(args) -> dict:
    """The MoE fields of the model spec (none for a dense model). A ``--moe-layer-freq`` pattern (a list of 0/1 per
    layer) becomes the frequency with the same number of MoE layers, as the model spreads them uniformly."""
    experts = getattr(args, "num_experts", None)
    if not experts:
        return {}
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, (list, tuple)):
        freq = max(1, round(len(freq) / max(1, sum(freq))))
    return {"num_experts": experts, "moe_topk": args.moe_router_topk, "moe_layer_freq": freq,
            "moe_ffn_hidden": getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size or 4 * args.hidden_size}


@dataclass
class Measured:
    """What the startup calibration measured (rank 0's view, mean or max over ranks where the probe agrees)."""

    intra: object | None  # calibration.Fit
    inter: object
    codecs: dict
    reduce_throughput: float
    optimizer_params_per_s: float
    optimizer_fixed_s: float
    seconds: float
    matmul_flops: float = 0.0
    """FLOP/s of a square matmul in the job's dtype (the compute estimate of the warm-up's provisional choice)."""

    def summary(self) -> dict:
        return {"inter_alpha_s": self.inter.alpha, "inter_bandwidth_Bps": self.inter.bandwidth,
                "intra_alpha_s": self.intra.alpha if self.intra else None,
                "intra_bandwidth_Bps": self.intra.bandwidth if self.intra else None,
                "codecs": {k: v["quantize"] for k, v in self.codecs.items()}, "matmul_flops": self.matmul_flops,
                "calibration_s": self.seconds}


def calibrate(probe, budget_s: float, *, max_bytes: int, dtype: torch.dtype, optimizer_params: int) -> Measured:
    """The startup calibration on every rank (``probe``: a ``calibration.Probe`` on the job's ranks), bounded by
    ``budget_s``: the inter-node ring step gets 40% of it and the intra-node all-to-all 25%, each a ladder of sizes
    that stops where the link's calls get long (``Probe.ring_ladder``: a slow link is fitted on small messages
    within its share, a fast one on large ones); the kernels (the blockwise ones and the codec-interface ones:
    ZFP, MPC, zstd), the fp32 reduction, Adam and a matmul run on fixed small sizes in the rest. Every count and
    size is agreed across ranks, so the collectives match."""
    t0 = time.perf_counter()
    inter = probe.ring_ladder(0.4 * budget_s, max_bytes)
    intra = probe.ring_ladder(0.25 * budget_s, max_bytes, group=probe.intra, peers=probe.g - 1) \
        if probe.intra is not None else None
    reps = 3 if budget_s < 10 else 5
    # The codec-interface kernels (ZFP, MPC, zstd: TP / PP candidates only) are the slowest here: left out when
    # the links took the budget's network share and more (agreed, so every rank makes the same calls).
    late = probe.agree_max(time.perf_counter() - t0) > 0.7 * budget_s
    codecs = probe.codecs(dtype=dtype, numel=1 << 17, reps=reps, interface=not late)
    reduce = probe.reduce_throughput()
    params_per_s, fixed = probe.optimizer(max(1 << 14, min(optimizer_params, 1 << 20)), reps=reps)
    n = 2048 if probe.device.type == "cuda" else 512  # large enough not to be launch-bound on a GPU
    a = torch.randn(n, n, device=probe.device).to(dtype)
    mm = probe.local_median(lambda: torch.mm(a, a), reps=reps)
    matmul_flops = probe.mean_over_ranks(2 * n ** 3 / mm)
    seconds = probe.agree_max(time.perf_counter() - t0)
    return Measured(intra=intra, inter=inter, codecs=codecs, reduce_throughput=reduce,
                    optimizer_params_per_s=params_per_s, optimizer_fixed_s=fixed, seconds=seconds,
                    matmul_flops=matmul_flops)


def cluster_fields(m: Measured, workload, *, nodes: int, ranks_per_node: int, backend: str,
                   fwd_bwd_s: float | None, source: str) -> dict:
    """``ClusterSpec`` fields from the calibration and the measured compute of one micro-batch (None: not measured
    yet; the compute is then the matmul FLOP rate's, a provisional estimate)."""
    from megatron_zpp.perfmodel import iteration_flops

    intra = m.intra or m.inter
    model, lay = workload.model, workload.layout
    world = nodes * ranks_per_node
    if fwd_bwd_s is None:
        compute_flops, iteration = max(m.matmul_flops, 1.0), []
    else:
        compute_flops = iteration_flops(workload) / world / max(fwd_bwd_s * lay.microbatches, 1e-9)
        iteration = ([{"layers": model.layers, "hidden": model.hidden, "seq_length": model.seq_length,
                       "micro_batch": lay.micro_batch, "vocab": model.vocab, "fwd_bwd_s": fwd_bwd_s}]
                     if lay.tp == 1 and lay.pp == 1 else [])
    return {"name": "zpp-auto", "source": source, "nodes": nodes, "ranks_per_node": ranks_per_node,
            "backend": backend, "intra_alpha": intra.alpha, "intra_bandwidth": intra.bandwidth,
            "inter_alpha": m.inter.alpha, "inter_bandwidth": m.inter.bandwidth, "inter_link_efficiency": 1.0,
            "inter_bandwidth_cap": None, "compute_flops": compute_flops, "measured_layers": [],
            "measured_iterations": iteration, "gamma": 1.0,
            "codec_throughput": {k: dict(v) for k, v in m.codecs.items()},
            "reduce_throughput": m.reduce_throughput, "optimizer_params_per_s": m.optimizer_params_per_s,
            "optimizer_overhead_s": max(m.optimizer_fixed_s, 0.0)}


def rank_candidates(cluster, workload, policies: list) -> list[tuple[str, float]]:
    """(name, predicted step seconds) of every policy the model can predict, fastest first (ties: list order)."""
    from megatron_zpp.perfmodel import predict

    out = []
    for i, p in enumerate(policies):
        try:
            out.append((predict(cluster, workload, p).step_time_s, i, p.name))
        except ValueError:  # e.g. a codec the calibration could not time here: not a candidate
            continue
    return [(name, s) for s, _, name in sorted(out)]


def decide_on_rank0(decide, device) -> object:
    """``decide()`` run on rank 0, its result on every rank (one broadcast): the decision is made once and taken by
    all. An exception on rank 0 travels in the broadcast and is raised on every rank (the others would otherwise
    wait in the broadcast for a rank that has left)."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = {"value": decide()}
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box[0] = {"error": f"{type(e).__name__}: {e}"}
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    if "error" in box[0]:
        raise RuntimeError(f"--zpp-policy auto: rank 0's decision failed: {box[0]['error']}")
    return box[0]["value"]


# ---------------------------------------------------------------------------------------------- the controller


class AutoPolicy:
    """One per rank: ``start()`` before the first iteration, then ``begin(it)`` before and ``end(it, s)`` after
    every 1-based iteration ``it``."""

    def __init__(self, config: AutoPolicyConfig, hooks, args, *, device: torch.device, vocab: int, agreement,
                 log=print, wandb_log=None) -> None:
        from megatron_zpp.comm import Topology
        from megatron_zpp.comm.topology import ranks_per_node_from_env

        self.config = config
        self.hooks = hooks
        self.args = args
        self.device = device
        self.agreement = agreement
        self.log = log
        self.wandb_log = wandb_log
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.workload = workload_from_args(args, vocab, self.world)
        self.zero_mode = self.workload.layout.zero_mode
        rpn = hooks.ranks_per_node or ranks_per_node_from_env() or self.world  # as the hooks' own topologies
        topo = Topology(None, ranks_per_node=rpn)  # the world's node split, as the policy's collectives see it
        self.ranks_per_node, self.nodes = topo.node_size, topo.num_nodes
        self._intra_group = topo.intra_group
        self.allow = parse_allow(config.allow)
        self.candidates = candidates(self.allow, zero_mode=self.zero_mode, tp=self.workload.layout.tp,
                                     pp=self.workload.layout.pp, ranks_per_node=hooks.policy.ranks_per_node,
                                     nodes_ranks=self.ranks_per_node, error_feedback=hooks.policy.error_feedback)
        self.candidates = [p for p in self.candidates if hooks.can_switch_to(p) and _runs_here(p, args)]
        self.by_name = {p.name: p for p in self.candidates}
        self.script = parse_script(config.script)
        # One bucket's share per rank, at most 8 MiB: the largest message the calibration's ladders try.
        self._max_bytes = min(8 << 20, (args.ddp_bucket_size or 40_000_000) * 4 // max(1, self.world))
        self.current = START
        self.decisions: list[dict] = []
        self.switches: list[dict] = []  # every switch taken: iteration, policy, reason (explorations' too)
        self.measured_inputs: Measured | None = None
        self.cluster = None
        self._steps: list[tuple[int, float, float]] = []  # (iteration, step s, compute s) this rank, since the last
        # window (a switch or a measurement)
        self._timers0 = (0.0, 0.0)
        self._switched_at = 1
        self._first_after_switch = -1.0  # this rank's step s of the first iteration after a switch into qWD
        self.switch_cost_s = 0.0  # the largest one-off cost of a switch into qWD on this link (agreed over ranks)
        self._ratio0: float | None = None  # measured / predicted step of the running policy, when chosen
        self._measured: dict[str, float] = {}  # policy -> measured step s since the last (re-)measure
        self._plan: list[tuple[int, str]] = []  # exploration: (iteration, "try NAME" | "judge CHOICE NAME...")
        self._next_check: int | None = None
        self._decide_at = config.warmup_iters + 1
        self._in_fallback = False
        self.overhead_s = 0.0  # calibration, decisions and re-measures: host time outside the timed iterations
        self.suspended = lambda: False  # the trainer: whether the divergence guard runs its fallback

    # ------------------------------------------------------------------ startup
    def start(self, first_iteration: int = 1) -> None:
        """Before ``first_iteration`` (1-based; after a resume, the one after the loaded checkpoint's): the startup
        calibration, on every rank (skipped with ``--zpp-auto-script``)."""
        self._decide_at = first_iteration + self.config.warmup_iters
        self._switched_at = first_iteration
        if self.script:
            return
        with self._charged():
            self._start(first_iteration)

    def _start(self, first_iteration: int) -> None:
        from megatron_zpp.training.calibration import Probe

        probe = Probe(self.device, self.ranks_per_node, self._intra_group)
        dtype = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else torch.float32
        shard_params = max(1, _total_params(self.workload) // max(1, self.workload.layout.dp * self.workload.layout.tp
                                                                   * self.workload.layout.pp))
        self.measured_inputs = calibrate(probe, self.config.calibration_s, max_bytes=self._max_bytes,
                                         dtype=dtype, optimizer_params=shard_params)
        if self.rank == 0:
            m = self.measured_inputs.summary()
            self.log(f"[zpp auto] calibration {m['calibration_s']:.1f} s (budget {self.config.calibration_s:g} s): "
                     f"inter-node {m['inter_bandwidth_Bps'] / 1e6:.2f} MB/s per node, alpha "
                     f"{m['inter_alpha_s'] * 1e3:.2f} ms; intra-node "
                     + (f"{m['intra_bandwidth_Bps'] / 1e6:.1f} MB/s per rank" if m["intra_bandwidth_Bps"] else "none")
                     + "; codecs " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in m["codecs"].items()))
        # The warm-up runs the choice on the measured links with the matmul rate as compute (a provisional
        # estimate): on a slow link, warming up uncompressed would cost more than the whole calibration.
        from megatron_zpp.perfmodel import from_dict
        from megatron_zpp.perfmodel.specs import ClusterSpec

        def provisional():
            fields = cluster_fields(self.measured_inputs, self.workload, nodes=self.nodes,
                                    ranks_per_node=self.ranks_per_node, backend=dist.get_backend(), fwd_bwd_s=None,
                                    source="--zpp-policy auto, provisional")
            return fields, rank_candidates(from_dict(ClusterSpec, fields, "auto calibration"), self.workload,
                                           fitting_now), self.measured_inputs.summary()

        # Only the warm-up's pick is limited by the memory left now (half of it: optimizer state and activations are
        # not allocated yet); the decision after the warm-up measures again, on every candidate.
        fitting_now = self._what_fits(share=0.5, peak=False)
        fields, ranked, inputs = decide_on_rank0(provisional, self.device)  # rank 0's measurements, on every rank
        self._provisional = from_dict(ClusterSpec, fields, "auto calibration")
        self.decisions.append({"iteration": first_iteration, "reason": "warm-up on the provisional estimate",
                               "inputs": inputs, "predicted_s": dict(ranked),
                               "choice": ranked[0][0], "previous": self.current, "runner_up": None, "margin": None,
                               "measured_s": None})
        if self.rank == 0:
            self.log(f"[zpp auto] warm-up ({self.config.warmup_iters} iterations) with {ranked[0][0]}, the choice "
                     "on the measured links with the matmul rate as compute")
        self._switch(first_iteration, ranked[0][0], "warm-up")

    # ------------------------------------------------------------------ per iteration
    # Every branch below is taken on every rank at the same iteration: the schedule (_decide_at, _plan,
    # _next_check) changes only from values every rank holds (the config, broadcasts, all-reduced times).
    def begin(self, iteration: int) -> None:
        """Before 1-based ``iteration``, before any of its collectives: decide, explore or re-check when due (its
        time adds to ``overhead_s``)."""
        with self._charged():
            self._begin(iteration)

    @contextlib.contextmanager
    def _charged(self):
        """Time spent inside counts to ``overhead_s`` (charged to the iterations in the run's summary)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.overhead_s += time.perf_counter() - t0

    def _begin(self, iteration: int) -> None:
        if self.suspended():
            # The divergence guard's fallback: no decision inside it (it promised uncompressed iterations), no
            # window measured while lossy codecs step aside; what was due waits for its end.
            self._in_fallback = True
            self._steps = []
            self._mark()
            return
        if self._in_fallback:
            # The fallback's end: its first iteration carries qWD's full-precision resync (not timed), and what was
            # due waits for a window of its own (the exploration keeps its spacing and its re-check).
            self._in_fallback = False
            self._switched_at = iteration
            self._first_after_switch = -1.0
            if self.cluster is None:
                self._decide_at = max(self._decide_at, iteration + 2)
            e = self.config.explore_iters
            shift = max(0, iteration + e - self._plan[0][0]) if self._plan else 0
            self._plan = [(it + shift, action) for it, action in self._plan]
            last = self._last_iteration(iteration)
            if self._plan and self._plan[-1][0] > last:
                # The shift pushed the judgement past the run's end: no runner-up left untried runs; what was
                # measured is judged after a window of the policy running now. With no timed iteration left for
                # that window (this one carries the resync) the policy running now stays: a switch in the last
                # iteration could not repay itself.
                self._plan = [(min(iteration + e, last), self._plan[-1][1])] if last - iteration >= 2 else []
            if self._next_check is not None:
                self._next_check = max(self._next_check + shift, iteration + e)
        if self.script:
            if iteration in self.script:
                self._switch(iteration, self.script[iteration], "script")
        elif iteration == self._decide_at and self.cluster is None:
            self._choose(iteration)
        elif self._plan and self._plan[0][0] == iteration:
            _, action = self._plan.pop(0)
            self._explore_step(iteration, action)
        elif self._next_check is not None and iteration >= self._next_check:
            self._recheck(iteration)
        self._mark()

    def end(self, iteration: int, seconds: float) -> None:
        """After ``iteration``: its step time and compute (step less this rank's exposed communication and codec
        time), kept locally; the first iteration after a switch carries one-off costs and is left out."""
        from megatron_zpp.comm import comm_timers

        t = comm_timers()
        codec, wait = t.codec_s - self._timers0[0], t.wait_s - self._timers0[1]
        if iteration > self._switched_at and not self.suspended():
            self._steps.append((iteration, seconds, max(seconds - codec - wait, 1e-9)))
        elif iteration == self._switched_at and self._first_after_switch == 0.0:
            self._first_after_switch = seconds  # armed by a switch after the warm-up's: its one-off cost is timed

    def _mark(self) -> None:
        from megatron_zpp.comm import comm_timers

        t = comm_timers()
        self._timers0 = (t.codec_s, t.wait_s)

    # ------------------------------------------------------------------ decisions
    def _window(self) -> tuple[float, float]:
        """(step s, compute s) of the iterations timed since the last window: each rank's median, then the slowest
        rank's (one all-reduce: every rank gets the same numbers). Clears the window. When the window follows a
        switch into qWD, the first iteration's excess over the window's step is that switch's one-off cost (the
        largest on this link is ``switch_cost_s``)."""
        steps = [s for _, s, _ in self._steps] or [math.nan]
        computes = [c for _, _, c in self._steps] or [math.nan]
        t = torch.tensor([statistics.median(steps), statistics.median(computes), self._first_after_switch],
                         dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self._steps = []
        step_s, compute_s, first = float(t[0]), float(t[1]), float(t[2])
        if first > 0 and math.isfinite(step_s):
            self.switch_cost_s = max(self.switch_cost_s, first - step_s)
        self._first_after_switch = -1.0
        return step_s, compute_s

    def _predict_all(self) -> list[tuple[str, float]]:
        return rank_candidates(self.cluster, self.workload, self.candidates)

    def _what_fits(self, share: float, peak: bool) -> list:
        """The candidates whose held weight copy (qWD's or hpZ's on Megatron-FSDP), beyond the running policy's,
        fits in ``share`` of the device memory every rank has left: the smallest over ranks of its free memory
        plus what the allocator holds now less what it holds now (``peak`` False: before training, optimizer
        state and activations not allocated yet) or held at its peak (after the warm-up). CUDA only: a CPU job's
        memory is not the accelerator's to run out of."""
        if self.device.type != "cuda" or self.zero_mode != "fsdp":
            return self.candidates
        free, _ = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        used = torch.cuda.max_memory_reserved(self.device) if peak else reserved
        left = torch.tensor([float(free + reserved - used)], dtype=torch.float64, device=self.device)
        dist.all_reduce(left, op=dist.ReduceOp.MIN)
        left = float(left)
        keep, dropped = fitting(self.candidates, self.by_name.get(self.current), left, share,
                                lambda p: held_copy_bytes(p, self.workload, self.ranks_per_node))
        if dropped and self.rank == 0:
            self.log(f"[zpp auto] not a candidate, its held weight copy would not fit in {share:.0%} of the "
                     f"{left / 2**30:.1f} GiB left on the fullest rank: {', '.join(dropped)}")
        return keep

    def _choose(self, iteration: int) -> None:
        """The first decision: rank 0 builds the cluster from its calibration and the warm-up's compute, every
        rank ranks the candidates on those same numbers."""
        from megatron_zpp.perfmodel import from_dict
        from megatron_zpp.perfmodel.specs import ClusterSpec

        step_s, compute_s = self._window()
        if not math.isfinite(step_s):  # nothing timed (a window emptied by the guard's fallback): measure again
            self._decide_at = iteration + 2
            return
        self.candidates = self._what_fits(share=0.8, peak=True)
        self.by_name = {p.name: p for p in self.candidates}
        if self.device.type == "cuda":
            # Host timers see no stream time: on CUDA the window's compute is its step less the communication,
            # codec time and bubble the model predicts for the running policy (never less than 30% of the step).
            from megatron_zpp.perfmodel import predict

            p = predict(self._provisional, self.workload, self.by_name[self.current])
            rest = p.dp_exposed_comm_s + p.codec_exposed_s + p.tp_comm_s + p.pp_comm_s + p.bubble_s
            compute_s = max(step_s - rest, 0.3 * step_s)

        def choose():  # rank 0's measurements decide: the others' may differ, their decision may not
            fields = cluster_fields(self.measured_inputs, self.workload, nodes=self.nodes,
                                    ranks_per_node=self.ranks_per_node, backend=dist.get_backend(),
                                    fwd_bwd_s=compute_s / self.workload.layout.microbatches,
                                    source=f"--zpp-policy auto, {time.strftime('%Y-%m-%d %H:%M')}")
            self.cluster = from_dict(ClusterSpec, fields, "auto calibration")
            self._write_cluster(fields)
            return {"fields": fields, "inputs": self.measured_inputs.summary(), "ranked": self._predict_all()}

        view = decide_on_rank0(choose, self.device)
        self.cluster = from_dict(ClusterSpec, view["fields"], "auto calibration")
        self._measured = {}
        self._note_measured(step_s)  # the warm-up pick's own window (not a later runner-up's of the same name)
        ranked = view["ranked"]
        self._decide(iteration, "startup calibration", ranked, ranked[0][0],
                     {"warmup_step_s": step_s, "compute_s": compute_s, **view["inputs"]})

    def _decide(self, iteration: int, reason: str, ranked: list[tuple[str, float]], choice: str, inputs: dict) -> None:
        """Log the decision, switch to ``choice`` and plan what follows: exploring runners-up when the model
        cannot tell them apart, else a first window of the choice (its measured-to-predicted ratio is the
        reference later re-checks compare with)."""
        predicted = dict(ranked)
        runner = next((n for n, _ in ranked if n != choice), None)
        margin = predicted[runner] / predicted[choice] - 1 if runner else math.inf
        self.decisions.append({"iteration": iteration, "reason": reason, "inputs": inputs, "predicted_s": predicted,
                               "choice": choice, "previous": self.current, "runner_up": runner, "margin": margin,
                               "measured_s": None})
        if self.rank == 0:
            top = ", ".join(f"{n} {s * 1e3:.0f}" for n, s in ranked[:6])
            self.log(f"[zpp auto] iteration {iteration}: {reason}; predicted ms per iteration: {top}"
                     + (" ..." if len(ranked) > 6 else "") + f"; choice {choice}"
                     + (f" (runner-up {runner} {100 * margin:+.1f}%)" if runner else ""))
        self._wandb({"zpp/auto_choice": self._index(choice), "zpp/auto_predicted_s": predicted[choice],
                     **{f"zpp/auto_predicted_s/{n}": s for n, s in ranked}}, iteration)
        self._switch(iteration, choice, reason)
        self._ratio0 = None
        e = self.config.explore_iters
        close = runners_up(ranked, choice, self.by_name, self.config.explore_margin)[:EXPLORE_MAX]
        # The best uncompressed candidate too, when the choice compresses and the model gives it a lead below
        # --zpp-auto-explore-baseline-margin: the model underrates codec and CPU costs on fast links
        # (docs/performance.md, "Does the model pick the fastest policy?"), and not compressing is the answer there.
        baseline = next((n for n, _ in ranked if all(c == "none" for c in self.by_name[n].codecs.values())), None)
        if baseline and baseline != choice and baseline not in close and \
                predicted[baseline] < predicted[choice] * (1 + self.config.explore_baseline_margin):
            close.append(baseline)
        # Exploring is an investment the rest of the run repays: the runners-up may take --zpp-auto-explore-share of
        # the iterations left (on a run of thousands every close one runs, on a short one few or none), and none
        # runs when the run would end before the judgement.
        left = self._iterations_left(iteration)
        close = close[:int(self.config.explore_share * left) // e]
        if close and (len(close) + 1) * e > left - 1:
            close = []
        if close and self.config.recheck_interval:
            # Measured beats predicted: time the choice, then each runner-up, keep the fastest unless the gain is
            # noise or does not repay a switch (kept_after_exploring; the warm-up's own measurement counts when this
            # is the startup decision).
            self._plan = [(iteration + (i + 1) * e, f"try {n}") for i, n in enumerate(close)]
            self._plan.append((iteration + (len(close) + 1) * e, "judge " + " ".join([choice, *close])))
            self._next_check = iteration + (len(close) + 2) * e
        else:
            self._plan = []
            self._next_check = iteration + e if self.config.recheck_interval else None

    def _full_precision_gather_s(self) -> float:
        """The model's time for one uncompressed gather of every weight bucket: what the first iteration after a
        switch into qWD pays (its held copy starts from exact weights). Same on every rank (the cluster is rank
        0's, broadcast)."""
        from megatron_zpp.perfmodel import full_precision_weight_gather_s

        return 0.0 if self.cluster is None else full_precision_weight_gather_s(self.cluster, self.workload)

    def _switch_cost(self, name: str, into_qwd_s: float) -> float:
        """One-off seconds of a switch from the running policy to ``name``: ``into_qwd_s`` for a switch into 4-bit
        weight differences from another weight scheme (the full-precision gather that starts the held copy), 0
        otherwise (a new INT8 or uncompressed scheme gathers as it always does; its hpZ copy fills on the way)."""
        return into_qwd_s if switches_into_qwd(self.by_name.get(self.current), self.by_name[name]) else 0.0

    def _last_iteration(self, iteration: int) -> float:
        """The run's last iteration as seen from ``iteration``: --train-iters, or the next ``--exit-interval``
        boundary (the trainer always has ``--train-iters``)."""
        end = getattr(self.args, "train_iters", None) or math.inf
        exit_interval = getattr(self.args, "exit_interval", None)
        if exit_interval:
            end = min(end, (iteration + exit_interval - 1) // exit_interval * exit_interval)
        return end

    def _iterations_left(self, iteration: int) -> float:
        """Iterations from ``iteration`` (included) to :meth:`_last_iteration`."""
        return self._last_iteration(iteration) - iteration + 1

    def _explore_step(self, iteration: int, action: str) -> None:
        step_s, _ = self._window()
        self._note_measured(step_s)
        verb, *names = action.split(" ")
        if verb == "try":
            self._switch(iteration, names[0], "exploring the runner-up")
            return
        tried = [n for n in dict.fromkeys([*names, *self._measured]) if n in self.by_name]
        left = self._iterations_left(iteration)
        into_qwd_s = max(self.switch_cost_s, self._full_precision_gather_s())
        keep = kept_after_exploring(self._measured, tried, self.current, self.config.explore_keep_margin,
                                    switch_cost_s=lambda n: self._switch_cost(n, into_qwd_s), iterations_left=left)
        if self.rank == 0:
            self.log(f"[zpp auto] iteration {iteration}: measured ms per iteration: "
                     + ", ".join(f"{n} {self._measured[n] * 1e3:.0f}" for n in tried if n in self._measured)
                     + f"; keeping {keep} (a switch into 4-bit weight differences costs {into_qwd_s * 1e3:.0f} ms "
                     f"once; {left:g} iterations left)")
        self.decisions.append({"iteration": iteration, "reason": "exploration measured", "inputs": {},
                               "predicted_s": {}, "choice": keep, "previous": self.current, "runner_up": None,
                               "margin": None, "measured_s": {n: self._measured.get(n) for n in tried}})
        self._wandb({"zpp/auto_choice": self._index(keep), "zpp/auto_measured_s": self._measured.get(keep)}, iteration)
        self._switch(iteration, keep, "exploration measured")
        self._ratio0 = None

    def _note_measured(self, step_s: float) -> None:
        """The running policy's measured step time: kept for the judge and, once, on its decision. An empty window
        (the guard's fallback took it) measures nothing."""
        if not math.isfinite(step_s):
            return
        self._measured[self.current] = step_s
        for d in reversed(self.decisions):
            if d.get("choice") == self.current and d.get("measured_s") is None and d["reason"] != "script":
                d["measured_s"] = step_s
                break

    def _recheck(self, iteration: int) -> None:
        step_s, _ = self._window()
        self._note_measured(step_s)
        self._wandb({"zpp/auto_measured_s": step_s}, iteration)
        self._next_check = iteration + self.config.recheck_interval
        def judge():
            predicted = dict(self._predict_all()).get(self.current)
            ratio = step_s / predicted if predicted else math.nan
            drift = math.nan if self._ratio0 is None else ratio / self._ratio0 - 1
            return {"ratio": ratio, "drift": drift}

        view = decide_on_rank0(judge, self.device)
        if self._ratio0 is None or not math.isfinite(self._ratio0):
            self._ratio0 = view["ratio"]  # the choice's first window: what later windows are compared with
            return
        drift = view["drift"]
        if not abs(drift) > self.config.recheck_tolerance:  # a NaN window (nothing timed) is no drift
            return
        # The link changed: measure it again (bounded), re-rank, switch past the hysteresis only.
        from megatron_zpp.training.calibration import Probe

        probe = Probe(self.device, self.ranks_per_node, self._intra_group)
        t0 = time.perf_counter()
        inter = probe.ring_ladder(min(2.0, self.config.calibration_s / 4), self._max_bytes)
        seconds = probe.agree_max(time.perf_counter() - t0)
        def rerank():
            self.cluster = dataclasses.replace(self.cluster, inter_alpha=inter.alpha, inter_bandwidth=inter.bandwidth)
            ranked = self._predict_all()
            predicted = dict(ranked)
            best = ranked[0][0]
            current = predicted.get(self.current, math.inf)
            # past the hysteresis, and repaying its one-off cost (on the new link: the model's) before the run ends
            cost = self._switch_cost(best, self._full_precision_gather_s())
            keep = not (predicted[best] < current * (1 - self.config.hysteresis)
                        and (current - predicted[best]) * self._iterations_left(iteration) > cost)
            return {"alpha": inter.alpha, "bandwidth": inter.bandwidth, "ranked": ranked,
                    "choice": self.current if keep else best}

        view = decide_on_rank0(rerank, self.device)
        self.cluster = dataclasses.replace(self.cluster, inter_alpha=view["alpha"], inter_bandwidth=view["bandwidth"])
        self._measured = {}
        self.switch_cost_s = 0.0  # measured on the old link
        ranked, choice = view["ranked"], view["choice"]
        self._decide(iteration, f"measured/predicted drifted {100 * drift:+.0f}%, link re-measured: "
                                f"{view['bandwidth'] / 1e6:.2f} MB/s per node in {seconds:.1f} s", ranked, choice,
                     {"step_s": step_s, "drift": drift, "inter_bandwidth_Bps": view["bandwidth"],
                      "inter_alpha_s": view["alpha"], "remeasure_s": seconds})

    def _switch(self, iteration: int, name: str, reason: str) -> None:
        """Every rank runs ``name`` from this iteration on (the divergence guard's switching path: an agreement
        step, so a switch that fails on one rank is the same error on all, before any mismatched collective)."""
        policy = self.by_name.get(name)
        if policy is None:  # a scripted preset
            policy = preset_for_job(name, zero_mode=self.zero_mode, ranks_per_node=self.hooks.policy.ranks_per_node,
                                    nodes_ranks=self.ranks_per_node)
        if name == self.current:
            return  # nothing changes: the window goes on (no one-off cost to leave out)
        with self.agreement.step("policy switch", local=True):
            self.hooks.switch_policy(policy)
        if reason == "script":
            self.decisions.append({"iteration": iteration, "reason": reason, "choice": name,
                                   "previous": self.current})
            if self.rank == 0:
                self.log(f"[zpp auto] iteration {iteration}: {self.current} -> {name} (script)")
        old = self.by_name.get(self.current)
        self.switches.append({"iteration": iteration, "policy": name, "reason": reason})
        self.current = name
        self._switched_at = iteration
        self._steps = []
        # Time the first iteration of a switch into qWD from another weight scheme (0.0 arms end()): its
        # full-precision gather is the one-off cost a later such switch pays again. Not the warm-up's: that first
        # iteration is the job's and carries its start-up.
        self._first_after_switch = 0.0 if reason != "warm-up" and switches_into_qwd(old, policy) else -1.0

    def _index(self, name: str) -> int:
        return next((i for i, p in enumerate(self.candidates) if p.name == name), -1)

    def _wandb(self, values: dict, iteration: int) -> None:
        if self.wandb_log is not None:  # set on the rank that owns the W&B run; every rank holds the same decisions
            self.wandb_log(values, iteration)

    def _write_cluster(self, fields: dict) -> None:
        from megatron_zpp.training.calibration import write_cluster

        path = self.config.cluster_yaml or (str(Path(self.args.save) / "zpp-auto-cluster.yaml") if self.args.save else
                                            str(Path(tempfile.gettempdir()) / f"zpp-auto-cluster-{os.getpid()}.yaml"))
        try:
            write_cluster(Path(path), fields, None, writer="--zpp-policy auto (megatron_zpp/training/auto_policy.py)")
            self.log(f"[zpp auto] wrote the calibrated cluster to {path} (python -m megatron_zpp.advise --cluster {path})")
        except (OSError, ValueError) as e:
            self.log(f"[zpp auto] could not write the cluster YAML {path}: {e}")

    def summary(self) -> dict:
        return {"decisions": self.decisions, "switches": self.switches, "current": self.current,
                "overhead_s": self.overhead_s,
                "switch_cost_s": self.switch_cost_s,
                "calibration": self.measured_inputs.summary() if self.measured_inputs else None,
                "candidates": [p.name for p in self.candidates]}


def switches_into_qwd(running, target) -> bool:
    """Whether going from ``running`` (None: unknown) to ``target`` starts 4-bit weight differences from another
    weight scheme: the one switch with a one-off cost, a full-precision gather that starts the held copy."""
    return bool(target.param_difference) and (running is None or running.weight_scheme != target.weight_scheme)


def gradient_scheme(policy) -> tuple:
    """What a policy sends for gradients: their codec and its intra-node hop (uncompressed, qgZ's INT4, sdp4bit's
    INT8 then Hadamard INT4)."""
    return policy.codecs["dp.grad"], policy.dp_grad_intra


def runners_up(ranked: list[tuple[str, float]], choice: str, by_name: dict, margin: float) -> list[str]:
    """The candidates predicted within ``margin`` of ``choice``: the best of each other gradient scheme first, then
    the rest, in predicted order. Gradients are most of the bytes, and the misranking measured so far was on their
    path: on Megatron-FSDP at 1 Gbit/s (docs/bench/2026-11-27-auto-both) it ranked its choice (uncompressed hierarchical
    gradients, 4-bit weight differences) and five more candidates with uncompressed gradients ahead of every qgZ
    one; fixed zeropp (qgZ, INT8 weights) ran 3-8% faster than auto."""
    predicted = dict(ranked)
    close = [n for n, s in ranked if n != choice and s < predicted[choice] * (1 + margin)]
    seen, first = {gradient_scheme(by_name[choice])}, []
    for n in close:
        scheme = gradient_scheme(by_name[n])
        if scheme not in seen:
            seen.add(scheme)
            first.append(n)
    return first + [n for n in close if n not in first]


def kept_after_exploring(measured: dict[str, float], tried: list[str], current: str, keep_margin: float, *,
                         switch_cost_s=0.0, iterations_left: float = math.inf) -> str:
    """The policy an exploration keeps: the fastest of ``tried`` measured with its switch's one-off cost spread over
    ``iterations_left`` (``switch_cost_s``: seconds, or a function of the policy name; none for ``current``, the one
    running), the earlier-tried on equal times; ``current`` unless that one's net gain over it is more than
    ``keep_margin`` of its step."""
    timed = [n for n in tried if math.isfinite(measured.get(n, math.nan))]
    if not timed:
        return current

    def net(n: str) -> float:
        if n == current:
            return measured[n]
        cost = switch_cost_s(n) if callable(switch_cost_s) else switch_cost_s
        return measured[n] + (cost / iterations_left if cost else 0.0)

    best = min(timed, key=lambda n: (net(n), tried.index(n)))
    if current in timed and measured[current] - net(best) <= keep_margin * measured[best]:
        return current
    return best


def held_copy_bytes(policy, workload, ranks_per_node: int) -> int:
    """Bytes per rank a Megatron-FSDP policy keeps beside the sharded weights: hpZ's secondary copy of the
    weights (``size / hpz`` shards of every bucket: the dp.param codec's rows for qwZ, the weights' dtype for qWD,
    plus qWD's held shard). 0 elsewhere: on the distributed optimizer qWD holds one shard, noise next to its
    optimizer state. An estimate: the pipeline stages' average share of the parameters (the embedding stage holds
    more) and MoE expert groups counted like the dense one."""
    from megatron_zpp.compression import get_codec

    lay = workload.layout
    if lay.zero_mode != "fsdp" or policy.codec("dp.param") == "none":
        return 0
    # data-parallel members per node, as the hooks' topology counts them (Megatron strides the group by TP)
    node_size = max(1, min(lay.dp, ranks_per_node // max(1, lay.tp)))
    hpz = policy.hpz_partition(node_size)
    if hpz <= 1:
        return 0
    params = _total_params(workload) // (lay.tp * lay.pp)
    if policy.param_difference:
        return params // hpz * lay.param_bytes + params // lay.dp * lay.param_bytes
    return get_codec(policy.codec("dp.param")).wire_bytes(params // hpz)


def fitting(policies: list, current, headroom: float, share: float, copy_bytes) -> tuple[list, list[str]]:
    """(the policies whose held copy, beyond the running policy's, fits in ``share`` of ``headroom`` bytes, the
    names of the others): auto never switches into an out-of-memory error."""
    base = copy_bytes(current) if current is not None else 0
    keep = [p for p in policies if copy_bytes(p) - base <= share * headroom]
    return keep, [p.name for p in policies if p not in keep]


def _runs_here(policy, args) -> bool:
    """Whether this job can run ``policy`` (qWD needs the distributed optimizer's or hpZ's copy of the weights)."""
    from megatron_zpp.megatron import check_weight_differences
    from megatron_zpp.policy import ConfigError

    if not policy.param_difference:
        return True
    try:
        check_weight_differences(args, policy.name, policy.hpz_size)
    except ConfigError:
        return False
    return True


def _total_params(workload) -> int:
    from megatron_zpp.perfmodel import total_params

    return total_params(workload)
