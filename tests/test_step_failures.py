"""No rank left hanging: a failure on one rank at each step that ends in a collective (checkpoint save, verify and
load, data loading, a codec's corrupt payload, the policy switch) is the same named error on every rank, and
every rank exits non-zero within 60 s (megatron_zpp/training/agreement.py).

Real processes, as tests/test_reliability.py launches them (2 gloo ranks, env:// rendezvous with rank 0 hosting the
store); faults are injected with ZPP_TEST_FAULT (megatron_zpp/training/faults.py). The stall timeout is set far
above 60 s, so only the agreement can end the ranks in time, and the process-group timeout (2 min) is above it too.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from test_reliability import HEARTBEAT_S, RUN_LIMIT_S, TINY, Ranks

WORLD = 2
EXIT_WITHIN_S = 60
# The stall timeout far above EXIT_WITHIN_S; still under --distributed-timeout-minutes 2 with its margin.
ARGS = [a for a in TINY] + ["--eval-iters", "0"]
ARGS[ARGS.index("--zpp-rank-timeout") + 1] = "100"
SAVE = ["--train-iters", "4", "--save-interval", "2"]


def _launch(out_dir: Path, args: list[str], fault: str) -> tuple[Ranks, dict[int, float]]:
    """Run until every rank exits; (the ranks, each one's seconds from the injected fault to its exit)."""
    ranks = Ranks(out_dir, args, fault, world=WORLD)
    try:
        failing = int(fault.split(",")[-1].split(":")[1])
        kind = fault.split(",")[-1].split(":")[0]
        injected = ranks.wait_for_line(failing, f"[fault injection] rank {failing}: {kind} at iteration", RUN_LIMIT_S)
        exits = ranks.exit_times(EXIT_WITHIN_S + 30)  # failing past EXIT_WITHIN_S is asserted below, with the text
    finally:
        ranks.close()
    return ranks, {r: round(t - injected, 1) for r, t in exits.items()}


def _check_every_rank(ranks: Ranks, seconds: dict[int, float], failing: int, names: str) -> None:
    print(f"\nrank {failing} failed; exits after {seconds} s (heartbeat {HEARTBEAT_S} s); exit codes "
          f"{[p.returncode for p in ranks.procs]}")
    for r in range(WORLD):
        text = ranks.text(r)
        line = next((x for x in text.splitlines() if re.search(names, x)), None)
        print(f"rank {r}: {line}")
        assert ranks.procs[r].returncode not in (0, None), (r, text[-3000:])
        assert line is not None, f"rank {r} does not print {names!r}:\n{text[-3000:]}"
        assert seconds[r] < EXIT_WITHIN_S, seconds


def _complete_checkpoints(ckpt: Path) -> dict:
    """The tracker's iteration, the iteration directories, and whether the tracker's checkpoint matches its
    manifest (every file there, with its size and SHA-256)."""
    tracker = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    folder = ckpt / f"iter_{tracker:07d}"
    files = json.loads((folder / "zpp_manifest.json").read_text())["files"]
    intact = all((folder / name).stat().st_size == entry["bytes"] and
                 hashlib.sha256((folder / name).read_bytes()).hexdigest() == entry["sha256"]
                 for name, entry in files.items())
    return {"tracker": tracker, "dirs": sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")),
            "intact": intact and len(files) > 0}


@pytest.fixture(scope="module")
def failed_save(tmp_path_factory):
    """Rank 1 fails writing the checkpoint of iteration 4 (ENOSPC after its data is written); the one of
    iteration 2 was saved before. Shared by the load test, which loads that checkpoint."""
    out = tmp_path_factory.mktemp("failed_save")
    ckpt = out / "ckpt"
    ranks, seconds = _launch(out / "run", ARGS + SAVE + ["--save", str(ckpt)], "save:1:4")
    return ranks, seconds, ckpt


def test_a_save_failing_on_one_rank_fails_every_rank_and_leaves_no_partial_checkpoint(failed_save):
    ranks, seconds, ckpt = failed_save
    _check_every_rank(ranks, seconds, 1, r"rank 1 failed in checkpoint save: OSError: \[Errno 28\] No space left")
    assert ranks.procs[1].returncode == 1 and ranks.procs[0].returncode == 75  # its own error / another rank's
    state = _complete_checkpoints(ckpt)
    print(f"checkpoint directory: {state}")
    assert state == {"tracker": 2, "dirs": ["iter_0000002"], "intact": True}


@pytest.mark.slow
def test_a_load_failing_on_one_rank_fails_every_rank(failed_save, tmp_path):
    ckpt = failed_save[2]
    ranks, seconds = _launch(tmp_path, ARGS + ["--train-iters", "4", "--load", str(ckpt)], "load:0:2")
    _check_every_rank(ranks, seconds, 0, r"rank 0 failed in checkpoint load: OSError: \[Errno 5\] Input/output error")


@pytest.mark.slow
def test_a_verification_failing_on_one_rank_fails_every_rank_and_leaves_no_partial_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    ranks, seconds = _launch(tmp_path / "run", ARGS + SAVE + ["--save", str(ckpt)], "verify:1:4")
    _check_every_rank(ranks, seconds, 1,
                      r"CheckpointError: checkpoint failed verification: rank 1: .*iter_0000004\.partial/.*corrupted")
    state = _complete_checkpoints(ckpt)
    print(f"checkpoint directory: {state}")
    assert state == {"tracker": 2, "dirs": ["iter_0000002"], "intact": True}


@pytest.mark.slow
def test_data_loading_failing_on_one_rank_fails_every_rank(tmp_path):
    ranks, seconds = _launch(tmp_path, ARGS + ["--train-iters", "4"], "data:0:3")
    _check_every_rank(ranks, seconds, 0, r"rank 0 failed in data loading: OSError: \[Errno 5\] Input/output error")


@pytest.mark.slow
def test_a_corrupt_payload_on_one_receiving_rank_fails_every_rank(tmp_path):
    # dp.grad lossless MPC: its payloads are containers, validated by the receiver (checksum).
    args = [a for a in ARGS if a != "--use-distributed-optimizer"]
    args[args.index("--zpp-policy") + 1] = "none"
    ranks, seconds = _launch(tmp_path, args + ["--train-iters", "4", "--zpp-dp-grad", "mpc"], "codec:1:3")
    _check_every_rank(ranks, seconds, 1, r"rank 1 failed in training iteration 3: PayloadError: .*checksum")


@pytest.mark.slow
def test_a_policy_switch_failing_on_one_rank_fails_every_rank(tmp_path):
    guard = ["--train-iters", "7", "--zpp-divergence-guard", "--zpp-divergence-min-history", "3"]
    ranks, seconds = _launch(tmp_path, ARGS + guard, "spike:6,switch:1:6")
    _check_every_rank(ranks, seconds, 1, r"rank 1 failed in policy switch: RuntimeError: injected failure")


def test_agreement_names_every_failed_rank_on_every_rank():
    """2 ranks, no training: a local step that fails on one rank, then on both with different errors, is the same
    StepFailedError on both ranks, naming each failed rank and its error; the same error on every rank is raised as
    it is; a collective step that succeeds passes, and a nested step's failure is not wrapped twice."""
    from megatron_zpp.testing import run_distributed

    out = run_distributed(_agreement_checks, 2)
    print(f"\n{out[0]}")
    assert out[0].pop("nested") == "rank 0 failed in inner: RuntimeError: deep", out  # rank 0's own, not agreed
    assert out[0] == out[1], out
    assert out[0] == {
        "one": "rank 1 failed in policy switch: OSError: [Errno 28] No space left on device",
        "two": "rank 0 failed in checkpoint commit: ValueError: zero; rank 1 failed in checkpoint commit: KeyError: 'one'",
        "same": "ValueError: bad --load",
        "tracker": "--load /ckpt: the ranks read different iterations from latest_checkpointed_iteration.txt (3 to 4); "
                   "a shared file system showing ranks different files?",
    }


def _agreement_checks():
    import torch.distributed as dist

    from megatron_zpp.training.agreement import Agreement, StepFailedError, is_agreed

    rank, agreement, out = dist.get_rank(), Agreement(), {}
    with agreement.step("nothing"):
        pass
    try:
        with agreement.step("policy switch", local=True):
            if rank == 1:
                raise OSError(28, "No space left on device")
    except StepFailedError as e:
        assert e.exit_code == (1 if rank == 1 else 75) and is_agreed(e)
        out["one"] = str(e)
    try:
        with agreement.step("checkpoint commit", local=True):
            raise ValueError("zero") if rank == 0 else KeyError("one")
    except StepFailedError as e:
        out["two"] = str(e)
    try:
        with agreement.step("checkpoint load", local=True):
            raise ValueError("bad --load")
    except ValueError as e:
        assert is_agreed(e)
        out["same"] = f"{type(e).__name__}: {e}"
    from megatron_zpp.training.checkpoint import CheckpointError, _agree_on_iteration

    _agree_on_iteration("/ckpt", 7, agreement)  # the same tracker everywhere: passes
    try:  # a stale shared-file-system view on one rank: both refuse, naming the range
        _agree_on_iteration("/ckpt", 3 if rank == 0 else 4, agreement)
    except CheckpointError as e:
        assert is_agreed(e)
        out["tracker"] = str(e)
    if rank == 0:  # no watchdog: a collective step's failure is raised on its rank only
        try:
            with agreement.step("outer"):
                with agreement.step("inner", confirm=False):
                    raise RuntimeError("deep")
        except StepFailedError as e:
            out["nested"] = str(e)
    dist.barrier()
    return out
