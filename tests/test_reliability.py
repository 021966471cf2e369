"""Rank failures and the divergence guard, on real processes (4 gloo ranks, 2 simulated nodes x 2).

Ranks are started as independent processes (env:// rendezvous, rank 0 hosting the store), not under
torchrun, whose agent would stop a dead worker's siblings itself: this checks what a rank on another
node sees. Faults are injected with ZPP_TEST_FAULT (megatron_zpp/training/faults.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
WORLD, RANKS_PER_NODE = 4, 2
HEARTBEAT_S, RANK_TIMEOUT_S = 1.0, 10.0
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--eval-iters", "0", "--log-interval", "1", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--use-distributed-optimizer", "--zpp-policy", "zeropp",
        "--zpp-ranks-per-node", str(RANKS_PER_NODE), "--zpp-heartbeat-interval", str(HEARTBEAT_S),
        "--zpp-rank-timeout", str(RANK_TIMEOUT_S), "--distributed-timeout-minutes", "2"]
RUN_LIMIT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """``world`` (default WORLD) ``pretrain_gpt.py`` processes; each one's output in ``out_dir/rank{r}.log``;
    killed on exit."""

    def __init__(self, out_dir: Path, args: list[str], fault: str | None = None, world: int = WORLD) -> None:
        self.out_dir = out_dir
        self.world = world
        out_dir.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        self.procs, self.logs = [], []
        for r in range(world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r % RANKS_PER_NODE),
                       LOCAL_WORLD_SIZE=str(RANKS_PER_NODE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
            env.pop("ZPP_TEST_FAULT", None)
            if fault:
                env["ZPP_TEST_FAULT"] = fault
            log = open(out_dir / f"rank{r}.log", "w")
            self.logs.append(log)
            self.procs.append(subprocess.Popen([sys.executable, str(REPO / "pretrain_gpt.py"), *args], env=env,
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def text(self, r: int) -> str:
        return (self.out_dir / f"rank{r}.log").read_text(errors="replace")

    def wait_for_line(self, r: int, needle: str, limit_s: float) -> float:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if needle in self.text(r):
                return time.monotonic()
            time.sleep(0.05)
        raise AssertionError(f"rank {r} never printed {needle!r} in {limit_s} s:\n{self.text(r)[-3000:]}")

    def exit_times(self, limit_s: float) -> dict[int, float]:
        """Each rank's exit time (monotonic), polled every 50 ms; fails the test past ``limit_s``."""
        deadline, done = time.monotonic() + limit_s, {}
        while len(done) < self.world and time.monotonic() < deadline:
            for r, p in enumerate(self.procs):
                if r not in done and p.poll() is not None:
                    done[r] = time.monotonic()
            time.sleep(0.05)
        missing = [r for r in range(self.world) if r not in done]
        assert not missing, f"ranks {missing} still running after {limit_s} s"
        return done

    def session_processes(self, r: int) -> list[str]:
        import psutil

        out = []
        for proc in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                # Zombies hold nothing; in a container whose init does not reap them they stay listed.
                if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.info["pid"]) == self.procs[r].pid:
                    out.append(" ".join(proc.info["cmdline"] or [])[:120])
            except (ProcessLookupError, PermissionError):
                pass
        return out

    def close(self) -> None:
        for p in self.procs:
            # The whole session: a rank killed by SIGKILL leaves its helper processes (Megatron's
            # checkpoint-writer Manager, multiprocessing's resource tracker) in it.
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
        for log in self.logs:
            log.close()


def _train(out_dir: Path, args: list[str], fault: str | None = None) -> tuple[Ranks, list[int]]:
    ranks = Ranks(out_dir, args, fault)
    try:
        ranks.exit_times(RUN_LIMIT_S)
    finally:
        ranks.close()
    return ranks, [p.returncode for p in ranks.procs]


def _summary(path: Path) -> dict:
    return json.loads(path.read_text())


def _logged_losses(text: str) -> dict[int, str]:
    """Iteration -> the loss as the iteration line prints it (``lm loss: %.6E``)."""
    out = {}
    for line in text.splitlines():
        if "] iteration " in line and "lm loss: " in line:
            out[int(line.split("iteration")[1].split("/")[0])] = line.split("lm loss: ")[1].split(" ")[0]
    return out


