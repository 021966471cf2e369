"""Measure a cluster for the performance model: the one code path of ``tools/calibrate.py`` and of the startup
calibration of ``--zpp-policy auto`` (``auto_policy.py``).

:class:`Probe` times collectives and kernels on all ranks at once, as in training (the same calls in the same
order on every rank; repetition counts are agreed, so the collectives match): alpha-beta fits of the intra-node
``all_to_all_single`` and of one node-major ring step (one flow leaving each node: the model's per-node
``inter_bandwidth``), codec kernels, the fp32 reduction and an Adam step. :func:`fit_alpha_beta` fits the
network points; :func:`cluster_fields` / :func:`write_cluster` turn a :class:`Calibration` into the cluster YAML
that ``megatron_zpp.perfmodel.load_cluster`` and the advisor read. ``tools/calibrate.py`` adds what only it
measures (a Megatron layer's compute and gamma, cross-checks against the model, the emulated link unshaped).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist


def parse_size(text: str) -> int:
    """``64K`` / ``8M`` / ``1G`` / ``4096`` -> bytes (binary multiples)."""
    s = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    digits = s[:-1] if s[-1:] in "KMG" else s
    if not digits.isdigit() or int(digits) <= 0:
        raise ValueError(f"size {text!r} is not valid; give a positive integer of bytes with an optional K, M or G "
                         "suffix (e.g. 64K, 8M)")
    return int(digits) * mult


@dataclass
class Fit:
    """A least-squares alpha-beta fit ``seconds = steps x alpha + bytes / bandwidth``."""

    alpha: float
    """Seconds per step (the intercept / steps), clamped at 0 (a negative intercept is noise)."""
    bandwidth: float
    """Bytes per second (1 / slope)."""
    intercept: float
    """The raw intercept in seconds, before clamping and dividing by steps."""
    max_rel_residual: float
    """Largest |measured - fitted| / measured over the points: how well a line describes them."""
    points: list[tuple[float, float]] = field(default_factory=list)
    """(bytes, seconds) the fit used."""


def fit_alpha_beta(nbytes: list[float], seconds: list[float], steps: int = 1) -> Fit:
    """Least squares of ``seconds`` on ``nbytes`` (a latency and a bandwidth), on *relative* residuals.

    Sizes span two orders of magnitude, so plain least squares would let the largest messages decide the latency
    too; weighting each point by 1 / seconds^2 minimizes relative errors instead: small messages pin alpha, large
    ones the bandwidth. ``steps``: latency-bearing steps per measured operation (all-to-all peers, ring steps), so
    ``alpha`` is per step. Raises ``ValueError`` for fewer than two distinct sizes, mismatched lists, a non-positive
    time, or a time that does not grow with size (no bandwidth: the measurement is broken)."""
    if len(nbytes) != len(seconds):
        raise ValueError(f"fit_alpha_beta: {len(nbytes)} sizes but {len(seconds)} times")
    if len(set(nbytes)) < 2:
        raise ValueError(f"fit_alpha_beta: needs at least two distinct sizes, got {sorted(set(nbytes))}")
    if steps < 1:
        raise ValueError(f"fit_alpha_beta: steps={steps} must be >= 1")
    if min(seconds) <= 0:
        raise ValueError(f"fit_alpha_beta: times must be positive, got {seconds}")
    w = [1.0 / (y * y) for y in seconds]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, nbytes)) / sw
    my = sum(wi * y for wi, y in zip(w, seconds)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, nbytes))
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, nbytes, seconds)) / sxx
    intercept = my - slope * mx
    if not slope > 0:
        raise ValueError(f"fit_alpha_beta: time does not grow with size (slope {slope:.3g} s/byte over sizes "
                         f"{[int(x) for x in nbytes]}, times {[f'{y:.3g}' for y in seconds]}); use larger sizes")
    residual = max(abs(y - (intercept + slope * x)) / y for x, y in zip(nbytes, seconds))
    return Fit(alpha=max(intercept, 0.0) / steps, bandwidth=1.0 / slope, intercept=intercept,
               max_rel_residual=residual, points=list(zip(nbytes, seconds)))


def layer_forward_flops(hidden: int, seq_length: int, micro_batch: int) -> float:
    """Forward FLOPs of one GPT layer for one micro-batch, the performance model's count (Narayanan et al.)."""
    from megatron_zpp.perfmodel import LayoutSpec, ModelSpec, WorkloadSpec
    from megatron_zpp.perfmodel.model import forward_flops

    w = WorkloadSpec(name="layer", model=ModelSpec(layers=1, hidden=hidden, heads=1, seq_length=seq_length, vocab=1),
                     layout=LayoutSpec(micro_batch=micro_batch, global_batch=micro_batch, dp=1))
    return forward_flops(w)[0]


