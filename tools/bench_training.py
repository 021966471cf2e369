"""Training benchmark on an emulated slow cluster: policies x inter-node rates x ZeRO paths.

For every (path, rate): one emulated cluster (``tools/netemu.py``: N namespaces x R gloo ranks,
``tc`` on both directions of each node's link), one ``torchrun`` launch per node that trains the
same model once per policy (in one process, so start-up is paid once per rate), and per run:
seconds per iteration and tokens/s (after the first iteration), cross-node bytes per iteration
counted by ``comm_stats`` and measured on the emulated NICs over the same window, and the host
step-time breakdown (compute and the rest, exposed data-parallel communication, codec).

    sudo python tools/bench_training.py --rates 25mbit,100mbit,unshaped --policies megatron,fair,zeropp
    python tools/bench_training.py --plot-only docs/bench/training.csv    # redraw from a CSV

Writes ``training.csv`` (one row per run, appended as runs finish) and ``throughput.png``
(tokens/s vs inter-node rate, one line per policy, like the ZeRO++ paper's Figure 13) and
``breakdown.png`` (stacked step time per policy at each rate) into ``--out-dir``. With
``--cluster CLUSTER.yaml`` each row also gets the performance model's prediction.

Policies: ``megatron`` (Megatron's own collectives: gloo's reduce-scatter is an all-reduce),
``fair`` (the project's uncompressed 2-hop reduce-scatter and ring all-gather), ``qwz``, ``hpz``
(Megatron-FSDP only), ``qgz``, and every preset in ``configs/policies``.
Needs root for the namespaces (see netemu).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from megatron_zpp.training.arguments import PROJECT_RECIPE  # noqa: E402

# The make-train model: 4 layers, hidden 256, sequence 256, global batch 32, fp32 (bf16 GEMMs on
# CPU take ~45 s/iteration and would hide every link effect). tools/sweep.py's batch parameters default to
# this batch.
MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE = 4, 32
MODEL_ARGS = PROJECT_RECIPE + ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
              "--micro-batch-size", str(MICRO_BATCH_SIZE),
              "--global-batch-size", str(GLOBAL_BATCH_SIZE), "--lr", "1e-3", "--min-lr", "1e-4",
              "--lr-warmup-iters", "2", "--eval-iters", "0",
              # ~7 buckets of the 3.3M parameters (Megatron's default makes one, which no collective can
              # overlap): as a large model has, so gradient reduce-scatters overlap the backward pass and
              # parameter all-gathers the forward pass. Megatron-FSDP buckets per module and ignores it.
              "--ddp-bucket-size", "500000"]
# --moe (issue 25): the same GPT with every layer a MoE layer of 8 experts (FFN 512), top-2, expert parallelism 2,
# the alltoall dispatcher: with --nodes 4 --ranks-per-node 1 both the token all-to-alls (EP groups {0,1}, {2,3})
# and the expert weights' data-parallel group ({0,2}, {1,3}) cross nodes.
MOE_ARGS = ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
            "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "1e-2", "--moe-ffn-hidden-size", "512"]
MOE_ONLY = ("zeropp-int8-dispatch",)  # policies that need --moe
PATHS = {
    "distopt": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
    "fsdp": ["--use-megatron-fsdp", "--overlap-grad-reduce", "--overlap-param-gather"],
}
# Single ZeRO++ components on an otherwise uncompressed (fair) baseline, so each one's effect is its own.
COMPONENTS = {
    "megatron": ["--zpp-policy", "none"],
    "fair": ["--zpp-policy", "fair"],
    "qwz": ["--zpp-policy", "fair", "--zpp-dp-param", "int8:block=256"],
    "hpz": ["--zpp-policy", "fair", "--zpp-hpz-size", "{ranks_per_node}"],
    "qgz": ["--zpp-policy", "fair", "--zpp-dp-grad", "int4:block=128"],
    # SDP4Bit's halves on zeropp (issue 23): 4-bit weight differences alone, the two-level Hadamard gradients alone
    "qwd": ["--zpp-policy", "zeropp", "--zpp-dp-param", "int4:block=2048", "--zpp-dp-param-difference"],
    "sdp4bit-grads": ["--zpp-policy", "sdp4bit", "--zpp-dp-param", "int8:block=256", "--no-zpp-dp-param-difference"],
    # issue 24: the measured choice (its calibration and decisions are charged to its iterations)
    "auto": ["--zpp-policy", "auto"],
    # issue 25 (--moe): zeropp on dense and expert parameters plus INT8 token dispatch
    "zeropp-int8-dispatch": ["--zpp-policy", "zeropp", "--zpp-ep-dispatch", "int8:block=128"],
}
DEFAULT_RATES = "25mbit,50mbit,100mbit,250mbit,1gbit,unshaped"
FIELDS = ["path", "rate", "rate_bits_per_s", "policy", "iterations", "seconds_per_iteration", "tokens_per_s",
          "compute_s", "exposed_comm_s", "codec_s", "inter_bytes_per_iteration", "nic_payload_bytes_per_iteration",
          "nic_over_counted", "final_loss", "replicas_identical", "predicted_seconds_per_iteration",
          "predicted_inter_bytes_per_iteration", "date", "machine"]


def policy_flags(name: str, ranks_per_node: int) -> list[str]:
    from megatron_zpp.policy import available_presets

    if name in COMPONENTS:
        return [f.format(ranks_per_node=ranks_per_node) for f in COMPONENTS[name]]
    if name in available_presets():
        return ["--zpp-policy", name]
    raise ValueError(f"policy {name!r}: valid: {', '.join(dict.fromkeys(list(COMPONENTS) + available_presets()))}")


def all_policies() -> list[str]:
    from megatron_zpp.policy import available_presets

    return [p for p in COMPONENTS if p not in MOE_ONLY] + [p for p in available_presets() if p not in ("none", "fair")]


# ------------------------------------------------------------------ worker (runs under torchrun)
def worker(a) -> None:
    """Train once per policy in this process (every rank), writing each run's summary."""
    import torch.distributed as dist

    from megatron_zpp.training.trainer import pretrain

    base = json.loads(a.worker_args)
    # Per-policy extra flags (tools/sweep.py: each policy's W&B run name and config).
    extra = json.loads(a.worker_extra) if a.worker_extra else {}
    rank = int(os.environ.get("RANK", "0"))
    for name in a.policies.split(","):
        out = Path(a.worker) / f"{name}.json"
        log = print if rank == 0 else (lambda *args, **kwargs: None)
        if rank == 0:
            print(f"bench_training: policy {name}", flush=True)
        pretrain(base + policy_flags(name, a.ranks_per_node) + extra.get(name, []) + ["--summary-json", str(out)],
                 log=log)
        if dist.is_initialized():
            dist.barrier()


