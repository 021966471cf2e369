"""Run a function on ``world_size`` gloo processes on this machine and collect what each returns.

Nodes are simulated: rank ``r`` is on node ``r // ranks_per_node`` (``LOCAL_WORLD_SIZE``
is set accordingly, so ``Topology(group)`` picks it up). A failure in any rank raises in
the caller with that rank's traceback; a hang in a collective fails after ``timeout_s`` (gloo's
timeout), any other hang after ``wall_limit_s``, with every rank stopped.
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


def _die_with_parent(parent_pid: int) -> None:
    """Linux: this rank is SIGKILLed when the process that spawned it dies, however it dies (a killed study or
    test run would otherwise leave its ranks running, blocked in gloo where a SIGTERM handler never runs)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the prctl: nothing will signal us
        os._exit(1)


def _entry(rank: int, fn: Callable, world_size: int, ranks_per_node: int, workdir: str, timeout_s: float,
           node_env: bool, parent_pid: int, args: tuple, kwargs: dict) -> None:
    _die_with_parent(parent_pid)
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
        context = mp.start_processes(_entry, args=(fn, world_size, ranks_per_node, workdir, timeout_s, node_env,
                                                   os.getpid(), args, kwargs), nprocs=world_size, join=False, start_method="spawn")
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
