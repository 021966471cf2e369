"""Mixture-of-Experts in ``pretrain_gpt.py``: Megatron-LM's MoE flags, their checks, the layer specs, the aux losses.

The flags have Megatron-LM's names, types, defaults and choices (``tests/test_arguments.py`` compares them); the
model is Megatron-Core's own MoE layer (router, token dispatcher, ``SequentialMLP`` experts), built through
``get_gpt_decoder_block_spec`` as Megatron-LM's GPT builder does. Expert parallelism (EP) splits the experts over
``--expert-model-parallel-size`` ranks; the expert weights are then replicated over the *expert*-data-parallel
group (world / (EP x expert-TP x PP)), which Megatron-Core's DDP and distributed optimizer reduce in their own
buckets (``expert_parallel_buffers``).

On a machine without a GPU the layer runs through the CPU shim's MoE fixes (``megatron_zpp/megatron/cpu_shim.py``);
``--moe-grouped-gemm`` needs a GPU (Transformer Engine's grouped GEMM) and is refused there with the reason.
"""

from __future__ import annotations

import argparse
import ast

from megatron_zpp.policy import ConfigError

DISPATCHERS = ("allgather", "alltoall", "flex")  # Megatron-LM's choices, same order
SUPPORTED_DISPATCHERS = ("allgather", "alltoall")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none")
# The aux losses Megatron-Core records per MoE layer, by load-balancing type (the names it logs them under).
TRACKED_LOSSES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}


