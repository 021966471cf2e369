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


def rewind_checkpoint(workdir: str, iteration: int) -> None:
    """Point the checkpoint tracker back at ``iteration`` (a save at the end of training moved it on)."""
    from pathlib import Path

    from megatron_zpp.training.checkpoint import TRACKER

    if dist.get_rank() == 0:
        (Path(workdir) / TRACKER).write_text(str(iteration))
    dist.barrier()


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
    rewind_checkpoint(workdir, 4)
    out = {"straight": straight["losses"][4:], "resumed": pretrain(base + ["--load", workdir], log=_quiet)["losses"]}
    if extra:
        import json

        from megatron_zpp.training.checkpoint import MANIFEST, RANK_STATE, _file_digest

        folder = Path(workdir) / "iter_0000004"
        name = f"{RANK_STATE}/rank_{dist.get_rank():05d}.pt"
        state = torch.load(folder / name, weights_only=True)
        residuals = state["compression"]["error_feedback_residuals"]
        out["residual_norms"] = [float(r.norm()) for r in residuals.values()]
        state["compression"]["error_feedback_residuals"] = {k: torch.zeros_like(r) for k, r in residuals.items()}
        torch.save(state, folder / name)
        entry = {"bytes": (folder / name).stat().st_size, "sha256": _file_digest(folder / name)}
        entries: list = [None] * dist.get_world_size()
        dist.all_gather_object(entries, (name, entry))
        if dist.get_rank() == 0:  # re-sign the edited files, or the load refuses them
            manifest = json.loads((folder / MANIFEST).read_text())
            manifest["files"].update(dict(entries))
            (folder / MANIFEST).write_text(json.dumps(manifest))
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

    import megatron_zpp.megatron.fsdp as fsdp_module

    base = SMALL + ["--use-megatron-fsdp", "--bf16", "--overlap-grad-reduce", "--overlap-param-gather",
                    "--zpp-ranks-per-node", "2", "--train-iters", str(iterations), "--ckpt-format", "fsdp_dtensor"]
    none = pretrain(base + ["--zpp-policy", "none"], log=_quiet)
    absent = pretrain(base, log=_quiet, plugin=False)
    out = {"absent": absent["losses"], "absent_grad_norms": absent["grad_norms"], "none": none["losses"],
           "none_traffic": none["traffic"]}
    fair = pretrain(base + ["--zpp-policy", "fair"], log=_quiet)
    out["fair"] = {k: fair[k] for k in ("losses", "grad_norms", "traffic", "dp_replicas_identical", "finite")}

    digests: list[str] = []
    originals = (fsdp_module.quantized_all_gather, fsdp_module.hpz_all_gather)

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

    fsdp_module.quantized_all_gather = digesting(originals[0])
    fsdp_module.hpz_all_gather = digesting(originals[1])
    try:
        zeropp = pretrain(base + ["--zpp-policy", "zeropp", "--save", workdir, "--save-interval", "3"], log=_quiet)
    finally:
        fsdp_module.quantized_all_gather, fsdp_module.hpz_all_gather = originals
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digests)
    out["zeropp"] = {k: zeropp[k] for k in ("losses", "traffic", "finite", "hpz_bytes_per_rank")}
    out["gathers"] = len(digests)
    out["gathers_identical_on_all_ranks"] = all(d == everyone[0] for d in everyone)
    rewind_checkpoint(workdir, 3)
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


DISTOPT_OVERLAP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
POLICIES = {"none": ["--zpp-policy", "none"], "fair": ["--zpp-policy", "fair"], "zeropp": ["--zpp-policy", "zeropp"],
            "mzhybrid": ["--zpp-policy", "mzhybrid"], "zhybrid": ["--zpp-policy", "zhybrid"],
            "int8-param": ["--zpp-policy", "none", "--zpp-dp-param", "int8:block=256"],
            # qWD (issue 23): 4-bit weight differences, a full-precision resync at iteration 3
            "qwd": ["--zpp-policy", "zeropp", "--zpp-dp-param", "int4:block=2048", "--zpp-dp-param-difference",
                    "--zpp-dp-param-resync-interval", "3"],
            # the preset: qWD plus two-level gradients (INT8 inside the node, Hadamard-rotated INT4 across)
            "sdp4bit": ["--zpp-policy", "sdp4bit", "--zpp-dp-param-resync-interval", "3"]}


def replica_consistency(parallel: list[str], policies: list[str], iterations: int) -> dict:
    """Train with ``--check-replica-weights`` under each policy: every module's forward and backward
    weights, digested at the point of use, compared across data-parallel replicas every iteration."""
    base = SMALL + parallel + ["--train-iters", str(iterations), "--zpp-ranks-per-node", "2",
                               "--check-replica-weights", "--eval-iters", "0"]
    out = {}
    for name in ["absent"] + policies:
        run = pretrain(base + POLICIES.get(name, []), log=_quiet, plugin=name != "absent")
        out[name] = run["replica_check"] | {"finite": run["finite"], "losses": run["losses"],
                                            "breakdown": run["breakdown"]}
    return out