# ------------------------------------------------------------------ driver
def machine() -> str:
    import platform

    return f"{os.cpu_count()}-cpu {platform.machine()} {platform.node()}"


def predict_row(cluster_yaml: Path | None, path: str, rate_bps: float | None, policy: str) -> tuple:
    if cluster_yaml is None:
        return "", ""
    # tools/model_check.py: the row's rate through the cluster's link efficiency (unshaped: its calibrated cap).
    from model_check import load_workloads, predict_for_row

    from megatron_zpp.perfmodel import load_cluster

    p = predict_for_row(load_cluster(cluster_yaml), load_workloads()[path], rate_bps, policy)
    return p.step_time_s, p.inter_bytes


def launch(cluster, path: str, rate: str, policies: list[str], *, iters: int, log_dir: Path,
           log_interval: int | None = None, timeout: float = 3600, python: str = sys.executable,
           verbose: bool = False, extra_flags: dict[str, list[str]] | None = None, on_line=None,
           model_extra: list[str] | None = None, log_tag: str | None = None) -> tuple:
    """One ``torchrun`` launch on ``cluster`` at inter-node ``rate`` that trains each policy in turn.

    Returns ``(result, summaries)``: netemu's ``RunResult`` and ``{policy: run summary}`` for the
    policies that finished (a failed launch keeps those before the failure). ``extra_flags`` adds
    trainer flags per policy, ``model_extra`` to every policy (``MOE_ARGS``). Node output goes to
    ``log_dir/log-{path}-{rate}.txt`` (``log-{path}-{rate}-{log_tag}.txt`` with a ``log_tag``).
    """
    from netemu import free_port

    if path not in PATHS:
        raise ValueError(f"path {path!r}: valid: {', '.join(PATHS)}")
    cluster.set_rate(None if rate == "unshaped" else rate)
    work = Path(tempfile.mkdtemp(prefix="bench_training"))
    ranks_per_node = cluster.config.ranks_per_node
    script = [str(Path(__file__).resolve()), "--worker", str(work), "--policies", ",".join(policies),
              "--ranks-per-node", str(ranks_per_node), "--worker-args",
              json.dumps(MODEL_ARGS + (model_extra or []) + PATHS[path] + ["--train-iters", str(iters),
                                                     "--log-interval", str(log_interval or iters)])]
    if extra_flags:
        script += ["--worker-extra", json.dumps(extra_flags)]
    log_path = Path(log_dir) / (f"log-{path}-{rate}-{log_tag}.txt" if log_tag else f"log-{path}-{rate}.txt")
    result = cluster.run_torchrun(script, timeout=timeout, master_port=free_port(), python=python, echo=verbose,
                                  log_path=log_path, on_line=on_line)
    if result.failure:
        print(f"FAILED ({result.failure}); see {log_path}", flush=True)
    summaries = {name: json.loads((work / f"{name}.json").read_text()) for name in policies
                 if (work / f"{name}.json").exists()}
    return result, summaries