@dataclass
class Calibration:
    """Everything the calibration measured (inputs of ``cluster_fields``), in the model's units."""

    nodes: int
    ranks_per_node: int
    backend: str
    intra: Fit | None
    """all_to_all_single on the intra-node groups (per rank); None with one rank per node."""
    inter: Fit
    """A send/recv ring step on the node-major world ring (one flow per node), at the link's rate (shaped, or
    real)."""
    inter_unshaped: Fit | None
    """The same with the emulated link unshaped (the host's ceiling); None on a real cluster."""
    nominal_rate_bits: float | None
    """The link's nominal rate (bits/s per node and direction) the inter fit ran at; None if unknown."""
    layer: dict
    """``hidden``, ``heads``, ``seq_length``, ``micro_batch``, ``fwd_bwd_s`` (mean over ranks), ``spread``, ``impl``."""
    gamma: float
    """Layer time with background all-reduces / alone, as measured (may be < 1 from noise)."""
    gamma_covered: bool
    """Whether the background collectives were still running when the timed layers ended."""
    codecs: dict[str, dict[str, float]]
    """codec name -> {quantize, dequantize} bytes of fp32 per second."""
    reduce_throughput: float
    optimizer_params_per_s: float
    optimizer_fixed_s: float
    """Intercept of the Adam fit (seconds per step at zero parameters)."""
    small_collective_s: float
    """A 4-byte all_reduce over all ranks (gloo's per-call software latency)."""
    step_collectives: int
    """Small collectives per training step charged to optimizer_overhead_s."""
    cross_checks: list[dict] = field(default_factory=list)
    """{name, rate, measured_s, predicted_s}: training's collectives vs the model with these numbers."""
    stream_bits_per_s: float | None = None
    iteration: dict | None = None
    """A no-communication training iteration (``measure_iteration``): ``MeasuredIteration`` fields plus
    ``step_s`` (slowest process) and ``per_process_s``; None if not measured."""
    """One TCP stream between two emulated nodes (``netemu.measure_stream``), a check of the shaping."""


