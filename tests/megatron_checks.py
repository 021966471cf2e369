"""Per-rank bodies of the Megatron-Core integration tests (spawned gloo processes, CPU shim)."""

from __future__ import annotations

import torch.distributed as dist

from megatron_zpp.policy import ZppConfig, check_policy_agreement, resolve_policy
from megatron_zpp.training.arguments import PROJECT_RECIPE
from megatron_zpp.training.trainer import pretrain

SMALL = PROJECT_RECIPE + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "constant",
         "--log-interval", "1000"]


def _quiet(*args, **kwargs) -> None:
    pass


def run_policies(parallel: list[str], iterations: int, ranks_per_node: int, overlap_variants: bool) -> dict:
    """Train the same small GPT with the plugin absent, with ``none``, ``fair`` and ``zeropp``.

    With ``overlap_variants`` the first two are repeated with --overlap-grad-reduce and
    --overlap-param-gather, and zeropp runs with them.
    """
    base = SMALL + parallel + ["--train-iters", str(iterations), "--zpp-ranks-per-node", str(ranks_per_node)]
    overlap = ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if "--use-distributed-optimizer" in parallel
                                           else [])
    none = pretrain(base + ["--zpp-policy", "none"], log=_quiet)
    absent = pretrain(base, log=_quiet, plugin=False)
    out = {"absent": absent["losses"], "absent_grad_norms": absent["grad_norms"], "none": none["losses"],
           "none_traffic": none["traffic"]}
    fair = pretrain(base + ["--zpp-policy", "fair"], log=_quiet)
    out["fair"] = {k: fair[k] for k in ("losses", "grad_norms", "traffic", "dp_replicas_identical", "finite")}
    if overlap_variants:
        out["absent_overlap"] = pretrain(base + overlap, log=_quiet, plugin=False)["losses"]
        out["none_overlap"] = pretrain(base + overlap + ["--zpp-policy", "none"], log=_quiet)["losses"]
    zeropp = pretrain(base + (overlap if overlap_variants else []) + ["--zpp-policy", "zeropp"], log=_quiet)
    out["zeropp"] = {k: zeropp[k] for k in ("losses", "traffic", "dp_replicas_identical", "finite")}
    return out


def policy_mismatch() -> str:
    """Rank 0 resolves a different dp.grad codec than the others: everyone gets a ValueError."""
    spec = "int8:block=256" if dist.get_rank() == 0 else "int4:block=128"
    try:
        check_policy_agreement(resolve_policy(ZppConfig(policy="zeropp", dp_grad=spec)))
    except ValueError as e:
        return str(e)
    return "no error"


def resume_matches_straight_run(workdir: str, extra: list[str] | None = None) -> dict:
    """Train 6 iterations saving at 4; resume from 4 to 6: the last two losses must be identical.
    With error feedback on (``extra``), also resume with the residuals dropped from the checkpoint:
    that run must differ (the residuals are part of the state)."""
    from pathlib import Path

    import torch

    extra = extra or []
    base = SMALL + ["--use-distributed-optimizer", "--zpp-policy", "zeropp", "--zpp-ranks-per-node", "1",
                    "--train-iters", "6"] + extra
    straight = pretrain(base + ["--save", workdir, "--save-interval", "4"], log=_quiet)
    if dist.get_rank() == 0:
        (Path(workdir) / "latest").write_text("4")
    dist.barrier()
    out = {"straight": straight["losses"][4:], "resumed": pretrain(base + ["--load", workdir], log=_quiet)["losses"]}
    if extra:
        path = Path(workdir) / "iter_0000004" / f"rank_{dist.get_rank():05d}.pt"
        state = torch.load(path, weights_only=False)
        residuals = state["compression"]["error_feedback_residuals"]
        out["residual_norms"] = [float(r.norm()) for r in residuals.values()]
        state["compression"]["error_feedback_residuals"] = {k: torch.zeros_like(r) for k, r in residuals.items()}
        torch.save(state, path)
        dist.barrier()
        out["resumed_without_residuals"] = pretrain(base + ["--load", workdir], log=_quiet)["losses"]
    return out