class _CountedDifferenceGathers:
    """While active: the hooks' weight-difference gathers, counted, and how many were full-precision resyncs."""

    def __enter__(self):
        import megatron_zpp.megatron.ddp as ddp
        import megatron_zpp.megatron.fsdp as fsdp

        self.original = ddp.weight_difference_all_gather
        self.original_hpz = fsdp.hpz_weight_difference_all_gather
        self.counts = {"gathers": 0, "resyncs": 0, "exchanges": 0, "second_exchanges": 0, "most_per_copy": 0}
        exchanged_at: dict[int, int] = {}  # id(hpZ copy) -> its generation (invalidations) at its last exchange
        per_copy: dict[int, int] = {}

        def counting(output, input, held, *args, **kwargs):
            self.counts["gathers"] += 1
            self.counts["resyncs"] += not held.valid
            return self.original(output, input, held, *args, **kwargs)

        def counting_hpz(output, input, shard, held, *args, **kwargs):  # Megatron-FSDP: every gather comes here
            self.counts["gathers"] += 1
            self.counts["resyncs"] += not held.valid
            if held.valid and not shard.valid:
                self.counts["exchanges"] += 1
                # a second exchange of one copy with no weight update between them
                self.counts["second_exchanges"] += exchanged_at.get(id(shard)) == shard.generation
                exchanged_at[id(shard)] = shard.generation
                per_copy[id(shard)] = per_copy.get(id(shard), 0) + 1
                self.counts["most_per_copy"] = max(per_copy.values())
            return self.original_hpz(output, input, shard, held, *args, **kwargs)

        ddp.weight_difference_all_gather = counting
        fsdp.hpz_weight_difference_all_gather = counting_hpz
        return self.counts

    def __exit__(self, *exc):
        import megatron_zpp.megatron.ddp as ddp
        import megatron_zpp.megatron.fsdp as fsdp

        ddp.weight_difference_all_gather = self.original
        fsdp.hpz_weight_difference_all_gather = self.original_hpz


def weight_difference_consistency(parallel: list[str], iterations: int) -> dict:
    """:func:`replica_consistency` under the ``sdp4bit`` preset (qWD and Hadamard-rotated two-level gradients;
    bf16, Megatron alone in bf16 too), counting the hooks' weight-difference gathers and their full-precision
    resyncs."""
    with _CountedDifferenceGathers() as counts:
        out = replica_consistency(parallel + ["--bf16"], ["sdp4bit"], iterations)
    out["sdp4bit"]["counts"] = counts
    return out


def weight_difference_resume(directory: str) -> dict:
    """qWD, bf16, distributed optimizer: 3 iterations (saved at 2 and at the end), then a run loaded from the
    last checkpoint for 2 more; the gathers of each run and how many were resyncs, with every replica's weights
    compared at every use in the resumed one."""
    base = SMALL + DISTOPT_OVERLAP + ["--bf16", "--zpp-ranks-per-node", "2", "--check-replica-weights",
                                      "--eval-iters", "0"] + POLICIES["qwd"][:-2]  # no periodic resync
    with _CountedDifferenceGathers() as first:
        saved = pretrain(base + ["--train-iters", "3", "--save", directory, "--save-interval", "2"], log=_quiet)
        first = dict(first)
    with _CountedDifferenceGathers() as resumed:
        loaded = pretrain(base + ["--train-iters", "5", "--load", directory], log=_quiet)
    return {"first": first, "resumed": dict(resumed), "saved_losses": saved["losses"],
            "resumed_losses": loaded["losses"], "replica_check": loaded["replica_check"], "finite": loaded["finite"]}


def optimizer_steps_from_its_own_weights(parallel: list[str], iterations: int, directory: str,
                                         policy: list[str] = ("--zpp-policy", "zeropp")) -> dict:
    """fp32 weights, distributed optimizer, zeropp (INT8 qwZ; or sdp4bit's 4-bit weight differences) with a
    checkpoint save midway: torch's AdamW step,
    spied through torch's global step hooks. Each step must start from exactly the weights the previous one
    produced (the optimizer's master copy), not from the decoded weights the gather wrote over them (without the
    fix, every step after the first does)."""
    import torch

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    snapshots: list[tuple[list, list]] = []  # (before, after) per step, this rank's shards

    def shards(optimizer) -> list:
        return [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]

    def before(optimizer, args, kwargs) -> None:
        snapshots.append((shards(optimizer), None))

    def after(optimizer, args, kwargs) -> None:
        snapshots[-1] = (snapshots[-1][0], shards(optimizer))

    # torch's global step hooks (not a patched step: torch wraps Optimizer.step with its own hook machinery)
    handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    try:
        run = pretrain(SMALL + parallel + list(policy) + ["--zpp-ranks-per-node", "2", "--eval-iters", "0",
                                           "--train-iters", str(iterations), "--save", directory,
                                           "--save-interval", "2", "--check-replica-weights"], log=_quiet)
    finally:
        for h in handles:
            h.remove()
    continuous = [all(torch.equal(b, a) for b, a in zip(snapshots[k][0], snapshots[k - 1][1]))
                  for k in range(1, len(snapshots))]
    # Resumed from the last checkpoint for 2 more iterations: replicas must agree from the first forward on
    # (the checkpoint's model tensor is DP rank 0's copy; the optimizer then loads each owner's exact shard).
    resumed = pretrain(SMALL + parallel + list(policy) + ["--zpp-ranks-per-node", "2", "--eval-iters", "0",
                                           "--train-iters", str(iterations + 2), "--load", directory,
                                           "--check-replica-weights"], log=_quiet)
    return {"steps": len(snapshots), "continuous": continuous, "finite": run["finite"],
            "replica_check": run["replica_check"], "resumed_replica_check": resumed["replica_check"],
            "resumed_losses": resumed["losses"]}


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
                    "--zpp-ranks-per-node", "2", "--zpp-policy", "zeropp", "--zpp-dp-grad-error-feedback",
                    "--ckpt-format", "fsdp_dtensor"]
    one = pretrain(base + ["--train-iters", "1"], log=_quiet)
    straight = pretrain(base + ["--train-iters", "4", "--save", workdir, "--save-interval", "2"], log=_quiet)
    rewind_checkpoint(workdir, 2)
    resumed = pretrain(base + ["--train-iters", "4", "--load", workdir], log=_quiet)
    return {"buckets_after_1": one["error_feedback_buckets"], "buckets_after_4": straight["error_feedback_buckets"],
            "straight": straight["losses"][2:], "resumed": resumed["losses"], "finite": straight["finite"]}


