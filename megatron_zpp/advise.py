"""Policy advisor: which compression policy (if any) makes this workload fastest on this cluster?

    python -m megatron_zpp.advise --cluster configs/clusters/v100-384-1ib.yaml \
        --workload configs/workloads/gpt-18b-384gpu.yaml [--policies megatron,fair,zeropp] \
        [--bandwidth 100Gbit,800Gbit] [--micro-batch 1] [--plot whatif.png] [--json]

Prints, per policy, the analytic step time, tokens/s, cross-node bytes per iteration and the speedup over
Megatron's baseline and the fair uncompressed baseline, then recommends the fastest, saying so when no
compression wins. ``--plot`` draws what-if curves (throughput vs inter-node bandwidth and vs micro-batch).
Numbers are model output (``megatron_zpp/perfmodel/README.md``), not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

from megatron_zpp.perfmodel import (DEFAULT_POLICIES, ClusterSpec, Prediction, WorkloadSpec, load_cluster,
                                    load_workload, predict, resolve)

_UNITS = {"": 1.0, "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8}


def parse_bandwidth(text: str) -> float:
    """``12.5e9`` (bytes/s), ``12.5GB`` (GB/s) or ``100Gbit`` (Gbit/s) -> bytes/s per node."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z]*?)(?:/s|ps)?\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"bandwidth {text!r} is not valid; give a positive number of bytes/s per node, or with "
                         f"a unit: {', '.join(u for u in _UNITS if u)} (e.g. 100Gbit, 12.5GB)")
    return float(match.group(1)) * _UNITS[unit]


def with_inter_bandwidth(cluster: ClusterSpec, bandwidth: float, nominal: bool = True) -> ClusterSpec:
    """``cluster`` with another inter-node bandwidth per node (bytes/s).

    ``nominal`` (a link's rated speed, e.g. ``--bandwidth 100Gbit`` or a tc rate): the model uses what such a
    link achieves, ``bandwidth x inter_link_efficiency``, capped by ``inter_bandwidth_cap`` (the host's ceiling
    where one was calibrated). ``nominal=False``: ``bandwidth`` is already an achieved figure, used as is.
    """
    if not bandwidth > 0:
        raise ValueError(f"inter-node bandwidth={bandwidth!r} must be a positive number of bytes/s per node")
    if nominal:
        bandwidth *= cluster.inter_link_efficiency
        if cluster.inter_bandwidth_cap is not None:
            bandwidth = min(bandwidth, cluster.inter_bandwidth_cap)
    return dataclasses.replace(cluster, inter_bandwidth=bandwidth)


def at_link_rate(cluster: ClusterSpec, rate_bits_per_s: float | None) -> ClusterSpec:
    """``cluster`` with its inter-node links at a nominal rate in bits/s per node and direction (a tc rate, as
    ``tools/netemu.py`` shapes them), or unshaped (``None``): then the calibrated ``inter_bandwidth_cap``."""
    if rate_bits_per_s is None:
        if cluster.inter_bandwidth_cap is None:
            raise ValueError(f"cluster {cluster.name!r} has no inter_bandwidth_cap, so an unshaped link cannot be "
                             "predicted; calibrate it with tools/calibrate.py --emulate (it measures the unshaped "
                             "link too) or give a rate")
        return dataclasses.replace(cluster, inter_bandwidth=cluster.inter_bandwidth_cap)
    return with_inter_bandwidth(cluster, rate_bits_per_s / 8, nominal=True)


def with_micro_batch(workload: WorkloadSpec, micro_batch: int) -> WorkloadSpec:
    """The same number of micro-batches per iteration, each ``micro_batch`` sequences."""
    lay = workload.layout
    layout = dataclasses.replace(lay, micro_batch=micro_batch,
                                 global_batch=micro_batch * lay.dp * lay.microbatches)
    return dataclasses.replace(workload, layout=layout)


def is_uncompressed(policy_name: str) -> bool:
    """No codec on any dimension and no hpZ: the uncompressed baselines."""
    p = resolve(policy_name).policy
    # Not Policy.is_identity: the fair baseline (dp_uncompressed: hierarchical) compresses nothing either.
    return all(c == "none" for c in p.codecs.values()) and p.hpz_size == 1


def evaluate(cluster: ClusterSpec, workload: WorkloadSpec, policies) -> list[Prediction]:
    return [predict(cluster, workload, p) for p in policies]


MIN_GAIN = 0.02  # lossy compression has a convergence cost: recommend it only for a clear speedup


def recommend(predictions: list[Prediction], min_gain: float = MIN_GAIN) -> tuple[Prediction, str]:
    """The policy to use and a sentence saying why. A compressed policy is recommended only when it beats the
    best uncompressed one by more than ``min_gain`` (its accuracy risk must buy something)."""
    best = min(predictions, key=lambda p: p.step_time_s)
    plain = sorted((p for p in predictions if is_uncompressed(p.policy)), key=lambda p: p.step_time_s)
    if not plain or is_uncompressed(best.policy):
        text = f"recommend {best.policy}" + (": no compression wins" if plain else "")
        return best, text
    gain = plain[0].step_time_s / best.step_time_s
    if gain > 1 + min_gain:
        return best, f"recommend {best.policy}: {gain:.2f}x faster than the best uncompressed ({plain[0].policy})"
    return plain[0], (f"recommend {plain[0].policy}: no compression; the fastest compressed policy, {best.policy}, "
                      f"gains only {100 * (gain - 1):.1f}% (< {100 * min_gain:g}%), not worth its accuracy risk")


