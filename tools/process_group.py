"""Stop a child started with ``start_new_session=True`` together with everything in its process group.

The tools launch torchrun, sbatch emulations and whole runs as session leaders, so one signal to the group reaches
every rank. Shared by the tools that time runs out (gpu_check, soak, netemu, launch_loop) so they all stop a run the
same way: SIGTERM first where the run should get to write its logs, then SIGKILL for what is left, including ranks
that outlive a leader that already exited.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_process_group(proc: subprocess.Popen, term_grace_s: float | None = 5.0, kill_grace_s: float = 5.0) -> None:
    """SIGTERM ``proc``'s group and wait up to ``term_grace_s`` for the leader (torchrun forwards SIGTERM to its
    ranks); then SIGKILL the group, which ends a leader that outlived the grace and any member it left behind.
    ``term_grace_s=None`` skips SIGTERM. Waits up to ``kill_grace_s`` for the leader to be reaped."""
    if term_grace_s is not None and proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=term_grace_s)
    _signal_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=kill_grace_s)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