def cluster_fields(c: Calibration, name: str, source: str) -> dict:
    """The ``ClusterSpec`` fields (a dict ``from_dict`` accepts) for a calibration."""
    intra = c.intra or c.inter  # one rank per node: no intra-node link; the model then never uses these
    efficiency = 1.0
    if c.nominal_rate_bits:
        efficiency = c.inter.bandwidth / (c.nominal_rate_bits / 8)
    fwd_flops = layer_forward_flops(c.layer["hidden"], c.layer["seq_length"], c.layer["micro_batch"])
    return {
        "name": name, "source": source, "nodes": c.nodes, "ranks_per_node": c.ranks_per_node, "backend": c.backend,
        "intra_alpha": intra.alpha, "intra_bandwidth": intra.bandwidth,
        # The latency from the unshaped fit where there is one: tbf lets each message's first burst (256 KiB) pass at
        # line rate, which bends the shaped fit's small sizes down and its intercept towards zero or below.
        "inter_alpha": (c.inter_unshaped or c.inter).alpha, "inter_bandwidth": c.inter.bandwidth,
        "inter_link_efficiency": efficiency,
        "inter_bandwidth_cap": c.inter_unshaped.bandwidth if c.inter_unshaped else None,
        "compute_flops": 3 * fwd_flops / c.layer["fwd_bwd_s"],
        "measured_layers": [{"hidden": c.layer["hidden"], "seq_length": c.layer["seq_length"],
                             "micro_batch": c.layer["micro_batch"], "tp": 1, "fwd_bwd_s": c.layer["fwd_bwd_s"]}],
        "measured_iterations": ([{k: c.iteration[k] for k in ("layers", "hidden", "seq_length", "micro_batch",
                                                               "vocab", "fwd_bwd_s")}] if c.iteration else []),
        "gamma": max(1.0, c.gamma),  # the model's gamma is a slowdown; a measured speed-up is noise
        "codec_throughput": {k: dict(v) for k, v in c.codecs.items()},
        "reduce_throughput": c.reduce_throughput,
        "optimizer_params_per_s": c.optimizer_params_per_s,
        "optimizer_overhead_s": max(c.optimizer_fixed_s, 0.0) + c.step_collectives * c.small_collective_s,
    }


def _num(v: float) -> str:
    # Always a dot and a signed exponent: YAML 1.1 then reads a float, not a string.
    return f"{v:.4e}"


