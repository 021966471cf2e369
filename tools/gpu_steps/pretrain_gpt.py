"""GPU check step ``pretrain_gpt``: this repository's ``pretrain_gpt.py`` on the GPU, zeropp against none.

    python tools/gpu_steps/pretrain_gpt.py --out DIR [--quick] [--device cpu]

Two runs of ``pretrain_gpt.py`` (the real entry point, through ``torch.distributed.run``), bf16, distributed
optimizer with ``--overlap-grad-reduce --overlap-param-gather``, the built-in corpus, once with
``--zpp-policy zeropp`` and once with ``--zpp-policy none``; figures: tokens/s (the trainer's, mean after
the first iteration), peak GPU memory (``gpu_peak_memory_bytes`` of the run summary,
``torch.cuda.max_memory_allocated``), first and final loss, and the data-parallel collectives each policy
ran (``traffic``). Writes ``DIR/pretrain_gpt.json``; exits 0 on pass / skipped, 1 on fail.

World size 1, NCCL: the backend a user trains with. Several ranks on one GPU would need gloo, which takes
CUDA tensors only by staging them through host memory (its ``reduce_scatter_tensor``, Megatron's own call
under ``--zpp-policy none``, is a whole all-reduce of a copy), and the ranks would time-share one GPU, so
neither tokens/s nor memory would say anything about a GPU cluster. At data-parallel size 1 the
collectives move nothing between ranks; what runs is the policy's hooks and codec kernels inside
Megatron's overlapped bucket path on CUDA, which is what this step checks (the comm path across ranks is
``comm_cuda``'s).

``--device cpu``: the same two runs on one CPU rank (gloo), a tiny model, fp32, a few iterations: a
self-check of this script's logic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (the step scripts' shared result file and verdict line)

NAME = "pretrain_gpt"
REPO = Path(__file__).resolve().parents[2]
POLICIES = ("zeropp", "none")

COMMON = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
          "--zpp-ranks-per-node", "1", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
          "--adam-beta2", "0.95", "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--eval-iters", "0",
          "--log-interval", "10", "--seed", "1234"]
# A small but real GPT: ~100M parameters at hidden 1024 x 8 layers (the byte tokenizer's 257-id
# vocabulary keeps the embedding small), 16 sequences of 1024 tokens per iteration.
GPU_MODEL = {
    "full": ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
             "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", "60", "--lr-warmup-iters", "5",
             "--bf16"],
    "quick": ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "1024",
              "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", "20", "--lr-warmup-iters", "2",
              "--bf16"],
}
CPU_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--lr-warmup-iters", "1",
             "--distributed-backend", "gloo"]


def write_result(out: Path, status: str, figures: dict, rows: list, detail: str) -> int:
    return _common.finish(out, NAME, status, figures, rows, detail)


def run_once(policy: str, model_args: list[str], out: Path, timeout_s: float, cpu: bool, cache: Path) -> dict:
    """One ``pretrain_gpt.py`` run on one rank; a row with its summary figures, or the error's tail. Its log
    and summary stay in ``out``; the dataset index cache goes to ``cache`` (a scratch folder)."""
    summary_path = out / f"{NAME}-{policy}.summary.json"
    log_path = out / f"{NAME}-{policy}.log"
    summary_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(REPO / "pretrain_gpt.py"), *COMMON, *model_args, "--zpp-policy", policy,
           "--summary-json", str(summary_path), "--data-cache-path", str(cache)]
    env = dict(os.environ)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the trainer picks CPU and gloo when it sees no GPU
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as the sbatch script and Megatron-LM's launchers set
    start = time.monotonic()
    row: dict = {"policy": policy, "command": " ".join(cmd[1:])}
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        row["returncode"] = proc.returncode
    except subprocess.TimeoutExpired:
        row["returncode"] = None
        row["error"] = f"timed out after {timeout_s:.0f} s"
    row["seconds"] = time.monotonic() - start
    tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
    if row["returncode"] != 0 or not summary_path.exists():
        row.setdefault("error", f"exit code {row['returncode']}")
        row["log_tail"] = tail
        return row
    s = json.loads(summary_path.read_text())
    row.update({"tokens_per_s": s["tokens_per_s"], "seconds_per_iteration": s["seconds_per_iteration"],
                "gpu_peak_memory_bytes": s.get("gpu_peak_memory_bytes"), "iterations": s["iterations"],
                "first_loss": s["first_loss"], "final_loss": s["final_loss"], "finite": s["finite"],
                "dp_calls": {tag: t["calls"] for tag, t in s.get("traffic", {}).items()},
                "policy_codecs": (s.get("policy") or {}).get("codecs")})
    return row


def judge(rows: list[dict], cpu: bool) -> tuple[str, dict, str]:
    figures: dict = {"device": "cpu" if cpu else "cuda", "world_size": 1,
                     "backend": "gloo" if cpu else "nccl"}
    problems = []
    for r in rows:
        p = r["policy"]
        if "error" in r:
            problems.append(f"{p}: {r['error']}: {r.get('log_tail', '')[-600:]}")
            continue
        figures[f"{p}_tokens_per_s"] = r["tokens_per_s"]
        figures[f"{p}_peak_memory_mb"] = (r["gpu_peak_memory_bytes"] / 2**20
                                          if r["gpu_peak_memory_bytes"] is not None else None)
        figures[f"{p}_first_loss"], figures[f"{p}_final_loss"] = r["first_loss"], r["final_loss"]
        if not r["finite"]:
            problems.append(f"{p}: parameters not finite at the end")
        if not r["final_loss"] < r["first_loss"]:
            problems.append(f"{p}: loss did not decrease ({r['first_loss']:.4f} -> {r['final_loss']:.4f})")
        if not cpu and r["gpu_peak_memory_bytes"] is None:
            problems.append(f"{p}: the run summary has no gpu_peak_memory_bytes")
    if all(f"{p}_tokens_per_s" in figures for p in POLICIES):
        figures["zeropp_over_none_tokens_per_s"] = figures["zeropp_tokens_per_s"] / figures["none_tokens_per_s"]
    if problems:
        return "fail", figures, "; ".join(problems)
    detail = ", ".join(f"{p}: {figures[f'{p}_tokens_per_s']:.0f} tokens/s, loss {figures[f'{p}_first_loss']:.3f} -> "
                       f"{figures[f'{p}_final_loss']:.3f}"
                       + (f", peak {figures[f'{p}_peak_memory_mb']:.0f} MiB" if figures[f"{p}_peak_memory_mb"] else "")
                       for p in POLICIES)
    return "pass", figures, detail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: self-check of this script on one CPU rank with a tiny model")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (default 110, --quick 55)")
    a = p.parse_args(argv)
    cpu = a.device == "cpu"
    if not cpu:
        import torch

        if not torch.cuda.is_available():
            return write_result(a.out, "skipped", {}, [], "no CUDA device (torch.cuda.is_available() is False)")
    a.out.mkdir(parents=True, exist_ok=True)
    model = CPU_MODEL if cpu else GPU_MODEL["quick" if a.quick else "full"]
    timeout = a.timeout or (55.0 if a.quick else 110.0) * (3 if cpu else 1)
    with tempfile.TemporaryDirectory(prefix="zpp-gpu-step-") as cache:
        rows = [run_once(policy, model, a.out, timeout, cpu, Path(cache)) for policy in POLICIES]
    status, figures, detail = judge(rows, cpu)
    figures["model_args"] = " ".join(model)
    if cpu:
        detail = "self-check on CPU (tiny model, fp32, gloo): " + detail
    return write_result(a.out, status, figures, rows, detail)


if __name__ == "__main__":
    sys.exit(main())
