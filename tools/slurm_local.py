"""A one-node SLURM cluster on this machine, in a private state directory, for tests and trying the sbatch script.

    python tools/slurm_local.py up [--state-dir DIR]        # start; prints the SLURM_CONF to export; Ctrl-C stops
    python tools/slurm_local.py down --state-dir DIR         # stop the `up` holding DIR
    python tools/slurm_local.py run -- sbatch --wait job.sh  # start, run the command against it, stop

From Python: ``with local_cluster() as env: subprocess.run(["sinfo"], env=env)``.

Debian's packages (slurmctld, slurmd, slurm-client, munge) are installed when missing and this runs as root;
otherwise :class:`SlurmUnavailable` says why. Everything the daemons write (munge key and socket, slurm.conf,
state, spool, logs) lives in the state directory, and the daemons listen on free high ports, so the cluster
never touches /etc/slurm, /etc/munge or a system cluster. The commands find it through ``SLURM_CONF``.

slurmd must run as root: it starts job steps as the submitting user. Stopping cancels the jobs, ends the
daemons this tool started and then any process still carrying this cluster's ``SLURM_CONF`` in its
environment (job steps that slurmd forked off, and their children), never anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
# Executable -> the Debian package that provides it.
BINARIES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "sinfo": "slurm-client",
            "scontrol": "slurm-client", "munged": "munge"}
# Daemons live in sbin, which a non-root PATH often lacks.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
CLUSTER_NAME = "zpp-local"
PARTITION = "debug"


class SlurmUnavailable(RuntimeError):
    """SLURM cannot run here (not root, packages missing and not installable, a daemon that will not start)."""


def _which(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if _which(b) is None]


def ensure_installed(timeout: float = 900.0, log=print) -> None:
    """Install Debian's SLURM and munge packages when a binary is missing (root and apt-get only).

    Raises :class:`SlurmUnavailable` naming what is missing and why it cannot be installed."""
    missing = missing_binaries()
    if not missing:
        return
    packages = sorted({BINARIES[b] for b in missing})
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{', '.join(missing)} not installed and not root: "
                               f"run `apt-get install -y {' '.join(PACKAGES)}` as root")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{', '.join(missing)} not installed and no apt-get on this machine "
                               f"(install {' '.join(PACKAGES)} with its package manager)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    deadline = time.monotonic() + timeout
    # A fresh container has no package lists; update first, then install (each bounded by what is left).
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        log(f"slurm_local: {' '.join(cmd)} (missing: {', '.join(packages)})")
        left = deadline - time.monotonic()
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(left, 1.0))
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` did not finish within {timeout:.0f} s") from None
        if done.returncode != 0:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed with exit code {done.returncode}: "
                                   f"{(done.stderr or done.stdout).strip()[-800:]}")
    still = missing_binaries()
    if still:
        raise SlurmUnavailable(f"installed {' '.join(PACKAGES)} but {', '.join(still)} still not found")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_memory_mb() -> int:
    """A modest RealMemory: half of MemTotal, at most 4 GiB. Memory is not a scheduled resource in this
    configuration (CR_CPU), the number only has to be no more than the machine has, or slurmd drains the node."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return max(min(int(line.split()[1]) // 1024 // 2, 4096), 100)
    except OSError:
        pass
    return 1024


