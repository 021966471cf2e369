"""GPU check step ``megatron_lm``: Megatron-LM's own training loop with the plugin, against the same run without.

    python tools/gpu_steps/megatron_lm.py --out DIR [--quick] [--device cpu]

Two runs of ``megatron.training.pretrain`` (shipped in the megatron-core wheel) on one GPU, each in its own
process (``torch.distributed.run``, world size 1, NCCL): a GPT of ~111M parameters (12 layers, hidden 768,
32768-id NullTokenizer vocabulary, 1024-token sequences, 16 per iteration), bf16, distributed optimizer with
both overlap flags, ``--mock-data``. ``plugin``: Megatron-LM's parser with ``zpp_extra_args_provider``,
``install_from_args`` before ``pretrain`` (docs/megatron-lm.md), ``--zpp-policy zeropp``. ``absent``: the
same command line without the plugin. The model provider is Megatron's default (``megatron.training.models``,
what Megatron-LM's ``pretrain_gpt.py`` builds); the dataset provider and forward step have the contract of
``pretrain_gpt.py``'s (``tests/plugin_checks.py`` has the same ones for CPU), the forward step moving the
batch to the GPU as ``get_batch`` does.

Figures: tokens/s of each (host timestamps at the start of each iteration, after a device synchronize,
over the iterations after the first tenth, at least two), the loss of the first and last ten iterations, and the
parameter count. Pass: both runs finish, the loss decreases in both, the plugin's run compressed its
data-parallel collectives (its byte counters saw calls). Writes ``DIR/megatron_lm.json``.

Patches: none on the GPU except the dataset-helpers build. Rank 0 runs ``make`` in
``megatron/core/datasets``; the wheel ships the compiled helpers and no Makefile, so ``make`` fails and
Megatron exits. The build is skipped when the Makefile is absent and the compiled helpers import.
``--device cpu`` (self-check on one gloo CPU rank, a tiny model, fp32) adds the two CPU-only patches of
``tests/plugin_checks.py`` (``allow_no_cuda``, one device reported) on top of the CPU shim.
"""

from __future__ import annotations

import argparse
import json
import re
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (the step scripts' shared result file and verdict line)

NAME = "megatron_lm"
REPO = Path(__file__).resolve().parents[2]
RUNS = ("plugin", "absent")

GPU_ARGS = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "1024",
            "--max-position-embeddings", "1024", "--micro-batch-size", "8", "--global-batch-size", "16",
            "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
            "--bf16", "--vocab-size", "32768"]
CPU_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--lr", "1e-3", "--lr-warmup-iters", "1", "--vocab-size", "1000", "--distributed-backend", "gloo"]
COMMON = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
          "--tokenizer-type", "NullTokenizer", "--mock-data", "--no-gradient-accumulation-fusion",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0", "--eval-interval", "1000000",
          "--num-workers", "0", "--seed", "1234"]
ITERS = {"full": 300, "quick": 40, "cpu": 12}
PLUGIN_ARGS = ["--zpp-policy", "zeropp", "--zpp-ranks-per-node", "1"]


def write_result(out: Path, status: str, figures: dict, rows: list, detail: str) -> int:
    return _common.finish(out, NAME, status, figures, rows, detail)


# ----------------------------------------------------------------------------- one run (in its own process)
class Recorder:
    """What the forward step sees: iteration start times, micro-batch losses (kept on the device, read at
    the end: no extra host sync per micro-batch), the model's parameter count."""

    def __init__(self, micro_per_iteration: int, cuda: bool) -> None:
        self.micro_per_iteration, self.cuda = micro_per_iteration, cuda
        self.micro = 0
        self.starts: list[float] = []
        self.losses: list = []  # (summed token loss, tokens) tensors per micro-batch
        self.parameters: int | None = None

    def forward_started(self, model) -> None:
        if self.parameters is None:
            self.parameters = sum(p.numel() for p in model.parameters())
        if self.micro % self.micro_per_iteration == 0:
            if self.cuda:
                import torch

                torch.cuda.synchronize()  # the previous iteration is done (Megatron syncs per step anyway)
            self.starts.append(time.perf_counter())
        self.micro += 1

    def per_iteration_loss(self) -> list[float]:
        import torch

        if not self.losses:
            return []
        sums = torch.stack([l.float() for l, _ in self.losses]).cpu()
        tokens = torch.stack([t.float() for _, t in self.losses]).cpu()
        k = self.micro_per_iteration
        n = len(self.losses) // k
        return [float(sums[i * k:(i + 1) * k].sum() / tokens[i * k:(i + 1) * k].sum()) for i in range(n)]


