"""An error said once (issue 22, item 5): a bad flag or configuration is one line from rank 0, naming the value
and the valid choices, and every rank exits with 2 (argparse's status); a bug keeps its traceback.

The launches start each rank as its own process (env:// rendezvous, as tests/test_reliability.py does) rather
than under torchrun, so each rank's exit status and output are its own; torchrun adds its own failure summary
(and traceback) for any non-zero exit, which no rank can prevent.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_zpp.policy import ConfigError, resolve_policy, zpp_config_from_args
from megatron_zpp.training.arguments import build_parser, validate_args

REPO = Path(__file__).resolve().parents[1]
LAUNCH_LIMIT_S = 600  # a launch that fails at start-up takes seconds; the 2 cores are shared


def _config(argv: list[str], world: int = 2) -> argparse.Namespace:
    """What pretrain() does with a command line before training: parse, validate, resolve the policy."""
    args = validate_args(build_parser().parse_args(argv), world)
    resolve_policy(zpp_config_from_args(args))
    return args


# (id, flags, world size, what the one line must say: the bad value and the valid choices)
BAD_CONFIGS = [
    ("policy-name", ["--zpp-policy", "zerop"], 2,
     ["'zerop'", "fair, hybrid, mzhybrid, none, sdp4bit, zeropp, zhybrid"]),
    ("codec-spec", ["--zpp-dp-grad", "int9"], 2, ["'int9'", "valid codecs: int4, int8"]),
    ("hadamard-run", ["--zpp-dp-grad", "int4:block=128,hadamard=48"], 2,
     ["hadamard=48", "valid: 0 (off) or a power of two in [2, 4096] that divides the block"]),
    ("hadamard-intra", ["--zpp-policy", "sdp4bit", "--zpp-dp-grad-intra", "int8:block=512,hadamard=256"], 2,
     ["rotates runs of 256", "must divide dp.grad's block 128"]),
    ("world-size", ["--tensor-model-parallel-size", "3"], 2, ["world size 2", "tensor (3)"]),
    ("ranks-per-node", ["--zpp-ranks-per-node", "3"], 4, ["--zpp-ranks-per-node 3", "valid: 1, 2, 4"]),
    ("fsdp-ckpt-format", ["--use-megatron-fsdp", "--save", "/nonexistent/ckpt"], 2,
     ["--ckpt-format torch_dist", "valid: --ckpt-format fsdp_dtensor"]),
    ("watchdog-flag", ["--zpp-rank-timeout", "-1"], 2, ["--zpp-rank-timeout -1", ">= 0"]),
    ("data-path", ["--data-path", "/nonexistent/corpus"], 2, ["/nonexistent/corpus", "not found"]),
]


@pytest.mark.parametrize("flags, world, says", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_configurations_raise_config_error_naming_value_and_choices(flags, world, says):
    with pytest.raises(ConfigError) as caught:
        _config(flags, world)
    text = str(caught.value)
    assert "\n" not in text, text
    for part in says:
        assert part in text, f"{part!r} not in {text!r}"


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_bad_flag_is_one_line_from_rank_0(rank, monkeypatch, capsys):
    monkeypatch.setenv("RANK", rank)
    for argv, says in ((["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
                       (["--lr-decay-style", "foo"], "invalid choice: 'foo' (choose from 'constant', 'linear'")):
        with pytest.raises(SystemExit) as caught:
            build_parser().parse_args(argv)
        assert caught.value.code == 2
        out, err = capsys.readouterr()
        assert out == ""
        if rank == "0":
            assert len(err.splitlines()) == 1 and says in err, err
        else:
            assert err == "", err
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["--help"])
    assert caught.value.code == 0
    out, err = capsys.readouterr()
    assert ("--zpp-policy" in out) == (rank == "0") and err == ""


def _pretrain_gpt(monkeypatch, pretrain):
    """pretrain_gpt.py as a module, its pretrain() replaced."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt_under_test", REPO / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "pretrain", pretrain)
    return module


def _config_error() -> Exception:
    return ConfigError("--zpp-hpz-size 3 does not divide --zpp-ranks-per-node 4; valid: 1, 2, 4")


