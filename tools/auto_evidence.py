"""Issue 24's evidence: ``--zpp-policy auto`` against the fixed policies on the emulated 2-node x 2-rank cluster.

    sudo python tools/auto_evidence.py rates --out-dir out/auto/rates-1          # every rate, one repeat
    sudo python tools/auto_evidence.py change --start 1gbit --then 25mbit --at 16 --iters 40 --out-dir out/auto/down-1
    python tools/auto_evidence.py report out/auto/rates-{1,2,3} [--plot docs/auto-vs-fixed.png]

``rates``: for each ZeRO path and inter-node rate, one torchrun launch per policy (tools/bench_training.py's;
fresh processes, so no run inherits another's state) trains each fixed policy and then ``auto``, the make-train model, ``--iters`` iterations each; auto's calibration and
decisions are charged to its iterations (the trainer's summary does it). Rows go to ``results.csv`` with
bench_training's columns plus ``repeat``.

``change``: the same launch at ``--start``; when a run's rank 0 logs iteration ``--at`` the link is reshaped to
``--then`` (and back to ``--start`` when the next policy starts). Per run, ``phases.csv`` gets the mean seconds
per iteration of each phase (phase 1: iterations 2..at, phase 2: the last ``--tail`` iterations) and, for auto,
the iteration of its first decision after the change.

``report``: the median over repeats per (path, rate, policy), auto against the best fixed policy measured in
the same launches, and the plot (throughput vs rate, each fixed policy and auto).
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

FIXED = {  # the fixed policies that can be fastest at each rate (megatron and fair: no compression)
    "distopt": ["megatron", "fair", "zeropp", "sdp4bit"],
    "fsdp": ["megatron", "fair", "zeropp", "sdp4bit"],
}
AUTO_FLAGS = ["--zpp-auto-calibration-s", "4"]
ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)")


def _rows_out(path: Path, rows: list[dict]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)


def run_rates(a) -> None:
    from bench_training import launch, summary_row
    from netemu import EmulatedCluster, NetemuConfig

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with EmulatedCluster(NetemuConfig(nodes=2, ranks_per_node=2)) as cluster:
        for path in a.paths.split(","):
            for rate in a.rates.split(","):
                policies = [p for p in FIXED[path] if p not in a.skip.split(",")] + ["auto"]
                t0 = time.monotonic()
                summaries = {}
                for name in policies:  # one launch each: a fresh process per run (no order effects)
                    (out / name).mkdir(parents=True, exist_ok=True)
                    _, got = launch(cluster, path, rate, [name], iters=a.iters, log_dir=out / name,
                                    log_interval=a.iters, extra_flags={"auto": AUTO_FLAGS})
                    summaries.update(got)
                rows = []
                for name, s in summaries.items():
                    row = summary_row(path, rate, name, s)
                    row["repeat"] = a.repeat
                    row["auto_final"] = s.get("auto_policy", {}).get("current", "")
                    row["auto_overhead_s"] = s.get("auto_policy", {}).get("overhead_s", "")
                    rows.append(row)
                    print(f"{path:7s} {rate:9s} {name:9s} {row['seconds_per_iteration'] * 1e3:7.0f} ms/it"
                          + (f"  (auto ran {row['auto_final']}, overhead {row['auto_overhead_s']:.1f} s)"
                             if name == "auto" else ""), flush=True)
                if rows:
                    _rows_out(out / "results.csv", rows)
                print(f"{path} {rate}: {time.monotonic() - t0:.0f} s", flush=True)


def run_change(a) -> None:
    from bench_training import launch
    from netemu import EmulatedCluster, NetemuConfig

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with EmulatedCluster(NetemuConfig(nodes=2, ranks_per_node=2)) as cluster:
        changed_at: dict[str, float] = {}
        current = {"policy": None}

        def on_line(node: int, line: str) -> None:
            if node != 0:
                return
            if line.startswith("bench_training: policy "):
                current["policy"] = line.split()[-1]
                cluster.set_rate(a.start)  # every run starts on the first link
                return
            m = ITERATION.search(line)
            if m and int(m.group(1)) == a.at and current["policy"] not in changed_at:
                cluster.set_rate(None if a.then == "unshaped" else a.then)
                changed_at[current["policy"]] = time.monotonic()

        policies = [p for p in FIXED[a.path] if p not in a.skip.split(",")] + ["auto"]
        flags = {"auto": AUTO_FLAGS + ["--zpp-auto-recheck-interval", str(a.recheck), "--zpp-auto-explore-iters",
                                       str(a.explore)]}
        summaries = {}
        for name in policies:  # one launch each: a fresh process per run (no order effects)
            (out / name).mkdir(parents=True, exist_ok=True)
            _, got = launch(cluster, a.path, a.start, [name], iters=a.iters, log_dir=out / name, log_interval=1,
                            extra_flags=flags, on_line=on_line)
            summaries.update(got)
    rows = []
    for name, s in summaries.items():
        times = s["iteration_seconds"]  # iteration k is times[k - 1]
        phase1 = statistics.mean(times[1:a.at])
        phase2 = statistics.mean(times[-a.tail:])
        decisions = s.get("auto_policy", {}).get("decisions", [])
        after = [d for d in decisions if d["iteration"] > a.at and d.get("reason", "").startswith("measured/predicted")]
        row = {"path": a.path, "start": a.start, "then": a.then, "at": a.at, "policy": name,
               "phase1_s_per_it": phase1, "phase2_s_per_it": phase2, "repeat": a.repeat,
               "auto_switch_iteration": after[0]["iteration"] if after else "",
               "auto_choice_after": after[0]["choice"] if after else "",
               "auto_final": s.get("auto_policy", {}).get("current", ""),
               "auto_decisions": "; ".join(f"{d['iteration']}:{d['choice']}" for d in decisions)}
        rows.append(row)
        print(f"{name:9s} phase 1 {phase1 * 1e3:6.0f} ms/it, phase 2 {phase2 * 1e3:6.0f} ms/it"
              + (f"; decisions {row['auto_decisions']}" if name == "auto" else ""), flush=True)
    if rows:
        _rows_out(out / "phases.csv", rows)


def report(a) -> None:
    rows = []
    for d in a.dirs:
        with (Path(d) / "results.csv").open() as f:
            rows += list(csv.DictReader(f))
    by: dict[tuple, list[float]] = {}
    for r in rows:
        by.setdefault((r["path"], r["rate"], r["policy"]), []).append(float(r["seconds_per_iteration"]))
    order = ["25mbit", "100mbit", "1gbit", "unshaped"]
    lines = ["| path | rate | " + " | ".join(FIXED["distopt"]) + " | auto | best fixed | auto / best fixed "
             "(throughput) | runs |", "|---" * (len(FIXED["distopt"]) + 6) + "|"]
    table = []
    for path in dict.fromkeys(r["path"] for r in rows):
        for rate in sorted({r["rate"] for r in rows if r["path"] == path}, key=lambda x: order.index(x)
                           if x in order else 99):
            med = {p: statistics.median(v) for (pa, ra, p), v in by.items() if pa == path and ra == rate}
            fixed = {p: s for p, s in med.items() if p != "auto"}
            best = min(fixed, key=fixed.get)
            ratio = fixed[best] / med["auto"] if "auto" in med else float("nan")
            n = len(by.get((path, rate, "auto"), []))
            lines.append(f"| {path} | {rate} | " + " | ".join(f"{med[p] * 1e3:.0f}" if p in med else "—"
                                                           for p in FIXED["distopt"])
                         + f" | {med.get('auto', float('nan')) * 1e3:.0f} | {best} | **{ratio:.3f}** | {n} |")
            table.append((path, rate, med, best, ratio))
    print("ms per iteration, median of the runs (auto: calibration and decisions included)\n")
    print("\n".join(lines))
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        paths = list(dict.fromkeys(t[0] for t in table))
        fig, axes = plt.subplots(1, len(paths), figsize=(6 * len(paths), 4), squeeze=False)
        tokens = 32 * 256
        for ax, path in zip(axes[0], paths):
            sel = [t for t in table if t[0] == path]
            xs = list(range(len(sel)))
            for p in FIXED[path] + ["auto"]:
                ys = [tokens / t[2][p] if p in t[2] else float("nan") for t in sel]
                ax.plot(xs, ys, "o-" if p != "auto" else "s--", label=p, linewidth=3 if p == "auto" else 1.5)
            ax.set_xticks(xs, [t[1] for t in sel])
            ax.set_title(f"{path}: tokens/s vs inter-node rate (emulated 2x2)")
            ax.set_ylabel("tokens/s")
            ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
        print(f"\nwrote {a.plot}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rates")
    r.add_argument("--out-dir", required=True)
    r.add_argument("--paths", default="distopt,fsdp")
    r.add_argument("--rates", default="25mbit,100mbit,1gbit,unshaped")
    r.add_argument("--iters", type=int, default=24)
    r.add_argument("--skip", default="", help="fixed policies to leave out, comma-separated")
    r.add_argument("--repeat", type=int, default=1)
    c = sub.add_parser("change")
    c.add_argument("--out-dir", required=True)
    c.add_argument("--path", default="distopt")
    c.add_argument("--start", required=True)
    c.add_argument("--then", required=True)
    c.add_argument("--at", type=int, default=16)
    c.add_argument("--iters", type=int, default=48)
    c.add_argument("--tail", type=int, default=12, help="phase 2: the mean of the last this many iterations")
    c.add_argument("--recheck", type=int, default=6, help="auto's --zpp-auto-recheck-interval")
    c.add_argument("--explore", type=int, default=3, help="auto's --zpp-auto-explore-iters")
    c.add_argument("--skip", default="")
    c.add_argument("--repeat", type=int, default=1)
    t = sub.add_parser("report")
    t.add_argument("dirs", nargs="+")
    t.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    {"rates": run_rates, "change": run_change, "report": report}[a.cmd](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