def test_killed_rank_names_it_and_the_restart_resumes(tmp_path):
    """Rank 2 is SIGKILLed in iteration 7; the others name it and stop within the rank timeout, leaving the
    checkpoint of iteration 4. The restart from it repeats iterations 5 and 6 as the killed run logged them (6
    also depends on the restored optimizer state), and finishes. (Bit-exact resumption of every value is
    test_megatron.py::test_save_and_load_resume_bit_exactly's; here it is the launch a user would restart.)"""
    iters = ["--train-iters", "8"]
    ckpt = tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--save-interval", "4"]
    ranks = Ranks(tmp_path / "killed", TINY + iters + save, fault="kill:2:7")
    try:
        killed_at = ranks.wait_for_line(2, "[fault injection] rank 2: kill at iteration 7", RUN_LIMIT_S)
        exits = ranks.exit_times(RANK_TIMEOUT_S + 60)
        # The ranks that gave up stopped their helper processes too (rank 2's die with the test's cleanup).
        left = {r: ranks.session_processes(r) for r in (0, 1, 3)}
        assert not any(left.values()), left
    finally:
        ranks.close()
    seconds = {r: round(t - killed_at, 2) for r, t in exits.items() if r != 2}
    print(f"\nSIGKILL of rank 2 at iteration 7: the other ranks exited after {seconds} s "
          f"(heartbeat {HEARTBEAT_S} s, --zpp-rank-timeout {RANK_TIMEOUT_S} s)")
    assert ranks.procs[2].returncode == -signal.SIGKILL
    for r in (0, 1, 3):
        assert ranks.procs[r].returncode != 0
        assert "rank 2 stopped responding" in ranks.text(r), ranks.text(r)[-3000:]
        assert seconds[r] < RANK_TIMEOUT_S, seconds
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    before = _logged_losses(ranks.text(0))
    assert sorted(before) == [1, 2, 3, 4, 5, 6], ranks.text(0)[-3000:]

    resumed_json = tmp_path / "resumed.json"
    ranks, codes = _train(tmp_path / "resumed", TINY + iters + save + ["--load", str(ckpt), "--summary-json",
                                                                       str(resumed_json)])
    assert codes == [0] * WORLD, [ranks.text(r)[-2000:] for r in range(WORLD)]
    after = _logged_losses(ranks.text(0))
    print(f"killed run's iterations 5-6: {[before[5], before[6]]}\nresumed from iteration 4:    "
          f"{[after[i] for i in sorted(after)]}")
    assert sorted(after) == [5, 6, 7, 8] and len(_summary(resumed_json)["losses"]) == 4
    assert [after[5], after[6]] == [before[5], before[6]]


def test_store_host_does_not_wait_for_a_rank_a_verdict_names_as_failed():
    """Rank 0 (hosting the store) learns of rank 2's death from rank 1's verdict: it waits for the live ranks to
    read it and mark themselves exiting, not for rank 2, which never will (it sat out its whole bound, a CI run
    saw rank 0 exit 6 s after its peers). A rank named alive (a step failure it reports itself, or found hung
    with its heartbeat going) is waited for: it reads the verdict and marks itself exiting. And what a rank
    publishes says which kind it found."""
    from megatron_zpp.testing import run_distributed

    assert run_distributed(_linger_checks, 1)[0] == {"found by rank 1": [1, 3], "self-reported by rank 3": [1, 2, 3],
                                                     "rank 2 hung, alive": [1, 2, 3]}