def summary_row(path: str, rate: str, name: str, s: dict, cluster_yaml: Path | None = None) -> dict:
    """One CSV row (``FIELDS``) from a run summary; NIC bytes are 0 when ``ZPP_NIC`` was not set."""
    from netemu import parse_rate

    rate_bps = None if rate == "unshaped" else parse_rate(rate)
    iters = s["iterations"]
    nic = s.get("nic") or {}
    b = s["breakdown"]
    pred_s, pred_bytes = predict_row(cluster_yaml, path, rate_bps, name)
    return {"path": path, "rate": rate, "rate_bits_per_s": rate_bps or "", "policy": name,
            "iterations": iters, "seconds_per_iteration": s["seconds_per_iteration"],
            "tokens_per_s": s["tokens_per_s"], "compute_s": b["compute_s"],
            "exposed_comm_s": b["exposed_comm_s"], "codec_s": b["codec_s"],
            "inter_bytes_per_iteration": s["inter_bytes"] / iters,
            "nic_payload_bytes_per_iteration": nic.get("payload_bytes", 0) / iters,
            "nic_over_counted": (nic.get("payload_bytes", 0) / s["inter_bytes"] if s["inter_bytes"] else ""),
            "final_loss": s["final_loss"], "replicas_identical": s["dp_replicas_identical"],
            "predicted_seconds_per_iteration": pred_s, "predicted_inter_bytes_per_iteration": pred_bytes,
            "date": time.strftime("%Y-%m-%d"), "machine": machine()}


def row_text(row: dict) -> str:
    return (f"{row['path']:8s} {row['rate']:9s} {row['policy']:9s} {row['seconds_per_iteration'] * 1e3:8.0f} ms/it "
            f"{row['tokens_per_s']:7.0f} tok/s | compute {row['compute_s'] * 1e3:6.0f} exposed comm "
            f"{row['exposed_comm_s'] * 1e3:6.0f} codec {row['codec_s'] * 1e3:5.0f} ms | cross-node "
            f"{row['inter_bytes_per_iteration'] / 1e6:7.2f} MB/it counted, "
            f"{row['nic_payload_bytes_per_iteration'] / 1e6:7.2f} measured")


