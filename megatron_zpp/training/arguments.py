"""Command-line arguments of ``pretrain_gpt.py``: Megatron-LM's flag names, plus the ``--zpp-*`` flags.

Only the flags this driver implements are accepted (argparse rejects others by name), with
Megatron-LM's spelling, type, default and meaning (``megatron.training.arguments`` of the pinned
megatron-core; ``tests/test_arguments.py`` compares them flag by flag), so a Megatron-LM command
line trains the same recipe here. The deliberate differences are listed in ``DIFFERENCES`` with
their reasons.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from megatron_zpp.policy import ConfigError, add_zpp_args
from megatron_zpp.policy.errors import ConfigFileNotFoundError
from megatron_zpp.training.quiet import launch_rank

# Flags whose default (or, where the reason says so, choices) differs from Megatron-LM's on purpose, and why
# (the parity test reads this).
DIFFERENCES = {
    "--num-layers": "required in Megatron-LM (no default); a small model here so `pretrain_gpt.py` runs bare",
    "--hidden-size": "required in Megatron-LM; a small default here",
    "--num-attention-heads": "required in Megatron-LM; a small default here",
    "--seq-length": "required in Megatron-LM; a small default here",
    "--micro-batch-size": "required in Megatron-LM; a small default here",
    "--train-iters": "Megatron-LM needs --train-iters or --train-samples; 100 here",
    "--lr": "Megatron-LM has no default learning rate (its optimizer config requires one); 1e-3 here",
    "--distributed-backend": "Megatron-LM defaults to nccl; here the default picks nccl with a GPU and gloo "
                             "without one (the CPU path)",
    "--tokenizer-type": "choices: this driver's ByteTokenizer (the built-in corpus's, and the default when the flag "
                        "is not given) and the Megatron-LM tokenizers it supports: GPT2BPETokenizer, "
                        "HuggingFaceTokenizer, NullTokenizer",
}
# The recipe the project's own tools, benchmarks and tests train: what this driver's defaults were before
# they followed Megatron-LM's (no dropout, Adam beta2 0.95, cosine decay to 1e-4, a short evaluation, logs
# every 10 iterations), passed explicitly so recorded measurements stay comparable. Later flags override it.
PROJECT_RECIPE = ["--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--adam-beta2", "0.95",
                  "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--eval-iters", "4", "--log-interval", "10"]
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
TRANSFORMER_IMPLS = ("local", "transformer_engine", "inference_optimized")  # Megatron-LM's choices, same order
TE_INSTALL = 'pip install -e ".[gpu]"'


def _attention_backend(name: str):
    """``--attention-backend flash`` -> ``AttnBackend.flash`` (Megatron-LM parses it the same way)."""
    from megatron.core.transformer.enums import AttnBackend

    try:
        return AttnBackend[name]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{name!r}; valid: {', '.join(b.name for b in AttnBackend)}") from None


class _Parser(argparse.ArgumentParser):
    """Records whether ``--transformer-impl`` was given (``args.transformer_impl_explicit``), and speaks from
    rank 0 only.

    Megatron-LM's default, transformer_engine, falls back to local on a machine without Transformer
    Engine (this CPU path); asking for it explicitly there is an error instead.

    Under a launcher every rank parses the same command line: a bad flag is one line from rank 0 (argparse's
    "error:" line, without the usage, which spans a screen for this many flags: ``--help`` has it), and every
    rank exits with argparse's status 2. ``--help`` prints once too.
    """

    def error(self, message: str):
        if launch_rank() == 0:
            print(f"{self.prog}: error: {message} (the flags: {self.prog} --help)", file=sys.stderr, flush=True)
        sys.exit(2)

    def print_help(self, file=None) -> None:
        if launch_rank() == 0:
            super().print_help(file)

    def print_usage(self, file=None) -> None:
        if launch_rank() == 0:
            super().print_usage(file)

    def parse_known_args(self, args=None, namespace=None):
        namespace = argparse.Namespace() if namespace is None else namespace
        given = hasattr(namespace, "transformer_impl")
        if not given:
            namespace.transformer_impl = None  # argparse leaves a preset attribute alone unless the flag is given
        namespace, rest = super().parse_known_args(args, namespace)
        namespace.transformer_impl_explicit = given or namespace.transformer_impl is not None
        if namespace.transformer_impl is None:
            namespace.transformer_impl = self.get_default("transformer_impl")
        return namespace, rest


def build_parser() -> argparse.ArgumentParser:
    # Here, not at the top: the tools that import PROJECT_RECIPE need not import Megatron-Core.
    from megatron_zpp.training.data import DEFAULT_SPLIT
    from megatron_zpp.training.tokenizer import DEFAULT_TOKENIZER, TOKENIZER_TYPES

    p = _Parser(description="GPT pretraining on Megatron-Core with megatron_zpp compression",
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
    g.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_comm", action="store_false",
                   help="interleaved schedule: batched, non-overlapped p2p instead of Megatron-LM's default "
                        "overlapped p2p")
    g.add_argument("--no-align-param-gather", dest="align_param_gather", action="store_false",
                   help="with --overlap-param-gather and pipeline parallelism: launch each stage's parameter "
                        "all-gathers separately instead of all at once (Megatron-LM's default: aligned)")
    g.add_argument("--distributed-backend", type=str, choices=("nccl", "gloo"), default=None,
                   help="default: nccl with a GPU, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="process-group timeout: a collective still waiting after this long fails (see also "
                        "--zpp-rank-timeout, which names the rank that died or hung)")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="standard deviation of the normal weight initialization")
    g.add_argument("--recompute-activations", action="store_true",
                   help="selective activation recomputation (the same as --recompute-granularity selective)")
    g.add_argument("--recompute-granularity", type=str, choices=("full", "selective"), default=None,
                   help="activation recomputation: full (whole layers, with --recompute-method) or selective "
                        "(the attention core)")
    g.add_argument("--recompute-method", type=str, choices=("uniform", "block"), default=None,
                   help="full recomputation: uniform (every --recompute-num-layers layers a checkpoint) or block "
                        "(the first --recompute-num-layers layers of each stage)")
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")

    from megatron_zpp.training.moe import add_moe_args

    add_moe_args(p)

    from megatron.core.transformer.enums import AttnBackend  # lazily: only what the parser needs

    g = p.add_argument_group("transformer implementation and fusions (Megatron-LM's defaults)")
    g.add_argument("--transformer-impl", type=str, choices=TRANSFORMER_IMPLS, default="transformer_engine",
                   help="transformer_engine: Transformer Engine's layers (Megatron-LM's default; needs a GPU and "
                        f"`{TE_INSTALL}`; when left at this default without TE, the driver uses local and says "
                        "why); local: Megatron-Core's own layers (runs anywhere, and the only choice with --zpp-tp "
                        "compression, as TE's layers issue their own tensor-parallel collectives)")
    g.add_argument("--attention-backend", type=_attention_backend, choices=list(AttnBackend),
                   default=AttnBackend.auto, metavar="{" + ",".join(b.name for b in AttnBackend) + "}",
                   help="auto (default): Transformer Engine picks flash, fused or unfused attention; local: "
                        "Megatron-Core's attention; flash/fused/unfused force a TE backend (need "
                        "--transformer-impl transformer_engine)")
    # On by default as in Megatron-LM; each is enabled only where it can run (a GPU, plus the library it
    # needs) and otherwise left off with the reason logged (megatron_zpp/training/model.py, resolve_fusions).
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="fused weight-gradient accumulation into main_grad (GPU with apex's "
                        "fused_weight_gradient_mlp_cuda)")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false",
                   help="fused bias + GeLU (GPU; like Megatron-LM, the fused kernel is GeLU's tanh approximation)")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false",
                   help="fused scale + mask + softmax (GPU; TE's attention, or apex's softmax kernels with local)")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false",
                   help="fused bias + dropout + residual add (GPU)")
    g.add_argument("--no-persist-layer-norm", action="store_true",
                   help="disable the persistent fused layer norm kernel (GPU; TE, or apex with local)")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None, help="default micro batch x data parallel")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", type=str, choices=LR_DECAY_STYLES, default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true", help="fp16 weights and activations with loss scaling")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="fp16: a static loss scale (a power of 2); default: dynamic loss scaling")
    g.add_argument("--initial-loss-scale", type=float, default=2**32, help="fp16 dynamic loss scaling: first scale")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="fp16 dynamic loss scaling: lowest scale")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="fp16 dynamic loss scaling: iterations without overflow before the scale doubles")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="fp16 dynamic loss scaling: overflows tolerated before the scale halves")
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefixes of .bin/.idx datasets (tools/preprocess_data.py), divided by --split: A, or "
                        "A B (weighted by size), or weight/prefix pairs 0.3 A 0.7 B; default: the built-in corpus")
    g.add_argument("--split", type=str, default=None,
                   help=f"train,valid,test shares of each --data-path prefix's documents (default with "
                        f"--data-path, as Megatron-LM: \"{DEFAULT_SPLIT}\")")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"the {split} split's own blend (the --data-path syntax), instead of --data-path")
    g.add_argument("--data-cache-path", default=None,
                   help="directory for the dataset index caches (default: under ~/.cache/megatron_zpp/data/indices)")
    g.add_argument("--tokenizer-type", type=str, choices=TOKENIZER_TYPES, default=None,
                   help=f"default {DEFAULT_TOKENIZER} (UTF-8 bytes + end-of-document, 257 ids; the built-in "
                        "corpus's); the vocabulary size comes from the tokenizer")
    g.add_argument("--tokenizer-model", type=str, default=None,
                   help="HuggingFaceTokenizer: a directory holding tokenizer.json, or that file")
    g.add_argument("--vocab-file", type=str, default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", type=str, default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: the number of ids")

    g = p.add_argument_group("checkpoints, logging")
    g.add_argument("--save", type=str, default=None, help="directory to save a checkpoint to at the end (and every "
                                                "--save-interval iterations)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", type=str, default=None, help="directory to resume from (any parallel layout)")
    g.add_argument("--ckpt-format", type=str, choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"),
                   default="torch_dist",
                   help="checkpoint format: torch_dist (megatron.core.dist_checkpointing; DDP and the distributed "
                        "optimizer) or fsdp_dtensor (Megatron-FSDP); Megatron-LM's torch and torch_dcp are not "
                        "implemented here")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="torch_dist: save the distributed optimizer's state by parameter, so the checkpoint reshards "
                        "across tensor and pipeline parallelism too (default dp_reshardable: data parallelism only)")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=100,
                   help="global batches of the validation split per evaluation (0: none)")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="evaluate every this many iterations (and at the end); default: at the end only")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop after the iteration that is a multiple of this (saving first when --save is set)")
    g.add_argument("--check-replica-weights", action="store_true",
                   help="debug: digest every module's weights at each forward and backward use and compare "
                        "them across data-parallel replicas every iteration (slow on real models)")
    g.add_argument("--summary-json", default=None,
                   help="rank 0 writes the run summary (losses, step-time breakdown, bytes counted and, with "
                        "ZPP_NIC set, measured on the NIC) to this JSON file")
    g.add_argument("--wandb-project", type=str, default=None)
    g.add_argument("--wandb-exp-name", type=str, default=None)
    g.add_argument("--wandb-save-dir", type=str, default=None)
    g.add_argument("--wandb-group", default=None, help="W&B run group (tools/sweep.py: the sweep's name)")
    g.add_argument("--wandb-job-type", default=None, help="W&B job type (tools/sweep.py: the ZeRO path)")
    g.add_argument("--wandb-config", action="append", default=[], metavar="KEY=VALUE",
                   help="extra W&B config entry, repeatable (tools/sweep.py: the emulated link rate); VALUE is "
                        "read as JSON when it parses, else kept as a string")
    add_zpp_args(p)
    from megatron_zpp.training.divergence import add_divergence_args
    from megatron_zpp.training.watchdog import add_rank_failure_args

    from megatron_zpp.policy.auto import add_auto_args

    add_rank_failure_args(p)
    add_divergence_args(p)
    add_auto_args(p)
    return p


@contextlib.contextmanager
def _flag_errors():
    """The flag checks that live beside their feature (data, rank watchdog, divergence guard) raise ValueError
    naming the flag, or FileNotFoundError naming a file a flag names: here, where only flags are read (and the
    files they name looked up), that is the user's configuration error."""
    try:
        yield
    except ConfigError:
        raise
    except FileNotFoundError as e:
        raise ConfigFileNotFoundError(str(e)) from e
    except ValueError as e:
        raise ConfigError(str(e)) from e


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Derive defaults and check that the parallel sizes fit the world; errors (``ConfigError``) name the values
    and the valid choices."""
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "global_batch_size", "train_iters"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value} must be a positive integer")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) "
                          f"parallel size = {tp * pp}")
    args.data_parallel_size = world_size // (tp * pp)
    rpn = getattr(args, "zpp_ranks_per_node", None)
    if rpn is not None:
        # Nodes are runs of rpn consecutive ranks: a value that does not divide the world leaves a partial last
        # node (the topology fails later, at the first hooked collective, naming groups instead of the flag),
        # and one larger than the world describes ranks that do not exist (every peer would count as on-node:
        # qgZ would skip its inter-node hop and the byte accounting would call the network traffic intra-node).
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        if rpn < 1 or rpn > world_size or world_size % rpn:
            why = ("is not a positive integer for" if rpn < 1 else "is larger than" if rpn > world_size
                   else "does not divide")
            raise ConfigError(f"--zpp-ranks-per-node {rpn} {why} the world size {world_size}; valid: "
                              f"{', '.join(map(str, divisors))} (ranks per node; the node count is world size / it)")
        hpz = getattr(args, "zpp_hpz_size", None)
        if hpz is not None and hpz >= 1 and rpn % hpz:
            # hpZ's partition must divide the data-parallel members per node, which divide the ranks per node.
            raise ConfigError(f"--zpp-hpz-size {hpz} does not divide --zpp-ranks-per-node {rpn}; valid: "
                              f"{', '.join(str(d) for d in range(1, rpn + 1) if rpn % d == 0)}")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise ConfigError(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
                          f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    if args.hidden_size % args.num_attention_heads:
        # Megatron-Core would quietly build attention heads of hidden // heads channels (a narrower attention).
        raise ConfigError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                          f"{args.num_attention_heads}")
    if args.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if args.num_layers % pp:
        raise ConfigError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage:
        per_stage = args.num_layers // pp
        if pp < 2 or per_stage % args.num_layers_per_virtual_pipeline_stage:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage} "
                              f"must divide the {per_stage} layers of each of >= 2 pipeline stages")
        vpp = per_stage // args.num_layers_per_virtual_pipeline_stage
        # As Megatron-LM: one virtual stage per rank is the plain 1F1B schedule, not an interleaved one.
        args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
        if args.use_megatron_fsdp:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage with --use-megatron-fsdp is not supported")
    if args.virtual_pipeline_model_parallel_size and args.num_microbatches % pp:
        # Megatron's interleaved schedule raises on this later, naming neither flag.
        raise ConfigError(f"the interleaved schedule (--num-layers-per-virtual-pipeline-stage "
                          f"{args.num_layers_per_virtual_pipeline_stage}) needs the number of micro-batches, "
                          f"--global-batch-size {args.global_batch_size} / (--micro-batch-size {args.micro_batch_size}"
                          f" x data-parallel size {args.data_parallel_size}) = {args.num_microbatches}, to be a "
                          f"multiple of --pipeline-model-parallel-size {pp}")
    # As in Megatron-LM: p2p overlap is the interleaved schedule's default and only exists there.
    args.overlap_p2p_comm = bool(args.overlap_p2p_comm and args.virtual_pipeline_model_parallel_size)
    if args.overlap_param_gather and not (args.use_distributed_optimizer or args.use_megatron_fsdp):
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer or --use-megatron-fsdp")
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive: pick one")
    if args.lr_decay_style == "WSD":
        raise ConfigError("--lr-decay-style WSD needs Megatron-LM's --lr-wsd-decay-* flags, which this driver does not "
                          "have; valid here: constant, linear, cosine, inverse-square-root")
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full" and (args.recompute_method is None or not args.recompute_num_layers):
        raise ConfigError("--recompute-granularity full needs --recompute-method (uniform, block) and "
                          f"--recompute-num-layers; got {args.recompute_method!r} and {args.recompute_num_layers!r}")
    decay_iters = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters >= decay_iters:
        raise ConfigError(f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than the decay iterations "
                          f"{decay_iters} (--lr-decay-iters, default --train-iters; Megatron's scheduler asserts "
                          "it with no message); lower the warmup or add iterations")
    from megatron_zpp.training.checkpoint import CKPT_FORMATS

    if args.ckpt_format not in CKPT_FORMATS:
        raise ConfigError(f"--ckpt-format {args.ckpt_format} is not implemented by this driver; valid: "
                          f"{', '.join(CKPT_FORMATS)}")
    if args.use_megatron_fsdp != (args.ckpt_format == "fsdp_dtensor") and (args.save or args.load):
        fsdp = args.use_megatron_fsdp
        raise ConfigError(f"--ckpt-format {args.ckpt_format} with{'' if fsdp else 'out'} --use-megatron-fsdp; valid: "
                          f"--ckpt-format {'fsdp_dtensor' if fsdp else 'torch_dist'} (as in Megatron-LM, Megatron-FSDP "
                          "checkpoints are fsdp_dtensor, DDP and distributed-optimizer ones torch_dist)")
    for name in ("eval_interval", "exit_interval", "save_interval", "log_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be a positive integer")
    args.wandb_config = parse_wandb_config(args.wandb_config)
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    from megatron_zpp.training.data import validate_data_args

    with _flag_errors():
        validate_data_args(args)
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                          f"{args.max_position_embeddings}")
    if args.ffn_hidden_size % tp:
        raise ConfigError(f"--ffn-hidden-size {args.ffn_hidden_size} (default 4 x --hidden-size) is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    from megatron_zpp.training.moe import validate_moe_args

    validate_moe_args(args, world_size)
    if args.sequence_parallel and tp > 1 and args.seq_length % tp:
        raise ConfigError(f"--sequence-parallel splits the sequence over the tensor-parallel ranks: --seq-length "
                          f"{args.seq_length} is not divisible by --tensor-model-parallel-size {tp}")
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr} (Megatron's scheduler asserts "
                          "min_lr <= lr with no message)")
    if args.eval_interval and not args.eval_iters:
        raise ConfigError(f"--eval-interval {args.eval_interval} with --eval-iters {args.eval_iters} would evaluate "
                          "nothing: give --eval-iters N (batches per evaluation) or drop --eval-interval")
    if args.save_interval and not args.save:
        raise ConfigError(f"--save-interval {args.save_interval} without --save: nothing would be saved; add --save "
                          "DIR")
    if args.distributed_timeout_minutes < 1:
        raise ConfigError(f"--distributed-timeout-minutes {args.distributed_timeout_minutes} must be >= 1")
    from megatron_zpp.training.divergence import divergence_config_from_args
    from megatron_zpp.training.watchdog import rank_failure_config_from_args

    with _flag_errors():
        rank_failure_config_from_args(args)  # errors name the flag now, before any process group exists
        divergence_config_from_args(args)
    from megatron_zpp.policy.auto import auto_config_from_args

    auto_config_from_args(args)  # ConfigErrors naming the --zpp-auto-* flag
    validate_transformer_impl(args)
    return args


def validate_transformer_impl(args: argparse.Namespace) -> None:
    """The flag combinations that are wrong on any machine (what the machine can run is decided later,
    in ``megatron_zpp.training.model.resolve_transformer_impl``)."""
    if args.transformer_impl == "inference_optimized":
        raise ConfigError("--transformer-impl inference_optimized is Megatron-LM's inference-only layer spec; for "
                          "training valid: transformer_engine, local")
    if args.transformer_impl == "local" and args.attention_backend.name in ("flash", "fused", "unfused"):
        raise ConfigError(f"--attention-backend {args.attention_backend.name} selects a Transformer Engine attention; "
                          "with --transformer-impl local valid: auto, local (or use --transformer-impl "
                          "transformer_engine)")


def parse_wandb_config(entries: list[str] | dict) -> dict:
    """``["rate=25mbit", "iters=8"]`` -> ``{"rate": "25mbit", "iters": 8}`` (idempotent on a dict)."""
    import json

    if isinstance(entries, dict):
        return entries
    out = {}
    for entry in entries:
        key, sep, value = entry.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--wandb-config {entry!r}: expected KEY=VALUE (e.g. rate=25mbit)")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out
