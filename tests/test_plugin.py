"""The plugin through Megatron-LM's own code: ``megatron.training.arguments`` (the real parser, with
``zpp_extra_args_provider``), ``install_from_args``, and ``megatron.training.pretrain()`` on gloo CPU ranks."""

from __future__ import annotations

import argparse
import inspect
import sys
import warnings

import pytest

import plugin_checks as checks
from megatron_zpp.megatron import install_from_args, zpp_extra_args_provider
from megatron_zpp.testing import run_distributed
from megatron_zpp.policy import EP_DIMENSIONS

# A Megatron-LM command line (docs/megatron-lm.md), without the --zpp-* flags.
MEGATRON_LM = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
               "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
               "--train-iters", "10", "--lr", "1e-4", "--use-distributed-optimizer", "--bf16",
               "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--mock-data"]


def _megatron_lm_args(argv: list[str], monkeypatch, world_size: int = 4):
    """``parse_args`` + ``validate_args`` of megatron.training, as ``parse_and_validate_args`` runs them (without
    its global state: a second call in one process would fail). ``validate_args`` reads RANK and WORLD_SIZE,
    and with TP > 1 the GPU's compute capability (``get_device_arch_version``: a Hopper's here) and
    CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM's launch scripts set it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training import arguments
        from megatron.training.arguments import parse_args, validate_args
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    args = parse_args(zpp_extra_args_provider, ignore_unknown_args=False)
    validate_args(args, {})
    return args


def test_zpp_flags_do_not_collide_with_megatron_lm():
    """No --zpp-* flag or destination is one of Megatron-LM's (argparse would refuse a second definition
    of a flag; a shared destination would silently overwrite Megatron's value)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import add_megatron_arguments
    megatron = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ours_actions = zpp_extra_args_provider(argparse.ArgumentParser(allow_abbrev=False, add_help=False))._actions
    flags = {f for a in megatron._actions for f in a.option_strings}
    dests = {a.dest for a in megatron._actions}
    collisions = sorted({f for a in ours_actions for f in a.option_strings} & flags) + \
        sorted({a.dest for a in ours_actions} & dests)
    print(f"\n{len(ours_actions)} --zpp-* flags against {len(flags)} Megatron-LM flags; collisions: {collisions}")
    assert not collisions
    assert ours_actions and all(f.startswith(("--zpp-", "--no-zpp-")) and a.dest.startswith("zpp_")
                                for a in ours_actions for f in a.option_strings)


def test_megatron_lm_parser_resolves_and_installs_the_policy(monkeypatch):
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    args = _megatron_lm_args(MEGATRON_LM + ["--zpp-policy", "zeropp", "--zpp-ranks-per-node", "2",
                                            "--zpp-dp-grad", "int4:block=64", "--zpp-pp", "int8"], monkeypatch)
    assert args.data_parallel_size == 4 and args.transformer_impl == "transformer_engine"  # Megatron-LM's
    group = pgb._ParamAndGradBucketGroup
    before = {name: inspect.getattr_static(group, name) for name in ("start_grad_sync", "start_param_sync")}
    p2p_before = p2p._batched_p2p_ops
    hooks = install_from_args(args)
    try:
        assert hooks.installed and hooks.ranks_per_node == 2
        assert hooks.policy.name == "zeropp"
        canonical = ",rounding=nearest,seed=0"  # resolved specs spell out the codec's defaults
        assert hooks.policy.codecs == {"dp.grad": "int4:block=64" + canonical, "dp.param": "int8:block=256" + canonical,
                                       "tp": "none", "pp": "int8:block=256" + canonical,
                                       **{d: "none" for d in EP_DIMENSIONS}}, hooks.policy.codecs
        assert all(inspect.getattr_static(group, n) is not f for n, f in before.items())
        assert p2p._batched_p2p_ops is not p2p_before
    finally:
        hooks.uninstall()
    assert not hooks.installed
    assert all(inspect.getattr_static(group, n) is f for n, f in before.items())
    assert p2p._batched_p2p_ops is p2p_before