def _pattern(node: ast.AST) -> list[int] | int:
    """A list-of-ints expression such as ``([1]*3+[0])*2``, evaluated without ``eval``."""
    if isinstance(node, ast.Expression):
        return _pattern(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.List):
        items = [_pattern(e) for e in node.elts]
        if not all(isinstance(i, int) for i in items):
            raise ValueError("list items must be integers")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern(node.left), _pattern(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            return left * right
    raise ValueError(f"unsupported expression {ast.dump(node)[:60]}")


def moe_freq_type(x):
    """``--moe-layer-freq``: ``N`` (one MoE layer every N layers, from the first) or a pattern of 0/1 per layer,
    written as a Python list expression, e.g. ``"([1]*3+[0]*1)*3"`` (Megatron-LM's syntax)."""
    if isinstance(x, int):
        return x
    text = str(x).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{x!r}: an integer N or a list pattern like ([1]*3+[0])*2") from None
    try:
        value = _pattern(ast.parse(text, mode="eval"))
    except (SyntaxError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{x!r}: not a list pattern of 0 and 1 ({e})") from None
    if not isinstance(value, list) or any(v not in (0, 1) for v in value):
        raise argparse.ArgumentTypeError(f"{x!r}: the pattern must be a list of 0 (dense) and 1 (MoE) per layer")
    return value


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts (Megatron-LM's flags)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: no MoE)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="expert parallelism: ranks the experts are divided over (tokens travel to their experts in "
                        "the token dispatcher's all-to-all or all-gather)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="tensor parallelism inside each expert (default: --tensor-model-parallel-size)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    g.add_argument("--moe-token-dispatcher-type", type=str, choices=DISPATCHERS, default="allgather",
                   help="allgather or alltoall (flex needs DeepEP or HybridEP on GPUs and is not supported here)")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                   help="coefficient(s) of the load-balancing loss(es), one per --moe-router-load-balancing-type")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", type=str, choices=LOAD_BALANCING,
                   default="aux_loss", help="load-balancing strategy (or strategies) of the router")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                   help="N: a MoE layer every N layers; or a 0/1 pattern per layer such as \"([1]*3+[0])*2\"")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's FFN hidden size (default --ffn-hidden-size)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="one grouped GEMM for a rank's local experts (GPU, Transformer Engine)")


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def validate_moe_args(args: argparse.Namespace, world_size: int) -> None:
    """Derive the expert-parallel sizes and check them against the world and the model; ``ConfigError`` names the
    flag, the value and what would be valid. Sets ``args.expert_data_parallel_size``."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = args.expert_model_parallel_size
    if args.num_experts is None:
        if ep != 1:
            raise ConfigError(f"--expert-model-parallel-size {ep} without --num-experts: there are no experts to "
                              "divide; add --num-experts N (a multiple of it)")
        args.expert_tensor_parallel_size = args.expert_tensor_parallel_size or tp
        args.expert_data_parallel_size = None
        return
    experts = args.num_experts
    if experts < 1:
        raise ConfigError(f"--num-experts {experts} must be a positive integer")
    if ep < 1 or experts % ep:
        valid = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ConfigError(f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}; valid "
                          f"expert-parallel sizes: {', '.join(map(str, valid))}")
    etp = args.expert_tensor_parallel_size = args.expert_tensor_parallel_size or tp
    if etp < 1 or world_size % (etp * ep * pp):
        raise ConfigError(f"world size {world_size} is not divisible by expert-tensor ({etp}) x expert-model ({ep}) x "
                          f"pipeline ({pp}) parallel size = {etp * ep * pp}")
    args.expert_data_parallel_size = world_size // (etp * ep * pp)
    if not 1 <= args.moe_router_topk <= experts:
        raise ConfigError(f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts {experts}")
    if args.moe_token_dispatcher_type not in SUPPORTED_DISPATCHERS:
        raise ConfigError(f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type} needs DeepEP or HybridEP "
                          f"(GPU kernels outside Megatron-Core's dispatchers); valid here: "
                          f"{', '.join(SUPPORTED_DISPATCHERS)}")
    if tp > 1 and not args.sequence_parallel:
        # Megatron-LM's argument check (Megatron-Core's MoE layer raises on it in its first training forward).
        raise ConfigError(f"MoE with --tensor-model-parallel-size {tp} needs --sequence-parallel (Megatron-LM "
                          "requires it)")
    if etp > 1:
        # Megatron-Core: "Bias in Moe is only supported when ETP==1", and this GPT's linear layers have biases
        # (Megatron-LM's --disable-bias-linear is not a flag of this driver).
        raise ConfigError(f"--expert-tensor-parallel-size {etp}: this GPT's linear layers have biases, which "
                          "Megatron-Core's experts support only at expert-tensor-parallel size 1; valid: 1 (with "
                          "--tensor-model-parallel-size > 1, give --expert-tensor-parallel-size 1)")
    types, coeffs = _as_list(args.moe_router_load_balancing_type), _as_list(args.moe_aux_loss_coeff)
    if len(types) > 1 and len(coeffs) != len(types):
        raise ConfigError(f"--moe-aux-loss-coeff {' '.join(map(str, coeffs))}: one coefficient per "
                          f"--moe-router-load-balancing-type ({' '.join(types)})")
    freq = args.moe_layer_freq
    if isinstance(freq, list) and len(freq) != args.num_layers:
        raise ConfigError(f"--moe-layer-freq pattern has {len(freq)} entries; it needs one per layer (--num-layers "
                          f"{args.num_layers})")
    if isinstance(freq, int) and freq < 1:
        raise ConfigError(f"--moe-layer-freq {freq} must be a positive integer")
    args.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
    if args.moe_ffn_hidden_size % etp:
        raise ConfigError(f"--moe-ffn-hidden-size {args.moe_ffn_hidden_size} is not divisible by "
                          f"--expert-tensor-parallel-size {etp}")


def check_moe_runs_here(args: argparse.Namespace, *, cuda: bool, impl: str) -> None:
    """What this machine cannot run: grouped GEMM without a GPU and Transformer Engine; on a GPU, Megatron-Core's
    own layers at expert-parallel size 1 (below)."""
    if args.num_experts is None:
        return
    if args.moe_grouped_gemm and not (cuda and impl == "transformer_engine"):
        why = "this machine has no GPU" if not cuda else "the layers are not Transformer Engine's"
        raise ConfigError(f"--moe-grouped-gemm runs Transformer Engine's grouped GEMM on a GPU and {why}; drop the "
                          "flag (the experts then run one GEMM each, SequentialMLP)")
    if cuda and impl == "local" and args.expert_model_parallel_size == 1 and args.expert_tensor_parallel_size == 1:
        # megatron-core 0.19: the expert MLP adds its bias in place to linear_fc2's output, which over a tensor-
        # parallel group of one is the input of an autograd Function returned as-is: the backward raises "is a
        # view and is being modified inplace". The CPU shim works around it (cpu_shim.py); the GPU path is not
        # patched.
        raise ConfigError("MoE with --transformer-impl local at --expert-model-parallel-size 1 fails in Megatron-Core "
                          "0.19's expert MLP backward (an in-place bias add on a view); use Transformer Engine's "
                          "layers (--transformer-impl transformer_engine) or --expert-model-parallel-size > 1")


def moe_config_kwargs(args: argparse.Namespace) -> dict:
    """``TransformerConfig`` fields of the MoE flags (``{}`` without MoE, so dense runs build what they did)."""
    if args.num_experts is None:
        return {}
    types, coeffs = _as_list(args.moe_router_load_balancing_type), _as_list(args.moe_aux_loss_coeff)
    return dict(num_moe_experts=args.num_experts, expert_model_parallel_size=args.expert_model_parallel_size,
                expert_tensor_parallel_size=args.expert_tensor_parallel_size, moe_router_topk=args.moe_router_topk,
                moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                moe_aux_loss_coeff=coeffs if len(coeffs) > 1 else coeffs[0],
                moe_router_load_balancing_type=types if len(types) > 1 else types[0],
                moe_layer_freq=args.moe_layer_freq, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                moe_grouped_gemm=args.moe_grouped_gemm)


def tracked_losses(args: argparse.Namespace) -> list[str]:
    """The aux-loss names Megatron-Core records for these flags (as Megatron-LM's training log tracks them)."""
    if args.num_experts is None:
        return []
    return [TRACKED_LOSSES[t] for t in _as_list(args.moe_router_load_balancing_type) if t in TRACKED_LOSSES]


def report_aux_losses(args: argparse.Namespace, iteration: int) -> dict[str, float]:
    """This iteration's MoE aux losses, averaged over MoE layers, micro-batches and data-parallel ranks, as
    Megatron-LM reports them; clears Megatron-Core's tracker. A collective: every rank, every iteration."""
    names = tracked_losses(args)
    if not names:
        return {}
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    totals: dict = {}
    get_moe_metrics_tracker().report(loss_scale=1.0 / args.num_microbatches, iteration=iteration,
                                     force_initialize=True, track_names=names, num_layers=args.num_layers,
                                     moe_layer_freq=args.moe_layer_freq, total_loss_dict=totals)
    return {k: float(v) for k, v in totals.items()}