def _agreed_load_error() -> Exception:
    from megatron_zpp.training.agreement import mark_agreed
    from megatron_zpp.training.checkpoint import CheckpointLoadError

    error = CheckpointLoadError("--load /ckpt: saved with --ckpt-format torch_dist, this run uses fsdp_dtensor")
    mark_agreed(error)  # as load_checkpoint raises it: every rank found it
    return error


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize("make_error, code", [(_config_error, 2), (_agreed_load_error, 66)],
                         ids=["config-error-exits-2", "agreed-load-error-exits-66"])
def test_main_says_a_user_error_once(make_error, code, rank, monkeypatch, capsys):
    """A configuration error, or a checkpoint load error every rank agreed on: one line from rank 0 naming it,
    nothing from the others, the same exit status everywhere."""
    error = make_error()

    def pretrain(argv):
        raise error

    module = _pretrain_gpt(monkeypatch, pretrain)
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as caught:
        module.main([])
    assert caught.value.code == code
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"pretrain_gpt.py: error: {error}\n" if rank == "0" else "")


def test_main_keeps_the_traceback_of_a_load_error_only_one_rank_saw(monkeypatch):
    """Not agreed (raised outside an agreement step, on this rank alone): not said once from rank 0, where this
    rank's message would be lost; it propagates with its traceback."""
    from megatron_zpp.training.checkpoint import CheckpointLoadError

    def pretrain(argv):
        raise CheckpointLoadError("--load /ckpt: no latest_checkpointed_iteration.txt")

    module = _pretrain_gpt(monkeypatch, pretrain)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(CheckpointLoadError):
        module.main([])


def test_main_lets_a_bug_through_with_its_traceback(monkeypatch):
    """A ValueError that is not a ConfigError is a bug: main() does not catch it, so the interpreter prints its
    traceback and exits 1 (the launch test below checks that on real processes)."""
    def pretrain(argv):
        raise ValueError("injected bug")

    module = _pretrain_gpt(monkeypatch, pretrain)
    with pytest.raises(ValueError, match="injected bug"):
        module.main([])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, argv: list[str], *, code: str | None = None) -> tuple[list[int], str]:
    """``world`` ranks of pretrain_gpt.py (or of ``python -c code``), each its own process; their exit codes and
    their output together."""
    port, procs = _free_port(), []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        env.pop("PYTHONWARNINGS", None)
        command = [sys.executable, "-c", code] if code else [sys.executable, str(REPO / "pretrain_gpt.py")]
        procs.append(subprocess.Popen([*command, *argv], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=LAUNCH_LIMIT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], "".join(outputs)


LAUNCHED = {c[0]: c[1:] for c in BAD_CONFIGS}
LAUNCHED["argparse"] = (["--lr-decay-style", "foo"], 2, ["'foo'", "choose from 'constant', 'linear'"])
# Not a ConfigError: a --load checkpoint that cannot be loaded (CheckpointLoadError, agreed by every rank in load_checkpoint), exit 66.
LAUNCHED["checkpoint-missing"] = (["--load", "/nonexistent/ckpt"], 2,
                                  ["--load /nonexistent/ckpt", "latest_checkpointed_iteration.txt"])
EXIT_CODES = {"checkpoint-missing": 66}


@pytest.mark.parametrize("case", [
    "policy-name",  # a ConfigError raised after torch.distributed is up; the others are slow-only
    *(pytest.param(c, marks=pytest.mark.slow)
      for c in ("codec-spec", "world-size", "fsdp-ckpt-format", "argparse", "checkpoint-missing")),
])
def test_a_launch_with_a_bad_configuration_says_it_once(case):
    flags, world, says = LAUNCHED[case]
    codes, output = _launch(world, [*flags, "--train-iters", "1"])
    # A load error comes after the start-up, whose lines (rank 0's, "> " first) may precede it.
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("> ")]
    print(f"\nexit codes {codes}; output:\n{output}")
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), output
    for part in says:
        assert part in lines[0], f"{part!r} not in {lines[0]!r}"
    assert "Traceback" not in output
    assert codes == [EXIT_CODES.get(case, 2)] * world, codes


