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


def _describe(a: argparse.Action) -> dict:
    return {"action": type(a).__name__, "dest": a.dest, "type": getattr(a.type, "__name__", a.type),
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
            "--seed", "--init-method-std", "--lr-decay-style", "--adam-beta2", "--eval-iters", "--data-path", "--split",
            "--train-data-path", "--valid-data-path", "--test-data-path", "--data-cache-path", "--tokenizer-type",
            "--tokenizer-model", "--vocab-file", "--merge-file", "--vocab-size"} <= set(shared)
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


def test_recompute_activations_is_selective():
    args = validate_args(build_parser().parse_args(["--recompute-activations"]), 1)
    assert args.recompute_granularity == "selective"