@pytest.mark.parametrize("flags, error, message", [
    (["--zpp-policy", "zeroplus"], ValueError, r"zeroplus.*(fair|zeropp)"),
    (["--zpp-dp-grad", "int9"], ValueError, r"int9"),
    # Megatron-LM's default --transformer-impl is TE, whose layers bypass the tp hooks
    (["--tensor-model-parallel-size", "2", "--zpp-tp", "int8"], ValueError,
     r"--zpp-tp int8:block=256\S* .* --transformer-impl transformer_engine .* add --transformer-impl local"),
])
def test_bad_zpp_values_through_megatron_lm_fail_clearly(flags, error, message, monkeypatch):
    args = _megatron_lm_args(MEGATRON_LM + flags, monkeypatch)
    with pytest.raises(error, match=message):
        install_from_args(args).uninstall()


def test_a_zpp_flag_megatron_lm_cannot_parse_is_named(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _megatron_lm_args(MEGATRON_LM + ["--zpp-ranks-per-node", "two"], monkeypatch)
    assert "--zpp-ranks-per-node: invalid int value: 'two'" in capsys.readouterr().err


def test_tp_codec_with_local_layers_installs(monkeypatch):
    args = _megatron_lm_args(MEGATRON_LM + ["--tensor-model-parallel-size", "2", "--zpp-tp", "int8",
                                            "--transformer-impl", "local"], monkeypatch)
    hooks = install_from_args(args)
    try:
        assert hooks.policy.codec("tp").startswith("int8:block=256")
    finally:
        hooks.uninstall()


# Megatron-LM's pretrain() on 2 gloo CPU ranks, as 2 one-rank "nodes" (so the data-parallel collectives
# cross a node boundary and zeropp compresses them). Local layers and no dropout: this machine has no TE.
PRETRAIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", "4", "--lr", "1e-3", "--use-distributed-optimizer", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1000", "--mock-data", "--transformer-impl", "local", "--distributed-backend", "gloo",
            "--no-gradient-accumulation-fusion", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0", "--log-interval", "1",
            "--zpp-ranks-per-node", "1"]


def _pretrain(extra: list[str], plugin: bool = True) -> list[dict]:
    return run_distributed(checks.megatron_lm_pretrain, 2, PRETRAIN + extra, plugin, ranks_per_node=1,
                           timeout_s=300)


@pytest.mark.slow
def test_megatron_lm_pretrain_with_the_plugin_on_cpu():
    """none trains bit-identically to Megatron-LM without the plugin; zeropp compresses the gradient
    reduce-scatter and the parameter all-gather and stays close (4 iterations)."""
    absent, none, zeropp = _pretrain([], plugin=False), _pretrain(["--zpp-policy", "none"]), \
        _pretrain(["--zpp-policy", "zeropp"])
    for a, n, z in zip(absent, none, zeropp):
        assert n["losses"] == a["losses"], (n["losses"], a["losses"])
        assert len(a["losses"]) == 4 * 2  # 2 micro-batches per rank per iteration
        # the counter install_from_args reads (--zpp-dp-grad-until), set on the args Megatron-LM trains with
        assert a["curr_iteration"] == n["curr_iteration"] == 3
        assert z["losses"][:2] == a["losses"][:2]  # the first forward precedes any compressed collective
        assert [l for l, _ in z["losses"]] == pytest.approx([l for l, _ in a["losses"]], rel=2e-2)
        assert z["traffic"]["dp.grad"]["inter_ratio"] < 0.2 and z["traffic"]["dp.param"]["inter_ratio"] < 0.3, \
            z["traffic"]
        assert n["traffic"]["dp.grad"]["inter_ratio"] == 1.0
    per_iter = {k: [sum(l for l, _ in r["losses"][2 * i:2 * i + 2]) / sum(t for _, t in r["losses"][2 * i:2 * i + 2])
                    for i in range(4)] for k, r in (("absent", absent[0]), ("zeropp", zeropp[0]))}
    print(f"\nMegatron-LM pretrain() on 2 CPU ranks, rank 0 loss per iteration: absent {per_iter['absent']}; "
          f"none identical; zeropp {per_iter['zeropp']}; zeropp bytes {zeropp[0]['traffic']}")
