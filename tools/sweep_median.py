"""The median of repeated sweeps: one table from several ``results.csv`` of the same grid (tools/sweep.py --local).

Per (path, rate, policy): the median seconds per iteration over the runs, its spread (min-max over median),
the median cross-node bytes counted and measured on the NICs, and the ratio of the medians against the
baselines of the same (path, rate) named with ``--against`` (default: zeropp and fair).

    python tools/sweep_median.py out/sweeps/sdp4bit-{1,2,3}/results.csv [--against zeropp,fair] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict
from pathlib import Path


def load(paths: list[Path]) -> dict[tuple[str, str, str], list[dict]]:
    rows: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for path in paths:
        with open(path) as f:
            for row in csv.DictReader(f):
                runs = rows[(row["path"], row["rate"], row["policy"])]
                batch = _batch(row)
                if runs and _batch(runs[0]) != batch:
                    raise ValueError(f"{path}: {row['path']} {row['policy']}@{row['rate']} ran at batch (micro, global) "
                                     f"{batch}, an earlier file's at {_batch(runs[0])}: give one batch's results only")
                runs.append(row)
    return rows


# tools/bench_training.py's MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE: the batch of every sweep from before tools/sweep.py
# recorded one (not imported: bench_training pulls in the trainer's arguments, seconds of imports for a table).
DEFAULT_BATCH = ("4", "32")


def _batch(row: dict) -> tuple[str, str]:
    """(micro, global) batch size of a row, as text; files from before tools/sweep.py recorded it had the default."""
    if not row.get("micro_batch_size") and not row.get("global_batch_size"):
        return DEFAULT_BATCH
    return row.get("micro_batch_size") or "", row.get("global_batch_size") or ""


def table(rows: dict[tuple[str, str, str], list[dict]], against: list[str]) -> list[dict]:
    median = {key: statistics.median(float(r["seconds_per_iteration"]) for r in runs) for key, runs in rows.items()}
    out = []
    for (path, rate, policy), runs in rows.items():
        times = [float(r["seconds_per_iteration"]) for r in runs]
        m = median[(path, rate, policy)]
        entry = {"path": path, "rate": rate, "policy": policy, "runs": len(runs),
                 "ms_per_iteration": round(1e3 * m, 1),
                 "spread": round((max(times) - min(times)) / m, 3),
                 "inter_MB_counted": round(statistics.median(float(r["inter_bytes_per_iteration"]) for r in runs) / 1e6, 3),
                 "inter_MB_measured": round(statistics.median(float(r["nic_payload_bytes_per_iteration"] or "nan")
                                                              for r in runs) / 1e6, 3),
                 "final_loss": round(statistics.median(float(r["final_loss"]) for r in runs), 4)}
        for base in against:
            b = median.get((path, rate, base))
            entry[f"x_{base}"] = round(b / m, 3) if b else None
        out.append(entry)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="results.csv of each repeat")
    p.add_argument("--against", default="zeropp,fair", help="baselines (policy names), comma-separated")
    p.add_argument("--out", type=Path, default=None, help="write median.csv and median.md here")
    args = p.parse_args(argv)
    against = [a for a in args.against.split(",") if a]
    try:
        loaded = load(args.results)
    except ValueError as e:
        p.error(str(e))
    out = table(loaded, against)
    batches = {_batch(runs[0]) for runs in loaded.values()}
    header = ["path", "rate", "policy", "runs", "ms_per_iteration", "spread"] + [f"x_{b}" for b in against] + \
             ["inter_MB_counted", "inter_MB_measured", "final_loss"]
    lines = [f"Median of {len(args.results)} runs ({', '.join(str(r) for r in args.results)}); x_P: P's median "
             "ms/iteration over this row's (> 1: faster than P); spread: (max - min) / median"
             + "".join(f"; batch {mb} per rank per micro-batch, {gb} per iteration" for mb, gb in sorted(batches)),
             "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(e[h]) for h in header) + " |" for e in out]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "median.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=header)
            w.writeheader()
            w.writerows({h: e[h] for h in header} for e in out)
        (args.out / "median.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