def _linger_checks():
    import torch.distributed as dist

    from megatron_zpp.training.watchdog import RankFailureConfig, RankWatchdog

    out = {}
    for case, verdict in (("found by rank 1", "1|2|1|rank 2 stopped responding"),
                          ("self-reported by rank 3", "3|3|0|rank 3 failed in checkpoint commit"),
                          ("rank 2 hung, alive", "1|2|0|rank 2 hung: rank 2 at iteration 3")):
        store = dist.HashStore()
        watchdog = RankWatchdog(RankFailureConfig(rank_timeout=10.0, heartbeat_interval=1.0), store=store)
        watchdog.world = 4  # a 4-rank run as rank 0 sees it; the other ranks' keys are written here
        store.set("verdict", verdict)
        assert watchdog._verdict() is not None
        waited = []
        watchdog._wait_until_exiting = waited.extend
        watchdog.linger_if_store_host()
        out[case] = waited
    # The publishing side: a finding of dead ranks (after its look at the heartbeats) is marked as such.
    store = dist.HashStore()
    finder = RankWatchdog(RankFailureConfig(rank_timeout=10.0, heartbeat_interval=1.0), store=store)
    finder._gone = {2}
    finder.publish("rank 2 stopped responding", [2])
    assert store.get("verdict").decode() == "0|2|1|rank 2 stopped responding"
    store = dist.HashStore()
    finder = RankWatchdog(RankFailureConfig(rank_timeout=10.0, heartbeat_interval=1.0), store=store)
    finder.publish("rank 3 hung", [3])
    assert store.get("verdict").decode() == "0|3|0|rank 3 hung"
    return out


@pytest.mark.slow
def test_hung_rank_is_named_by_every_rank_within_the_timeout(tmp_path):
    ranks = Ranks(tmp_path / "hung", TINY + ["--train-iters", "8"], fault="hang:1:3")
    try:
        hung_at = ranks.wait_for_line(1, "[fault injection] rank 1: hang at iteration 3", RUN_LIMIT_S)
        exits = ranks.exit_times(RANK_TIMEOUT_S + 60)
    finally:
        ranks.close()
    seconds = {r: round(t - hung_at, 2) for r, t in exits.items()}
    print(f"\nrank 1 hung at iteration 3: every rank exited after {seconds} s (--zpp-rank-timeout {RANK_TIMEOUT_S} s)")
    for r in range(WORLD):
        text = ranks.text(r)
        assert ranks.procs[r].returncode == 75, (r, ranks.procs[r].returncode, text[-3000:])
        assert "rank 1 hung" in text, text[-3000:]
        # The timeout, the 2.5-heartbeat look at the store and one heartbeat of slack.
        assert seconds[r] < RANK_TIMEOUT_S + 4 * HEARTBEAT_S + 5, seconds


# --check-replica-weights: every module's weights at each forward and backward use are compared across the
# data-parallel replicas every iteration, through the codec switches.
GUARD = TINY + ["--train-iters", "14", "--zpp-divergence-guard", "--zpp-divergence-fallback-iters", "3",
                "--zpp-divergence-min-history", "3", "--check-replica-weights"]


# The spike case is slow: the reload test below triggers on a spike too, and the NaN case covers the fallback.
@pytest.mark.parametrize("fault,reason", [pytest.param("spike:8", "loss spike", marks=pytest.mark.slow),
                                          ("nan:1:8", "non-finite gradients")])
def test_divergence_guard_falls_back_and_recovers_on_every_rank(tmp_path, fault, reason):
    summary_json = tmp_path / "summary.json"
    ranks, codes = _train(tmp_path / "run", GUARD + ["--summary-json", str(summary_json)], fault=fault)
    assert codes == [0] * WORLD, [ranks.text(r)[-2000:] for r in range(WORLD)]
    for r in range(WORLD):
        lines = [line for line in ranks.text(r).splitlines() if line.startswith("[divergence guard]")]
        assert len(lines) == 2, lines
        assert lines[0].startswith(f"[divergence guard] rank {r} iteration 8: {reason}"), lines
        assert "lossy dimensions dp.grad, dp.param uncompressed for 3 iterations (iterations 9-11)" in lines[0]
        assert lines[1] == f"[divergence guard] rank {r} iteration 12: fallback over; compressing again"
    summary = _summary(summary_json)
    assert summary["divergence_guard"]["uncompressed_iterations"] == [9, 10, 11]
    checked = summary["replica_check"]
    assert checked["uses_compared"] > 0 and checked["mismatches"] == 0, checked
    losses = summary["losses"]
    assert all(v == v and v < 10 for v in losses[8:]), losses  # finite and back near the pre-event loss
    assert summary["finite"]  # the NaN step was skipped: no weight became NaN
    # What went on the wire: iterations 9-11 sent dp.grad uncompressed (ratio 1), the others compressed.
    ratios = {}
    for line in ranks.text(0).splitlines():
        if "] iteration " in line and "dp.grad MB" in line:
            it = int(line.split("iteration")[1].split("/")[0])
            ratios[it] = float(line.split("dp.grad MB intra/inter:")[1].split("(x")[1].split(")")[0])
    assert [it for it, x in sorted(ratios.items()) if x == 1.0] == [9, 10, 11], ratios


