"""Megatron-Core integration (layer 4): install a compression policy into megatron.core's collectives.

For users of Megatron-LM's own ``pretrain_gpt.py``::

    from megatron_zpp.megatron import zpp_extra_args_provider, install_from_args
    args = parse_and_validate_args(extra_args_provider=zpp_extra_args_provider)
    install_from_args(args)   # before pretrain() builds DDP and the optimizer

``install_from_args`` also applies the ``--zpp-dp-grad-until`` schedule: before every hooked
collective it reads ``args.curr_iteration`` (set by Megatron-LM's training loop on the global args
object that ``parse_and_validate_args`` returned) and ``args.train_iters``.

The CPU shim (``cpu_shim.py``) is only for machines without a GPU.
"""

import torch.distributed as dist

from megatron_zpp.megatron.flight_recorder import flight_recorder_default
from megatron_zpp.megatron.hooks import MegatronHooks
from megatron_zpp.policy import EP_DIMENSIONS, ConfigError, add_zpp_args, resolve_policy, zpp_config_from_args


def zpp_extra_args_provider(parser):
    """Megatron-LM ``extra_args_provider``: adds the ``--zpp-*`` flags."""
    return add_zpp_args(parser)


def hooks_from_args(args) -> MegatronHooks:
    """Resolve the policy from parsed ``--zpp-*`` args; the hooks, not installed.

    The dp.grad schedule follows Megatron-LM's own iteration counter: ``args.curr_iteration``
    out of ``args.train_iters`` (both set by ``megatron.training`` before each step), read before
    every hooked collective.
    """
    # Checked across ranks by MegatronHooks.install, or, since Megatron-LM initializes torch.distributed
    # only inside pretrain() after this call, right after its initialize_model_parallel.
    config = zpp_config_from_args(args)
    policy = without_idle_preset_ep_codecs(args, resolve_policy(config), config)
    if policy.param_difference:
        check_weight_differences(args, policy.name, policy.hpz_size)
    check_expert_parallel_codecs(args, policy)
    check_expert_data_parallel_layout(args, policy)
    check_error_feedback(args, policy)

    def megatron_lm_iteration() -> tuple[int, int | None]:
        # train_iters: set by Megatron-LM from --train-iters, or from --train-samples inside pretrain().
        return getattr(args, "curr_iteration", 0) or 0, getattr(args, "train_iters", None)

    model_parallel = None
    if policy.name == "auto":  # the tp / pp codecs auto may turn on are installed now, off until it does
        from megatron_zpp.policy.auto import auto_config_from_args, model_parallel_codecs, parse_allow

        model_parallel = model_parallel_codecs(parse_allow(auto_config_from_args(args).allow))
    return MegatronHooks(policy, ranks_per_node=args.zpp_ranks_per_node, iteration_source=megatron_lm_iteration,
                         model_parallel_codecs=model_parallel)


def check_expert_data_parallel_layout(args, policy) -> None:
    """Refuse, at start-up rather than at the first expert collective, an MoE layout whose expert-data-parallel
    groups the nodes split unevenly while the policy routes data-parallel traffic through megatron_zpp's
    collectives (their intra- / inter-node hops need the same number of members on every node). Megatron-Core
    strides those groups by expert TP x EP, so they are even exactly when that block and the ranks per node
    divide one another (as for the allgather dispatcher's TP x EP group)."""
    if getattr(args, "num_experts", None) is None or not _routes_data_parallel(policy):
        return
    block, per_node = _expert_block(args), _ranks_per_node(args)
    if _split_unevenly(block, per_node):
        raise ConfigError(f"policy {policy.name!r}: the expert-data-parallel groups stride by expert TP x EP = "
                          f"{block} ranks, which {per_node} ranks per node split unevenly over the nodes (the "
                          "compressed and hierarchical collectives need as many members on every node); make one a "
                          "multiple of the other, or leave the data-parallel collectives to Megatron (--zpp-dp-grad "
                          "none --zpp-dp-param none --zpp-dp-uncompressed megatron)")