def run_sweep(a) -> Path:
    from netemu import EmulatedCluster, NetemuConfig

    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "training.csv"
    new = not csv_path.exists() or not a.append
    with open(csv_path, "w" if new else "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        config = NetemuConfig(nodes=a.nodes, ranks_per_node=a.ranks_per_node)
        with EmulatedCluster(config) as cluster:
            for path in a.paths.split(","):
                policies = [p for p in a.policies.split(",") if not (p == "hpz" and path != "fsdp")]
                for rate in a.rates.split(","):
                    print(f"\n=== {path}, inter-node {rate}: {', '.join(policies)}", flush=True)
                    t0 = time.monotonic()
                    _, summaries = launch(cluster, path, rate, policies, iters=a.iters, log_dir=out_dir,
                                          timeout=a.timeout, python=a.python, verbose=a.verbose,
                                          model_extra=MOE_ARGS if a.moe else None)
                    for name, s in summaries.items():
                        row = summary_row(path, rate, name, s, a.cluster)
                        writer.writerow(row)
                        f.flush()
                        print(row_text(row), flush=True)
                    print(f"    ({time.monotonic() - t0:.0f} s for this rate)", flush=True)
    return csv_path


def read_rows(csv_path: Path) -> list[dict]:
    with open(csv_path) as f:
        return list(csv.DictReader(f))


def report(rows: list[dict]) -> str:
    """Per path and rate: each policy's step time and its speedup over both baselines."""
    lines = []
    for path in dict.fromkeys(r["path"] for r in rows):
        for rate in dict.fromkeys(r["rate"] for r in rows if r["path"] == path):
            sel = {r["policy"]: r for r in rows if r["path"] == path and r["rate"] == rate}
            meg = float(sel["megatron"]["seconds_per_iteration"]) if "megatron" in sel else None
            fair = float(sel["fair"]["seconds_per_iteration"]) if "fair" in sel else None
            for name, r in sel.items():
                t = float(r["seconds_per_iteration"])
                lines.append(f"{path:8s} {rate:9s} {name:9s} {t * 1e3:8.0f} ms/it"
                             + (f"  x{meg / t:5.2f} vs megatron" if meg else "")
                             + (f"  x{fair / t:5.2f} vs fair" if fair else "")
                             + f"  cross-node {float(r['inter_bytes_per_iteration']) / 1e6:7.2f} MB/it counted")
    return "\n".join(lines)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = list(dict.fromkeys(r["path"] for r in rows))
    stamp = f"{rows[0]['date']}, {rows[0]['machine']}" if rows else ""
    fig, axes = plt.subplots(1, len(paths), figsize=(6.5 * len(paths), 4.5), squeeze=False)
    for ax, path in zip(axes[0], paths):
        sel = [r for r in rows if r["path"] == path]
        shaped = sorted({float(r["rate_bits_per_s"]) for r in sel if r["rate_bits_per_s"]})
        unshaped_x = (shaped[-1] * 4) if shaped else 1e9
        for name in dict.fromkeys(r["policy"] for r in sel):
            pts = sorted((float(r["rate_bits_per_s"]) if r["rate_bits_per_s"] else unshaped_x,
                          float(r["tokens_per_s"])) for r in sel if r["policy"] == name)
            ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], marker="o", label=name,
                    linestyle="--" if name in ("megatron", "fair") else "-")
        ax.set_xscale("log")
        ax.minorticks_off()  # only the measured rates are labelled (minor log ticks would add 6x10^1 etc.)
        ticks = [x / 1e6 for x in shaped] + [unshaped_x / 1e6]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks[:-1]] + ["unshaped"], rotation=30)
        ax.set_xlabel("inter-node link per node and direction (Mbit/s)")
        ax.set_ylabel("tokens/s (measured)")
        ax.set_title(f"{path}: 2 emulated nodes x 2 gloo ranks")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    throughput = _save(fig, out_dir / "throughput.png", f"Training throughput vs inter-node bandwidth ({stamp})", 110)

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    fig, axes = plt.subplots(len(paths), len(rates), figsize=(3.2 * len(rates), 3.6 * len(paths)), squeeze=False)
    for i, path in enumerate(paths):
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            sel = [r for r in rows if r["path"] == path and r["rate"] == rate]
            names = [r["policy"] for r in sel]
            bottom = [0.0] * len(sel)
            for key, colour in (("compute_s", "tab:blue"), ("exposed_comm_s", "tab:red"), ("codec_s", "tab:green")):
                vals = [max(float(r[key]), 0.0) for r in sel]
                ax.bar(names, vals, bottom=bottom, color=colour, label=key[:-2].replace("_", " "))
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_title(f"{path}, {rate}", fontsize=9)
            ax.tick_params(axis="x", rotation=60, labelsize=7)
            if j == 0:
                ax.set_ylabel("seconds / iteration")
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    breakdown = _save(fig, out_dir / "breakdown.png", f"Per-iteration breakdown, measured on the host ({stamp})", 100)
    return [throughput, breakdown]


def _save(fig, path: Path, title: str, dpi: int) -> Path:
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--paths", default="distopt,fsdp", help=f"ZeRO paths: {', '.join(PATHS)}")
    p.add_argument("--policies", default=None, help="comma-separated (default: all: megatron, fair, qwz, hpz, "
                                                    "qgz and every preset)")
    p.add_argument("--rates", default=DEFAULT_RATES, help="inter-node rates in tc units, or 'unshaped'")
    p.add_argument("--iters", type=int, default=8, help="training iterations per run (the first is not timed)")
    p.add_argument("--moe", action="store_true",
                   help="the MoE GPT (MOE_ARGS: 8 experts, top-2, EP=2, alltoall dispatcher); with --nodes 4 "
                        "--ranks-per-node 1 its token all-to-alls cross nodes")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--out-dir", default=str(REPO / "docs" / "bench"))
    p.add_argument("--append", action="store_true", help="append to an existing training.csv")
    p.add_argument("--cluster", type=Path, default=None, help="cluster YAML: add the model's predictions")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per (path, rate) launch")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--verbose", action="store_true", help="echo node 0's training log")
    p.add_argument("--plot-only", type=Path, default=None, help="redraw plots and the report from this CSV")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-args", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-extra", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    if a.plot_only:
        rows = read_rows(a.plot_only)
        print(report(rows))
        for f in plot(rows, a.plot_only.parent):
            print(f"wrote {f}")
        return 0
    a.policies = a.policies or ",".join(all_policies())
    for name in a.policies.split(","):
        policy_flags(name, a.ranks_per_node)  # fail before any namespace exists
    for path in a.paths.split(","):
        if path not in PATHS:
            p.error(f"path {path!r}: valid: {', '.join(PATHS)}")
    from netemu import terminate_like_ctrl_c

    terminate_like_ctrl_c()  # a kill from timeout/SLURM still removes the namespaces
    csv_path = run_sweep(a)
    rows = read_rows(csv_path)
    print("\n" + report(rows))
    for f in plot(rows, csv_path.parent):
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
