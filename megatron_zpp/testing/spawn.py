"""Run a function on ``world_size`` gloo processes on this machine and collect what each returns.

Nodes are simulated: rank ``r`` is on node ``r // ranks_per_node`` (``LOCAL_WORLD_SIZE``
is set accordingly, so ``Topology(group)`` picks it up). A failure in any rank raises in
the caller with that rank's traceback; a hang in a collective fails after ``timeout_s`` (gloo's
timeout), any other hang after ``wall_limit_s``, with every rank stopped.

Ranks start by ``spawn`` (a fresh interpreter each) unless ``preload_rank_modules`` switched this process to a
forkserver: then the modules it names are imported once, in the server, and every rank is forked from it. On
a 2-core machine that turns a Megatron test's ~30 s of four ranks importing megatron.core into well under one.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import reduction

_start_method = "spawn"
_PRELOAD_ENV = "ZPP_FORKSERVER_PRELOAD"  # the forkserver's preload list, read once by testing/_preload.py


def preload_rank_modules(modules: list[str]) -> None:
    """Start the ranks of later ``run_distributed`` calls from a forkserver that imports ``modules`` once.

    For CPU test runs: a rank then starts in a fraction of a second instead of re-importing torch and
    megatron.core. The server starts now, so the modules see this moment's environment at import (a rank gets
    the caller's environment of its own start before anything else is unpickled). A module that fails to
    import is reported on stderr and left to the ranks. Refused when CUDA is available: importing those modules
    may initialise the CUDA driver in the server, and a process forked from it cannot use CUDA.

    What a forked rank does not give a test: modules the test forgot to import are there already (the
    server's); ``hash()`` of a string is the same on every rank (PYTHONHASHSEED is fixed at the server's start).
    """
    global _start_method
    if torch.cuda.is_available():
        raise RuntimeError("preload_rank_modules is for CPU-only runs: CUDA is available here, and ranks forked "
                           "from a server that imported CUDA code cannot use it; leave ranks to 'spawn'")
    from multiprocessing import forkserver

    # The server imports one module of ours, which imports the list and reports failures: forkserver's own
    # preload tolerates only ImportError, and any other error (a warning turned into one) would kill it.
    mp.get_context("forkserver").set_forkserver_preload(["megatron_zpp.testing._preload"])
    os.environ[_PRELOAD_ENV] = ",".join(modules)
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[_PRELOAD_ENV]
    _start_method = "forkserver"


class _InheritedFd:
    """This process's file descriptor ``fd``, duplicated into the rank when the rank is pickled at start.

    Under a forkserver a rank's stdout and stderr are otherwise the server's, i.e. whatever they were when the
    server started, not the caller's now as under ``spawn`` (for a test, its capture).
    """

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _InheritedFd._rebuild, (reduction.DupFd(self.fd),)

    @staticmethod
    def _rebuild(dup) -> int:
        return dup.detach()


def _expected_parent() -> int | None:
    """The process a rank started now will have as its parent: this one, or the forkserver."""
    if _start_method == "spawn":
        return os.getpid()
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return getattr(forkserver._forkserver, "_forkserver_pid", None)  # CPython's name, 3.11 to 3.14


def _die_with_parent(caller_pid: int, expected_parent: int | None, forked: bool) -> None:
    """Linux: this rank is SIGKILLed when the process that started it dies, however it dies (a killed study or
    test run would otherwise leave its ranks running, blocked in gloo where a SIGTERM handler never runs).

    Under ``spawn`` that parent is the caller of ``run_distributed``; under the forkserver it is the server,
    which exits when the caller does (its end of the server's liveness pipe closes).
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # the parent died before the prctl: nothing will signal us
    if forked:  # (not _start_method: that is the caller's, not this process's)
        # A forked rank inherits the write end of the server's liveness pipe, which would keep the server (and
        # so this rank) alive after the caller is gone: drop it.
        from multiprocessing import forkserver

        server = forkserver._forkserver
        if hasattr(server, "_forkserver_alive_fd"):  # CPython's name, 3.11 to 3.14
            if server._forkserver_alive_fd is not None:
                os.close(server._forkserver_alive_fd)
                server._forkserver_alive_fd = None
        else:
            print("megatron_zpp.testing: this Python's forkserver keeps its liveness pipe elsewhere; ranks may "
                  "outlive a killed caller", file=sys.stderr, flush=True)
    try:
        os.kill(caller_pid, 0)
    except ProcessLookupError:
        os._exit(1)


def _entry(rank: int, payload: bytes, world_size: int, ranks_per_node: int, workdir: str, timeout_s: float,
           node_env: bool, caller_pid: int, expected_parent: int | None, environ: dict | None,
           stdio: tuple | None) -> None:
    forked = environ is not None
    _die_with_parent(caller_pid, expected_parent, forked)
    if forked:
        # As under spawn: the caller's environment and output of now (a forked rank has the server's), before
        # the function and its arguments are unpickled (their modules may read the environment at import), and
        # fresh random seeds (a fork copies the server's generators: every rank would draw the same numbers).
        os.environ.clear()
        os.environ.update(environ)
        for target, fd in zip((1, 2), stdio):
            os.dup2(fd, target)
            os.close(fd)
        torch.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
    try:
        _run_rank(rank, payload, world_size, ranks_per_node, workdir, timeout_s, node_env)
    finally:
        if forked and sys.version_info < (3, 13):
            # 3.12's forkserver ends a rank with os._exit: its atexit handlers (logging, coverage) would not run.
            import atexit

            atexit._run_exitfuncs()


def _run_rank(rank: int, payload: bytes, world_size: int, ranks_per_node: int, workdir: str, timeout_s: float,
              node_env: bool) -> None:
    fn, args, kwargs = pickle.loads(payload)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    if node_env:
        os.environ.update(LOCAL_WORLD_SIZE=str(ranks_per_node), LOCAL_RANK=str(rank % ranks_per_node))
    else:  # as under a launcher that says nothing about nodes
        for name in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS_PER_NODE"):
            os.environ.pop(name, None)
    torch.set_num_threads(1)  # several processes share few cores
    # When another rank fails, the spawner SIGTERMs this one: exit through Python so multiprocessing's exit
    # handlers stop the helper processes this rank started (Megatron's checkpoint writer starts a Manager
    # server), which would otherwise outlive the test holding its output pipes open.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(*args, **kwargs)
        with open(f"{workdir}/result{rank}", "wb") as f:
            pickle.dump(result, f)
        # A rank that finished first must not close its connections while a peer still reads from them (a
        # collective that raised mid-way, e.g. on a corrupt payload, leaves transfers in flight): gloo then
        # aborts the peer ("terminate called without an active exception"). Only on success: a rank that
        # raised is waited for by nobody.
        dist.barrier()
    finally:
        dist.destroy_process_group()


WALL_LIMIT_S = 900.0  # a whole run's bound: hangs outside collectives (gloo's timeout only covers those)


def run_distributed(fn: Callable, world_size: int, *args, ranks_per_node: int | None = None,
                    timeout_s: float = 120.0, node_env: bool = True, wall_limit_s: float = WALL_LIMIT_S,
                    **kwargs) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on every rank of a fresh gloo world; return the results by rank.

    ``fn`` must be importable by name (a module-level function), as processes are spawned.
    ``node_env=False`` leaves ``LOCAL_WORLD_SIZE`` / ``LOCAL_RANK`` unset. ``timeout_s`` bounds each
    collective (gloo's timeout); ``wall_limit_s`` bounds the whole run: past it every rank is stopped
    (SIGTERM, then SIGKILL) and ``TimeoutError`` names the ranks still running. On Linux the ranks also die
    with this process if it is killed.
    """
    ranks_per_node = ranks_per_node or world_size
    if world_size % ranks_per_node:
        raise ValueError(f"world_size={world_size} is not a multiple of ranks_per_node={ranks_per_node}")
    with tempfile.TemporaryDirectory(prefix="zpp-dist-") as workdir:
        forked = _start_method == "forkserver"
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        context = mp.start_processes(
            _entry, args=(pickle.dumps((fn, args, kwargs)), world_size, ranks_per_node, workdir, timeout_s, node_env,
                          os.getpid(), _expected_parent(), dict(os.environ) if forked else None,
                          (_InheritedFd(1), _InheritedFd(2)) if forked else None),
            nprocs=world_size, join=False, start_method=_start_method)
        deadline = time.monotonic() + wall_limit_s
        try:
            # join() raises with the failing rank's traceback (and stops the others) when one fails.
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    running = [r for r, p in enumerate(context.processes) if p.is_alive()]
                    raise TimeoutError(f"run_distributed({getattr(fn, '__name__', fn)}): ranks {running} still "
                                       f"running after {wall_limit_s:g} s; stopped")
        finally:
            _stop(context.processes)
        results = []
        for r in range(world_size):
            with open(f"{workdir}/result{r}", "rb") as f:
                results.append(pickle.load(f))
        return results


def _stop(processes, grace_s: float = 10.0) -> None:
    """SIGTERM what still runs (ranks exit through Python and stop their helper processes), then SIGKILL."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