def cluster_yaml(fields: dict, c: Calibration | None = None, writer: str = "tools/calibrate.py") -> str:
    """The cluster YAML text, commented with what each number is and how it was measured."""
    def fit_note(f: Fit | None) -> str:
        return (f"fit intercept {f.intercept * 1e3:.3f} ms, worst point off the line by {100 * f.max_rel_residual:.1f}%"
                if f else "")

    lines = [f"# Written by {writer}; rerun it rather than editing by hand. Units: seconds, bytes, bytes/s,",
             "# FLOP/s. inter_bandwidth is per NODE (bytes leaving a node), intra_bandwidth per rank.",
             f"name: {fields['name']}",
             f"source: {json.dumps(fields['source'])}",
             f"nodes: {fields['nodes']}",
             f"ranks_per_node: {fields['ranks_per_node']}",
             f"backend: {fields['backend']}",
             f"intra_alpha: {_num(fields['intra_alpha'])}        # all_to_all_single, intra-node groups, per peer step"
             + (f"; {fit_note(c.intra)}" if c and c.intra else ""),
             f"intra_bandwidth: {_num(fields['intra_bandwidth'])}    # bytes/s per rank (both nodes at once)",
             f"inter_alpha: {_num(fields['inter_alpha'])}        # send/recv ring step, node-major world ring, per step"
             + ("; from the unshaped fit (tbf's burst biases the shaped intercept)" if c and c.inter_unshaped else ""),
             f"inter_bandwidth: {_num(fields['inter_bandwidth'])}    # bytes/s leaving one node (one ring flow)"
             + (f"; link nominal {c.nominal_rate_bits / 1e6:g} Mbit/s; {fit_note(c.inter)}, alpha "
                f"{c.inter.alpha * 1e3:.3f} ms" if c and c.nominal_rate_bits else ""),
             f"inter_link_efficiency: {fields['inter_link_efficiency']:.4f}  # inter_bandwidth / nominal rate"
             + (f"; one TCP stream reached {c.stream_bits_per_s / c.nominal_rate_bits:.3f}"
                if c and c.stream_bits_per_s and c.nominal_rate_bits else ""),
             ("inter_bandwidth_cap: null" if fields["inter_bandwidth_cap"] is None else
              f"inter_bandwidth_cap: {_num(fields['inter_bandwidth_cap'])}  # the same fit with the link unshaped "
              "(host ceiling)" + (f"; {fit_note(c.inter_unshaped)}, alpha "
                                  f"{c.inter_unshaped.alpha * 1e3:.3f} ms" if c and c.inter_unshaped else "")),
             f"compute_flops: {_num(fields['compute_flops'])}      # FLOP/s per rank: the layer below's FLOPs / time",
             "measured_layers:" + ("" if fields["measured_layers"] else " []")]
    for m in fields["measured_layers"]:
        lines.append(f"  - {{hidden: {m['hidden']}, seq_length: {m['seq_length']}, micro_batch: {m['micro_batch']}, "
                     f"tp: {m['tp']}, fwd_bwd_s: {_num(m['fwd_bwd_s'])}}}"
                     + (f"  # {c.layer['impl']}, mean of all ranks running at once (spread "
                        f"{100 * c.layer['spread']:.1f}%)" if c else ""))
    lines.append("measured_iterations:" + ("" if fields["measured_iterations"] else " []"))
    for m in fields["measured_iterations"]:
        lines.append(measured_iteration_line(m, c.iteration if c else None))
    lines.append(f"gamma: {fields['gamma']:.4f}                  # layer time with background all-reduces / alone"
                 + (f" (measured {c.gamma:.4f}" + ("" if c.gamma_covered else
                                                   ", background ended early: a lower bound") + ")" if c else ""))
    lines.append("codec_throughput:               # bytes of fp32 input (quantize) / output (dequantize) per second")
    for name, t in fields["codec_throughput"].items():
        ratios = "".join(f", {k}: {t[k]:.4f}" for k in ("ratio_fp32", "ratio_16bit") if t.get(k) is not None)
        lines.append(f"  {name}: {{quantize: {_num(t['quantize'])}, dequantize: {_num(t['dequantize'])}{ratios}}}")
    lines += [f"reduce_throughput: {_num(fields['reduce_throughput'])}  # fp32 sum of received chunks, bytes in/s",
              f"optimizer_params_per_s: {_num(fields['optimizer_params_per_s'])}  # Adam on fp32, all ranks at once",
              f"optimizer_overhead_s: {_num(fields['optimizer_overhead_s'])}    # Adam fixed part"
              + (f" {max(c.optimizer_fixed_s, 0) * 1e3:.2f} ms + {c.step_collectives} small all-reduces x "
                 f"{c.small_collective_s * 1e3:.2f} ms" if c else "")]
    if c and c.cross_checks:
        lines.append("# Cross-checks (not fitted): training's collectives measured vs the model with these numbers:")
        for x in c.cross_checks:
            lines.append(f"#   {x['name']:<34} {x['rate']:<9} measured {x['measured_s'] * 1e3:8.1f} ms, model "
                         f"{x['predicted_s'] * 1e3:8.1f} ms ({x['predicted_s'] / x['measured_s']:.2f}x)")
    return "\n".join(lines) + "\n"


def measured_iteration_line(m: dict, measured: dict | None = None, note: str = "") -> str:
    """One ``measured_iterations`` entry of the YAML; ``measured`` (``measure_iteration``'s dict) adds its
    processes' times as a comment, ``note`` a word on where the entry came from."""
    line = (f"  - {{layers: {m['layers']}, hidden: {m['hidden']}, seq_length: {m['seq_length']}, "
            f"micro_batch: {m['micro_batch']}, vocab: {m['vocab']}, fwd_bwd_s: {_num(m['fwd_bwd_s'])}}}")
    comment = []
    if measured:
        comment.append(f"pretrain_gpt.py without communication, {len(measured['per_process_s'])} processes at once, "
                       f"step {measured['step_s'] * 1e3:.0f} ms (slowest; all: "
                       + ", ".join(f"{t * 1e3:.0f}" for t in measured["per_process_s"]) + " ms)")
    if note:
        comment.append(note)
    return line + ("  # " + "; ".join(comment) if comment else "")