def _speedup(p: Prediction, predictions: list[Prediction], name: str) -> float | None:
    ref = next((q for q in predictions if q.policy == name), None)
    return ref.step_time_s / p.step_time_s if ref else None


def format_table(cluster: ClusterSpec, workload: WorkloadSpec, predictions: list[Prediction],
                 min_gain: float = MIN_GAIN) -> str:
    lay = workload.layout
    lines = [f"cluster {cluster.name}: {cluster.nodes} x {cluster.ranks_per_node} ranks, inter-node "
             f"{cluster.inter_bandwidth * 8 / 1e9:g} Gbit/s per node; workload {workload.name}: "
             f"{lay.zero_mode}, tp={lay.tp} pp={lay.pp} dp={lay.dp}, {lay.micro_batch * workload.model.seq_length} "
             f"tokens per micro-batch (analytic model output)",
             f"{'policy':<10}{'step s':>10}{'tokens/s':>12}{'TFLOP/s':>9}{'x-node GB':>11}{'GB/node':>10}"
             f"{'vs megatron':>12}{'vs fair':>9}{'exposed s':>10}{'codec s':>9}"]
    for p in predictions:
        vs = [_speedup(p, predictions, n) for n in ("megatron", "fair")]
        vs_text = "".join(f"{(f'{v:.2f}x' if v else '-'):>{w}}" for v, w in zip(vs, (12, 9)))
        lines.append(f"{p.policy:<10}{p.step_time_s:>10.3f}{p.tokens_per_s:>12.0f}{p.tflops_per_rank:>9.3g}"
                     f"{p.inter_bytes / 1e9:>11.4g}{p.inter_bytes_per_node / 1e9:>10.4g}{vs_text}"
                     f"{p.dp_exposed_comm_s:>10.3f}{p.codec_exposed_s:>9.3f}")
    lines.append(recommend(predictions, min_gain)[1])
    return "\n".join(lines)


def plot(path: str, cluster: ClusterSpec, workload: WorkloadSpec, policies: list[str]) -> None:
    """What-if curves: tokens/s vs inter-node bandwidth, and vs micro-batch per GPU, one line per policy."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[tools]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Achieved bandwidths around this cluster's (1/64x .. 64x), so no link efficiency is applied again.
    bandwidths = [cluster.inter_bandwidth * 2 ** (i / 2) for i in range(-12, 13)]
    micro_batches = [1, 2, 4, 8, 16]
    fig, (ax_bw, ax_mb) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in policies:
        ax_bw.plot([b * 8 / 1e9 for b in bandwidths],
                   [predict(with_inter_bandwidth(cluster, b, nominal=False), workload, name).tokens_per_s
                    for b in bandwidths],
                   label=name)
        ax_mb.plot(micro_batches, [predict(cluster, with_micro_batch(workload, mb), name).tokens_per_s / cluster.world_size
                                   for mb in micro_batches], marker="o", label=name)
    ax_bw.axvline(cluster.inter_bandwidth * 8 / 1e9, color="gray", linestyle=":", label="this cluster")
    ax_bw.set(xscale="log", xlabel="inter-node bandwidth per node (Gbit/s)", ylabel="tokens/s",
              title=f"{workload.name} on {cluster.name}")
    ax_mb.set(xscale="log", xlabel="micro-batch per rank (sequences)", ylabel="tokens/s per rank",
              title=f"at {cluster.inter_bandwidth * 8 / 1e9:g} Gbit/s per node")
    ax_mb.set_xticks(micro_batches, [str(m) for m in micro_batches])
    for ax in (ax_bw, ax_mb):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.text(0.5, 0.005, "analytic model output (megatron_zpp.perfmodel), not measurements", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_zpp.advise", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", required=True, help="cluster YAML (configs/clusters/)")
    parser.add_argument("--workload", required=True, help="workload YAML (configs/workloads/)")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help="comma-separated: megatron, fair, qwz, hpz, qgz, presets (zeropp, hybrid, none) or "
                             "policy YAML paths (default: %(default)s)")
    parser.add_argument("--bandwidth", help="override inter-node bandwidth per node; comma-separated values give "
                                            "one table each (e.g. 100Gbit,800Gbit or 12.5e9 bytes/s)")
    parser.add_argument("--micro-batch", type=int, help="override sequences per micro-batch (same number of "
                                                        "micro-batches per iteration)")
    parser.add_argument("--min-gain", type=float, default=MIN_GAIN,
                        help="recommend a compressed policy only above this speedup over the best uncompressed "
                             "(default: %(default)s = 2%%)")
    parser.add_argument("--plot", metavar="PNG", help="draw what-if curves into this file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    try:
        cluster, workload = load_cluster(args.cluster), load_workload(args.workload)
        if args.micro_batch is not None:
            workload = with_micro_batch(workload, args.micro_batch)
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        clusters = ([with_inter_bandwidth(cluster, parse_bandwidth(b)) for b in args.bandwidth.split(",")]
                    if args.bandwidth else [cluster])
        results = [(c, evaluate(c, workload, policies)) for c in clusters]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"cluster": dataclasses.asdict(c), "workload": dataclasses.asdict(workload),
                           "recommended": recommend(preds, args.min_gain)[0].policy,
                           "recommendation": recommend(preds, args.min_gain)[1],
                           "predictions": [p.to_dict() for p in preds]} for c, preds in results], indent=1))
    else:
        print("\n\n".join(format_table(c, workload, preds, args.min_gain) for c, preds in results))
    if args.plot:
        plot(args.plot, clusters[0], workload, policies)
        if not args.json:
            print(f"what-if curves written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