def _routes_data_parallel(policy) -> bool:
    """Whether any data-parallel collective may go through megatron_zpp's collectives under ``policy`` (auto may
    switch to a policy that does; hpZ builds its topology even with uncompressed weights)."""
    return (policy.name == "auto" or policy.codec("dp.grad") != "none" or policy.codec("dp.param") != "none"
            or policy.dp_uncompressed != "megatron" or policy.hpz_size != 1)


def check_error_feedback(args, policy) -> None:
    """Refuse error feedback with virtual pipeline stages: its residuals are named by a bucket's index in its model
    chunk (stable across checkpoints), and each virtual stage is a chunk of its own whose buckets count from 0
    again, so chunks of identical layers would share one residual without any size check noticing."""
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    # validated arguments say it in vpp (None when the layers make one virtual stage per rank: plain 1F1B)
    interleaved = (vpp or 1) > 1 if hasattr(args, "virtual_pipeline_model_parallel_size") else bool(per_stage)
    if policy.error_feedback and interleaved:
        raise ConfigError(f"policy {policy.name!r}: --zpp-dp-grad-error-feedback keeps one residual per gradient "
                          "bucket of a model chunk; with virtual pipeline stages (--num-layers-per-virtual-pipeline-"
                          f"stage {per_stage}, virtual pipeline size {vpp}) the chunks' buckets would share them; "
                          "drop one of the two")


def without_idle_preset_ep_codecs(args, policy, config):
    """A built-in preset's ``ep`` codecs where the job cannot run them, or would lose the shared experts' overlap:
    off, as a preset's ``pp`` codec idles at PP 1, so one preset serves dense and MoE models (the policy line of
    the log shows them as none). Codecs given by ``--zpp-ep-*`` flags or in the user's own policy file stay, for
    :func:`check_expert_parallel_codecs` to refuse with the reason."""
    import dataclasses
    import logging

    from megatron_zpp.policy import available_presets

    if config.policy not in available_presets():
        return policy
    explicit = {d for d in EP_DIMENSIONS if getattr(config, d.replace(".", "_"), None) is not None}
    idle = [d for d in EP_DIMENSIONS if d not in explicit and policy.codec(d) != "none"]
    why = (_expert_parallel_refusal(args) or _shared_expert_overlap(args)) if idle else None
    if why is None:
        return policy
    if getattr(args, "num_experts", None) is not None:
        logging.getLogger(__name__).info("policy %s: its ep codecs are off: %s", policy.name, why)
    return dataclasses.replace(policy, codecs=policy.codecs | {d: "none" for d in idle})


def _shared_expert_overlap(args) -> str | None:
    # A compressed exchange runs synchronously on the current stream: allowed when asked for by name (it is
    # correct), but a preset should not take the overlap away unasked.
    if getattr(args, "moe_shared_expert_overlap", False):
        return "--moe-shared-expert-overlap overlaps the shared experts with Megatron's own exchange"
    return None


def _expert_parallel_refusal(args) -> str | None:
    """Why this job's MoE token exchange cannot take ep codecs (``None``: it can)."""
    if getattr(args, "num_experts", None) is None:
        return "the ep codecs compress MoE token dispatch and combine; this model has no experts (--num-experts)"
    dispatcher = getattr(args, "moe_token_dispatcher_type", "allgather")
    if dispatcher not in ("alltoall", "allgather"):
        return (f"the ep codecs hook the alltoall and allgather token dispatchers; --moe-token-dispatcher-type is "
                f"{dispatcher}; valid with ep codecs: alltoall, allgather")
    ep = getattr(args, "expert_model_parallel_size", 1)
    if ep == 1:
        return "--expert-model-parallel-size 1 sends no tokens between ranks; give it > 1 or drop the ep codecs"
    # Megatron-LM's script: a compressed exchange is synchronous on the current stream and reads sizes to the host
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        return ("--overlap-moe-expert-parallel-comm runs dispatch and combine on a communication stream, which the "
                "ep codecs' synchronous exchange would serialize; drop one of them")
    if getattr(args, "cuda_graph_impl", "none") not in (None, "none") or getattr(args, "enable_cuda_graph", False):
        return ("CUDA graphs capture the dispatcher, and the ep codecs' exchange is not capturable (host reads, byte "
                "counters); drop --cuda-graph-impl or the ep codecs")
    if dispatcher == "allgather":
        # its gathers and reduce-scatters run over the expert TP x EP group, consecutive ranks, whose compressed
        # collectives need the same number of members on every node
        size, per_node = _expert_block(args), _ranks_per_node(args)
        if _split_unevenly(size, per_node):
            return (f"the allgather dispatcher exchanges over expert TP x EP = {size} consecutive ranks, which "
                    f"{per_node} ranks per node split unevenly; make one a multiple of the other or use "
                    "--moe-token-dispatcher-type alltoall")
    return None