def _datasets(num_samples, vp_stage=None):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, split="1,1,1",
                              tokenizer=get_tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config).build()


_datasets.is_distributed = True  # every rank builds its datasets (as Megatron-LM's pretrain_gpt.py)


def _loss(recorder: Recorder, loss_mask, output):
    import torch

    mask = loss_mask.view(-1).float()
    loss = torch.sum(output.float().view(-1) * mask)
    tokens = mask.sum().to(torch.int)
    # Copies: Megatron's schedule divides the returned loss in place (by the tokens and micro-batches).
    recorder.losses.append((loss.detach().clone(), tokens.detach().clone()))
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.float().view(1)])}


def _forward_step(recorder: Recorder, device, data_iterator, model, return_schedule_plan=False):
    recorder.forward_started(model)
    batch = next(data_iterator)
    batch = {k: (v.to(device, non_blocking=True) if hasattr(v, "to") else v) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss, recorder, batch["loss_mask"])


def _skip_dataset_helpers_build() -> bool:
    """Skip ``make`` of the dataset helpers when the wheel ships them compiled and no Makefile."""
    import megatron.core.datasets.utils as dataset_utils

    folder = Path(dataset_utils.__file__).parent
    if (folder / "Makefile").exists():
        return False
    from megatron.core.datasets import helpers_cpp  # noqa: F401  (compiled helpers present: nothing to build)

    dataset_utils.compile_helpers = lambda: None
    return True


def _cpu_patches() -> None:
    """``--device cpu`` only: the CPU shim and the two CPU patches of ``tests/plugin_checks.py``."""
    import torch

    from megatron_zpp.megatron.cpu_shim import install_cpu_shim

    install_cpu_shim()
    torch.cuda.device_count = lambda: 1
    import megatron.training.training as training
    from megatron.training.initialize import initialize_megatron

    training.initialize_megatron = partial(initialize_megatron, allow_no_cuda=True)


