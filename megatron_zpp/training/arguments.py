"""Command-line arguments of ``pretrain_gpt.py``: Megatron-LM's flag names, plus the ``--zpp-*`` flags.

Only the flags this driver implements are accepted (argparse rejects others by name), with
Megatron-LM's spelling and meaning. Flags issue [4] will implement (``--use-megatron-fsdp``)
exist and fail clearly until then.
"""

from __future__ import annotations

import argparse

from megatron_zpp.policy import add_zpp_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="GPT pretraining on Megatron-Core with megatron_zpp compression",
                                allow_abbrev=False)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved 1F1B: layers per virtual pipeline stage")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="ZeRO-3 via Megatron-FSDP (parameters, gradients and optimizer state sharded)")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="parameters per data-parallel communication bucket (Megatron's default: one bucket of "
                        "max(40M, 1M x DP) with the distributed optimizer; smaller buckets let the gradient "
                        "reduce-scatter and the parameter all-gather overlap compute in a small model)")
    g.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_communication", action="store_false",
                   help="interleaved schedule: batched, non-overlapped p2p instead of Megatron-LM's default "
                        "overlapped p2p")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with a GPU, gloo without")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None, help="default micro batch x data parallel")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("data, checkpoints, logging")
    g.add_argument("--data-path", default=None,
                   help="prefix of a .bin/.idx made by tools/preprocess_data.py; default: the built-in corpus")
    g.add_argument("--save", default=None, help="directory to save a checkpoint to at the end (and every "
                                                "--save-interval iterations)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None, help="directory to resume from")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-iters", type=int, default=4,
                   help="global batches of the validation split evaluated at the end (0: none)")
    g.add_argument("--check-replica-weights", action="store_true",
                   help="debug: digest every module's weights at each forward and backward use and compare "
                        "them across data-parallel replicas every iteration (slow on real models)")
    g.add_argument("--summary-json", default=None,
                   help="rank 0 writes the run summary (losses, step-time breakdown, bytes counted and, with "
                        "ZPP_NIC set, measured on the NIC) to this JSON file")
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g.add_argument("--wandb-group", default=None, help="W&B run group (tools/sweep.py: the sweep's name)")
    g.add_argument("--wandb-job-type", default=None, help="W&B job type (tools/sweep.py: the ZeRO path)")
    g.add_argument("--wandb-config", action="append", default=[], metavar="KEY=VALUE",
                   help="extra W&B config entry, repeatable (tools/sweep.py: the emulated link rate); VALUE is "
                        "read as JSON when it parses, else kept as a string")
    add_zpp_args(p)
    return p


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Derive defaults and check that the parallel sizes fit the world; errors name the values."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) "
                         f"parallel size = {tp * pp}")
    args.data_parallel_size = world_size // (tp * pp)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
                         f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    if args.num_attention_heads % tp:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    if args.num_layers % pp:
        raise ValueError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage:
        per_stage = args.num_layers // pp
        if pp < 2 or per_stage % args.num_layers_per_virtual_pipeline_stage:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage} "
                             f"must divide the {per_stage} layers of each of >= 2 pipeline stages")
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
        if args.use_megatron_fsdp:
            raise ValueError("--num-layers-per-virtual-pipeline-stage with --use-megatron-fsdp is not supported")
    # As in Megatron-LM: p2p overlap is the interleaved schedule's default and only exists there.
    args.overlap_p2p_communication = bool(args.overlap_p2p_communication and args.virtual_pipeline_model_parallel_size)
    if args.overlap_param_gather and not (args.use_distributed_optimizer or args.use_megatron_fsdp):
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer or --use-megatron-fsdp")
    args.wandb_config = parse_wandb_config(args.wandb_config)
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if args.seq_length > args.max_position_embeddings:
        raise ValueError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                         f"{args.max_position_embeddings}")
    return args


def parse_wandb_config(entries: list[str] | dict) -> dict:
    """``["rate=25mbit", "iters=8"]`` -> ``{"rate": "25mbit", "iters": 8}`` (idempotent on a dict)."""
    import json

    if isinstance(entries, dict):
        return entries
    out = {}
    for entry in entries:
        key, sep, value = entry.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--wandb-config {entry!r}: expected KEY=VALUE (e.g. rate=25mbit)")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out