def fsdp_zeropp(iterations: int, workdir: str) -> dict:
    """Megatron-FSDP (ZeRO-3) on 2 nodes x 2, bf16: plugin absent vs none (bit-identical), fair, zeropp
    (trains, every rank decodes bit-identical weights in every gather, traffic per collective),
    and a run saved at iteration 3 and resumed with hpZ (losses equal to the uninterrupted run)."""
    import hashlib
    from pathlib import Path

    import torch

    import megatron_zpp.megatron.hooks as hooks_module

    base = SMALL + ["--use-megatron-fsdp", "--bf16", "--overlap-grad-reduce", "--overlap-param-gather",
                    "--zpp-ranks-per-node", "2", "--train-iters", str(iterations)]
    none = pretrain(base + ["--zpp-policy", "none"], log=_quiet)
    absent = pretrain(base, log=_quiet, plugin=False)
    out = {"absent": absent["losses"], "absent_grad_norms": absent["grad_norms"], "none": none["losses"],
           "none_traffic": none["traffic"]}
    fair = pretrain(base + ["--zpp-policy", "fair"], log=_quiet)
    out["fair"] = {k: fair[k] for k in ("losses", "grad_norms", "traffic", "dp_replicas_identical", "finite")}

    digests: list[str] = []
    originals = (hooks_module.quantized_all_gather, hooks_module.hpz_all_gather)

    def digesting(fn):
        def call(output, *args, **kwargs):
            handle = fn(output, *args, **kwargs)

            class Digest:
                def wait(self):
                    if handle is not None:
                        handle.wait()
                    # A copy: exporting FSDP's bucket itself to numpy would pin its storage.
                    raw = output.detach().clone().view(-1).view(torch.uint8)
                    digests.append(hashlib.sha256(raw.numpy().tobytes()).hexdigest())
            d = Digest()
            if handle is None:
                d.wait()
                return None
            return d
        return call

    hooks_module.quantized_all_gather = digesting(originals[0])
    hooks_module.hpz_all_gather = digesting(originals[1])
    try:
        zeropp = pretrain(base + ["--zpp-policy", "zeropp", "--save", workdir, "--save-interval", "3"], log=_quiet)
    finally:
        hooks_module.quantized_all_gather, hooks_module.hpz_all_gather = originals
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digests)
    out["zeropp"] = {k: zeropp[k] for k in ("losses", "traffic", "finite", "hpz_bytes_per_rank")}
    out["gathers"] = len(digests)
    out["gathers_identical_on_all_ranks"] = all(d == everyone[0] for d in everyone)
    if dist.get_rank() == 0:
        (Path(workdir) / "latest").write_text("3")
    dist.barrier()
    out["resumed"] = pretrain(base + ["--zpp-policy", "zeropp", "--load", workdir], log=_quiet)["losses"]
    return out


def model_parallel_codecs(parallel: list[str], dim: str, iterations: int) -> dict:
    """``--zpp-{dim} int8`` trains; ``none`` is bit-identical to no plugin; traffic under ``dim``."""
    base = SMALL + parallel + ["--train-iters", str(iterations), "--zpp-ranks-per-node", "2"]
    out = {"absent": pretrain(base, log=_quiet, plugin=False)["losses"],
           "none": pretrain(base + ["--zpp-policy", "none"], log=_quiet)["losses"]}
    run = pretrain(base + [f"--zpp-{dim}", "int8:block=256"], log=_quiet)
    out["int8"] = {k: run[k] for k in ("losses", "traffic", "finite")}
    return out


def lossless_codec_for(dim: str) -> str:
    """One lossless codec per model-parallel dimension in the tests (both covered, half the runs)."""
    return {"tp": "mpc", "pp": "zstd"}[dim]


def hybrid_presets(parallel: list[str], dim: str, iterations: int) -> dict:
    """The MVAPICH presets on a model-parallel layout: a lossless codec alone on ``dim`` trains
    bit-identically to Megatron without the plugin; mzhybrid and zhybrid train, keep the data-parallel
    replicas on identical weights at every use, and count their traffic."""
    base = SMALL + parallel + ["--train-iters", str(iterations), "--zpp-ranks-per-node", "2", "--eval-iters", "0"]
    out = {"absent": pretrain(base, log=_quiet, plugin=False)["losses"]}
    codec = lossless_codec_for(dim)
    out[f"{dim}-{codec}"] = pretrain(base + ["--zpp-policy", "none", f"--zpp-{dim}", codec], log=_quiet)["losses"]
    for preset in ("mzhybrid", "zhybrid"):
        run = pretrain(base + ["--zpp-policy", preset, "--check-replica-weights"], log=_quiet)
        out[preset] = {k: run[k] for k in ("losses", "traffic", "finite", "replica_check")}
    return out


POLICIES = {"none": ["--zpp-policy", "none"], "fair": ["--zpp-policy", "fair"], "zeropp": ["--zpp-policy", "zeropp"],
            "mzhybrid": ["--zpp-policy", "mzhybrid"], "zhybrid": ["--zpp-policy", "zhybrid"],
            "int8-param": ["--zpp-policy", "none", "--zpp-dp-param", "int8:block=256"]}


def replica_consistency(parallel: list[str], policies: list[str], iterations: int) -> dict:
    """Train with ``--check-replica-weights`` under each policy: every module's forward and backward
    weights, digested at the point of use, compared across data-parallel replicas every iteration."""
    base = SMALL + parallel + ["--train-iters", str(iterations), "--zpp-ranks-per-node", "2",
                               "--check-replica-weights", "--eval-iters", "0"]
    out = {}
    for name in ["absent"] + policies:
        run = pretrain(base + POLICIES.get(name, []), log=_quiet, plugin=name != "absent")
        out[name] = run["replica_check"] | {"finite": run["finite"], "losses": run["losses"]}
    return out