def write_config(state_dir: Path, *, node: str, cpus: int, ctld_port: int, slurmd_port: int, user: str,
                 munge_socket: Path | None = None) -> Path:
    """slurm.conf, cgroup.conf and an empty plugstack.conf for one node; returns the slurm.conf path.
    ``munge_socket``: default ``state_dir/munge.socket``."""
    for sub in ("ctld", "slurmd"):
        (state_dir / sub).mkdir(mode=0o700, exist_ok=True)
    # No cgroup plugin is configured (proctrack/linuxproc, task/none), so nothing reads this beyond slurmd's
    # start-up parse; it is written so that a system cgroup.conf next to a default path is never picked up.
    (state_dir / "cgroup.conf").write_text("CgroupAutomount=no\nConstrainCores=no\nConstrainRAMSpace=no\n")
    # The system plugstack.conf may include SPANK plugins of a real cluster; this one loads none.
    (state_dir / "plugstack.conf").write_text("")
    s = state_dir
    conf = f"""\
# Written by tools/slurm_local.py: one node, private state in {s}
ClusterName={CLUSTER_NAME}
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket or s / "munge.socket"}
StateSaveLocation={s}/ctld
SlurmdSpoolDir={s}/slurmd
SlurmctldPidFile={s}/slurmctld.pid
SlurmdPidFile={s}/slurmd.pid
SlurmctldLogFile={s}/slurmctld.log
SlurmdLogFile={s}/slurmd.log
PlugStackConfig={s}/plugstack.conf
# Process tracking by parent pid, no cgroups: works in containers without a writable cgroup tree.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Without slurmdbd there is no sacct: finished jobs stay in `scontrol show job` for an hour instead of 5 min.
MinJobAge=3600
# scancel: SIGTERM, then SIGKILL after this many seconds.
KillWait=5
# A node that was down (the daemon restarted) returns to service by itself.
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={node_memory_mb()} State=UNKNOWN
PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""
    path = s / "slurm.conf"
    path.write_text(conf)
    return path


def _die_with_parent() -> None:
    """Runs in the daemon child before exec: SIGTERM it when this process dies (even by SIGKILL), so a killed
    test leaves no daemons behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def _is_job_process(pid: int, conf_entry: bytes) -> bool:
    """A job step of this cluster or a process of one of its jobs: ``SLURM_CONF=<ours>`` in its environment and
    either slurmstepd or SLURM_JOB_ID set. A shell that merely exported our SLURM_CONF has no SLURM_JOB_ID."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    return conf_entry in environ and (comm == "slurmstepd" or any(e.startswith(b"SLURM_JOB_ID=") for e in environ))


@dataclass
class LocalCluster:
    """A running one-node cluster. ``env`` is os.environ plus SLURM_CONF and a PATH with the SLURM binaries."""

    state_dir: Path
    conf: Path
    node: str
    munge_socket: Path
    env: dict = field(default_factory=dict)
    procs: dict = field(default_factory=dict)  # name -> Popen of the daemons this cluster started

    def start(self, timeout: float = 60.0) -> None:
        s = self.state_dir
        # The key and munged's seed stay in a root-only directory; the socket must be reachable by every job's
        # user (munged checks both).
        private = s / "munge"
        private.mkdir(mode=0o700, exist_ok=True)
        key = private / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn("munged", [_which("munged"), "--foreground", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={s}/munged.pid", f"--log-file={s}/munged.log",
                               f"--seed-file={private}/munged.seed", "--num-threads=2"])
        self._wait_for(self.munge_socket.exists, timeout, "munged to create its socket",
                       s / "munged.log")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
        self._wait_for(self.node_idle, timeout, f"node {self.node} to be idle in sinfo",
                       s / "slurmctld.log", s / "slurmd.log")

    def _spawn(self, name: str, cmd: list) -> None:
        out = open(self.state_dir / f"{name}.stdout", "wb")
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        out.close()

    def _wait_for(self, ready, timeout: float, what: str, *logs: Path) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead:
                exits = ", ".join(f"{n} exited with {c}" for n, c in dead.items())
                raise SlurmUnavailable(f"waiting for {what}: {exits}"
                                       + self._logs(*logs))
            if ready():
                return
            time.sleep(0.5)
        raise SlurmUnavailable(f"timed out after {timeout:g} s waiting for {what}" + self._logs(*logs))

    def _logs(self, *logs: Path) -> str:
        names = list(logs) + [self.state_dir / f"{n}.stdout" for n in self.procs]
        return "".join(f"\n--- {p} (tail) ---\n{_tail(p)}" for p in names if p.exists())

    def node_idle(self) -> bool:
        try:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True,
                                 text=True, timeout=10).stdout
        except subprocess.TimeoutExpired:
            return False
        return any(line.split() == [self.node, "idle"] for line in out.splitlines())

    def stop(self, timeout: float = 20.0) -> None:
        """Cancel jobs, stop the daemons, then end leftover job processes of this cluster (found by SLURM_CONF
        in their environment). Safe to call twice and after a failed start."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                subprocess.run(["scancel", "--full", f"--partition={PARTITION}"], env=self.env,
                               capture_output=True, timeout=10)
        for name in ("slurmd", "slurmctld", "munged"):  # reverse start order
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self._kill_strays(timeout)

    def _kill_strays(self, timeout: float) -> None:
        # slurmd double-forks slurmstepd, so job steps are not our children; they and the jobs' processes carry
        # SLURM_CONF (slurmd's, and SLURM sets it in every job's environment).
        marker = f"SLURM_CONF={self.conf}".encode()
        me = os.getpid()

        def strays() -> list[int]:
            return [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != me
                    and _is_job_process(int(d), marker)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = strays()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + (timeout if sig == signal.SIGTERM else 5)
            while pids and time.monotonic() < deadline:
                time.sleep(0.2)
                pids = strays()
            if not pids:
                return


def _enterable_by_all(path: Path) -> bool:
    return all(p.stat().st_mode & 0o001 for p in [path.resolve(), *path.resolve().parents])


def check_can_run() -> None:
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmd must run as root (it starts job steps as the submitting user); "
                               f"running as uid {os.geteuid()}")


