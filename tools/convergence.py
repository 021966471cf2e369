"""Convergence studies: the ZeRO++ paper's Table 5 for our setting, the MVAPICH hybrid presets, loss curves.

``--study zeropp`` (default): four runs of the same small GPT on the ZeRO-3 path (Megatron-FSDP, bf16),
same seed and data (the built-in corpus), on 4 CPU ranks as 2 simulated nodes x 2 (or GPUs with
--nproc/--ranks-per-node):

  baseline                      --zpp-policy none
  ZeRO++ (hpZ & qwZ & qgZ on)   --zpp-policy zeropp
  ZeRO++ (qgZ first 50%)        --zpp-policy zeropp --zpp-dp-grad-until 0.5
  ZeRO++ (hpZ & qwZ on; qgZ off) --zpp-policy zeropp --zpp-dp-grad none

with the paper's goals (<= 1% all on, <= 0.3% qgZ first 50%, <= 0.1% qgZ off).

``--study hybrid``: the per-dimension presets against the baseline on 3D-style parallelism (tensor
parallel 2 x data parallel 2, distributed optimizer = ZeRO-1, bf16), where their tensor-parallel codecs
run: baseline (none), mzhybrid, zhybrid, hybrid. MVAPICH reports MZHybrid at the baseline loss and ZHybrid
"acceptable"; there is no numeric goal, the gaps are reported.

It prints the validation loss at the end of each run and its gap to the baseline, and writes the
training-loss curves to ``docs/convergence[-hybrid]-<date>-<machine>.png`` (numbers in a JSON beside it).

``--study sdp4bit`` (issue 23): `none`, `zeropp`, `sdp4bit` and each half of sdp4bit alone (4-bit weight
differences on zeropp's gradients; the two-level Hadamard gradients on zeropp's INT8 weights), each with
``--seeds`` seeds, on the distributed optimizer in fp32 with both overlap flags; validation loss every
``--eval-every`` iterations. ``--model train`` is ``make train``'s model (4 layers, hidden 256, sequence 256,
batch 32; the issue's), ``--model small`` the 2 x 128 model of the other studies. ``--stress`` adds a run
pair at 4x the learning rate, INT4 across nodes with and without the Hadamard rotation. It prints the final
validation loss per policy (mean and seed spread), the gap of each mean to `none`'s against `none`'s own
seed-to-seed spread, and plots the validation curves with the spread shaded. Each finished (run, seed) is
added to ``<out-dir>/convergence-sdp4bit-<model>-<steps>it-<machine>.json`` as it ends, so a stopped study
resumes where it was (the same command again) and ``--report`` prints the table from the runs so far.

``--study moe`` (issue 25): the same seeded, resumable study on the MoE GPT (``--model moe``: 4 layers, 8 experts,
top-2, expert parallelism 2 with the alltoall dispatcher): `none`, `zeropp` (dense and expert parameters), INT8
token dispatch (``--zpp-ep-dispatch int8:block=128``), and both.

    python tools/convergence.py [--study zeropp|hybrid|sdp4bit|moe] [--steps 300] [--seeds 3] [--out-dir docs]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_zpp.training.arguments import PROJECT_RECIPE  # noqa: E402
from megatron_zpp.testing import run_distributed  # noqa: E402

RUNS = {
    "baseline": ["--zpp-policy", "none"],
    "ZeRO++ (hpZ & qwZ & qgZ on)": ["--zpp-policy", "zeropp"],
    "ZeRO++ (hpZ & qwZ on; qgZ on for first 50%)": ["--zpp-policy", "zeropp", "--zpp-dp-grad-until", "0.5"],
    "ZeRO++ (hpZ & qwZ on; qgZ off)": ["--zpp-policy", "zeropp", "--zpp-dp-grad", "none"],
}
GOALS = {"ZeRO++ (hpZ & qwZ & qgZ on)": 1.0, "ZeRO++ (hpZ & qwZ on; qgZ on for first 50%)": 0.3,
         "ZeRO++ (hpZ & qwZ on; qgZ off)": 0.1}
HYBRID_RUNS = {
    "baseline": ["--zpp-policy", "none"],
    "mzhybrid (ZFP 8 DP grads, MPC TP/ZeRO)": ["--zpp-policy", "mzhybrid"],
    "zhybrid (ZFP 8 DP grads, ZFP 16 TP/ZeRO)": ["--zpp-policy", "zhybrid"],
    "hybrid (INT4 qgZ, INT8 qwZ, MPC TP)": ["--zpp-policy", "hybrid"],
}
STUDIES = {
    # name: (runs, goals, parallel layout flags, title)
    "zeropp": (RUNS, GOALS, ["--use-megatron-fsdp"], "ZeRO-3 / Megatron-FSDP bf16"),
    "hybrid": (HYBRID_RUNS, {}, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
               "TP2 x DP2, distributed optimizer (ZeRO-1), bf16"),
}


SDP4BIT_RUNS = {
    "none": ["--zpp-policy", "none"],
    "zeropp": ["--zpp-policy", "zeropp"],
    "sdp4bit": ["--zpp-policy", "sdp4bit"],
    "sdp4bit weights only (qWD)": ["--zpp-policy", "zeropp", "--zpp-dp-param", "int4:block=2048",
                                   "--zpp-dp-param-difference"],
    "sdp4bit gradients only (2-level + Hadamard)": ["--zpp-policy", "sdp4bit", "--zpp-dp-param", "int8:block=256",
                                                    "--no-zpp-dp-param-difference"],
}
# The stress pair: 4x the learning rate, INT4 gradients across nodes (INT8 inside), rotated or not.
STRESS_RUNS = {
    "stress: INT4 inter-node, Hadamard 32": ["--zpp-policy", "zeropp", "--zpp-dp-grad-intra", "int8:block=512",
                                             "--zpp-dp-grad", "int4:block=128,hadamard=32"],
    "stress: INT4 inter-node, no Hadamard": ["--zpp-policy", "zeropp", "--zpp-dp-grad-intra", "int8:block=512",
                                             "--zpp-dp-grad", "int4:block=128"],
    "stress: none": ["--zpp-policy", "none"],
}
# Issue 25: the MoE GPT (alltoall dispatcher, EP=2) under none, zeropp on dense and expert parameters, and INT8
# token dispatch (DeepSeek-V3's idea: lossy dispatch, combine exact).
MOE_RUNS = {
    "none": ["--zpp-policy", "none"],
    "zeropp": ["--zpp-policy", "zeropp"],
    "int8 dispatch": ["--zpp-policy", "none", "--zpp-ep-dispatch", "int8:block=128"],
    "zeropp + int8 dispatch": ["--zpp-policy", "zeropp", "--zpp-ep-dispatch", "int8:block=128"],
}
SEEDED_STUDIES = {"sdp4bit": SDP4BIT_RUNS, "moe": MOE_RUNS}  # study -> runs (the resumable, seeded studies)
MODELS = {
    # make train's model (Makefile TRAIN_ARGS), fp32
    "train": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
              "--micro-batch-size", "4", "--global-batch-size", "32", "--lr", "1e-3"],
    "small": ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
              "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-3"],
    # issue 25's MoE GPT: 4 layers, 8 experts, top-2, EP=2 (expert-data-parallel 2 on 4 ranks), alltoall dispatcher
    "moe": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
            "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-3", "--num-experts", "8",
            "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
            "--moe-aux-loss-coeff", "1e-2"],
}


def sdp4bit_args(model: str, steps: int, seed: int, eval_every: int, ranks_per_node: int, lr_scale: float) -> list[str]:
    flags = list(MODELS[model])
    lr = flags.index("--lr") + 1
    flags[lr] = str(float(flags[lr]) * lr_scale)
    return PROJECT_RECIPE + flags + [
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--lr-warmup-iters", str(max(1, steps // 10)), "--train-iters", str(steps), "--eval-iters", "8",
        "--eval-interval", str(eval_every), "--log-interval", str(max(1, steps // 6)), "--seed", str(seed),
        "--zpp-ranks-per-node", str(ranks_per_node)]


def _sdp4bit_worker(model: str, steps: int, seeds: int, eval_every: int, ranks_per_node: int, stress: bool,
                    runs: list[str], results_path: str, done: list[list], commit: str, study: str = "sdp4bit") -> None:
    """Runs every (run, seed) pair not in ``done``, seed-major (so a partial study has every run at its first
    seeds), and after each one rank 0 adds its record to ``results_path``: a study that is stopped resumes."""
    import torch.distributed as dist

    from megatron_zpp.training.trainer import pretrain

    plans = [(name, flags, 1.0) for name, flags in SEEDED_STUDIES[study].items() if name in runs]
    if stress:
        plans += [(name, flags, 4.0) for name, flags in STRESS_RUNS.items()]
    finished = {(name, seed) for name, seed in done}
    for k in range(seeds):
        seed = 1234 + k
        for name, flags, lr_scale in plans:
            if (name, seed) in finished:
                continue
            if dist.get_rank() == 0:
                print(f"# run: {name}, seed {seed}", flush=True)
            summary = pretrain(sdp4bit_args(model, steps, seed, eval_every, ranks_per_node, lr_scale) + flags)
            if dist.get_rank() == 0:
                record = {"seed": seed, "valid_curve": summary["valid_curve"], "valid_loss": summary["valid_loss"],
                          "losses": summary["losses"], "finite": summary["finite"],
                          "inter_bytes": summary["inter_bytes"],
                          "seconds_per_iteration": summary["seconds_per_iteration"],
                          "date": datetime.date.today().isoformat(), "commit": commit}
                _add_record(Path(results_path), name, record)


def _study_path(out_dir: Path, model: str, steps: int, study: str = "sdp4bit") -> Path:
    # No date in the name: the file accumulates runs over days (each record has its date and commit).
    return out_dir / f"convergence-{study}-{model}-{steps}it-{machine_name()}.json"


def _load_study(path: Path, model: str, steps: int, study: str = "sdp4bit") -> dict:
    if not path.exists():
        return {"study": study, "model": model, "steps": steps, "results": {}}
    data = json.loads(path.read_text())
    if (data.get("model"), data.get("steps")) != (model, steps):
        raise SystemExit(f"{path} holds model {data.get('model')!r}, {data.get('steps')} iterations; this call asks "
                         f"for {model!r}, {steps}: pass another --out-dir or the same --model/--steps")
    return data


def _add_record(path: Path, name: str, record: dict) -> None:
    data = json.loads(path.read_text())
    data["results"].setdefault(name, []).append(record)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)  # atomic: a killed study never leaves a torn file


def seeded_main(args) -> None:
    import statistics

    study_runs = SEEDED_STUDIES[args.study]
    runs = list(study_runs) if args.runs is None else args.runs.split(",")
    unknown = [r for r in runs if r not in study_runs]
    if unknown or "none" not in runs:
        raise SystemExit(f"--runs {args.runs!r}: valid runs: {', '.join(study_runs)} (none is required: the "
                         "gaps are against it)")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = _study_path(out_dir, args.model, args.steps, args.study)
    data = _load_study(path, args.model, args.steps, args.study)
    done = [[name, r["seed"]] for name, records in data["results"].items() for r in records]
    if not args.report:
        if not path.exists():
            path.write_text(json.dumps(data, indent=1))
        if done:
            print(f"resuming {path}: {len(done)} runs already there, skipped", flush=True)
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1]).stdout.strip()
        run_distributed(_sdp4bit_worker, args.nproc, args.model, args.steps, args.seeds, args.eval_every,
                        args.ranks_per_node, args.stress, runs, str(path), done, commit, args.study,
                        ranks_per_node=args.ranks_per_node,
                        timeout_s=4 * 3600, wall_limit_s=12 * 3600)
        data = _load_study(path, args.model, args.steps, args.study)
    results = {name: sorted(recs, key=lambda r: r["seed"]) for name, recs in data["results"].items()}
    if "none" not in results:
        raise SystemExit(f"{path}: no `none` run yet, nothing to compare against")
    finals = {name: [r["valid_loss"] for r in runs] for name, runs in results.items()}
    base = finals["none"]
    base_mean = statistics.mean(base)
    spread = max(base) - min(base)
    print(f"\n{args.study} study ({path.name}): model {args.model}, {args.steps} iterations, distributed optimizer "
          f"(fp32, both overlap flags), {args.nproc} ranks as {args.nproc // args.ranks_per_node} nodes x "
          f"{args.ranks_per_node}; final validation LM loss")
    print(f"`none`'s seed-to-seed spread (max - min): {spread:.5f} ({100 * spread / base_mean:.3f}%)")
    print("| run | seeds | mean | min | max | gap of the mean vs none | within none's spread | cross-node MB/iteration |")
    print("|---|---|---|---|---|---|---|---|")
    for name, values in finals.items():
        stress_base = finals.get("stress: none")
        ref = statistics.mean(stress_base) if name.startswith("stress") and stress_base else base_mean
        mean = statistics.mean(values)
        gap = mean - ref
        mb = statistics.mean(r["inter_bytes"] for r in results[name]) / 1e6 / args.steps  # summary: the whole run
        within = "yes" if abs(gap) <= spread else "no"
        print(f"| {name} | {len(values)} | {mean:.5f} | {min(values):.5f} | {max(values):.5f} | {gap:+.5f} ({100 * gap / ref:+.3f}%) "
              f"| {within} | {mb:.3f} |")
    stem = path.stem
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, runs in results.items():
        its = [i for i, _ in runs[0]["valid_curve"]]
        curves = [[v for _, v in r["valid_curve"]] for r in runs]
        lo = [min(c[j] for c in curves) for j in range(len(its))]
        hi = [max(c[j] for c in curves) for j in range(len(its))]
        mean = [statistics.mean(c[j] for c in curves) for j in range(len(its))]
        line, = ax.plot(its, mean, label=f"{name} ({statistics.mean(finals[name]):.4f})",
                        linestyle="--" if name.startswith("stress") else "-")
        ax.fill_between(its, lo, hi, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("validation LM loss (mean over seeds, min-max shaded)")
    ax.set_title(f"{args.study} convergence, model {args.model}, {machine_name()}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / f"{stem}.png", dpi=120)
    print(f"\nwrote {out_dir / stem}.png and .json")


def model_args(steps: int, ranks_per_node: int, layout: list[str]) -> list[str]:
    return PROJECT_RECIPE + layout + ["--bf16", "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-3",
            "--min-lr", "1e-4", "--lr-warmup-iters", str(max(1, steps // 10)), "--train-iters", str(steps),
            "--eval-iters", "16", "--log-interval", str(max(1, steps // 6)), "--seed", "1234",
            "--zpp-ranks-per-node", str(ranks_per_node)]


def _worker(steps: int, ranks_per_node: int, study: str) -> dict:
    from megatron_zpp.training.trainer import pretrain

    import torch.distributed as dist

    runs, _, layout, _ = STUDIES[study]
    results = {}
    for name, flags in runs.items():
        if dist.get_rank() == 0:
            print(f"# run: {name}", flush=True)
        summary = pretrain(model_args(steps, ranks_per_node, layout) + flags)
        results[name] = {"losses": summary["losses"], "valid_loss": summary["valid_loss"],
                         "inter_bytes": summary["inter_bytes"],
                         "inter_bytes_uncompressed": summary["inter_bytes_uncompressed"],
                         "seconds_per_iteration": summary["seconds_per_iteration"]}
    return results


def machine_name() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{platform.node() or 'host'}-{os.cpu_count()}cpu-{cpu}".replace(" ", "_").replace("/", "_")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=sorted(STUDIES) + sorted(SEEDED_STUDIES), default="zeropp",
                   help="zeropp: ZeRO++ Table 5 on Megatron-FSDP; hybrid: the per-dimension presets on TP2 x DP2; "
                        "sdp4bit: none / zeropp / sdp4bit and its halves over seeds (issue 23); moe: the MoE GPT "
                        "under none / zeropp / INT8 token dispatch over seeds (issue 25)")
    p.add_argument("--seeds", type=int, default=3, help="sdp4bit: seeds per run")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="sdp4bit, moe: the model (default: train for sdp4bit, moe for moe)")
    p.add_argument("--eval-every", type=int, default=50, help="sdp4bit: iterations between validations")
    p.add_argument("--stress", action="store_true", help="sdp4bit: add the 4x learning-rate Hadamard pair")
    p.add_argument("--runs", default=None, help="sdp4bit: comma-separated subset of the runs (default: all five)")
    p.add_argument("--report", action="store_true",
                   help="sdp4bit: run nothing; print the table and plot from the study's JSON (runs so far)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "docs"))
    args = p.parse_args()
    if args.steps < 1:
        raise SystemExit("--steps must be positive")
    if args.model is None:
        args.model = "moe" if args.study == "moe" else "train"
    if args.study in SEEDED_STUDIES:
        if args.seeds < 1 or args.eval_every < 1:
            raise SystemExit(f"--seeds {args.seeds} and --eval-every {args.eval_every} must be positive")
        if args.stress and args.study != "sdp4bit":
            raise SystemExit("--stress is the sdp4bit study's run pair")
        return seeded_main(args)
    _, goals, _, title = STUDIES[args.study]
    results = run_distributed(_worker, args.nproc, args.steps, args.ranks_per_node, args.study,
                              ranks_per_node=args.ranks_per_node, timeout_s=3600)[0]

    base = results["baseline"]["valid_loss"]
    heading = "Table 5" if args.study == "zeropp" else "Hybrid presets"
    print(f"\n{heading} (our setting: GPT 2x128 on the Python stdlib corpus, {args.steps} steps x 16 x 128 tokens, "
          f"{title}, {args.nproc} ranks as {args.nproc // args.ranks_per_node} nodes x "
          f"{args.ranks_per_node}): validation LM loss at the end of training")
    print("| run | validation loss | gap vs baseline | goal | cross-node bytes vs uncompressed |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        gap = 100 * (r["valid_loss"] - base) / base
        goal = goals.get(name)
        verdict = "" if goal is None else (f"<= {goal}% " + ("met" if abs(gap) <= goal else "NOT met"))
        ratio = r["inter_bytes"] / r["inter_bytes_uncompressed"] if r["inter_bytes_uncompressed"] else 1.0
        print(f"| {name} | {r['valid_loss']:.6f} | {gap:+.3f}% | {verdict} | x{ratio:.4f} |")

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    study = "" if args.study == "zeropp" else f"-{args.study}"
    stem = f"convergence{study}-{datetime.date.today().isoformat()}-{machine_name()}"
    (out_dir / f"{stem}.json").write_text(json.dumps({"study": args.study, "layout": title, "steps": args.steps,
                                                      "results": results}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"the table is above and the numbers are in {stem}.json; the PNG needs matplotlib: "
                         f"pip install -e '.[tools]' ({e})") from e
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        losses = r["losses"]
        window = max(1, len(losses) // 30)
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, label=f"{name} (valid {r['valid_loss']:.4f})")
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"training LM loss (moving average over {window})")
    ax.set_title(f"megatron_zpp convergence: {title}, {machine_name()}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / f"{stem}.png", dpi=120)
    print(f"\nwrote {out_dir / stem}.png and .json")


if __name__ == "__main__":
    main()