def _ranks_per_node(args) -> int | None:
    """``--zpp-ranks-per-node``, else the launcher's ``LOCAL_WORLD_SIZE`` (``None``: unknown)."""
    from megatron_zpp.comm.topology import ranks_per_node_from_env

    return getattr(args, "zpp_ranks_per_node", None) or ranks_per_node_from_env()


def _split_unevenly(block: int, per_node: int | None) -> bool:
    """Whether nodes of ``per_node`` ranks split groups of ``block`` consecutive ranks (or groups striding by
    ``block``) unevenly: neither divides the other."""
    return bool(per_node) and block % per_node != 0 and per_node % block != 0


def _expert_block(args) -> int:
    """Expert TP x EP: the size of the consecutive-rank groups MoE's token exchange runs over, and the stride of the
    expert-data-parallel groups (Megatron-Core's expert TP defaults to the dense TP)."""
    etp = getattr(args, "expert_tensor_parallel_size", None) or getattr(args, "tensor_model_parallel_size", 1) or 1
    return (getattr(args, "expert_model_parallel_size", 1) or 1) * etp


def check_expert_parallel_codecs(args, policy) -> None:
    """The ``ep`` codecs run on the alltoall and allgather token dispatchers (``expert_parallel.py``): refuse them,
    naming the flags, without MoE, without expert parallelism to carry them, with the flex dispatcher, with the
    overlapped expert-parallel exchange or with CUDA graphs."""
    chosen = [d for d in EP_DIMENSIONS if policy.codec(d) != "none"]
    why = _expert_parallel_refusal(args) if chosen else None
    if why is not None:
        flags = ", ".join(f"--zpp-{d.replace('.', '-')} {policy.codec(d)}" for d in chosen)
        raise ConfigError(f"{flags}: {why}")