@contextlib.contextmanager
def local_cluster(state_dir: str | Path | None = None, *, timeout: float = 60.0, install: bool = True,
                  install_timeout: float = 900.0, log=print):
    """Start the one-node cluster, yield its :class:`LocalCluster` (``.env`` for subprocesses), stop it on exit.

    ``state_dir``: where config, keys, state and logs go (default: a new temporary directory, removed after)."""
    check_can_run()
    if install:
        ensure_installed(install_timeout, log=log)
    elif missing_binaries():
        raise SlurmUnavailable(f"not installed: {', '.join(missing_binaries())}")
    owned = state_dir is None
    path = Path(tempfile.mkdtemp(prefix="zpp-slurm-")) if owned else Path(state_dir)
    path.mkdir(parents=True, exist_ok=True)
    # Readable by all: jobs of any user read slurm.conf and reach the munge socket here (munged refuses a
    # socket directory others cannot enter, and one they can write).
    path.chmod(0o755)
    node = socket.gethostname().split(".")[0]
    socket_dir = path
    if not _enterable_by_all(path):
        # munged refuses a socket that not every user can reach (pytest's tmp directories are 0700): then a
        # directory of its own under /tmp.
        socket_dir = Path(tempfile.mkdtemp(prefix="zpp-munge-"))
        socket_dir.chmod(0o755)
    munge_socket = socket_dir / "munge.socket"
    conf = write_config(path, node=node, cpus=os.cpu_count() or 1, ctld_port=free_port(), slurmd_port=free_port(),
                        user=pwd.getpwuid(os.geteuid()).pw_name, munge_socket=munge_socket)
    env = dict(os.environ, SLURM_CONF=str(conf), PATH=SEARCH_PATH)
    cluster = LocalCluster(state_dir=path, conf=conf, node=node, munge_socket=munge_socket, env=env)
    try:
        cluster.start(timeout)
        yield cluster
    finally:
        cluster.stop()
        if owned:
            shutil.rmtree(path, ignore_errors=True)
        if socket_dir != path:
            shutil.rmtree(socket_dir, ignore_errors=True)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the cluster and keep it up until Ctrl-C, SIGTERM or `down`")
    up.add_argument("--state-dir", default=None, help="default: a new temporary directory (printed)")
    down = sub.add_parser("down", help="stop the `up` that holds --state-dir")
    down.add_argument("--state-dir", required=True)
    run = sub.add_parser("run", help="start the cluster, run CMD with SLURM_CONF set, stop; exits with CMD's code")
    run.add_argument("--state-dir", default=None)
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    for s in (up, run):
        s.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the node to be idle")
        s.add_argument("--no-install", action="store_true", help="never apt-get install missing packages")
    args = p.parse_args(argv)

    if args.cmd == "down":
        pid_file = Path(args.state_dir) / "up.pid"
        if not pid_file.exists():
            print(f"slurm_local: no cluster up in {args.state_dir} ({pid_file} missing)", file=sys.stderr)
            return 1
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
        for _ in range(120):
            if not Path(f"/proc/{pid}").exists():
                return 0
            time.sleep(0.5)
        print(f"slurm_local: `up` process {pid} still running after 60 s", file=sys.stderr)
        return 1

    command = getattr(args, "command", [])
    command = command[1:] if command[:1] == ["--"] else command
    if args.cmd == "run" and not command:
        p.error("run needs a command: run -- CMD ARGS...")
    # SIGTERM takes the same path as Ctrl-C: the context manager's exit stops the daemons.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        with contextlib.ExitStack() as stack:
            cluster = stack.enter_context(local_cluster(args.state_dir, timeout=args.timeout,
                                                        install=not args.no_install))
            if args.cmd == "run":
                return subprocess.run(command, env=cluster.env).returncode
            pid_file = cluster.state_dir / "up.pid"
            pid_file.write_text(str(os.getpid()))
            stack.callback(pid_file.unlink, missing_ok=True)
            print(f"slurm_local: node {cluster.node} idle; state in {cluster.state_dir}\n"
                  f"  export SLURM_CONF={cluster.conf}\n"
                  f"  stop with Ctrl-C or: python tools/slurm_local.py down --state-dir {cluster.state_dir}",
                  flush=True)
            while True:
                time.sleep(3600)
    except SlurmUnavailable as e:
        print(f"slurm_local: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130 if args.cmd == "run" else 0


if __name__ == "__main__":
    sys.exit(main())