def none_is_megatron(parallel: list[str], iterations: int) -> dict:
    """Megatron without the plugin vs the ``none`` policy, with no ranks-per-node anywhere (no
    --zpp-ranks-per-node, LOCAL_WORLD_SIZE unset): losses and the process groups each run creates."""
    import torch.distributed as torch_dist

    base = SMALL + parallel + ["--train-iters", str(iterations), "--eval-iters", "0"]
    created: list = []
    original = torch_dist.new_group

    def counting(*args, **kwargs):
        created.append(1)
        return original(*args, **kwargs)

    out = {}
    torch_dist.new_group = counting
    try:
        for name, argv, plugin in (("absent", base, False), ("none", base + ["--zpp-policy", "none"], True)):
            created.clear()
            run = pretrain(argv, log=_quiet, plugin=plugin)
            out[name] = {"losses": run["losses"], "groups_created": len(created),
                         "grad_bytes": run["traffic"].get("dp.grad", {}).get("inter_bytes", 0)}
    finally:
        torch_dist.new_group = original
    return out


def schedule_through_curr_iteration(iterations: int) -> list[str]:
    """The codec of every gradient reduction when ``--zpp-dp-grad-until 0.5`` is applied by the hooks
    from ``args.curr_iteration`` (the Megatron-LM plugin path; pretrain_gpt.py uses the same one)."""
    import megatron_zpp.megatron.hooks as hooks_module

    seen: list[str] = []
    original = hooks_module.MegatronHooks._reduce_scatter_grads

    def spy(self, *args, **kwargs):
        seen.append(self.grad_codec)
        return original(self, *args, **kwargs)

    hooks_module.MegatronHooks._reduce_scatter_grads = spy
    try:
        pretrain(SMALL + ["--use-distributed-optimizer", "--train-iters", str(iterations), "--eval-iters", "0",
                          "--zpp-policy", "zeropp", "--zpp-dp-grad-until", "0.5", "--zpp-ranks-per-node", "1"],
                 log=_quiet)
    finally:
        hooks_module.MegatronHooks._reduce_scatter_grads = original
    return seen


def megatron_lm_flags(iterations: int) -> dict:
    """The flags added for Megatron-LM parity, each run short on this world."""
    base = SMALL + ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                    "--train-iters", str(iterations), "--zpp-ranks-per-node", "1"]
    lines: list[str] = []

    def collect(*args, **kwargs):
        lines.append(" ".join(str(a) for a in args))

    out = {"plain": pretrain(base, log=_quiet)["losses"]}
    out["selective"] = pretrain(base + ["--recompute-activations"], log=_quiet)["losses"]
    out["full"] = pretrain(base + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                   "--recompute-num-layers", "1"], log=_quiet)["losses"]
    out["init_std"] = pretrain(base + ["--init-method-std", "0.05"], log=_quiet)["losses"]
    run = pretrain(base + ["--eval-interval", "2"], log=collect)
    out["eval_lines"] = [line for line in lines if "validation loss at iteration" in line]
    out["eval_losses"] = run["losses"]
    out["exit"] = pretrain(base + ["--exit-interval", "3"], log=_quiet)["losses"]
    fp16 = pretrain(base + ["--fp16", "--initial-loss-scale", "4096"], log=_quiet)
    out["fp16"] = {"losses": fp16["losses"], "finite": fp16["finite"]}
    return out


def error_feedback_fsdp(workdir: str) -> dict:
    """Error feedback on Megatron-FSDP (bucket storage reallocated for every reduction): one residual per
    bucket whatever the number of iterations, and a resume from a checkpoint continues bit for bit."""
    from pathlib import Path

    base = SMALL + ["--use-megatron-fsdp", "--bf16", "--overlap-grad-reduce", "--overlap-param-gather",
                    "--zpp-ranks-per-node", "2", "--zpp-policy", "zeropp", "--zpp-dp-grad-error-feedback"]
    one = pretrain(base + ["--train-iters", "1"], log=_quiet)
    straight = pretrain(base + ["--train-iters", "4", "--save", workdir, "--save-interval", "2"], log=_quiet)
    if dist.get_rank() == 0:
        (Path(workdir) / "latest").write_text("2")
    dist.barrier()
    resumed = pretrain(base + ["--train-iters", "4", "--load", workdir], log=_quiet)
    return {"buckets_after_1": one["error_feedback_buckets"], "buckets_after_4": straight["error_feedback_buckets"],
            "straight": straight["losses"][2:], "resumed": resumed["losses"], "finite": straight["finite"]}
