"""torch.distributed's flight recorder: off on gloo unless the user sized it (issue [22], bounded memory).

The recorder is a ring of the last N collectives (default 2000, each with its Python stack), read by the
variables in ``FLIGHT_RECORDER_ENV`` in that order, 0 turning it off. It must be set before
``init_process_group``: ``pretrain_gpt.py`` does so before creating the group, and ``install_from_args`` does so
for Megatron-LM's own script, whose ``pretrain()`` creates the group after that call.
"""

from __future__ import annotations

import os

FLIGHT_RECORDER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def flight_recorder_default(backend: str | None, environ=os.environ, dump_path: str | None = None) -> None:
    """Turn the flight recorder off on gloo unless the user sized it. On by default, it holds ~1-3 MB of entries
    that only its dump reads (a tool for NCCL hangs; our rank watchdog names a gloo rank that hangs), filled
    over the first 2000 collectives (hundreds of steps), and replacing its oldest entry every collective after
    that grew the heap glibc holds by up to ~9 MB per 100 steps (ZHybrid; docs/soak/README.md). NCCL keeps
    torch's default: there the recorder is what explains a hang. ``dump_path``: Megatron-LM's
    ``--flight-recorder-dump-path``; a user who asked for dumps keeps the recorder (Megatron-LM sizes it)."""
    if dump_path:
        return
    if backend == "gloo" and not any(environ.get(name) for name in FLIGHT_RECORDER_ENV):
        environ[FLIGHT_RECORDER_ENV[0]] = "0"