def _rank1_sleeps_outside_collectives():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(1000)  # no collective pending: gloo's timeout cannot see this hang
    return dist.get_rank()


def test_spawned_test_worlds_are_bounded_and_stopped():
    from megatron_zpp.testing.spawn import run_distributed

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1\] still running after 5 s; stopped"):
        run_distributed(_rank1_sleeps_outside_collectives, 2, wall_limit_s=5)
    print(f"\nhung spawned world stopped after {time.monotonic() - t0:.1f} s (wall limit 5 s)")
    assert time.monotonic() - t0 < 60


# preload_rank_modules refuses a machine with CUDA (a forked rank could not use it).
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the forkserver is for CPU-only runs")


# In a rank this module is imported when the rank's function is unpickled: it must see the test's variables.
_PROBE_AT_IMPORT = os.environ.get("ZPP_SPAWN_PROBE")


def _report_environment_and_directory():
    import torch.distributed as dist

    print(f"rank {dist.get_rank()} probe={os.environ.get('ZPP_SPAWN_PROBE')} in {os.getcwd()}", flush=True)
    print(f"rank {dist.get_rank()} on stderr", file=sys.stderr, flush=True)
    return os.environ.get("ZPP_SPAWN_PROBE"), _PROBE_AT_IMPORT, os.getcwd(), torch.initial_seed()


@pytest.mark.parametrize("start", ["spawn", pytest.param("forkserver", marks=CPU_ONLY)])
def test_ranks_see_the_callers_environment_directory_and_output(tmp_path, monkeypatch, capfd, start):
    """Under the forkserver the suite uses, a rank is forked from a server started with the session: it must
    still see what the test set up now, as a spawned rank does (the variables, also in modules it imports, the
    directory, the capture), and draw its own random seed."""
    from megatron_zpp.testing import spawn

    if start == "forkserver" and spawn._start_method != "forkserver":
        spawn.preload_rank_modules(["torch.distributed"])  # fails on a CUDA machine, by design
    monkeypatch.setattr(spawn, "_start_method", start)
    monkeypatch.setenv("ZPP_SPAWN_PROBE", f"set by the test ({start})")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    results = spawn.run_distributed(_report_environment_and_directory, 2)
    assert [r[:3] for r in results] == [(f"set by the test ({start})",) * 2 + (str(tmp_path),)] * 2, results
    assert results[0][3] != results[1][3], "both ranks drew the same random seed"  # fresh per process
    out, err = capfd.readouterr()
    for rank in range(2):
        assert f"rank {rank} probe=set by the test ({start}) in {tmp_path}" in out, out
        assert f"rank {rank} on stderr" in err, err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("start", ["spawn", pytest.param("forkserver", marks=CPU_ONLY)])