def worker(run: str, megatron_argv: list[str], result_path: Path, cpu: bool) -> None:
    import torch

    patches = []
    if cpu:
        _cpu_patches()
        patches += ["cpu_shim", "device_count=1", "allow_no_cuda"]
    if _skip_dataset_helpers_build():
        patches.append("skip dataset helpers make (no Makefile in the wheel)")
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_zpp.comm import comm_stats
    from megatron_zpp.megatron import install_from_args, zpp_extra_args_provider

    sys.argv = ["pretrain_gpt.py", *megatron_argv]
    plugin = run == "plugin"
    args = parse_and_validate_args(extra_args_provider=zpp_extra_args_provider if plugin else None)
    hooks = install_from_args(args) if plugin else None
    comm_stats().reset()
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    micro = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    recorder = Recorder(micro, cuda=not cpu)
    try:
        config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(config, _datasets, ModelType.encoder_or_decoder, partial(_forward_step, recorder, device))
    finally:
        if hooks is not None:
            hooks.uninstall()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    losses = recorder.per_iteration_loss()
    # Iteration i runs from starts[i] to starts[i + 1]; the last one, whose end would include Megatron's
    # teardown, is left out, as is the warm-up (the first tenth, at least two iterations).
    starts = recorder.starts
    skip = max(2, len(starts) // 10)
    timed = len(starts) - 1 - skip
    seconds = starts[-1] - starts[skip]
    tokens_per_iteration = args.global_batch_size * args.seq_length
    traffic = {tag: {"calls": s.calls, "inter_ratio": s.inter_ratio} for tag, s in comm_stats().snapshot().items()}
    result = {
        "run": run, "iterations": len(losses), "parameters": recorder.parameters, "patches": patches,
        "tokens_per_s": tokens_per_iteration * timed / seconds if timed > 0 and seconds > 0 else None,
        "seconds_per_iteration": seconds / timed if timed > 0 else None,
        "losses": losses, "transformer_impl": args.transformer_impl,
        "peak_memory_bytes": None if cpu else torch.cuda.max_memory_allocated(device),
        "traffic": traffic, "policy": hooks.policy.to_dict() if hooks is not None else None,
    }
    result_path.write_text(json.dumps(result, default=str))


# ----------------------------------------------------------------------------- driver
def _transformer_impl_args(cpu: bool = False) -> list[str]:
    """Megatron-LM's default layers are Transformer Engine's; without TE installed, its local ones.

    The local layers then need apex for two of Megatron-LM's defaults: the persistent layer norm (the
    torch LayerNorm fallback asserts it is off) and the masked-softmax fusion (bf16 calls apex's
    ``scaled_masked_softmax_cuda``, an ImportError without it). Without apex both are turned off, as a
    user of a plain torch image has to."""
    import importlib.util

    def has(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    if has("transformer_engine") and not cpu:  # TE's layers need a GPU: the CPU self-check is always local
        return []
    args = ["--transformer-impl", "local"]
    if not has("apex"):
        args += ["--no-persist-layer-norm"]
    if not (has("scaled_masked_softmax_cuda") and has("scaled_upper_triang_masked_softmax_cuda")):
        args += ["--no-masked-softmax-fusion"]
    return args


def root_error(log: str) -> str:
    """The exception that ended a failed rank's traceback (``[rank0]: AssertionError: ...``), not the launcher's
    ChildFailedError banner nor shutdown noise (``Exception ignored in ...``); "" when there is none. Lines a
    rank printed (``[rankN]:``) win over unprefixed ones."""
    found: dict[bool, str] = {}
    in_traceback = {True: False, False: False}
    for line in log.splitlines():
        ranked = bool(re.match(r"^\[rank\d+\]:", line.strip()))
        text = re.sub(r"^\[rank\d+\]:\s*", "", line.strip())
        if text.startswith("Traceback (most recent call last)"):
            in_traceback[ranked] = True
        elif (in_traceback[ranked] and re.match(r"^[\w.]+(Error|Exception|Interrupt)\b:?", text)
              and "ChildFailedError" not in text and not text.startswith("Exception ignored")):
            found[ranked] = text
            in_traceback[ranked] = False
    return (found.get(True) or found.get(False) or "")[:500]


def run_once(run: str, argv: list[str], out: Path, timeout_s: float, cpu: bool) -> dict:
    result_path, log_path = out / f"{NAME}-{run}.result.json", out / f"{NAME}-{run}.log"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", __file__,
           "--worker", run, "--result", str(result_path), "--out", str(out)] + (["--device", "cpu"] if cpu else []) \
        + ["--", *argv]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron-LM's launch scripts set it
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    row: dict = {"run": run, "command": " ".join(cmd[1:])}
    start = time.monotonic()
    with open(log_path, "w") as log:
        # its own session: torchrun starts its workers in new sessions too, so a timeout must kill them by
        # their process group, or a worker would keep the GPU busy through the next run and step
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            row["returncode"] = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_run(proc)
            row["returncode"], row["error"] = None, f"timed out after {timeout_s:.0f} s"
    row["seconds"] = time.monotonic() - start
    if row["returncode"] != 0 or not result_path.exists():
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        cause = root_error(text)
        row.setdefault("error", f"exit code {row['returncode']}" + (f" ({cause})" if cause else ""))
        row["log_tail"] = text[-3000:]
        return row
    row.update(json.loads(result_path.read_text()))
    return row


def _kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's group and every worker session it started (their parent is the launcher)."""
    import signal

    workers = []
    try:
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    if int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) == proc.pid:
                        workers.append(int(pid))
                except (OSError, IndexError, ValueError):
                    pass
    except OSError:
        pass
    for pgid in [proc.pid] + workers:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def judge(rows: list[dict], cpu: bool) -> tuple[str, dict, str]:
    figures: dict = {"device": "cpu" if cpu else "cuda", "world_size": 1, "backend": "gloo" if cpu else "nccl"}
    problems = []
    for r in rows:
        name = r["run"]
        if "error" in r:
            problems.append(f"{name}: {r['error']}: {r.get('log_tail', '')[-600:]}")
            continue
        losses = r["losses"]
        k = max(1, min(10, len(losses) // 4))
        first, last = _mean(losses[:k]), _mean(losses[-k:])
        figures.update({f"{name}_tokens_per_s": r["tokens_per_s"], f"{name}_first_loss": first,
                        f"{name}_final_loss": last, f"{name}_iterations": r["iterations"],
                        f"{name}_peak_memory_mb": (r["peak_memory_bytes"] / 2**20 if r["peak_memory_bytes"] else None)})
        figures["parameters"] = r["parameters"]
        figures["transformer_impl"] = r["transformer_impl"]
        if not all(map(_finite, losses)):
            problems.append(f"{name}: non-finite loss")
        elif not last < first:
            problems.append(f"{name}: loss did not decrease (mean of the first {k} iterations {first:.4f}, "
                            f"of the last {k} {last:.4f})")
        if name == "plugin" and not any(t["calls"] for t in r["traffic"].values()):
            problems.append("plugin: its hooks saw no data-parallel collective (not installed on the path?)")
    if not cpu and figures.get("parameters") is not None and figures["parameters"] < 100e6:
        problems.append(f"the model has {figures['parameters']} parameters (< 100M)")
    if all(f"{n}_tokens_per_s" in figures for n in RUNS) and figures["absent_tokens_per_s"]:
        figures["plugin_over_absent_tokens_per_s"] = figures["plugin_tokens_per_s"] / figures["absent_tokens_per_s"]
    if problems:
        return "fail", figures, "; ".join(problems)
    detail = ", ".join(f"{n}: {figures[f'{n}_tokens_per_s']:.0f} tokens/s, loss {figures[f'{n}_first_loss']:.3f} -> "
                       f"{figures[f'{n}_final_loss']:.3f}" for n in RUNS)
    return "pass", figures, f"{figures['parameters'] / 1e6:.1f}M parameters, " + detail


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    megatron_argv: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, megatron_argv = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: self-check of this script on one CPU rank with a tiny model")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (default 140, --quick 55)")
    p.add_argument("--worker", choices=RUNS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    cpu = a.device == "cpu"
    if a.worker:
        worker(a.worker, megatron_argv, a.result, cpu)
        return 0
    if not cpu:
        import torch

        if not torch.cuda.is_available():
            return write_result(a.out, "skipped", {}, [], "no CUDA device (torch.cuda.is_available() is False)")
    a.out.mkdir(parents=True, exist_ok=True)
    iters = ITERS["cpu" if cpu else "quick" if a.quick else "full"]
    base = (CPU_ARGS if cpu else GPU_ARGS) + _transformer_impl_args(cpu) + COMMON + [
        "--train-iters", str(iters), "--log-interval", str(max(1, iters // 6))]
    timeout = a.timeout or (180.0 if cpu else 55.0 if a.quick else 140.0)
    rows = [run_once(run, base + (PLUGIN_ARGS if run == "plugin" else []), a.out, timeout, cpu) for run in RUNS]
    status, figures, detail = judge(rows, cpu)
    figures["megatron_args"] = " ".join(base)
    if cpu:
        detail = "self-check on CPU (tiny model, fp32, gloo): " + detail
    return write_result(a.out, status, figures, rows, detail)


if __name__ == "__main__":
    sys.exit(main())