RESHARD_LAYOUTS = {"DP4": [], "TP2xDP2": ["--tensor-model-parallel-size", "2"],
                   "PP2xDP2": ["--pipeline-model-parallel-size", "2"]}


def reshard_resume(workdir: str, zero: list[str], layouts: list[str], policy: str = "none") -> dict:
    """Train 6 iterations at DP4 saving at 4; resume from 4 on each of ``layouts``: the two losses after the
    resume, against the uninterrupted run's. The padded vocabulary is the same at TP1 and TP2 (256-divisible)."""
    base = SMALL + ["--make-vocab-size-divisible-by", "256", "--global-batch-size", "8", "--train-iters", "6",
                    "--zpp-ranks-per-node", "2", "--zpp-policy", policy] + zero
    straight = pretrain(base + ["--save", workdir, "--save-interval", "4"], log=_quiet)
    out = {"straight": straight["losses"][4:]}
    for name in layouts:
        rewind_checkpoint(workdir, 4)
        out[name] = pretrain(base + RESHARD_LAYOUTS[name] + ["--load", workdir], log=_quiet)["losses"]
    return out


def checkpoint_damage(workdir: str) -> dict:
    """Save at 2 and 4; then: a save of iteration 6 killed before its commit (rank 0 SIGKILLs itself) is
    tested by the caller; here, after the kill, the previous checkpoint must load and continue like the
    uninterrupted run; then a truncated and a bit-flipped file must be refused with their names."""
    from pathlib import Path

    from megatron_zpp.training.checkpoint import CheckpointError

    base = SMALL + ["--use-distributed-optimizer", "--zpp-ranks-per-node", "2", "--zpp-policy", "none"]
    out: dict = {"partial_left": sorted(p.name for p in Path(workdir).glob("*.partial"))}
    resumed = pretrain(base + ["--train-iters", "6", "--load", workdir, "--save", workdir], log=_quiet)
    out["resumed"] = resumed["losses"]
    folder = Path(workdir) / "iter_0000006"  # the save at the end of the resumed run
    out["partial_after_resave"] = sorted(p.name for p in Path(workdir).glob("*.partial"))
    data = sorted(folder.glob("*.distcp"))[0]
    errors = {}
    for damage in ("truncate", "flip"):
        if dist.get_rank() == 0:
            raw = bytearray(data.read_bytes())
            backup = bytes(raw)
            if damage == "truncate":
                raw = raw[: len(raw) // 2]
            else:
                raw[len(raw) // 3] ^= 0x10
            data.write_bytes(bytes(raw))
        dist.barrier()
        try:
            pretrain(base + ["--train-iters", "7", "--load", workdir], log=_quiet)
            errors[damage] = "no error"
        except CheckpointError as e:
            errors[damage] = str(e)
        dist.barrier()
        if dist.get_rank() == 0:
            data.write_bytes(backup)
        dist.barrier()
    out["errors"] = errors
    return out


def save_then_get_killed(workdir: str) -> None:
    """Train 6 iterations saving every 2; rank 0 SIGKILLs itself inside the save of iteration 6, after every
    rank wrote its data and before the commit (the spawner then stops the others)."""
    import os

    os.environ["ZPP_TEST_KILL_DURING_SAVE"] = "6"
    base = SMALL + ["--use-distributed-optimizer", "--zpp-ranks-per-node", "2", "--zpp-policy", "none"]
    pretrain(base + ["--train-iters", "6", "--save", workdir, "--save-interval", "2"], log=_quiet)


def straight_losses(iterations: int) -> list[float]:
    base = SMALL + ["--use-distributed-optimizer", "--zpp-ranks-per-node", "2", "--zpp-policy", "none"]
    return pretrain(base + ["--train-iters", str(iterations)], log=_quiet)["losses"]
