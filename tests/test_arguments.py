"""pretrain_gpt.py's flags against Megatron-LM's own parser (``megatron.training.arguments``), flag by flag."""

import argparse
import warnings

import pytest

from megatron_zpp.training.arguments import DIFFERENCES, build_parser, validate_args


def _megatron_parser() -> argparse.ArgumentParser:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import add_megatron_arguments
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings if flag not in ("-h", "--help")}


def _type(a: argparse.Action):
    """A type's name; for a converter function (Megatron-LM's enum flags), what it makes of each choice's name."""
    if a.type is None or isinstance(a.type, type) or not a.choices:
        return getattr(a.type, "__name__", a.type)
    return ("converts", tuple(a.type(getattr(c, "name", c)) for c in a.choices))


def _describe(a: argparse.Action) -> dict:
    return {"action": type(a).__name__, "dest": a.dest, "type": _type(a), "nargs": a.nargs,
            "default": a.default, "choices": tuple(a.choices) if a.choices else None}


def test_every_shared_flag_matches_megatron_lm():
    """Type, action, destination, default and choices of every flag both parsers have; the deliberate
    differences (DIFFERENCES, with their reasons) may differ in the default only, or in the choices where the
    reason begins with "choices:"."""
    megatron, ours = _actions(_megatron_parser()), _actions(build_parser())
    shared = sorted(set(megatron) & set(ours))
    mismatches, rows = [], []
    for flag in shared:
        m, o = _describe(megatron[flag]), _describe(ours[flag])
        fields = [k for k in m if m[k] != o[k]]
        allowed = set()
        if flag in DIFFERENCES:
            allowed = {"default", "choices"} if DIFFERENCES[flag].startswith("choices:") else {"default"}
        if flag == "--distributed-backend":  # None = pick by device (DIFFERENCES)
            allowed = {"default"}
        bad = [k for k in fields if k not in allowed]
        rows.append(f"{flag:42s} {'same' if not fields else 'differs (documented): ' + DIFFERENCES[flag] if not bad else 'MISMATCH ' + str({k: (m[k], o[k]) for k in bad})}")
        if bad:
            mismatches.append((flag, {k: (m[k], o[k]) for k in bad}))
    print(f"\n{len(shared)} flags shared with megatron.training.arguments:\n" + "\n".join(rows))
    assert not mismatches, mismatches
    # the flags users reach for (issue [8]) are all there
    assert {"--eval-interval", "--exit-interval", "--save-interval", "--ddp-bucket-size", "--no-align-param-gather",
            "--recompute-granularity", "--recompute-activations", "--recompute-method", "--fp16", "--loss-scale",
            "--seed", "--init-method-std", "--lr-decay-style", "--adam-beta2", "--eval-iters", "--transformer-impl",
            "--attention-backend", "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion",
            "--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--data-path", "--split",
            "--train-data-path", "--valid-data-path", "--test-data-path", "--data-cache-path", "--tokenizer-type",
            "--tokenizer-model", "--vocab-file", "--merge-file", "--vocab-size",
            # MoE (issue 25)
            "--num-experts", "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--moe-router-topk",
            "--moe-token-dispatcher-type", "--moe-aux-loss-coeff", "--moe-router-load-balancing-type",
            "--moe-layer-freq", "--moe-ffn-hidden-size", "--moe-grouped-gemm"} <= set(shared)
    # every documented difference is a flag we really share
    assert set(DIFFERENCES) <= set(shared), set(DIFFERENCES) - set(shared)