def write_cluster(path: Path, fields: dict, c: Calibration | None = None, writer: str = "tools/calibrate.py"):
    """Write the YAML, then load it back with ``load_cluster`` (the file must be valid, or nothing is kept)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _write_loadable(path, cluster_yaml(fields, c, writer))


def _write_loadable(path: Path, text: str):
    """Write ``text`` to ``path`` only if ``load_cluster`` accepts it (checked on a temporary file, removed
    whatever the failure); returns the loaded cluster."""
    from megatron_zpp.perfmodel import load_cluster

    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    try:
        cluster = load_cluster(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    return cluster


def add_measured_iteration(path: Path, entry: dict, measured: dict | None = None, note: str = ""):
    """Add one ``measured_iterations`` entry to the cluster YAML at ``path``, or replace the entry of the same
    shape (layers, hidden, sequence, micro-batch, vocabulary), keeping every other line as written; then load it
    back with ``load_cluster`` (an invalid result keeps the old file). Returns the loaded cluster."""
    import yaml

    path = Path(path)
    with open(path, newline="") as f:  # as stored: read_text would turn CRLF into LF
        text = f.read()
    newline = "\r\n" if "\r\n" in text else "\n"  # the file's own line ending, kept
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.split("#")[0].rstrip() in ("measured_iterations:",
                                                                                  "measured_iterations: []")]
    if len(starts) != 1:
        raise ValueError(f"{path}: expected one 'measured_iterations:' line (a YAML written by tools/calibrate.py), "
                         f"found {len(starts)}")
    head = starts[0]
    lines[head] = lines[head].replace("measured_iterations: []", "measured_iterations:", 1)  # its comment kept
    # The block's entries ("  - {...}"), past blank and comment lines, up to the next key.
    entries, i = [], head + 1
    while i < len(lines) and (lines[i].startswith("  - ") or not lines[i].strip()
                              or lines[i].lstrip().startswith("#")):
        if lines[i].startswith("  - "):
            entries.append(i)
        i += 1
    shape = ("layers", "hidden", "seq_length", "micro_batch", "vocab")
    new = measured_iteration_line(entry, measured, note)
    same = [j for j in entries if all(yaml.safe_load(lines[j])[0].get(k) == entry[k] for k in shape)]
    if same:
        lines[same[0]] = new
        for j in reversed(same[1:]):  # a shape twice: the model would use only the first
            del lines[j]
    else:
        lines.insert(entries[-1] + 1 if entries else head + 1, new)
    return _write_loadable(path, newline.join(lines) + newline)


def fit_or_bound(nbytes: list[float], seconds: list[float], steps: int = 1) -> Fit:
    """:func:`fit_alpha_beta`, or where the times do not grow with size (a link too fast for these sizes: all
    latency and jitter) ``FAST_LINK`` bytes/s and alpha from the fastest time. Times agreed across ranks give the
    same answer on every rank, so a job never fails on a noisy fit."""
    try:
        return fit_alpha_beta(nbytes, seconds, steps)
    except ValueError:
        if not nbytes or len(nbytes) != len(seconds) or min(seconds) <= 0:
            raise
        return Fit(alpha=min(seconds) / steps, bandwidth=FAST_LINK, intercept=min(seconds),
                   max_rel_residual=float("nan"), points=list(zip(nbytes, seconds)))


FAST_LINK = 1e12  # bytes/s: "faster than these sizes can tell"


class Probe:
    """The measurements of one rank; every rank makes the same calls in the same order.

    Args:
        device: where the tensors live (CUDA work is synchronized before each time is read).
        ranks_per_node: ranks per node; the world is node-major (rank // ranks_per_node is the node).
        intra_group: this rank's intra-node process group (None with one rank per node).
    """

    def __init__(self, device, ranks_per_node: int, intra_group=None) -> None:
        self.device = torch.device(device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if ranks_per_node < 1 or self.world % ranks_per_node:
            raise ValueError(f"ranks per node={ranks_per_node} must divide the world size {self.world}")
        self.g, self.nodes = ranks_per_node, self.world // ranks_per_node
        self.intra = intra_group

    # ------------------------------------------------------------------ timing
    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def agree_max(self, value: float) -> float:
        """The largest value over all ranks (every rank gets the same number)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def gather_values(self, value: float) -> list[float]:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return [float(x.item()) for x in out]

    def timed(self, fn, budget_s: float, max_reps: int = 20, min_reps: int = 3, warm_counts: bool = False) -> float:
        """Seconds per call of ``fn`` on the slowest rank: one warm-up call sizes the repetitions to ``budget_s``
        (the same count on every rank: collectives must match); each call is timed on its own, the slowest rank's
        time taken per call, and the median over calls returned, so one call slowed by another job on a shared
        machine does not move the result. ``warm_counts`` (the network ladder, whose calls are transfers): with
        fewer than 3 timed calls the warm-up call joins the median's samples, and with ``min_reps`` 1 a warm-up
        call that takes the whole budget is the measurement (a second call would double what it costs the job)."""
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        self.sync()
        warm = self.agree_max(time.perf_counter() - t0)
        if warm_counts and min_reps <= 1 and warm >= budget_s:
            return warm  # a large message on a slow link: its one-off costs are noise next to the transfer
        reps = max(min_reps, min(max_reps, int(budget_s / max(warm, 1e-6))))
        dist.barrier()
        t = torch.tensor(self._each_call(fn, reps), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        calls = t.tolist()
        return statistics.median(calls + [warm] if warm_counts and reps < 3 else calls)

    def local_median(self, fn, reps: int, warm: int = 1) -> float:
        """Median seconds of ``fn`` on this rank (all ranks run it at once after a barrier)."""
        for _ in range(warm):
            fn()
        self.sync()
        dist.barrier()
        return statistics.median(self._each_call(fn, reps))

    def _each_call(self, fn, reps: int) -> list[float]:
        """Seconds of each of ``reps`` calls of ``fn`` on this rank, device work included."""
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return times

    def mean_over_ranks(self, value: float) -> float:
        return statistics.fmean(self.gather_values(value))

    # ------------------------------------------------------------------ network
    def a2a_fit(self, group, peers: int, senders_per_node: int, sizes: list[int], budget_s: float,
                min_fit_bytes: int = 0) -> Fit | None:
        """all_to_all_single of ``size`` bytes per peer on ``group``; the fit is against the bytes one rank sends
        (per-rank link) times ``senders_per_node`` (a node's link). Sizes whose link bytes are at most
        ``min_fit_bytes`` are skipped (a token bucket's burst passes them at line rate: they measure the bucket,
        not the rate)."""
        if group is None:
            return None
        members = peers + 1
        sizes = [x for x in sizes if peers * x * senders_per_node > min_fit_bytes]
        if len(sizes) < 2:
            raise ValueError(f"fewer than two --sizes send more than {min_fit_bytes} bytes per link; give larger sizes")
        xs, ts = [], []
        for size in sizes:
            numel = size // 4
            inp = torch.randn(members * numel, device=self.device)
            out = torch.empty_like(inp)
            t = self.timed(lambda: dist.all_to_all_single(out, inp, group=group), budget_s)
            xs.append(float(peers * numel * 4 * senders_per_node))
            ts.append(t)
        return fit_alpha_beta(xs, ts, steps=peers)

    def ring_fit(self, sizes: list[int], budget_s: float, min_fit_bytes: int = 0, min_reps: int = 3) -> Fit:
        """One ring step on all ranks at once: every rank sends ``size`` bytes to the next rank and receives from the
        previous one (send/recv, as a ring all-gather / all-reduce step). The ring is node-major, so each node has
        exactly one flow leaving it: the step time is ``alpha + size / inter_bandwidth`` (intra hops on the same
        step are much faster)."""
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        sizes = [x for x in sizes if x > min_fit_bytes]
        if len(sizes) < 2:
            raise ValueError(f"fewer than two --sizes exceed {min_fit_bytes} bytes per link; give larger sizes")
        xs, ts = [], []
        for size in sizes:
            send = torch.randn(size // 4, device=self.device)
            recv = torch.empty_like(send)

            def step():
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]):
                    w.wait()
            ts.append(self.timed(step, budget_s, min_reps=min_reps))
            xs.append(float(size // 4 * 4))
        return fit_alpha_beta(xs, ts)

    def ring_ladder(self, share_s: float, max_bytes: int, group=None, peers: int = 0) -> Fit:
        """A fit within ``share_s``: sizes from 32 KiB up by 4x (to ``max_bytes``), each timed on a quarter of the
        share's remainder, stopping after the first size whose single call takes over a twelfth of the share: a
        slow link is fitted on small messages, a fast one on large ones. One node-major ring step (``group``
        None), else ``all_to_all_single`` with ``peers`` peers on ``group``. Sizes and stops are agreed (the
        times are), so every rank makes the same calls."""
        deadline = time.perf_counter() + share_s
        xs, ts = [], []
        size = 32 << 10
        while True:
            # Agreed (the largest over ranks): the repetition counts below must be the same on every rank.
            left = self.agree_max(max(deadline - time.perf_counter(), 0.0))
            # The next size's calls take ~4x the last one's: two timed calls after the warm-up where the share has
            # room for them, else the warm-up call alone when it takes its budget.
            reps = 2 if not ts or ts[-1] * 4 * 4 < left else 1
            if group is None:
                t = self._ring_step(size, left / 4, reps)
                xs.append(float(size))
            else:
                t = self._a2a(group, peers, size, left / 4, reps)
                xs.append(float(peers * size))
            ts.append(t)
            # Past 512 KiB (a token bucket's burst passes smaller messages at line rate), a call over a twelfth of
            # the share ends the ladder; so does the share's end (agreed: every rank stops at the same size).
            late = len(ts) >= 2 and self.agree_max(float(time.perf_counter() > deadline)) > 0
            if (t > share_s / 12 and size >= 512 << 10) or size * 4 > max(max_bytes, 1 << 20) or late:
                break
            size *= 4
        if len(ts) < 2:  # one size took the whole share: a second, smaller one anchors the latency
            small = 8 << 10
            ts.append(self._ring_step(small, share_s / 8, 1) if group is None else self._a2a(group, peers, small,
                                                                                               share_s / 8, 1))
            xs.append(float(small if group is None else peers * small))
        return fit_or_bound(xs, ts, steps=max(peers, 1))

    def _ring_step(self, size: int, budget_s: float, min_reps: int) -> float:
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        send = torch.randn(size // 4, device=self.device)
        recv = torch.empty_like(send)

        def step():
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]):
                w.wait()
        return self.timed(step, budget_s, max_reps=5, min_reps=min_reps, warm_counts=True)

    def _a2a(self, group, peers: int, size: int, budget_s: float, min_reps: int) -> float:
        numel = size // 4
        inp = torch.randn((peers + 1) * numel, device=self.device)
        out = torch.empty_like(inp)
        return self.timed(lambda: dist.all_to_all_single(out, inp, group=group), budget_s, max_reps=5,
                          min_reps=min_reps, warm_counts=True)

    def small_collective(self) -> float:
        x = torch.zeros(1, device=self.device)
        return self.timed(lambda: dist.all_reduce(x), budget_s=0.3, max_reps=50, min_reps=10)

    # ------------------------------------------------------------------ kernels
    def codecs(self, dtype: torch.dtype = torch.float32, numel: int = 1 << 20, reps: int = 7,
               interface: bool = True) -> dict[str, dict[str, float]]:
        """Bytes of ``dtype`` input (quantize) / output (dequantize) per second of the blockwise kernels (INT8
        block 256, INT4 block 128, INT4 with the Hadamard rotation in runs of 32 as ``int4+hadamard``), mean over
        ranks, all ranks at once; with ``interface`` also the codec-interface ones (ZFP, MPC, zstd)."""
        from megatron_zpp.compression import layout, ops

        if self.agree_max(0.0 if ops.kernels_available(self.device) else 1.0) > 0:  # the same answer on every rank
            return {}
        n = numel
        x = torch.randn(n, device=self.device).to(dtype)
        out = torch.empty_like(x)
        size = x.element_size()
        result = {}
        for name, bits, block, rotate in (("int8", 8, 256, 0), ("int4", 4, 128, 0), ("int4+hadamard", 4, 128, 32)):
            packed = torch.empty(1, layout.row_bytes(n, bits, block), dtype=torch.uint8, device=self.device)
            q = self.local_median(lambda: ops.quantize_rows_(x, packed, bits, block, hadamard=rotate), reps=reps)
            d = self.local_median(lambda: ops.dequantize_rows_(packed, out, bits, block, hadamard=rotate), reps=reps)
            result[name] = {"quantize": self.mean_over_ranks(size * n / q),
                            "dequantize": self.mean_over_ranks(size * n / d)}
        if interface:
            result.update(self.interface_codecs(x.float()))
        return result

    def interface_codecs(self, x) -> dict[str, dict[str, float]]:
        """The codecs the collectives run through the codec interface (comm/any_codec.py): ZFP at rate 8
        (the hybrid presets' gradient rate; other rates are within ~20%), and the lossless ones with their
        ratios on Gaussian fp32 and bf16 data (a conservative stand-in for training tensors:
        docs/codec-quality.md measured 1.1-1.4x higher on captured ones)."""
        from megatron_zpp.compression import get_codec

        result = {}
        for name, spec in (("zfp", "zfp:rate=8"), ("mpc", "mpc"), ("zstd", "zstd")):
            codec = get_codec(spec)
            if self.device.type not in codec.devices:
                continue
            packed = codec.encode(x)
            e = self.local_median(lambda: codec.encode(x), reps=5)
            d = self.local_median(lambda: codec.decode(packed), reps=5)
            entry = {"quantize": self.mean_over_ranks(4 * x.numel() / e),
                     "dequantize": self.mean_over_ranks(4 * x.numel() / d)}
            if not codec.fixed_size:
                half = x.to(torch.bfloat16)
                entry["ratio_fp32"] = 4 * x.numel() / codec.payload_nbytes(packed)
                entry["ratio_16bit"] = 2 * x.numel() / codec.payload_nbytes(codec.encode(half))
            result[name] = entry
        return result

    def reduce_throughput(self) -> float:
        n = 1 << 20
        chunks = torch.randn(2, n, device=self.device)
        acc = torch.empty(n, device=self.device)
        t = self.local_median(lambda: torch.sum(chunks, dim=0, dtype=torch.float32, out=acc), reps=9)
        return self.mean_over_ranks(chunks.numel() * 4 / t)

    def optimizer(self, params: int, reps: int = 7) -> tuple[float, float]:
        """(params/s, fixed s): Adam as Megatron-Core picks it on this machine (torch AdamW without TE/apex) plus
        the grad-norm pass and clipping scale of its step, on ``params`` fp32 parameters and a quarter of them."""
        try:
            from megatron.core.optimizer import Adam
        except ImportError:
            from torch.optim import AdamW as Adam
        xs, ts = [], []
        for n in (max(1, params // 4), params):
            p = torch.nn.Parameter(torch.randn(n, device=self.device))
            p.grad = torch.randn(n, device=self.device)
            opt = Adam([p], lr=1e-4, weight_decay=0.01)

            def step():
                norm = torch.linalg.vector_norm(p.grad)
                p.grad.mul_(1.0 / max(1.0, float(norm)))
                opt.step()
            t = self.local_median(step, reps=reps, warm=2)
            xs.append(float(n))
            ts.append(statistics.fmean(self.gather_values(t)))
        fit = fit_or_bound(xs, ts)
        return fit.bandwidth, fit.intercept