def check_weight_differences(args, policy_name: str, hpz_size: int | None = None) -> None:
    """Refuse qWD (``dp_param_difference``) where the weights it adds differences to are not the replicas' own
    copy: it needs the distributed optimizer's gathered parameter buffer, which the optimizer writes from its
    master weights (separate fp32 ones with --bf16/--fp16; with fp32 weights the owner's slice itself, kept
    aside by the hooks while the replicas hold the decoded weights), or Megatron-FSDP's hpZ secondary copy."""
    def refuse(why: str) -> None:
        raise ConfigError(f"policy {policy_name!r}: --zpp-dp-param-difference (qWD) {why}")

    if getattr(args, "use_megatron_fsdp", False):
        # On the hpZ secondary copy (fsdp.py), whatever the weights' dtype: each rank holds size / hpz_size
        # shards of the weights, so hpZ over one rank would keep the whole model on every rank.
        if hpz_size == 1:
            refuse("on Megatron-FSDP keeps the weights in the hpZ secondary copy (size / hpz_size shards per "
                   "rank): --zpp-hpz-size 1 would hold the whole model on every rank; use --zpp-hpz-size node "
                   "(or a divisor of the ranks per node above 1)")
        # Megatron strides the data-parallel group by TP x CP: from that many ranks per node on, the group has one
        # member per node and no hpZ copy (an MoE expert group there gathers with qwZ INT8 instead, fsdp.py)
        stride = (getattr(args, "tensor_model_parallel_size", 1) or 1) * (getattr(args, "context_parallel_size", 1)
                                                                          or 1)
        per_node = _ranks_per_node(args)
        if per_node and stride >= per_node and (getattr(args, "data_parallel_size", None) or 2) > 1:
            refuse(f"on Megatron-FSDP keeps the weights in the hpZ secondary copy inside a node; with {per_node} "
                   f"ranks per node and TP x CP = {stride} the data-parallel group has one member per node and no "
                   "such copy; use zeropp's INT8 weights (--zpp-policy zeropp) or fewer model-parallel ranks per node")
        strategy = getattr(args, "data_parallel_sharding_strategy", "optim_grads_params")
        if strategy != "optim_grads_params":
            refuse(f"on Megatron-FSDP needs --data-parallel-sharding-strategy optim_grads_params (sharded weights); "
                   f"with {strategy!r} the gathered buffer is the weights' own storage, which the held copy "
                   "would overwrite")
        return
    if not getattr(args, "use_distributed_optimizer", False):
        refuse("gathers the sharded weights of the distributed optimizer or Megatron-FSDP; add "
               "--use-distributed-optimizer or --use-megatron-fsdp")
    if getattr(args, "use_precision_aware_optimizer", False) and getattr(args, "store_param_remainders", True):
        refuse("cannot run with --use-precision-aware-optimizer storing parameter remainders (Transformer "
               "Engine's FusedAdam rebuilds its master weights from the 16-bit weights, which qWD replaces)")
    if getattr(args, "reuse_grad_buf_for_mxfp8_param_ag", False):
        refuse("cannot run with --reuse-grad-buf-for-mxfp8-param-ag (the gathered weights share the gradient "
               "buffer, which Megatron zeroes and accumulates into between gathers)")


def check_transformer_impl(args, hooks: MegatronHooks) -> None:
    """Refuse a ``tp`` codec with Transformer Engine's layers (Megatron-LM's default ``--transformer-impl``).

    The ``tp`` hooks replace Megatron-Core's tensor-parallel collectives (``tensor_parallel.mappings`` and
    ``layers``); TE's linear layers issue their own, so most of the TP traffic would pass uncompressed
    while the policy says otherwise.
    """
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if getattr(args, "transformer_impl", None) == "transformer_engine" and tp > 1 and hooks.policy.compresses("tp"):
        raise ValueError(f"--zpp-tp {hooks.policy.codec('tp')} (policy {hooks.policy.name!r}) compresses "
                         "Megatron-Core's tensor-parallel collectives, but --transformer-impl transformer_engine "
                         "(Megatron-LM's default) runs Transformer Engine's layers, which issue their own: add "
                         "--transformer-impl local, or --zpp-tp none")


def install_from_args(args) -> MegatronHooks:
    """:func:`hooks_from_args`, installed: call after ``parse_and_validate_args``, before ``pretrain()``."""
    hooks = hooks_from_args(args)
    if hooks.policy.name == "auto":
        raise ConfigError("--zpp-policy auto measures, chooses and switches between iterations inside megatron_zpp's "
                          "own training loop (pretrain_gpt.py of this project); in Megatron-LM's script pick a fixed "
                          "policy (python -m megatron_zpp.advise suggests one for your cluster)")
    check_transformer_impl(args, hooks)
    if not dist.is_initialized():  # Megatron-LM's pretrain() creates the process group after this call
        flight_recorder_default(getattr(args, "distributed_backend", None),
                                dump_path=getattr(args, "flight_recorder_dump_path", None))
    return hooks.install()


__all__ = ["MegatronHooks", "check_expert_parallel_codecs", "check_transformer_impl", "check_weight_differences", "hooks_from_args", "install_from_args",
           "zpp_extra_args_provider"]
