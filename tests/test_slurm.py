"""The SLURM script: --dry-run prints the launch it would run (GPU and CPU modes, inside and outside an
allocation), and on a real one-node cluster (tools/slurm_local.py: Debian's slurmctld, slurmd and munge, installed
when missing) a CPU job trains to its summary and scancel ends every rank.

The real-cluster tests need root (slurmd starts job steps as the submitting user) and skip with the reason
where the daemons cannot be installed or started."""

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm" / "pretrain_gpt.sbatch"
sys.path.insert(0, str(ROOT / "tools"))

import slurm_local  # noqa: E402


def _fake_scontrol(tmp_path: Path) -> Path:
    """`scontrol show hostnames` expands a node list; a stand-in prints node names."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text('#!/bin/bash\n# usage: scontrol show hostnames LIST ("gpu[01-04]" style, expanded)\n'
                    'list="$3"; prefix="${list%%[*}"; range="${list#*[}"; range="${range%]}"\n'
                    'if [[ "$list" == "$prefix" ]]; then echo "$list"; exit 0; fi\n'
                    'for i in $(seq -w ${range%-*} ${range#*-}); do echo "$prefix$i"; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return bin_dir


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_dry_run_prints_the_launch(tmp_path, nodes):
    nodelist = "gpu01" if nodes == 1 else f"gpu[01-{nodes:02d}]"
    env = dict(os.environ, SLURM_JOB_NUM_NODES=str(nodes), SLURM_GPUS_ON_NODE="8", SLURM_JOB_NODELIST=nodelist,
               SLURM_JOB_ID="4242", PATH=f"{_fake_scontrol(tmp_path)}:{os.environ['PATH']}")
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--zpp-policy", "zeropp", "--use-megatron-fsdp"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert f"nodes={nodes} gpus_per_node=8 world_size={8 * nodes} head=gpu01" in out
    launch = out.splitlines()[-1]
    assert launch.startswith("srun --ntasks-per-node=1 ")
    for piece in (f"--nnodes {nodes}", "--nproc-per-node 8", "--rdzv-backend c10d", "--rdzv-endpoint gpu01:29500",
                  "--rdzv-id 4242", "pretrain_gpt.py", "--distributed-backend nccl", "--zpp-ranks-per-node 8",
                  "--zpp-policy zeropp --use-megatron-fsdp"):
        assert piece in launch, (piece, launch)
    assert "--dry-run" not in launch


def _clean_env(tmp_path: Path) -> dict:
    """No SLURM_* variables (the tests may run inside an allocation) and a PATH of only the few commands the
    script uses outside one: no scontrol, no nvidia-smi."""
    bin_dir = tmp_path / "plain-bin"
    bin_dir.mkdir()
    for tool in ("dirname", "nproc", "head", "sed", "tr"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "ZPP_"))}
    return env | {"PATH": str(bin_dir), "HOME": str(tmp_path)}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_dry_run_outside_an_allocation(tmp_path):
    """No SLURM_* environment and no scontrol: the launch on localhost, exit 0."""
    bash = shutil.which("bash")
    out = subprocess.run([bash, str(SCRIPT), "--dry-run", "--train-iters", "3"], env=_clean_env(tmp_path),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "head=localhost" in out.stdout and "--rdzv-endpoint localhost:29500" in out.stdout, out.stdout
    assert out.stdout.splitlines()[-1].endswith("--train-iters 3")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_dry_run_cpu_mode_with_simulated_nodes(tmp_path):
    env = dict(os.environ, SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="cpu[01-02]", SLURM_JOB_ID="77",
               SLURM_CPUS_ON_NODE="8", ZPP_CPU_RANKS_PER_NODE="4", ZPP_RANKS_PER_NODE="2",
               PATH=f"{_fake_scontrol(tmp_path)}:{os.environ['PATH']}")
    env.pop("SLURM_GPUS_ON_NODE", None)
    env.pop("SLURM_GPUS_PER_NODE", None)
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--zpp-policy", "zeropp"], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    assert "nodes=2 cpu_ranks_per_node=4 zpp_ranks_per_node=2 world_size=8 head=cpu01 backend=gloo" in out, out
    launch = out.splitlines()[-1]
    for piece in ("--nnodes 2", "--nproc-per-node 4", "--rdzv-endpoint cpu01:29500", "--distributed-backend gloo",
                  "--zpp-ranks-per-node 2", "--zpp-policy zeropp"):
        assert piece in launch, (piece, launch)
    # Simulated nodes must tile the ranks of a machine.
    bad = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env | {"ZPP_RANKS_PER_NODE": "3"},
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "ZPP_RANKS_PER_NODE=3 does not divide the 4 ranks per node" in bad.stderr
    bad = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env | {"ZPP_CPU_RANKS_PER_NODE": "four"},
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "ZPP_CPU_RANKS_PER_NODE=four is not a positive integer" in bad.stderr


def test_slurm_conf_names_the_private_paths(tmp_path):
    conf = slurm_local.write_config(tmp_path, node="n0", cpus=3, ctld_port=40001, slurmd_port=40002, user="root")
    text = conf.read_text()
    for line in ("ClusterName=zpp-local", "SlurmctldPort=40001", "SlurmdPort=40002",
                 "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", f"StateSaveLocation={tmp_path}/ctld",
                 f"AuthInfo=socket={tmp_path}/munge.socket",
                 "NodeName=n0 NodeAddr=127.0.0.1 CPUs=3"):
        assert line in text, line
    assert (tmp_path / "cgroup.conf").exists()


def test_install_needs_root_and_names_the_packages(monkeypatch):
    monkeypatch.setattr(slurm_local, "missing_binaries", lambda: ["slurmd", "munged"])
    monkeypatch.setattr(slurm_local.os, "geteuid", lambda: 1000)
    with pytest.raises(slurm_local.SlurmUnavailable, match=r"slurmd, munged not installed and not root: run "
                       r"`apt-get install -y slurmctld slurmd slurm-client munge` as root"):
        slurm_local.ensure_installed(timeout=1, log=lambda *a: None)


def test_install_failure_names_the_command(monkeypatch):
    """A failing apt-get (offline CI) is a SlurmUnavailable with its exit code and output (the fixture skips)."""
    monkeypatch.setattr(slurm_local, "missing_binaries", lambda: ["slurmctld"])
    monkeypatch.setattr(slurm_local.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_local.shutil, "which", lambda name, **kw: f"/usr/bin/{name}")
    ran = []

    def apt(cmd, **kw):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 100, "", "E: Could not resolve deb.debian.org")
    monkeypatch.setattr(slurm_local.subprocess, "run", apt)
    with pytest.raises(slurm_local.SlurmUnavailable, match=r"`apt-get update` failed with exit code 100: "
                       r"E: Could not resolve deb.debian.org"):
        slurm_local.ensure_installed(timeout=5, log=lambda *a: None)
    assert ran == [["apt-get", "update"]]


# ---------------------------------------------------------------- a real cluster

PYTHON = sys.executable
# The tiny run of the issue: 4 gloo ranks on one SLURM node, seen by the plugin as 2 nodes x 2 ranks.
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--eval-iters", "1", "--log-interval", "2", "--zpp-policy", "zeropp",
        "--use-distributed-optimizer", "--hidden-dropout", "0", "--attention-dropout", "0"]
JOB_TIMEOUT = 600  # seconds; a 6-iteration job takes about 1-2 minutes on a loaded 2-core machine


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """One local cluster for the session; stopped (daemons, then leftover job processes) even when a test fails."""
    if sys.platform != "linux":
        pytest.skip("tools/slurm_local.py runs SLURM's Linux daemons")
    try:
        slurm_local.check_can_run()
    except slurm_local.SlurmUnavailable as e:
        pytest.skip(f"slurm_local: {e}")
    state = tmp_path_factory.mktemp("slurm")
    manager = slurm_local.local_cluster(state, timeout=90, install=True, install_timeout=900)
    try:
        running = manager.__enter__()
    except slurm_local.SlurmUnavailable as e:
        pytest.skip(f"slurm_local: {e}")
    try:
        yield running
    finally:
        manager.__exit__(None, None, None)


def _submit(cluster, job_dir: Path, train_iters: int, wait: bool) -> subprocess.CompletedProcess:
    """sbatch the script for the tiny CPU run; the log goes to job_dir (--output), the job runs there (--chdir)."""
    env = cluster.env | {"ZPP_CPU_RANKS_PER_NODE": "4", "ZPP_RANKS_PER_NODE": "2", "PYTHON": PYTHON,
                         "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                         "RDZV_PORT": str(slurm_local.free_port()), "OMP_NUM_THREADS": "1"}
    cmd = ["sbatch", "--parsable", "--job-name=zpp-test", "--nodes=1", "--gpus-per-node=0",
           f"--cpus-per-task={os.cpu_count()}", f"--chdir={job_dir}", f"--output={job_dir}/%x-%j.out",
           *(["--wait"] if wait else []), str(SCRIPT), *TINY, "--train-iters", str(train_iters),
           # A unique path on every rank's command line: finds the job's processes.
           "--summary-json", str(job_dir / "summary.json")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT + 60)


def job_fields(cluster, job_id: str) -> dict:
    """JobState and ExitCode of a job: sacct when accounting is configured, else `scontrol show job` (MinJobAge in
    the local slurm.conf keeps finished jobs there for an hour)."""
    acct = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode"], env=cluster.env,
                          capture_output=True, text=True, timeout=30)
    if acct.returncode == 0 and acct.stdout.strip():
        state, code = acct.stdout.split()[0].split("|")
        return {"JobState": state.split()[0], "ExitCode": code}
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=cluster.env, capture_output=True,
                           text=True, timeout=30, check=True).stdout
    return dict(re.findall(r"(JobState|ExitCode)=(\S+)", shown))


def _wait_state(cluster, job_id: str, states: set[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        fields = job_fields(cluster, job_id)
        if fields.get("JobState") in states or time.monotonic() > deadline:
            return fields
        time.sleep(0.5)


def _job_processes(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with_marker = any(marker in a for a in (p.info["cmdline"] or []))
        if with_marker and p.pid != os.getpid():
            found.append(p)
    return found


def _log(job_dir: Path, job_id: str) -> str:
    path = job_dir / f"zpp-test-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def test_sbatch_cpu_job_trains_to_its_summary(cluster, tmp_path):
    """sbatch --wait: 4 gloo ranks (2 simulated nodes x 2) train 6 iterations; the job COMPLETED with 0:0 and its
    log holds the trainer's iteration lines and summary."""
    t0 = time.monotonic()
    done = _submit(cluster, tmp_path, train_iters=6, wait=True)
    seconds = time.monotonic() - t0
    job_id = done.stdout.strip().split(";")[0]
    log = _log(tmp_path, job_id)
    print(f"sbatch --wait: job {job_id} took {seconds:.1f} s")
    assert done.returncode == 0, (done.stdout, done.stderr, log[-3000:])
    fields = job_fields(cluster, job_id)
    assert fields == {"JobState": "COMPLETED", "ExitCode": "0:0"}, (fields, log[-3000:])
    assert "pretrain_gpt.sbatch: cpu, 1 node(s) x 4 ranks (gloo, --zpp-ranks-per-node 2)" in log, log[-3000:]
    assert "> megatron_zpp: world 4 = TP 1 x PP 1 x DP 4; policy zeropp" in log, log[-3000:]
    for it in (2, 4, 6):
        assert re.search(rf"iteration +{it}/ +6 \|.*lm loss: [0-9.E+-]+", log), (it, log[-3000:])
    assert re.search(r"> summary: 6 iterations, lm loss [0-9.]+ -> [0-9.]+, .*validation lm loss [0-9.]+", log)
    assert "> summary: data-parallel replicas bit-identical: True; parameters finite: True" in log
    # 2 simulated nodes: the gradient reduce-scatter crossed them, compressed.
    assert re.search(r"> summary: dp.grad \(analytic bytes\): \d+ calls, inter-node [0-9.]+ MB vs [0-9.]+ MB", log)
    assert (tmp_path / "summary.json").exists()