def test_a_megatron_lm_command_line_means_the_same_here():
    argv = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
            "--max-position-embeddings", "256", "--micro-batch-size", "2", "--global-batch-size", "16",
            "--lr", "3e-4", "--train-iters", "50", "--lr-warmup-iters", "5", "--bf16", "--seed", "7",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--recompute-activations",
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--eval-interval", "20", "--save-interval", "25",
            "--data-path", "0.3", "data/a_text_document", "0.7", "data/b_text_document", "--split", "98,2,0",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "gpt2/vocab.json",
            "--merge-file", "gpt2/merges.txt",
            "--data-cache-path", "cache"]
    megatron = vars(_megatron_parser().parse_args(argv))
    ours = vars(build_parser().parse_args(argv))
    shared = set(megatron) & set(ours)
    documented = {f.lstrip("-").replace("-", "_") for f in DIFFERENCES}  # defaults differing on purpose
    differ = {k: (megatron[k], ours[k]) for k in shared - documented if megatron[k] != ours[k]}
    assert not differ, differ
    assert len(shared) >= 50, sorted(shared)


@pytest.mark.parametrize("flags, message", [
    (["--lr-warmup-iters", "8", "--train-iters", "6"], "--lr-warmup-iters 8 must be smaller than the decay iterations 6"),
    (["--lr-warmup-iters", "6", "--train-iters", "6"], "--lr-warmup-iters 6 must be smaller"),
    (["--lr-decay-style", "WSD"], "WSD needs Megatron-LM's --lr-wsd-decay"),
    (["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive"),
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
    (["--eval-interval", "0"], "--eval-interval 0 must be a positive integer"),
    (["--exit-interval", "-1"], "--exit-interval -1 must be a positive integer"),
])
def test_inconsistent_schedules_fail_before_megatron_asserts(flags, message):
    with pytest.raises(ValueError, match=message):
        validate_args(build_parser().parse_args(flags), 1)


# Each row was run through trainer.pretrain first: what Megatron-Core did without the check is in the comment.
@pytest.mark.parametrize("flags, world, message", [
    # AssertionError "First dimension of the tensor should be divisible by tensor parallel size" (mappings.py)
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "63",
      "--max-position-embeddings", "64"], 2,
     r"--seq-length 63 is not divisible by --tensor-model-parallel-size 2"),
    # trained silently with 4 heads of 16 channels: a 64-wide attention in a 66-wide model
    (["--hidden-size", "66"], 1, r"--hidden-size 66 is not divisible by --num-attention-heads 4"),
    # AssertionError "129 is not divisible by 2 when instantiating TransformerLayer"
    (["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "129"], 2,
     r"--ffn-hidden-size 129 \(default 4 x --hidden-size\) is not divisible by --tensor-model-parallel-size 2"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1,
     r"--global-batch-size 6 is not a multiple of --micro-batch-size 4 x data-parallel size 1 = 4"),
    (["--global-batch-size", "4", "--micro-batch-size", "4"], 2,
     r"--global-batch-size 4 is not a multiple of --micro-batch-size 4 x data-parallel size 2 = 8"),
    (["--micro-batch-size", "0"], 1, r"--micro-batch-size 0 must be a positive integer"),
    # AssertionError with no message (optimizer_param_scheduler.py)
    (["--min-lr", "1e-2", "--lr", "1e-3"], 1, r"--min-lr 0.01 is larger than --lr 0.001"),
    # trained without ever evaluating
    (["--eval-interval", "2", "--eval-iters", "0"], 1, r"--eval-interval 2 with --eval-iters 0 would evaluate nothing"),
    # trained without ever saving
    (["--save-interval", "2"], 1, r"--save-interval 2 without --save"),
    # RuntimeError "The remainder of M ... divided by N ... should be 0" (schedules.py), no flag named
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "6", "--micro-batch-size", "2"], 2,
     r"--num-layers-per-virtual-pipeline-stage 1\) needs the number of micro-batches, --global-batch-size 6 / "
     r"\(--micro-batch-size 2 x data-parallel size 1\) = 3, to be a multiple of --pipeline-model-parallel-size 2"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     r"--num-layers-per-virtual-pipeline-stage 3 must divide the 2 layers"),
    (["--transformer-impl", "inference_optimized"], 1, r"inference_optimized is Megatron-LM's inference-only"),
    (["--transformer-impl", "local", "--attention-backend", "flash"], 1,
     r"--attention-backend flash selects a Transformer Engine attention; with --transformer-impl local valid: auto"),
])
def test_inconsistent_sizes_fail_naming_the_flags(flags, world, message):
    with pytest.raises(ValueError, match=message):
        validate_args(build_parser().parse_args(flags), world)


