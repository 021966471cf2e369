"""Calibrate a cluster for the performance model: measure it into a cluster YAML for ``load_cluster``.

    sudo python tools/calibrate.py --emulate --nodes 2 --ranks-per-node 2 --rate 100mbit \\
        --out configs/clusters/emulated-2x2.yaml                  # builds the emulated cluster (tools/netemu.py)
    torchrun --nnodes N --nproc-per-node G ... tools/calibrate.py --out cluster.yaml [--rate 100gbit]   # real
    python tools/calibrate.py --add-iteration WORKLOAD.yaml --out configs/clusters/emulated-2x2.yaml   # one more shape

Every measurement runs on all ranks at once, as in training (on the emulated cluster 4 ranks share 2 cores, so a
rank alone would be twice as fast as it ever is in a job). What is measured, and which primitive:

- network: least-squares alpha-beta fits ``T = steps x alpha + bytes / B`` (on relative residuals) over message
  sizes (default 64 KB-8 MB). Intra-node: ``all_to_all_single`` on the intra-node groups, both nodes at once (hop 1
  of the project's 2-hop reduce-scatter; B per rank). Inter-node: one send/recv ring step on all ranks at once over
  the node-major world ring, one flow leaving each node (the step of gloo's/NCCL's ring all-gather and all-reduce
  and of the model's ``ring()``; B = bytes leaving one node per second). The emulated mode fits the inter-node link
  twice: shaped at ``--rate`` (-> ``inter_bandwidth``, ``inter_link_efficiency`` = achieved / nominal; sizes within
  two tbf bursts skipped) and unshaped (-> ``inter_bandwidth_cap``, the host's ceiling, and ``inter_alpha``).
- cross-checks (reported, not fitted): the collectives training calls (gloo/NCCL all_gather_into_tensor,
  reduce_scatter_tensor, all_reduce; the project's uncompressed 2-hop reduce-scatter and qwZ all-gather) at one size,
  measured vs ``megatron_zpp.perfmodel.collectives`` with the fitted numbers.
- compute: one Megatron-Core GPT layer (local spec, fp32 as ``pretrain_gpt.py`` builds it) forward + backward at
  the benchmark shape -> ``measured_layers`` and ``compute_flops`` = its FLOPs / time; ``gamma`` = the same with
  gloo all-reduces running in the background / alone.
- kernels: INT8 (block 256) and INT4 (block 128) quantize / dequantize (``megatron_zpp.compression.ops``), the fp32
  sum of received chunks (``reduce_throughput``), an Adam step on a model-shard-sized fp32 parameter
  (``optimizer_params_per_s``; fixed part + the step's small collectives -> ``optimizer_overhead_s``).

Every loop is bounded in count and in time; the emulated 2x2 calibration takes about two minutes.

``--add-iteration WORKLOAD`` measures one more workload's no-communication iteration on this host (as the emulated
calibration does for ``--workload``: as many processes at once as the cluster has ranks, all on this host) and adds
it to the existing ``--out`` YAML, every other line kept. The model uses a measured iteration only for a workload
of exactly its shape, micro-batch included; elsewhere it scales the layer's FLOPs, which leaves out the framework's
per-micro-batch and per-step overhead (at micro-batch 1 on the emulated cluster it predicted a fifth of the
measured step unshaped: docs/bench/2026-11-28-sdp4bit-tiny-batch). It is for an emulated cluster's YAML (a real one
would get all its ranks on this host). A measured iteration's shape has no dtype: a bf16 and an fp32 measurement
of one shape replace each other, and either is used for both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from megatron_zpp.training.arguments import PROJECT_RECIPE  # noqa: E402
from megatron_zpp.training.calibration import (Calibration, Fit, Probe, add_measured_iteration,  # noqa: E402,F401
                                             cluster_fields, cluster_yaml, fit_alpha_beta, layer_forward_flops,
                                             parse_size, write_cluster)

DEFAULT_SIZES = "64K,256K,1M,4M,8M"
# Benchmark model of tools/bench_training.py (configs/workloads/tiny-gpt-2x2.yaml).
DEFAULT_LAYER = dict(hidden=256, heads=8, seq_length=256, micro_batch=4)
# Small collectives in one training step besides the buckets: Megatron's distributed-optimizer grad-norm
# all-reduce and pretrain_gpt.py's loss all-reduce (megatron_zpp/training/trainer.py _reduce_loss).
DEFAULT_STEP_COLLECTIVES = 2
CROSS_CHECK_SHARD_BYTES = 1 << 20


# ---------------------------------------------------------------------------------------------- pure helpers


def predicted_cross_checks(fields: dict, measured: list[dict]) -> list[dict]:
    """Fill ``predicted_s`` of every measured collective from ``perfmodel.collectives`` with the fitted cluster."""
    from megatron_zpp.perfmodel import collectives as C
    from megatron_zpp.perfmodel.specs import ClusterSpec, from_dict

    base = from_dict(ClusterSpec, {k: v for k, v in fields.items() if v is not None}, "calibration")
    out = []
    for x in measured:
        cluster = base
        if x["rate"] == "unshaped" and base.inter_bandwidth_cap is not None:
            cluster = dataclasses.replace(base, inter_bandwidth=base.inter_bandwidth_cap)
        group = C.make_group(list(range(cluster.world_size)), cluster.ranks_per_node, 1)
        shard = x["shard_bytes"] // 4
        cost = {
            "all_gather_into_tensor": lambda: C.all_gather(cluster, group, shard, "none", 4),
            "reduce_scatter_tensor": lambda: C.torch_reduce_scatter(cluster, group, shard, 4),
            "all_reduce": lambda: C.torch_all_reduce(cluster, group, shard, 4),
            "2-hop reduce-scatter (fair)": lambda: C.hierarchical_reduce_scatter(cluster, group, shard, "none",
                                                                                None, 1, 4),
            "qwZ all-gather int8": lambda: C.all_gather(cluster, group, shard, "int8:block=256", 4),
        }[x["kind"]]()
        out.append({**x, "name": f"{x['kind']} {x['shard_bytes'] >> 20} MB/rank", "predicted_s": cost.total_s})
    return out


def table(c: Calibration, fields: dict) -> str:
    """What was measured, as a printable table."""
    rows = []

    def add(what, value, how):
        rows.append((what, value, how))

    if c.intra:
        add("intra alpha / B", f"{c.intra.alpha * 1e3:.3f} ms, {c.intra.bandwidth / 1e6:.1f} MB/s per rank",
            f"all_to_all intra groups, worst residual {100 * c.intra.max_rel_residual:.1f}%")
    add("inter alpha / B", f"{c.inter.alpha * 1e3:.3f} ms, {c.inter.bandwidth / 1e6:.2f} MB/s per node",
        f"send/recv ring step, worst residual {100 * c.inter.max_rel_residual:.1f}%")
    if c.nominal_rate_bits:
        add("inter link efficiency", f"{fields['inter_link_efficiency']:.3f}",
            f"vs nominal {c.nominal_rate_bits / 8e6:.2f} MB/s" + (
                f"; one TCP stream {c.stream_bits_per_s / c.nominal_rate_bits:.3f}" if c.stream_bits_per_s else ""))
    if c.inter_unshaped:
        add("inter unshaped (cap)", f"{c.inter_unshaped.alpha * 1e3:.3f} ms, {c.inter_unshaped.bandwidth / 1e6:.1f} "
            "MB/s per node", f"worst residual {100 * c.inter_unshaped.max_rel_residual:.1f}%")
    L = c.layer
    add("layer fwd+bwd", f"{L['fwd_bwd_s'] * 1e3:.1f} ms", f"h{L['hidden']} s{L['seq_length']} b{L['micro_batch']}, "
        f"{L['impl']}, spread {100 * L['spread']:.1f}%")
    add("compute_flops", f"{fields['compute_flops'] / 1e9:.2f} GFLOP/s per rank", "3 x layer forward FLOPs / time")
    add("gamma", f"{c.gamma:.3f}", "with background all-reduces" + ("" if c.gamma_covered else " (ended early)"))
    for name, t in c.codecs.items():
        add(f"{name} quantize / dequantize", f"{t['quantize'] / 1e9:.2f} / {t['dequantize'] / 1e9:.2f} GB/s",
            "fp32 bytes per second")
    add("reduce_throughput", f"{c.reduce_throughput / 1e9:.2f} GB/s", "fp32 sum of 2 received chunks")
    add("optimizer", f"{c.optimizer_params_per_s / 1e6:.1f} M params/s, fixed {c.optimizer_fixed_s * 1e3:.2f} ms",
        "Adam on fp32, 2 sizes")
    add("small all_reduce", f"{c.small_collective_s * 1e3:.2f} ms", f"x {c.step_collectives} per step -> "
        f"optimizer_overhead_s {fields['optimizer_overhead_s'] * 1e3:.2f} ms")
    for x in c.cross_checks:
        add(f"check {x['kind']}", f"{x['measured_s'] * 1e3:.1f} ms ({x['rate']})",
            f"model {x['predicted_s'] * 1e3:.1f} ms = {x['predicted_s'] / x['measured_s']:.2f}x")
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return "\n".join(f"{a:<{w0}}  {b:<{w1}}  {h}" for a, b, h in rows)


# ---------------------------------------------------------------------------------------------- worker


class Worker(Probe):
    """The measurements of one rank (all ranks run the same calls in the same order): the shared ones of
    :class:`~megatron_zpp.training.calibration.Probe`, and the layer compute, gamma and cross-checks."""

    def __init__(self, a) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.a = torch, dist, a
        cuda = torch.cuda.is_available() and a.backend != "gloo"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if not dist.is_initialized():
            dist.init_process_group(a.backend or ("nccl" if cuda else "gloo"))
        self.backend = dist.get_backend()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        g = a.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        if g < 1 or self.world % g:
            raise ValueError(f"ranks per node={g} must divide the world size {self.world} (set --ranks-per-node or "
                             "launch with torchrun, which sets LOCAL_WORLD_SIZE)")
        self.g, self.nodes = g, self.world // g
        if self.nodes < 2:
            raise ValueError(f"{self.world} ranks with {g} per node is one node: there is no inter-node link to "
                             "calibrate")
        # Every rank creates every group, in the same order (new_group is collective).
        intra = None
        for n in range(self.nodes):
            grp = dist.new_group(list(range(n * g, (n + 1) * g))) if g > 1 else None
            if self.rank // g == n:
                intra = grp
        super().__init__(self.device, g, intra)

    def cross_checks(self, rate: str) -> list[dict]:
        """Training's collectives at one size on all ranks (see predicted_cross_checks)."""
        torch, dist = self.torch, self.dist
        from megatron_zpp.comm import Topology, qgz_reduce_scatter, quantized_all_gather

        topo = Topology(None, ranks_per_node=self.g)
        shard = CROSS_CHECK_SHARD_BYTES // 4
        full = torch.randn(self.world * shard, device=self.device)
        part = torch.randn(shard, device=self.device)
        calls = {
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, part),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part, full),
            "all_reduce": lambda: dist.all_reduce(full),
            "2-hop reduce-scatter (fair)": lambda: qgz_reduce_scatter(part, full, topo, codec="none", op="sum"),
            "qwZ all-gather int8": lambda: quantized_all_gather(full, part, topo, codec="int8:block=256"),
        }
        out = []
        for kind, fn in calls.items():
            if kind == "qwZ all-gather int8" and self.device.type == "cpu":
                from megatron_zpp.compression import ops
                if not ops.kernels_available(self.device):
                    continue
            t = self.timed(fn, budget_s=1.0, max_reps=5, min_reps=2)
            out.append({"kind": kind, "rate": rate, "shard_bytes": shard * 4, "measured_s": t})
        return out

    # ------------------------------------------------------------------ compute
    def build_layer(self):
        """``--layers`` GPT layers as pretrain_gpt.py builds them (Megatron-Core local spec, fp32), run as in the
        model: forward through all, then backward through all, so activations leave the caches between a layer's
        forward and its backward as in training; a plain torch layer of the same shape where Megatron-Core is
        missing. Returns (callable fwd+bwd of one layer on average, description)."""
        torch, a = self.torch, self.a
        h, heads, s, b = a.hidden, a.heads, a.seq_length, a.micro_batch
        x = torch.randn(s, b, h, device=self.device, requires_grad=True)
        dy = torch.randn(s, b, h, device=self.device)
        try:
            from megatron.core import parallel_state, tensor_parallel
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
            from megatron.core.transformer import TransformerConfig
            from megatron.core.transformer.spec_utils import build_module
        except ImportError:
            return self._torch_layer(x, dy), "plain torch layer (Megatron-Core not installed)"
        import warnings

        warnings.filterwarnings("ignore")
        if self.device.type == "cpu":
            from megatron_zpp.megatron.cpu_shim import install_cpu_shim

            install_cpu_shim()
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        config = TransformerConfig(
            num_layers=1, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=4 * h, hidden_dropout=0.0,
            attention_dropout=0.0, params_dtype=torch.float32, use_cpu_initialization=self.device.type == "cpu",
            gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
        layers = [build_module(get_gpt_layer_local_spec(), config=config, layer_number=i + 1).to(self.device)
                  for i in range(a.layers)]

        def stack():
            y = x
            for layer in layers:
                y = layer(hidden_states=y, attention_mask=None)
                y = y[0] if isinstance(y, tuple) else y
            torch.autograd.backward(y, dy)
        return stack, f"Megatron-Core local-spec layer, mean of a {a.layers}-layer stack"

    def _torch_layer(self, x, dy):
        torch = self.torch
        a = self.a
        h, heads = a.hidden, a.heads
        nn = torch.nn
        ln1, ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        qkv, proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        fc1, fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        for m in (ln1, ln2, qkv, proj, fc1, fc2):
            m.to(self.device)

        def step():
            s, b, _ = x.shape
            q, k, v = qkv(ln1(x)).view(s, b, 3, heads, h // heads).permute(2, 1, 3, 0, 4)
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = x + proj(att.permute(2, 0, 1, 3).reshape(s, b, h))
            y = y + fc2(torch.nn.functional.gelu(fc1(ln2(y))))
            torch.autograd.backward(y, dy)
        def stack():
            for _ in range(a.layers):  # the same layer: a plain torch stand-in, timed per layer like the stack
                step()
        return stack

    def _layer_block(self, step, background: bool) -> tuple[float, list[float], bool]:
        """``layer_reps`` timed passes on every rank at once, optionally while all-reduces of 4 MB per rank run in
        the collective backend's background threads. Returns (mean over ranks of the per-rank medians, the per-rank
        medians, whether the background outlasted the passes on every rank)."""
        torch, dist = self.torch, self.dist
        works = []
        step()  # warm: allocator, first-call paths
        self.sync()
        dist.barrier()
        if background:
            # Enough back-to-back all-reduces to outlast the timed passes (1.5x their expected time), at most 50.
            stack_s = self.a.layers * self._layer_s
            count = int(min(50, max(1, math.ceil(1.5 * self.a.layer_reps * stack_s / self._allreduce_s))))
            works = [dist.all_reduce(self._bg[i % len(self._bg)], async_op=True) for i in range(count)]
        times = []
        for _ in range(self.a.layer_reps):
            t0 = time.perf_counter()
            step()
            self.sync()
            times.append(time.perf_counter() - t0)
        covered = bool(works) and not works[-1].is_completed()
        for w in works:
            w.wait()
        per_rank = [t / self.a.layers for t in self.gather_values(statistics.median(times))]
        covered = self.agree_max(0.0 if covered else 1.0) == 0.0
        return statistics.fmean(per_rank), per_rank, covered

    def compute(self, step) -> dict:
        """Layer time alone, with background communication, alone again: gamma = with / mean(alone), interleaved so
        that a drift in the machine's load (other jobs on shared cores) affects both sides alike."""
        torch, dist = self.torch, self.dist
        self._bg = [torch.randn(1 << 20, device=self.device) for _ in range(4)]
        self._allreduce_s = self.timed(lambda: dist.all_reduce(self._bg[0]), budget_s=0.5, max_reps=5, min_reps=1)
        alone1, ranks1, _ = self._layer_block(step, False)
        self._layer_s = alone1
        with_bg, _, covered = self._layer_block(step, True)
        alone2, ranks2, _ = self._layer_block(step, False)
        alone = (alone1 + alone2) / 2
        per_rank = [(x + y) / 2 for x, y in zip(ranks1, ranks2)]
        return {"fwd_bwd_s": alone, "spread": (max(per_rank) - min(per_rank)) / alone,
                "alone_blocks_s": [alone1, alone2], "with_background_s": with_bg, "gamma": with_bg / alone,
                "gamma_covered": covered}

    # ------------------------------------------------------------------ run
    def run(self, phase: str) -> dict:
        a, log = self.a, (print if self.rank == 0 else (lambda *x, **k: None))
        sizes = [parse_size(s) for s in a.sizes.split(",")]
        out: dict = {"nodes": self.nodes, "ranks_per_node": self.g, "backend": self.backend}
        t0 = time.monotonic()
        log(f"calibrate: {self.nodes} nodes x {self.g} ranks, {self.backend}, phase {phase}", flush=True)
        out["small_collective_s"] = self.small_collective()
        out["inter"] = dataclasses.asdict(self.ring_fit(sizes, a.budget, a.min_fit_bytes))
        log(f"calibrate: inter fit done ({time.monotonic() - t0:.0f} s)", flush=True)
        intra = self.a2a_fit(self.intra, self.g - 1, 1, sizes, a.budget) if self.g > 1 else None
        out["intra"] = dataclasses.asdict(intra) if intra else None
        out["cross_checks"] = self.cross_checks(a.rate_label)
        log(f"calibrate: network done ({time.monotonic() - t0:.0f} s)", flush=True)
        if phase == "net":
            return out
        step, impl = self.build_layer()
        measured = self.compute(step)
        out["gamma"], out["gamma_covered"] = measured.pop("gamma"), measured.pop("gamma_covered")
        out["layer"] = {**measured, "impl": impl, "hidden": a.hidden, "heads": a.heads,
                        "seq_length": a.seq_length, "micro_batch": a.micro_batch}
        log(f"calibrate: compute done ({time.monotonic() - t0:.0f} s)", flush=True)
        out["codecs"] = self.codecs()
        out["reduce_throughput"] = self.reduce_throughput()
        out["optimizer_params_per_s"], out["optimizer_fixed_s"] = self.optimizer(a.optimizer_params)
        log(f"calibrate: kernels done ({time.monotonic() - t0:.0f} s)", flush=True)
        return out


def _fit(d: dict | None) -> Fit | None:
    if d is None:
        return None
    return Fit(**{**d, "points": [tuple(p) for p in d["points"]]})


def assemble(full: dict, unshaped: dict | None, nominal_rate_bits: float | None, step_collectives: int,
             stream_bits_per_s: float | None = None) -> Calibration:
    """A ``Calibration`` from the worker's JSON (and the unshaped run's, on an emulated cluster)."""
    return Calibration(
        nodes=full["nodes"], ranks_per_node=full["ranks_per_node"], backend=full["backend"],
        intra=_fit(full["intra"]), inter=_fit(full["inter"]), inter_unshaped=_fit(unshaped["inter"]) if unshaped else None,
        nominal_rate_bits=nominal_rate_bits, layer=full["layer"], gamma=full["gamma"],
        gamma_covered=full["gamma_covered"], codecs=full["codecs"], reduce_throughput=full["reduce_throughput"],
        optimizer_params_per_s=full["optimizer_params_per_s"], optimizer_fixed_s=full["optimizer_fixed_s"],
        small_collective_s=full["small_collective_s"], step_collectives=step_collectives,
        cross_checks=full["cross_checks"] + (unshaped["cross_checks"] if unshaped else []),
        stream_bits_per_s=stream_bits_per_s)


def finish(c: Calibration, a, command: str) -> int:
    """Fields, cross-check predictions, YAML, table."""
    source = (f"tools/calibrate.py {time.strftime('%Y-%m-%d')} on {machine()}, load average "
              f"{os.getloadavg()[0]:.1f} at the end: {command}")
    fields = cluster_fields(c, a.name, source)
    c.cross_checks = predicted_cross_checks(fields, c.cross_checks)
    cluster = write_cluster(Path(a.out), fields, c)
    print(table(c, fields))
    print(f"calibrate: wrote {a.out} (cluster {cluster.name!r}, loads with megatron_zpp.perfmodel.load_cluster)")
    return 0


def machine() -> str:
    return f"{os.cpu_count()}-cpu {platform.machine()} {platform.node()}"


# ---------------------------------------------------------------------------------------------- driver


def worker_argv(a, phase: str, json_out: Path, rate_label: str) -> list[str]:
    argv = [str(Path(__file__).resolve()), "--worker-json", str(json_out), "--phase", phase, "--rate-label", rate_label,
            "--sizes", a.sizes, "--budget", str(a.budget), "--hidden", str(a.hidden), "--heads", str(a.heads),
            "--seq-length", str(a.seq_length), "--micro-batch", str(a.micro_batch), "--layer-reps",
            str(a.layer_reps), "--layers", str(a.layers), "--optimizer-params", str(a.optimizer_params),
            "--ranks-per-node", str(a.ranks_per_node), "--min-fit-bytes", str(a.min_fit_bytes)]
    return argv + (["--backend", a.backend] if a.backend else [])


def measure_iteration(a, processes: int) -> dict:
    """Agarwal et al.'s T_comp: ``pretrain_gpt.py`` on the workload's model with data-parallel size 1 (no
    communication at all), one rank's share of the batch, in ``processes`` concurrent processes (as many as
    the cluster's ranks share this host, so each gets the CPU share it gets in training; one thread each,
    as torchrun gives training ranks). The iteration minus its optimizer step (the fitted Adam rate on the
    full model), per micro-batch, of the slowest process (synchronous training waits for it)."""
    import subprocess

    from netemu import free_port

    from megatron_zpp.perfmodel import load_workload, total_params

    w = load_workload(Path(a.workload))
    m, lay = w.model, w.layout
    if lay.tp != 1 or lay.pp != 1:
        raise ValueError(f"--workload {a.workload}: the iteration measurement needs tp = pp = 1, got "
                         f"tp={lay.tp}, pp={lay.pp}")
    micro = lay.global_batch // (lay.micro_batch * lay.dp)
    work = Path(tempfile.mkdtemp(prefix="calibrate-iteration"))
    argv = PROJECT_RECIPE + ["--num-layers", m.layers, "--hidden-size", m.hidden, "--num-attention-heads", m.heads,
            "--seq-length", m.seq_length, "--micro-batch-size", lay.micro_batch,
            "--global-batch-size", lay.micro_batch * micro, "--train-iters", a.iteration_iters,
            "--eval-iters", 0, "--log-interval", 1000] + (["--bf16"] if lay.param_bytes == 2 else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("ZPP_NIC", None)
    procs = []
    for i in range(processes):
        cmd = [a.python, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
               str(REPO / "pretrain_gpt.py")] + [str(x) for x in argv] + ["--summary-json", str(work / f"{i}.json")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env))
    try:
        for proc in procs:
            proc.wait(timeout=a.timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    steps = []
    for i, proc in enumerate(procs):
        f = work / f"{i}.json"
        if proc.returncode or not f.exists():
            raise RuntimeError(f"calibrate: the no-communication iteration run {i} failed ({proc.returncode})")
        steps.append(json.loads(f.read_text())["seconds_per_iteration"])
    step = max(steps)
    optimizer_s = total_params(w) / a.optimizer_rate_for_iteration + a.optimizer_fixed_for_iteration
    return {"layers": m.layers, "hidden": m.hidden, "seq_length": m.seq_length, "micro_batch": lay.micro_batch,
            "vocab": m.vocab, "fwd_bwd_s": max(step - optimizer_s, 0.5 * step) / micro, "step_s": step,
            "per_process_s": steps}


def emulate(a, command: str) -> int:
    from netemu import EmulatedCluster, NetemuConfig, free_port, measure_stream, parse_rate

    nominal = parse_rate(a.rate) if a.rate else None
    work = Path(tempfile.mkdtemp(prefix="calibrate"))
    config = NetemuConfig(nodes=a.nodes, ranks_per_node=a.ranks_per_node, rate=a.rate)
    with EmulatedCluster(config) as cluster:
        stream = None
        if nominal:
            # One TCP stream, sized to last ~1 s at the nominal rate (bounded 4-64 MiB).
            mib = int(min(64, max(4, nominal / 8 / (1 << 20))))
            stream = measure_stream(cluster, mib << 20)["bits_per_s"]
            print(f"calibrate: one TCP stream node 0 -> 1: {stream / 1e6:.1f} Mbit/s "
                  f"({stream / nominal:.3f} of {a.rate})", flush=True)
        runs = [("full", a.rate or "unshaped")] + ([("net", "unshaped")] if nominal else [])
        results = {}
        for phase, rate in runs:
            cluster.set_rate(None if rate == "unshaped" else rate)
            out = work / f"{phase}.json"
            argv = worker_argv(a, phase, out, rate)
            if rate != "unshaped" and not a.min_fit_bytes:
                # tbf passes a burst per node at line rate: fit only sizes well beyond two of them.
                argv[argv.index("--min-fit-bytes") + 1] = str(2 * cluster._burst_bytes(rate))
            r = cluster.run_torchrun(argv, timeout=a.timeout, master_port=free_port(),
                                     python=a.python, echo=True, log_path=work / f"log-{phase}.txt")
            if r.failure or not out.exists():
                print(f"calibrate: the {phase} run at {rate} failed ({r.failure}); logs in {work}", file=sys.stderr)
                print("".join(o[-3000:] for o in r.outputs), file=sys.stderr)
                return 1
            results[phase] = json.loads(out.read_text())
    c = assemble(results["full"], results.get("net"), nominal, a.step_collectives, stream)
    if a.workload:
        # After the network phases, with the namespaces gone: it needs no network, only this host's CPUs.
        a.optimizer_rate_for_iteration, a.optimizer_fixed_for_iteration = c.optimizer_params_per_s, max(
            c.optimizer_fixed_s, 0.0)
        c.iteration = measure_iteration(a, a.nodes * a.ranks_per_node)
        print(f"calibrate: no-communication iteration: {c.iteration['step_s'] * 1e3:.0f} ms (slowest of "
              f"{len(c.iteration['per_process_s'])}), {c.iteration['fwd_bwd_s'] * 1e3:.0f} ms per micro-batch",
              flush=True)
    return finish(c, a, command)


def add_iteration(a, command: str) -> int:
    """--add-iteration: the workload's no-communication iteration, measured with the YAML's optimizer rate
    subtracted, added to the existing cluster YAML ``--out``."""
    from megatron_zpp.perfmodel import load_cluster

    cluster = load_cluster(Path(a.out))
    if "--emulate" not in cluster.source:
        # Every rank of the cluster runs on this host at once, as the emulated cluster's do; a real cluster's
        # YAML (calibrated under torchrun) would get all its ranks on one host.
        raise ValueError(f"--add-iteration measures on this host with as many processes as the cluster has ranks: "
                         f"it is for an emulated cluster's YAML (written by tools/calibrate.py --emulate); "
                         f"{a.out} says: {cluster.source!r}")
    a.workload = a.add_iteration
    # The Adam time the measurement subtracts: the YAML's fitted rate. Its fixed part, which the full calibration
    # subtracts too (clamped at 0; 0.00 ms on the emulated cluster), is not in the YAML, which keeps only its sum
    # with the step's small collectives (optimizer_overhead_s); a run with data-parallel size 1 has none of those.
    a.optimizer_rate_for_iteration = cluster.optimizer_params_per_s
    a.optimizer_fixed_for_iteration = 0.0
    it = measure_iteration(a, cluster.nodes * cluster.ranks_per_node)
    # Printed before the YAML is touched: a failed write loses no measurement.
    print(f"calibrate: no-communication iteration at micro-batch {it['micro_batch']}: {it['step_s'] * 1e3:.0f} ms "
          f"(slowest of {len(it['per_process_s'])}; all: {', '.join(f'{t * 1e3:.0f}' for t in it['per_process_s'])} "
          f"ms), {it['fwd_bwd_s'] * 1e3:.0f} ms per micro-batch; load average {os.getloadavg()[0]:.1f}", flush=True)
    note = (f"added {time.strftime('%Y-%m-%d')} on {machine()}, load average {os.getloadavg()[0]:.1f}: {command}")
    add_measured_iteration(Path(a.out), it, it, note)
    print(f"calibrate: added to {a.out}", flush=True)
    return 0


def worker_main(a, command: str) -> int:
    import torch.distributed as dist

    w = Worker(a)
    result = w.run(a.phase)
    if w.rank == 0:
        if a.worker_json:
            Path(a.worker_json).write_text(json.dumps(result))
        else:  # launched by the user's torchrun on a real cluster: write the YAML here
            from netemu import parse_rate

            nominal = parse_rate(a.rate) if a.rate else None
            finish(assemble(result, None, nominal, a.step_collectives), a, command)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", help="cluster YAML to write")
    p.add_argument("--name", default=None, help="cluster name (default: the output file's stem)")
    p.add_argument("--emulate", action="store_true", help="build the emulated cluster (tools/netemu.py; needs root) "
                                                           "and run this script on it with torchrun")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node (emulated: default 2; under torchrun: LOCAL_WORLD_SIZE)")
    p.add_argument("--rate", default=None, help="inter-node link rate in tc units (100mbit, 1gbit): emulated, the "
                                               "shaping; real, the nominal rate for inter_link_efficiency")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="bytes per peer of the alpha-beta fits (%(default)s)")
    p.add_argument("--budget", type=float, default=1.5,
                   help="seconds of repetitions per fitted size, at most 20 and at least 2 calls (%(default)s)")
    p.add_argument("--hidden", type=int, default=DEFAULT_LAYER["hidden"])
    p.add_argument("--heads", type=int, default=DEFAULT_LAYER["heads"])
    p.add_argument("--seq-length", type=int, default=DEFAULT_LAYER["seq_length"])
    p.add_argument("--micro-batch", type=int, default=DEFAULT_LAYER["micro_batch"])
    p.add_argument("--layers", type=int, default=4, help="layers of the timed stack (the benchmark model's 4)")
    p.add_argument("--layer-reps", type=int, default=5, help="timed forward+backward passes of the stack")
    p.add_argument("--min-fit-bytes", type=int, default=0,
                   help="skip fit sizes whose bytes per link are at most this (emulated: 2 tbf bursts when shaped)")
    p.add_argument("--optimizer-params", type=int, default=830_848,
                   help="fp32 parameters of the Adam measurement (default: the benchmark model's shard, 3,323,392 / 4)")
    p.add_argument("--step-collectives", type=int, default=DEFAULT_STEP_COLLECTIVES,
                   help="small all-reduces per training step charged to optimizer_overhead_s (%(default)s)")
    p.add_argument("--workload", default=str(REPO / "configs" / "workloads" / "tiny-gpt-2x2.yaml"),
                   help="emulated: also time this workload's training iteration without communication "
                        "(measured_iterations; '' skips it) (%(default)s)")
    p.add_argument("--add-iteration", metavar="WORKLOAD", default=None,
                   help="only measure WORKLOAD's no-communication iteration on this host and add it to the existing "
                        "cluster YAML --out (no network measurement, no root)")
    p.add_argument("--iteration-iters", type=int, default=6,
                   help="iterations of each no-communication run (the first is not timed) (%(default)s)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with GPUs, else gloo")
    p.add_argument("--timeout", type=float, default=300, help="seconds per emulated launch")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--phase", default="full", choices=("full", "net"), help=argparse.SUPPRESS)
    p.add_argument("--rate-label", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    command = "python tools/calibrate.py " + " ".join(shlex.quote(x) for x in argv)
    for name in ("nodes", "layers", "layer_reps", "optimizer_params", "hidden", "heads", "seq_length", "micro_batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be a positive integer")
    if a.step_collectives < 0:
        p.error(f"--step-collectives={a.step_collectives} must be >= 0")
    if not 0 < a.budget <= 10:
        p.error(f"--budget={a.budget} must be in (0, 10] seconds")
    try:
        sizes = [parse_size(s) for s in a.sizes.split(",")]
        if len(set(sizes)) < 2:
            raise ValueError(f"--sizes={a.sizes!r} needs at least two distinct sizes for a fit")
        if a.rate:
            from netemu import parse_rate
            parse_rate(a.rate)
    except ValueError as e:
        p.error(str(e))
    if a.worker_json is None and not a.out:
        p.error("--out is required")
    if a.add_iteration:
        if not Path(a.out).is_file():
            p.error(f"--add-iteration adds to an existing cluster YAML: --out {a.out!r} is not a file")
        import yaml

        try:
            return add_iteration(a, command)
        except (ValueError, FileNotFoundError, yaml.YAMLError) as e:  # YAMLError: a hand-edited file it cannot read
            p.error(f"--out {a.out}: {e}")
    a.name = a.name or (Path(a.out).stem if a.out else "cluster")
    a.rate_label = a.rate_label or a.rate or "unshaped"
    if a.emulate:
        a.ranks_per_node = a.ranks_per_node or 2
        if a.nodes < 2:
            p.error(f"--nodes={a.nodes}: an emulated calibration needs at least 2 nodes (an inter-node link)")
        return emulate(a, "sudo " + command)
    return worker_main(a, "torchrun ... tools/calibrate.py " + " ".join(shlex.quote(x) for x in argv))


if __name__ == "__main__":
    sys.exit(main())