@pytest.mark.slow
def test_scancel_ends_every_rank(cluster, tmp_path):
    """scancel once training iterations are logged: the job is CANCELLED and no torchrun or rank of it is left."""
    sub = _submit(cluster, tmp_path, train_iters=100_000, wait=False)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    marker = str(tmp_path / "summary.json")
    deadline = time.monotonic() + JOB_TIMEOUT
    while not re.search(r"iteration +\d+/", _log(tmp_path, job_id)):
        fields = job_fields(cluster, job_id)
        assert fields.get("JobState") in ("PENDING", "RUNNING"), (fields, _log(tmp_path, job_id)[-3000:])
        assert time.monotonic() < deadline, f"no iteration logged in {JOB_TIMEOUT} s:\n{_log(tmp_path, job_id)[-3000:]}"
        time.sleep(1)
    ranks = [p for p in _job_processes(marker) if "pretrain_gpt.py" in " ".join(p.cmdline())]
    assert len(ranks) >= 5, [p.cmdline()[:4] for p in ranks]  # torchrun and its 4 ranks

    t0 = time.monotonic()
    subprocess.run(["scancel", job_id], env=cluster.env, capture_output=True, timeout=30, check=True)
    left = _job_processes(marker)
    while left and time.monotonic() - t0 < 60:
        time.sleep(0.2)
        left = _job_processes(marker)
    gone_s = time.monotonic() - t0
    fields = _wait_state(cluster, job_id, {"CANCELLED"}, timeout=60)
    print(f"scancel: job {job_id}'s {len(ranks)} processes gone {gone_s:.1f} s after scancel; state {fields}")
    assert not left, [(p.pid, p.cmdline()[:4]) for p in left]
    assert fields.get("JobState") == "CANCELLED", fields