def test_spawned_ranks_die_with_a_killed_spawner(tmp_path, start):
    """A study or test killed with SIGKILL (or SIGTERM, which skips Python's finally blocks) must not leave
    its ranks running: they are blocked in gloo, where no Python signal handler runs. Under the forkserver
    (what the test suite uses) the ranks' parent is the server, which must go with the spawner."""
    pids = tmp_path / "pids"
    preload = "preload_rank_modules(['torch.distributed']); " if start == "forkserver" else ""
    script = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from tests.test_reliability import _ranks_wait_forever; "
              f"from megatron_zpp.testing.spawn import preload_rank_modules, run_distributed; {preload}"
              f"run_distributed(_ranks_wait_forever, 2, {str(pids)!r}, timeout_s=600)")
    spawner = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(tmp_path.glob("pids/*"))) < 2:
        time.sleep(0.2)
    ranks = [int(p.name) for p in tmp_path.glob("pids/*")]
    assert len(ranks) == 2, "the ranks did not start"
    assert spawner.poll() is None, "the spawner ended on its own: the ranks failed"
    spawner.kill()
    spawner.wait()
    t0 = time.monotonic()
    alive = ranks
    while alive and time.monotonic() - t0 < 20:
        time.sleep(0.2)
        alive = [pid for pid in ranks if _alive(pid)]
    print(f"\nranks {ranks} gone {time.monotonic() - t0:.1f} s after the spawner was killed")
    for pid in alive:  # a failing run must not leave them holding pytest's output
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"ranks {alive} still running 20 s after their spawner was killed"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _ranks_wait_forever(pid_dir: str):
    import torch
    import torch.distributed as dist

    os.makedirs(pid_dir, exist_ok=True)
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    # Both blocked in gloo (C++, the GIL released) until the timeout: torch's own parent-death signal, SIGINT,
    # only sets a flag that Python would check when the call returns.
    dist.recv(torch.zeros(1), src=1 - dist.get_rank())


def test_divergence_guard_reloads_the_last_checkpoint_once(tmp_path):
    summary_json = tmp_path / "summary.json"
    ckpt = tmp_path / "ckpt"
    # Both overlap flags: the step has prefetched the next forward's gathers when the reload comes.
    ranks, codes = _train(tmp_path / "run", GUARD + ["--zpp-divergence-reload", "--save", str(ckpt), "--save-interval",
                                                     "4", "--summary-json", str(summary_json),
                                                     "--overlap-grad-reduce", "--overlap-param-gather"],
                          fault="spike:6")
    assert codes == [0] * WORLD, [ranks.text(r)[-2000:] for r in range(WORLD)]
    for r in range(WORLD):
        lines = [line for line in ranks.text(r).splitlines() if line.startswith("[divergence guard]")]
        assert lines[0].startswith(f"[divergence guard] rank {r} iteration 6: loss spike"), lines
        assert f"[divergence guard] rank {r}: reloaded {ckpt} at iteration 4" in lines, lines
        assert any(line.startswith(f"[divergence guard] rank {r} iteration 5: reloaded the checkpoint of iteration 4")
                   for line in lines), lines
    summary = _summary(summary_json)
    # Iterations 5-7 rerun uncompressed; the injected spike comes back at iteration 6 (the data's, then), which
    # extends the fallback without a second reload of the same checkpoint.
    uncompressed = summary["divergence_guard"]["uncompressed_iterations"]
    assert uncompressed[:3] == [5, 6, 7], uncompressed
    reloads = [e for e in summary["divergence_guard"]["events"] if e["reason"].startswith("reloaded")]
    assert len(reloads) == 1, summary["divergence_guard"]["events"]
    assert len(summary["losses"]) == 14 and summary["finite"]


@pytest.mark.slow  # Megatron-FSDP on gloo/CPU crashes now and then (heap corruption inside Megatron-FSDP)
def test_divergence_guard_skips_a_nan_step_under_megatron_fsdp(tmp_path):
    summary_json = tmp_path / "summary.json"
    args = [a for a in GUARD if a != "--use-distributed-optimizer"] + ["--use-megatron-fsdp"]
    ranks, codes = _train(tmp_path / "run", args + ["--summary-json", str(summary_json)], fault="nan:1:8")
    assert codes == [0] * WORLD, [ranks.text(r)[-2000:] for r in range(WORLD)]
    for r in range(WORLD):
        assert f"[divergence guard] rank {r} iteration 8: non-finite gradients" in ranks.text(r)
    summary = _summary(summary_json)
    # The gradients live on Megatron-FSDP's DTensor main parameters: the check must see them, or Adam writes NaN.
    assert summary["finite"] and summary["divergence_guard"]["uncompressed_iterations"] == [9, 10, 11]