@pytest.mark.slow
def test_a_launch_with_a_bug_prints_its_traceback():
    """A bug (an exception that is not a ConfigError, here a ValueError injected into the validation) is not taken
    for a user error: every rank prints its traceback and exits non-zero."""
    code = ("import runpy, sys\n"
            "import megatron_zpp.training.trainer as trainer\n"
            "def validate_args(args, world):\n"
            "    raise ValueError('injected bug')\n"
            "trainer.validate_args = validate_args\n"
            f"sys.argv[0] = {str(REPO / 'pretrain_gpt.py')!r}\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    codes, output = _launch(2, ["--train-iters", "1"], code=code)
    print(f"\nexit codes {codes}; output:\n{output}")
    assert output.count("Traceback (most recent call last)") == 2, output
    assert output.count("ValueError: injected bug") == 2, output
    assert "error: injected bug" not in output  # not dressed up as a user error
    assert all(c != 0 for c in codes), codes


def test_launch_rank_reads_torchrun_then_slurm(monkeypatch):
    """Before torch.distributed is up, the rank that says a user error once comes from the launcher: torchrun's
    RANK, else srun's SLURM_PROCID (one task per rank), else 0; a garbled value is skipped, not fatal."""
    from megatron_zpp.training.quiet import launch_rank

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    assert launch_rank() == 0
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert launch_rank() == 3
    monkeypatch.setenv("RANK", "1")
    assert launch_rank() == 1
    monkeypatch.setenv("RANK", "x")
    assert launch_rank() == 3


def test_error_feedback_with_virtual_pipeline_stages_is_refused_naming_both():
    """Error-feedback residuals are named by a bucket's index in its model chunk; virtual pipeline stages are
    chunks of their own, whose same-numbered buckets would share a residual silently: refused at start-up."""
    from megatron_zpp.megatron import hooks_from_args

    flags = ["--global-batch-size", "16", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
             "--num-layers-per-virtual-pipeline-stage", "1", "--zpp-policy", "zeropp", "--zpp-dp-grad-error-feedback"]
    with pytest.raises(ConfigError, match="--zpp-dp-grad-error-feedback.*--num-layers-per-virtual-pipeline-stage 1"):
        hooks_from_args(_config(flags, world=4))
    hooks_from_args(_config(flags[:-1], world=4))  # either one alone is fine
    hooks_from_args(_config(flags[:6] + flags[8:], world=4))


def test_expert_data_parallel_groups_split_unevenly_over_nodes_are_refused_at_start_up():
    """EP=4 on nodes of 6 ranks: the expert-data-parallel groups (stride 4) put 2, 1, 2, 1 members on the nodes,
    which the compressed collectives cannot split into hops; refused before training, not at the first gather."""
    from megatron_zpp.megatron import hooks_from_args

    flags = ["--num-experts", "4", "--expert-model-parallel-size", "4", "--zpp-ranks-per-node", "6",
             "--global-batch-size", "48", "--zpp-policy", "zeropp"]
    for policy in ("zeropp", "auto"):  # auto starts as none but may switch to a policy that routes them
        with pytest.raises(ConfigError, match="expert TP x EP = 4 ranks, which 6 ranks per node split unevenly"):
            hooks_from_args(_config(flags[:-1] + [policy], world=12))
    hooks_from_args(_config(flags[:-1] + ["none"], world=12))  # Megatron's own collectives: nothing to split
    hooks_from_args(_config(flags[:-1] + ["none", "--zpp-ep-dispatch", "mpc", "--moe-token-dispatcher-type",
                                          "alltoall"], world=12))  # ep codecs only: data parallel is Megatron's
    hooks_from_args(_config(flags[:5] + ["4"] + flags[6:], world=12))  # 4 per node: even


def test_weight_differences_on_megatron_fsdp_need_a_data_parallel_group_with_an_hpz_copy():
    """qWD on Megatron-FSDP keeps the weights in the hpZ copy inside a node: with TP filling the node the dense
    data-parallel group has one member per node and no copy, refused at start-up, naming the sizes."""
    from megatron_zpp.megatron import hooks_from_args

    flags = ["--use-megatron-fsdp", "--bf16", "--tensor-model-parallel-size", "2", "--zpp-ranks-per-node", "2",
             "--zpp-policy", "sdp4bit"]
    with pytest.raises(ConfigError, match="with 2 ranks per node and TP x CP = 2 the data-parallel group has one "
                                          "member per node"):
        hooks_from_args(_config(flags, world=4))
    hooks_from_args(_config(flags[:5] + ["4"] + flags[6:], world=8))  # 2 data-parallel members per node
