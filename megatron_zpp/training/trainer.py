"""``pretrain(argv)``: GPT pretraining on Megatron-Core with a megatron_zpp compression policy.

A compact driver in the shape of Megatron-LM's ``pretrain_gpt.py``: the model is
Megatron-Core's ``GPTModel`` (``model.py``: Transformer Engine's layers where TE and a GPU are there,
Megatron-Core's own otherwise), wrapped in its ``DistributedDataParallel`` with its (distributed) optimizer and pipeline schedules; the
policy's hooks are installed before DDP is built. It runs on GPUs with NCCL and, when there is
no GPU, on CPU processes with gloo through ``megatron_zpp.megatron.cpu_shim``.

Launch with torchrun (one process per GPU, or per CPU rank)::

    torchrun --nproc-per-node 4 pretrain_gpt.py --use-distributed-optimizer --zpp-policy zeropp \\
        --zpp-ranks-per-node 2 --train-iters 50
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_zpp.megatron.flight_recorder import flight_recorder_default
from megatron_zpp.policy import ConfigError
from megatron_zpp.training import faults
from megatron_zpp.training.agreement import Agreement, StepFailedError, communication_error, describe, is_agreed
from megatron_zpp.training.arguments import build_parser, validate_args
from megatron_zpp.training.divergence import DivergenceGuard, divergence_config_from_args
from megatron_zpp.training.data import build_datasets, micro_batches
from megatron_zpp.training.log import IterationLogger
from megatron_zpp.training.model import (build_model, optimizer_fallback_note, resolve_fusions,
                                         resolve_transformer_impl, transformer_engine_available)
from megatron_zpp.training.moe import check_moe_runs_here, report_aux_losses
from megatron_zpp.training.quiet import install_warning_filters
from megatron_zpp.training.tokenizer import padded_vocab_size, tokenizer_from_args
from megatron_zpp.training.watchdog import RankFailureError, RankWatchdog, rank_failure_config_from_args


def _init_distributed(args) -> torch.device:
    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        from megatron_zpp.megatron.cpu_shim import install_cpu_shim

        install_cpu_shim()
    backend = args.distributed_backend or ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise ConfigError("--distributed-backend nccl needs a GPU; this machine has none (valid here: gloo)")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        flight_recorder_default(backend)
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def _loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) * faults.loss_factor()
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.float().view(1)])}


def _forward_step(device, on_micro_batch, agreement, data_iterator, model):
    faults.process_fault()
    # No confirmation per micro-batch: the iteration's own collectives follow; a failure is published.
    with agreement.step("data loading", confirm=False):
        faults.raise_if("data")
        batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    on_micro_batch()
    return output, partial(_loss_func, batch["loss_mask"])


def _nothing() -> None:
    pass




def pretrain(argv: list[str] | None = None, *, log=print, plugin: bool = True) -> dict:
    """Parse ``argv`` (Megatron-style flags), train, and return the run summary (on every rank).

    ``plugin=False`` builds the same run without installing the hooks (tests compare the two).
    """
    install_warning_filters()  # the known-harmless upstream warnings (quiet.py); pretrain_gpt.py did it before imports
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_zpp.megatron import hooks_from_args

    args = build_parser().parse_args(argv)
    device = _init_distributed(args)
    world, rank = dist.get_world_size(), dist.get_rank()
    # The checks read files (data prefixes, tokenizer files, a policy YAML) on each rank: one staged on some
    # nodes only must not leave the others in the next collective with no watchdog yet. A local step: the same
    # error on every rank is raised as it is (a ConfigError: one line, exit 2), else every rank names the ranks.
    with Agreement(device=device).step("configuration", local=True):
        args = validate_args(args, world)
        # The same path as Megatron-LM's script (install_from_args): the dp.grad schedule reads
        # args.curr_iteration, which the loop below sets as Megatron-LM's does.
        hooks = hooks_from_args(args)
    hooks.device_type = device.type
    policy = hooks.policy
    cuda = device.type == "cuda"
    impl, impl_note = resolve_transformer_impl(
        args, cuda=cuda, te=transformer_engine_available(),
        tp_compressed=(policy.compresses("tp") or hooks.model_parallel_codecs["tp"] != "none")
        and args.tensor_model_parallel_size > 1)
    fusions, fusions_off = resolve_fusions(args, impl, cuda=cuda)
    check_moe_runs_here(args, cuda=cuda, impl=impl)
    if rank == 0:
        for note in (impl_note, optimizer_fallback_note(cuda)):
            if note:
                log(note)
        if fusions_off and cuda:  # on CPU all are off, as expected; on a GPU a missing library is worth a line
            log("> fusions off: " + ", ".join(f"{k} ({v})" for k, v in fusions_off.items()))
    if plugin:
        hooks.install()
    watchdog = RankWatchdog(rank_failure_config_from_args(args))
    watchdog.coarse = args.pipeline_model_parallel_size > 1
    watchdog.start()
    agreement = Agreement(device=device, watchdog=watchdog)
    faults.configure(os.environ.get("ZPP_TEST_FAULT"))

    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size)
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        torch.manual_seed(args.seed)
        tokenizer = tokenizer_from_args(args)
        # Megatron-LM's embedding size: the tokenizer's vocabulary padded to divisible-by x TP.
        args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                                   args.tensor_model_parallel_size)
        with agreement.step("data loading"):
            data = build_datasets(args, tokenizer)  # first: a bad dataset fails before the model is built
        config, chunks = build_model(args, device, impl, fusions)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.bf16, overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather, use_distributed_optimizer=args.use_distributed_optimizer,
            bucket_size=args.ddp_bucket_size, align_param_gather=args.align_param_gather)
        if args.use_megatron_fsdp:
            from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

            # ZeRO-3: parameters, gradients and optimizer state sharded over DP. The fused
            # pre-scale (PREMUL_SUM) is NCCL-only, and compressed reduce-scatters pre-scale anyway.
            ddp_config.use_megatron_fsdp = True
            ddp_config.data_parallel_sharding_strategy = "optim_grads_params"
            ddp_config.gradient_reduce_div_fusion = False
            # An explicit device: Megatron-FSDP allocates gradient buckets inside backward hooks,
            # where the CPU shim's device redirection is not active.
            models = [FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=c, device=device)
                      for c in chunks]
        else:
            # Only the first chunk buckets its gradients (Megatron-LM's convention for virtual stages).
            models = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c,
                                              disable_bucketing=i > 0) for i, c in enumerate(chunks)]
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
                            bf16=args.bf16, fp16=args.fp16, loss_scale=args.loss_scale,
                            initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
                            loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
                            params_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32,
                            use_distributed_optimizer=args.use_distributed_optimizer or args.use_megatron_fsdp),
            models)
        samples = args.global_batch_size  # Megatron's scheduler counts samples, as it is stepped by them
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters * samples, lr_decay_steps=args.lr_decay_iters * samples,
            lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
            wd_incr_steps=args.train_iters * samples, wd_incr_style="constant")
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
        single = len(models) == 1
        if args.overlap_grad_reduce:
            config.no_sync_func = models[0].no_sync if single else [m.no_sync for m in models]
        if args.overlap_param_gather:
            config.param_sync_func = models[0].start_param_sync if single else [m.start_param_sync for m in models]

        replica_check = None
        if args.check_replica_weights:
            from megatron_zpp.megatron.replica_check import ReplicaWeightCheck

            # Registered after Megatron's hooks: digests the weights each module actually uses.
            expert_group = parallel_state.get_expert_data_parallel_group() if args.num_experts else None
            replica_check = ReplicaWeightCheck(models, parallel_state.get_data_parallel_group(),
                                               expert_group=expert_group)

        guard = DivergenceGuard(divergence_config_from_args(args), hooks, device=device, fp16=args.fp16, log=log,
                                agreement=agreement)
        guard.install(optimizer)
        faults.install_policy_faults(hooks)

        start_iteration = 0
        if args.load:
            from megatron_zpp.training.checkpoint import load_checkpoint

            start_iteration = load_checkpoint(args, models, optimizer, scheduler, hooks, log=log, agreement=agreement)
            hooks.invalidate_secondary()
            hooks.resync_weights(loaded=True)  # qWD: the loaded weights are gathered in full precision first
            _gather_loaded_fp32_weights(args, models, hooks)

        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        # One iterator per model chunk: with virtual stages each chunk pulls its own micro-batches.
        # Resuming at iteration k continues from sample k x global batch (Megatron-LM's consumed samples).
        def train_batches(iteration: int):
            iterators = [micro_batches(data.train, iteration * args.global_batch_size, args.micro_batch_size,
                                       dp_rank, dp_size) for _ in models]
            return iterators[0] if single else iterators

        batches = train_batches(start_iteration)
        forward_backward = get_forward_backward_func()
        logger = IterationLogger(args, policy, log=log, device=device)
        logger.start(data.description, world)
        if logger.wandb is not None:
            guard.wandb_log = lambda values, step: logger.wandb.log(values, step=step)
        auto = None
        if policy.name == "auto":
            from megatron_zpp.policy.auto import auto_config_from_args
            from megatron_zpp.training.auto_policy import AutoPolicy

            auto = AutoPolicy(auto_config_from_args(args), hooks, args, device=device, vocab=tokenizer.vocab_size,
                              agreement=agreement, log=log, wandb_log=guard.wandb_log)
            auto.suspended = lambda: guard.suspended_until is not None
            with watchdog.paused(), agreement.step("auto policy calibration"):
                auto.start(start_iteration + 1)

        def on_micro_batch():
            watchdog.progress(args.curr_iteration + 1, faults.state["micro_batch"])

        losses = []
        valid_curve: list[tuple[int, float]] = []  # (iteration, validation loss) of the evaluations during training
        valid_batches = None  # one validation stream for every evaluation, as Megatron-LM's
        if args.eval_iters:
            # The evaluations an earlier run made before iteration k consumed their samples (Megatron-LM
            # keeps that count in its checkpoint; here it follows from --eval-interval).
            evaluated = start_iteration // args.eval_interval if args.eval_interval else 0
            consumed = evaluated * args.eval_iters * args.global_batch_size
            streams = [micro_batches(data.valid, consumed, args.micro_batch_size, dp_rank, dp_size) for _ in models]
            valid_batches = streams[0] if single else streams
        last_iteration = args.train_iters
        # Resumed into the directory it loaded from: that iteration is saved already (re-saving it would only
        # open a window in which the tracker names a directory being replaced).
        same_dir = bool(args.load and args.save and Path(args.load).resolve() == Path(args.save).resolve())
        saved_iteration = start_iteration if same_dir else None
        iteration = start_iteration - 1
        while iteration + 1 < args.train_iters:
            iteration += 1
            args.curr_iteration = iteration
            faults.state.update(iteration=iteration + 1, micro_batch=0)
            watchdog.progress(iteration + 1, 0)
            guard.begin(iteration + 1)  # before any collective: the codecs of this step
            if auto is not None:
                with watchdog.paused():  # a decision may re-measure the link (bounded, a few seconds)
                    auto.begin(iteration + 1)
            hooks.ensure_policy_agreed()  # once, world-wide; here every rank is at the same point
            hooks.sync_iteration()  # schedule and rounding seeds for this step, before any collective
            t0 = time.perf_counter()
            # A failure on one rank (a corrupt payload its receiver alone sees, ...) is published to the peers,
            # which are blocked in the step's collectives; no confirmation: the loss reduction follows.
            with agreement.step(f"training iteration {iteration + 1}", confirm=False):
                for m in models:
                    m.zero_grad_buffer()
                optimizer.zero_grad()
                reduced = forward_backward(
                    forward_step_func=partial(_forward_step, device, on_micro_batch, agreement), data_iterator=batches,
                    model=models, num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size, forward_only=False)
                update_ok, grad_norm, _ = optimizer.step()
            # No invalidate_secondary() here: Megatron-FSDP's weight install (hooked) invalidates the hpZ copies
            # inside the step, and with --overlap-param-gather the step then prefetches the next forward's
            # gathers, which may have refreshed them already (qWD's difference exchange does, at its progress
            # point): invalidating again made qWD exchange a second difference for those buckets.
            if update_ok:  # as Megatron-LM: a skipped step (overflow, non-finite gradients) leaves the schedule
                scheduler.step(increment=args.global_batch_size)
            if replica_check is not None:
                replica_check.end_iteration(iteration + 1)
            loss = _reduce_loss(reduced, parallel_state)
            step_s = time.perf_counter() - t0
            losses.append(loss)
            diverged = guard.end(iteration + 1, loss, grad_norm, update_ok)
            if auto is not None:
                auto.end(iteration + 1, step_s)
            logger.iteration(iteration + 1, loss, scheduler.get_lr(optimizer.param_groups[0]), grad_norm,
                             step_s, update_ok, hooks.hpz_bytes, report_aux_losses(args, iteration + 1))
            if diverged and guard.config.reload:
                with watchdog.paused():
                    back = _reload_after_divergence(args, models, optimizer, scheduler, hooks, guard, log, agreement)
                if back is not None:  # rewind: the data, the losses and the guard's fallback restart from there
                    guard.rewound(back)
                    del losses[max(0, back - start_iteration):]
                    batches = train_batches(back)
                    iteration = back - 1
                    continue
            if args.save and args.save_interval and (iteration + 1) % args.save_interval == 0:
                with watchdog.paused():
                    _save(args, iteration + 1, models, optimizer, scheduler, hooks, agreement)
                saved_iteration = iteration + 1
            done = iteration + 1
            if args.exit_interval and done % args.exit_interval == 0 and done < args.train_iters:
                last_iteration = done
                if rank == 0:
                    log(f"> exiting at iteration {done} (--exit-interval {args.exit_interval})")
                break
            if args.eval_interval and valid_batches is not None and done % args.eval_interval == 0 \
                    and done < args.train_iters:
                with watchdog.paused():
                    loss_now = _evaluate_during_training(args, models, valid_batches, forward_backward, device,
                                                         parallel_state, agreement)
                valid_curve.append((done, loss_now))
                if rank == 0:
                    log(f"> validation loss at iteration {done}: {loss_now:.6f}")
        logger.end_training()  # per-iteration bytes: the loop only, not the final sync and evaluation
        watchdog.loop_done()  # the final save and evaluation have no stall timeout; heartbeats go on
        if args.save and saved_iteration != last_iteration:
            _save(args, last_iteration, models, optimizer, scheduler, hooks, agreement)
        if args.use_distributed_optimizer or args.use_megatron_fsdp:
            # Overlap leaves params stale until the next forward, and FSDP keeps them sharded:
            # gather them (with the policy's codec) so replicas can be compared.
            for m in models:
                m.start_param_sync(force_sync=True)
        valid_loss = None
        if valid_batches is not None:
            valid_loss = evaluate(args, models, valid_batches, forward_backward, device, parallel_state, agreement)
        if replica_check is not None:
            replica_check.remove()
        summary = logger.finish(losses, models, hooks, valid_loss=valid_loss,
                                finite=_all_ranks_finite(optimizer, device), sharded=args.use_megatron_fsdp,
                                replica_check=replica_check)
        summary["valid_curve"] = valid_curve + ([(last_iteration, valid_loss)] if valid_loss is not None else [])
        summary["divergence_guard"] = guard.summary()
        if auto is not None:
            summary["auto_policy"] = auto.summary()
            # Auto's calibration and decisions run outside the timed iterations: charged to them, so its throughput
            # compares with a fixed policy's as a whole run would.
            timed = max(1, len(logger.times) - 1)  # the summary's mean is over the iterations after the first
            # without the calibration and decisions (warm-up and exploration iterations are in both)
            summary["seconds_per_iteration_without_auto_overhead"] = summary["seconds_per_iteration"]
            summary["seconds_per_iteration"] += auto.overhead_s / timed
            summary["tokens_per_s"] = args.global_batch_size * args.seq_length / summary["seconds_per_iteration"]
            if rank == 0:
                log(f"> summary: --zpp-policy auto ran {auto.current} at the end; its calibration and decisions took "
                    f"{auto.overhead_s:.1f} s, charged to the iterations: {summary['seconds_per_iteration'] * 1e3:.0f} "
                    f"ms/iteration, {summary['tokens_per_s']:.0f} tokens/s")
        summary["error_feedback_buckets"] = sorted(hooks._residuals)  # names of the buckets holding a residual
        summary["tokenizer"] = {"type": args.tokenizer_type, "vocab_size": tokenizer.vocab_size,
                                "padded_vocab_size": args.padded_vocab_size}
        summary["model_vocab_size"] = _unwrap(chunks[0]).vocab_size
        if args.summary_json and rank == 0:
            Path(args.summary_json).write_text(json.dumps(summary, indent=1, default=str))
        return summary
    except Exception as e:
        if isinstance(e, StepFailedError) or is_agreed(e):
            # Agreed (every rank raises it now) or reported already (the peers were told and have given up).
            watchdog.main_thread_exiting()
            watchdog.linger_if_store_host()
            raise
        if not communication_error(e):
            # This rank's own error outside the named steps: tell the peers (they may wait in a collective),
            # then raise it as it is.
            agreement.report(StepFailedError("training", {rank: describe(e)}, rank))
            watchdog.linger_if_store_host()
            raise
        # A collective that failed because a peer died names no rank; the heartbeats do. Only communication
        # errors are looked at, and a finding that names this very rank (its own error put it behind) is not one.
        found = watchdog.find_failed() if watchdog.enabled else None
        detail = found[1] if found and rank not in found[0] else None
        if detail:
            log(f"[rank watchdog] rank {rank}: {detail}")
            watchdog.publish(detail, found[0])
            watchdog.mark_exiting()
            watchdog.linger_if_store_host()
            raise RankFailureError(f"rank {rank}: {type(e).__name__} in a collective because {detail}") from e
        raise
    finally:
        watchdog.stop()
        if hooks.installed:
            hooks.uninstall()
        parallel_state.destroy_model_parallel()


def _unwrap(module):
    """The GPTModel inside Float16Module (and similar single-module wrappers)."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _all_ranks_finite(optimizer, device) -> bool:
    """Whether the weights the optimizer holds (every rank's shard of the main weights) are finite.
    The module's parameters are not checked: under Megatron-FSDP they may point at released buckets."""
    from megatron_zpp.training.checkpoint import main_params

    ok = torch.tensor([float(all(bool(torch.isfinite(p).all()) for p in main_params(optimizer)))], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


@torch.no_grad()
def _evaluate_during_training(args, models, batches, forward_backward, device, parallel_state,
                              agreement=None) -> float:
    """``--eval-interval``: with overlapped parameter gathers the weights of the last step are still being
    gathered; Megatron-LM syncs them (``disable_forward_pre_hook``) for the evaluation, then restores."""
    hooked = [m for m in models if args.overlap_param_gather and hasattr(m, "disable_forward_pre_hook")]
    for m in hooked:
        m.disable_forward_pre_hook(param_sync=True)
    try:
        return evaluate(args, models, batches, forward_backward, device, parallel_state, agreement)
    finally:
        for m in hooked:
            m.enable_forward_pre_hook()


def _reload_after_divergence(args, models, optimizer, scheduler, hooks, guard, log, agreement=None) -> int | None:
    """``--zpp-divergence-reload``: load the last complete checkpoint of ``--save`` (else ``--load``); its
    iteration, or None when there is none or it was reloaded once already (a spike that comes back after a
    reload is the data's, not the codec's: the fallback alone handles it, instead of a loop of reloads)."""
    import copy

    from megatron_zpp.training.agreement import mark_agreed
    from megatron_zpp.training.checkpoint import TRACKER, CheckpointLoadError, load_checkpoint, read_tracker

    # Rank 0's view for everyone: a shared file system may show a tracker to some ranks first. Rank 0 alone
    # reads it, and sends its error too, so no rank raises while the others wait in the broadcast.
    decision = [None, None, None]  # folder, its iteration, rank 0's error
    if dist.get_rank() == 0:
        folder = next((d for d in (args.save, args.load) if d and (Path(d) / TRACKER).exists()), None)
        try:
            decision = [folder, None if folder is None else
                        read_tracker(folder, "--save" if folder == args.save else "--load"), None]
        except CheckpointLoadError as e:
            decision = [folder, None, str(e)]
    dist.broadcast_object_list(decision, src=0)
    folder, latest, error = decision
    if error is not None:
        failure = CheckpointLoadError(error)
        mark_agreed(failure)
        raise failure
    if folder is None or latest in guard.reloaded:
        if dist.get_rank() == 0:
            why = ("--save/--load hold none yet" if folder is None else
                   f"iteration {latest} was reloaded once already")
            log(f"[divergence guard] no checkpoint reload ({why}); the fallback goes on")
        return None
    guard.reloaded.add(latest)
    if args.overlap_param_gather:
        # The step prefetched the next forward's gathers (of the diverged weights): finish them before the load
        # writes those buffers, so that no gather is in flight across it and none is waited after it.
        for m in models:
            m.start_param_sync(force_sync=True)
    reload_args = copy.copy(args)
    reload_args.load = folder
    iteration = load_checkpoint(reload_args, models, optimizer, scheduler, hooks, log=log, agreement=agreement)
    hooks.invalidate_secondary()
    hooks.resync_weights(loaded=True)
    _gather_loaded_fp32_weights(args, models, hooks)
    log(f"[divergence guard] rank {dist.get_rank()}: reloaded {folder} at iteration {iteration}")
    return iteration


def _gather_loaded_fp32_weights(args, models, hooks) -> None:
    """fp32 weights under a lossy dp.param gather, after a load: the model tensor of a checkpoint is data-parallel
    rank 0's copy (its own shard exact, the others decoded), and the optimizer then writes each owner's exact
    shard over its slice (fp32 main parameters are views of it). Gather once, so every replica holds the
    decoded weights of every shard, as the uninterrupted run did after its gather."""
    dp_param = hooks.policy.codec("dp.param") if hooks is not None else "none"
    if not args.use_distributed_optimizer or args.bf16 or args.fp16 or dp_param == "none":
        return
    from megatron_zpp.compression import get_codec

    if get_codec(dp_param).lossless:
        return
    for m in models:
        m.start_param_sync(force_sync=True)


def _save(args, iteration, models, optimizer, scheduler, hooks, agreement=None) -> None:
    """A checkpoint of the weights the optimizer just produced: with overlapped parameter gathers the modules
    still hold the previous step's until their next forward, so sync them first (as Megatron-LM does)."""
    from megatron_zpp.training.checkpoint import save_checkpoint

    hooked = [m for m in models if args.overlap_param_gather and hasattr(m, "disable_forward_pre_hook")]
    for m in hooked:
        m.disable_forward_pre_hook(param_sync=True)
    try:
        # fp32 weights under a lossy dp.param codec: the owners' shards hold the decoded weights; the checkpoint
        # gets the optimizer's exact ones (megatron/ddp.py, "the optimizer's own shard")
        with hooks.exact_weights() if hooks is not None else contextlib.nullcontext():
            save_checkpoint(args, iteration, models, optimizer, scheduler, hooks, agreement=agreement)
    finally:
        for m in hooked:
            m.enable_forward_pre_hook()


def evaluate(args, models, batches, forward_backward, device, parallel_state, agreement=None) -> float:
    """Mean token loss over ``--eval-iters`` global batches of the validation split (forward only)."""
    agreement = agreement or Agreement(device=device)
    for m in models:
        m.eval()
    totals = []
    for _ in range(args.eval_iters):
        reduced = forward_backward(forward_step_func=partial(_forward_step, device, _nothing, agreement),
                                   data_iterator=batches,
                                   model=models, num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                                   micro_batch_size=args.micro_batch_size, forward_only=True)
        totals.append(_reduce_loss(reduced, parallel_state))
    for m in models:
        m.train()
    return sum(totals) / len(totals)


def _reduce_loss(reduced, parallel_state) -> float:
    """Mean token loss of the iteration over the data-parallel group (last pipeline stage), sent to all."""
    if parallel_state.is_pipeline_last_stage():
        total = torch.stack([d["lm loss"] for d in reduced]).sum(0).to(torch.float64)
    else:
        total = torch.zeros(2, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        total = total.cuda()
    # A world-wide sum counts each DP replica once per tensor-parallel rank: the ratio is unaffected.
    dist.all_reduce(total)
    total = total.cpu()
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")
