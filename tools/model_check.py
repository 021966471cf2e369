"""Model vs measurement: the performance model's step time and cross-node bytes for every row of a training CSV.

    python tools/model_check.py docs/bench/training.csv --cluster configs/clusters/emulated-2x2.yaml \\
        [--plot model_vs_measured.png] [--json check.json]

For each row of ``tools/bench_training.py``'s ``training.csv`` (path, rate, policy, measured seconds per iteration,
counted cross-node bytes) the model predicts at that row's link rate: a shaped row at nominal rate x the cluster's
``inter_link_efficiency`` (capped by ``inter_bandwidth_cap``), an unshaped row at ``inter_bandwidth_cap`` (the
calibrated unshaped link; ``advise.at_link_rate``). Prints measured vs predicted step time and the relative error
per row, then the median and maximum |relative error| overall and per path (the calibration's goal: median <= 5%,
max <= 15%), and predicted vs counted cross-node bytes per iteration.

Ranking: what a user (or ``--zpp-policy auto``) does with the model is pick the policy it predicts fastest. For each
(path, rate) with several policies measured, the model's pick is the one with the smallest predicted step time and
its **regret** is the pick's measured step time over the measured best's (1.0: it picked the best). Reported per
(path, rate), then how often the pick was the measured best and the median and maximum regret (goal of issue 24:
median regret <= 5%). Repeats of one (path, rate, policy) count by their median.

The calibration comes from microbenchmarks (``tools/calibrate.py``), never from these rows: nothing here is fitted.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The benchmark model of tools/bench_training.py, per ZeRO path.
WORKLOADS = {"distopt": REPO / "configs/workloads/tiny-gpt-2x2.yaml",
             "fsdp": REPO / "configs/workloads/tiny-gpt-2x2-fsdp.yaml"}
GOAL_MEDIAN, GOAL_MAX = 0.05, 0.15
GOAL_REGRET_MEDIAN = 0.05
NEAR_TIE = 0.01  # a predicted lead below this is no preference
REQUIRED = ("path", "rate", "rate_bits_per_s", "policy", "iterations", "seconds_per_iteration",
            "inter_bytes_per_iteration")


@dataclass
class RowCheck:
    """One CSV row against the model."""

    path: str
    rate: str
    policy: str
    measured_s: float
    """Measured seconds per iteration (mean after the first)."""
    predicted_s: float
    """The model's seconds per iteration at the row's rate."""
    measured_exposed_s: float | None
    """Measured exposed data-parallel communication + codec per iteration (the trainer's host breakdown)."""
    predicted_exposed_s: float
    """The model's exposed data-parallel communication + codec."""
    counted_bytes: float
    """Cross-node bytes per iteration counted by comm_stats over the whole run (the CSV's column)."""
    predicted_bytes: float
    """The model's cross-node bytes per iteration, as that counter counts them (see ``counted_like``)."""
    measured_nic_bytes: float | None = None
    """TCP payload measured on the emulated NICs per iteration, if the CSV has it."""

    @property
    def rel_error(self) -> float:
        """(predicted - measured) / measured step time."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def bytes_rel_error(self) -> float:
        return (self.predicted_bytes - self.counted_bytes) / self.counted_bytes if self.counted_bytes else 0.0


def load_workloads(overrides: dict[str, Path] | None = None) -> dict:
    from megatron_zpp.perfmodel import load_workload

    return {path: load_workload(f) for path, f in {**WORKLOADS, **(overrides or {})}.items()}


def predict_for_row(cluster, workload, rate_bits_per_s: float | None, policy: str):
    """The model's ``Prediction`` for one run: ``cluster`` at the row's nominal link rate (None: unshaped)."""
    from megatron_zpp.advise import at_link_rate
    from megatron_zpp.perfmodel import predict

    return predict(at_link_rate(cluster, rate_bits_per_s), workload, policy)


def counted_like(prediction, workload, iterations: int) -> float:
    """Predicted cross-node bytes per iteration as ``pretrain_gpt.py`` counts them: its window closes at the end
    of the training loop (``IterationLogger.end_training``), so the final parameter sync and the evaluation are
    not in it and the model's per-iteration bytes compare directly. ``workload`` and ``iterations`` are kept
    for callers that pass them."""
    return prediction.inter_bytes


def _float(row: dict, key: str) -> float | None:
    value = row.get(key, "")
    return float(value) if value not in ("", None) else None


def check_rows(rows: list[dict], cluster, workloads: dict) -> list[RowCheck]:
    """Predict every row; ``ValueError`` naming the row for an unknown path or a malformed row."""
    out = []
    for i, r in enumerate(rows):
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            raise ValueError(f"row {i + 1}: missing column(s) {missing}; a tools/bench_training.py CSV has "
                             f"{', '.join(REQUIRED)}")
        if r["path"] not in workloads:
            raise ValueError(f"row {i + 1}: path={r['path']!r} has no workload; valid: {', '.join(workloads)}")
        workload = workloads[r["path"]]
        rate = _float(r, "rate_bits_per_s")
        p = predict_for_row(cluster, workload, rate, r["policy"])
        exposed = [_float(r, k) for k in ("exposed_comm_s", "codec_s")]
        out.append(RowCheck(
            path=r["path"], rate=r["rate"], policy=r["policy"], measured_s=float(r["seconds_per_iteration"]),
            predicted_s=p.step_time_s,
            measured_exposed_s=None if None in exposed else sum(exposed),
            predicted_exposed_s=p.dp_exposed_comm_s + p.codec_exposed_s,
            counted_bytes=float(r["inter_bytes_per_iteration"]),
            predicted_bytes=counted_like(p, workload, int(float(r["iterations"]))),
            measured_nic_bytes=_float(r, "nic_payload_bytes_per_iteration")))
    return out


def error_stats(checks: list[RowCheck], key=None) -> dict[str, dict[str, float]]:
    """Median and max |relative error| of the step time (and of the bytes) per group (``key(check)``; all rows under
    ``"all"``)."""
    groups: dict[str, list[RowCheck]] = {"all": list(checks)}
    if key is not None:
        for c in checks:
            groups.setdefault(key(c), []).append(c)
    out = {}
    for name, cs in groups.items():
        if not cs:
            continue
        errs = [abs(c.rel_error) for c in cs]
        berrs = [abs(c.bytes_rel_error) for c in cs]
        out[name] = {"rows": len(cs), "median": statistics.median(errs), "max": max(errs),
                     "bytes_median": statistics.median(berrs), "bytes_max": max(berrs)}
    return out


@dataclass
class Pick:
    """The model's choice among the policies measured at one (path, rate)."""

    path: str
    rate: str
    policies: int
    """Policies measured there."""
    best: str
    """The measured-fastest policy."""
    best_s: float
    pick: str
    """The policy with the smallest predicted step time."""
    pick_s: float
    """The pick's measured seconds per iteration."""
    margin: float = 0.0
    """The pick's predicted lead over the model's runner-up (runner-up / pick - 1): under ~1% the model has no
    real preference, and the pick among near-ties is arbitrary."""

    @property
    def regret(self) -> float:
        """The pick's measured step time over the best's (1.0: the pick was the best)."""
        return self.pick_s / self.best_s


def ranking(checks: list[RowCheck]) -> list[Pick]:
    """One :class:`Pick` per (path, rate) where at least two policies were measured, in first-seen order."""
    groups: dict[tuple[str, str], dict[str, list[RowCheck]]] = {}
    for c in checks:
        groups.setdefault((c.path, c.rate), {}).setdefault(c.policy, []).append(c)
    picks = []
    for (path, rate), by_policy in groups.items():
        if len(by_policy) < 2:
            continue
        measured = {pol: statistics.median(c.measured_s for c in cs) for pol, cs in by_policy.items()}
        predicted = {pol: cs[0].predicted_s for pol, cs in by_policy.items()}
        best = min(measured, key=measured.get)
        ranked = sorted(predicted, key=predicted.get)
        pick = ranked[0]
        margin = predicted[ranked[1]] / predicted[pick] - 1
        picks.append(Pick(path, rate, len(by_policy), best, measured[best], pick, measured[pick], margin))
    return picks


def ranking_stats(picks: list[Pick]) -> dict[str, float]:
    regrets = [p.regret for p in picks]
    return {"groups": len(picks), "picked_best": sum(p.regret == 1.0 for p in picks),
            "near_ties": sum(p.margin < NEAR_TIE for p in picks),
            "regret_median": statistics.median(regrets) - 1 if regrets else 0.0,
            "regret_max": max(regrets) - 1 if regrets else 0.0}


def ranking_report(picks: list[Pick]) -> str:
    if not picks:
        return "ranking: no (path, rate) with two or more policies measured"
    lines = [f"{'path':<8} {'rate':<9} {'policies':>8}  {'measured best':<22} {'model picks':<22} {'regret':>7} "
             f"{'predicted lead':>14}"]
    for p in picks:
        lines.append(f"{p.path:<8} {p.rate:<9} {p.policies:8d}  {p.best:<10} {p.best_s * 1e3:9.0f}ms  "
                     f"{p.pick:<10} {p.pick_s * 1e3:9.0f}ms  {100 * (p.regret - 1):+6.1f}% {100 * p.margin:13.2f}%"
                     + ("  near-tie" if p.margin < NEAR_TIE else ""))
    s = ranking_stats(picks)
    lines.append(f"ranking: the model picked the measured best in {s['picked_best']} of {s['groups']} (path, rate); "
                 f"regret median {100 * s['regret_median']:.1f}%, max {100 * s['regret_max']:.1f}%; {s['near_ties']} picks "
                 f"led by < {100 * NEAR_TIE:g}% (near-ties: the pick among them is arbitrary) (goal: median <= "
                 f"{100 * GOAL_REGRET_MEDIAN:g}%: {'met' if s['regret_median'] <= GOAL_REGRET_MEDIAN else 'NOT met'})")
    return "\n".join(lines)


def report(checks: list[RowCheck]) -> str:
    MB = 1e6
    lines = [f"{'path':<8} {'rate':<9} {'policy':<9} {'measured':>9} {'model':>9} {'error':>7}   "
             f"{'exposed meas':>12} {'model':>7}   {'x-node MB/it counted':>20} {'model':>7} {'error':>7}"]
    for c in checks:
        exposed = f"{c.measured_exposed_s * 1e3:10.0f}ms" if c.measured_exposed_s is not None else f"{'-':>12}"
        lines.append(f"{c.path:<8} {c.rate:<9} {c.policy:<9} {c.measured_s * 1e3:7.0f}ms {c.predicted_s * 1e3:7.0f}ms "
                     f"{100 * c.rel_error:+6.1f}%   {exposed} {c.predicted_exposed_s * 1e3:5.0f}ms   "
                     f"{c.counted_bytes / MB:20.2f} {c.predicted_bytes / MB:7.2f} {100 * c.bytes_rel_error:+6.2f}%")
    lines.append("")
    for what, key in (("overall", None), ("per path", lambda c: c.path), ("per rate", lambda c: c.rate),
                      ("per policy", lambda c: c.policy)):
        stats = error_stats(checks, key)
        for name, s in stats.items():
            if key is not None and name == "all":
                continue
            label = "all rows" if name == "all" else name
            lines.append(f"{what:<10} {label:<10} {s['rows']:3d} rows: step time |error| median {100 * s['median']:5.1f}%"
                         f", max {100 * s['max']:5.1f}%; bytes median {100 * s['bytes_median']:.2f}%, max "
                         f"{100 * s['bytes_max']:.2f}%")
    s = error_stats(checks)["all"]
    met = s["median"] <= GOAL_MEDIAN and s["max"] <= GOAL_MAX
    lines.append(f"goal (median <= {100 * GOAL_MEDIAN:g}%, max <= {100 * GOAL_MAX:g}%): "
                 + ("met" if met else "NOT met"))
    return "\n".join(lines)


def plot(checks: list[RowCheck], out: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.2, 5.6))
    policies = list(dict.fromkeys(c.policy for c in checks))
    rates = list(dict.fromkeys(c.rate for c in checks))
    markers = "osD^v<>P*X"
    for i, pol in enumerate(policies):
        for j, rate in enumerate(rates):
            sel = [c for c in checks if c.policy == pol and c.rate == rate]
            if sel:
                ax.scatter([c.measured_s for c in sel], [c.predicted_s for c in sel], color=f"C{i}",
                           marker=markers[j % len(markers)], s=50, label=f"{pol}, {rate}")
    lo = 0.8 * min(min(c.measured_s, c.predicted_s) for c in checks)
    hi = 1.2 * max(max(c.measured_s, c.predicted_s) for c in checks)
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="model = measured")
    ax.fill_between([lo, hi], [lo * (1 - GOAL_MAX), hi * (1 - GOAL_MAX)], [lo * (1 + GOAL_MAX), hi * (1 + GOAL_MAX)],
                    color="gray", alpha=0.15, label=f"+/-{100 * GOAL_MAX:g}%")
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel="measured seconds / iteration", ylabel="predicted seconds / iteration",
           title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _workload_overrides(items: list[str]) -> dict[str, Path]:
    out = {}
    for item in items:
        path, sep, file = item.partition("=")
        if not sep or not file:
            raise ValueError(f"--workload {item!r} must be PATH=FILE, e.g. distopt=configs/workloads/tiny-gpt-2x2.yaml")
        out[path] = Path(file)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", type=Path, help="training.csv written by tools/bench_training.py")
    p.add_argument("--cluster", type=Path, required=True, help="calibrated cluster YAML (tools/calibrate.py)")
    p.add_argument("--workload", action="append", default=[],
                   help="PATH=FILE: the workload YAML of a ZeRO path (default: distopt and fsdp tiny-gpt-2x2)")
    p.add_argument("--plot", type=Path, default=None, help="draw predicted vs measured into this PNG")
    p.add_argument("--json", type=Path, default=None, help="write the per-row checks and the statistics here")
    a = p.parse_args(argv)
    try:
        from megatron_zpp.perfmodel import load_cluster

        cluster = load_cluster(a.cluster)
        workloads = load_workloads(_workload_overrides(a.workload))
        with open(a.csv) as f:
            rows = list(csv.DictReader(f))
        if not rows:
            raise ValueError(f"{a.csv} has no rows")
        checks = check_rows(rows, cluster, workloads)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model ({a.cluster}) vs measured ({a.csv}, {rows[0].get('date', '?')}, {rows[0].get('machine', '?')}):")
    print(report(checks))
    print()
    picks = ranking(checks)
    print(ranking_report(picks))
    if a.plot:
        plot(checks, a.plot, f"model vs measured: {cluster.name}")
        print(f"wrote {a.plot}")
    if a.json:
        a.json.write_text(json.dumps({"rows": [asdict(c) | {"rel_error": c.rel_error, "bytes_rel_error":
                                                            c.bytes_rel_error} for c in checks],
                                      "stats": {"overall": error_stats(checks),
                                                "per_path": error_stats(checks, lambda c: c.path)},
                                      "ranking": [asdict(p) | {"regret": p.regret} for p in picks],
                                      "ranking_stats": ranking_stats(picks)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