def test_one_virtual_stage_per_rank_is_plain_1f1b():
    """As Megatron-LM: 2 layers per stage in virtual stages of 2 is not interleaved (it used to build an
    interleaved schedule with one chunk, which Megatron's schedule rejected)."""
    args = validate_args(build_parser().parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                                    "--num-layers-per-virtual-pipeline-stage", "2"]), 2)
    assert args.virtual_pipeline_model_parallel_size is None and not args.overlap_p2p_comm


def test_transformer_impl_default_falls_back_explicit_errors():
    """Megatron-LM's default (transformer_engine) becomes local with the reason where TE cannot run; an
    explicit request there fails with the install command; local is never changed."""
    from megatron_zpp.training.model import resolve_transformer_impl

    default = validate_args(build_parser().parse_args([]), 1)
    explicit = validate_args(build_parser().parse_args(["--transformer-impl", "transformer_engine"]), 1)
    local = validate_args(build_parser().parse_args(["--transformer-impl", "local"]), 1)
    assert default.transformer_impl == "transformer_engine" and not default.transformer_impl_explicit
    assert explicit.transformer_impl_explicit and local.transformer_impl_explicit
    impl, note = resolve_transformer_impl(default, cuda=False, te=False, tp_compressed=False)
    assert impl == "local" and "Transformer Engine is not installed" in note and 'pip install -e ".[gpu]"' in note
    with pytest.raises(ValueError, match=r'--transformer-impl transformer_engine: Transformer Engine is not '
                                         r'installed \(on a CUDA machine: pip install -e "\.\[gpu\]"\)'):
        resolve_transformer_impl(explicit, cuda=False, te=False, tp_compressed=False)
    with pytest.raises(ValueError, match="need a GPU"):
        resolve_transformer_impl(explicit, cuda=False, te=True, tp_compressed=False)
    with pytest.raises(ValueError, match="--zpp-tp codec"):
        resolve_transformer_impl(explicit, cuda=True, te=True, tp_compressed=True)
    assert resolve_transformer_impl(default, cuda=True, te=True, tp_compressed=True)[0] == "local"
    assert resolve_transformer_impl(default, cuda=True, te=True, tp_compressed=False) == ("transformer_engine", "")
    assert resolve_transformer_impl(local, cuda=True, te=True, tp_compressed=False) == ("local", "")


def test_fusions_follow_megatron_lm_where_they_can_run():
    from megatron_zpp.training.model import resolve_fusions

    args = validate_args(build_parser().parse_args([]), 1)
    on_cpu, why = resolve_fusions(args, "local", cuda=False)
    assert not any(on_cpu.values()) and set(why.values()) == {"no GPU"}
    with_te, why = resolve_fusions(args, "transformer_engine", cuda=True)
    assert with_te["bias_activation_fusion"] and with_te["bias_dropout_fusion"] and with_te["masked_softmax_fusion"]
    assert with_te["persist_layer_norm"] and not with_te["apply_rope_fusion"]  # learned absolute positions
    # apex is not installed here: Megatron-Core's linear layers would raise on gradient_accumulation_fusion
    assert not with_te["gradient_accumulation_fusion"] and "fused_weight_gradient_mlp_cuda" in \
        why["gradient_accumulation_fusion"]
    off = validate_args(build_parser().parse_args(["--no-bias-gelu-fusion", "--no-bias-dropout-fusion"]), 1)
    fusions, why = resolve_fusions(off, "transformer_engine", cuda=True)
    assert not fusions["bias_activation_fusion"] and not fusions["bias_dropout_fusion"]
    assert "bias_activation_fusion" not in why  # turned off by the user: nothing to explain


def test_recompute_activations_is_selective():
    args = validate_args(build_parser().parse_args(["--recompute-activations"]), 1)
    assert args.recompute_granularity == "selective"
