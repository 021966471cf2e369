"""Test-only fault injection (tests/test_reliability.py), configured by ``ZPP_TEST_FAULT``.

A comma-separated list of ``KIND:RANK:ITER`` (rank RANK only) or ``KIND:ITER`` (every rank); ITER is 1-based:

=========  ==========================================================================================
kind       what happens at iteration ITER
=========  ==========================================================================================
kill       the rank SIGKILLs itself in its first forward of ITER
hang       the rank blocks forever there (a rank stuck before its next collective)
spike      the loss (and so the gradients) x 100
nan        the loss (and so, through the gradient reduction, everyone's gradients) NaN
save       the save of the checkpoint of iteration ITER raises ``OSError`` (ENOSPC) on the rank, after its
           data is written, before the commit
verify     the rank flips a byte of the first file it verifies in the save of iteration ITER (its hash
           then differs from the manifest's)
load       loading the checkpoint of iteration ITER raises ``OSError`` (EIO) on the rank, before the
           sharded read
data       the rank's data loader raises ``OSError`` (EIO) reading its first micro-batch of ITER
codec      the rank flips a byte of the first compressed payload it receives and decodes in ITER (its
           container checksum then fails; use a policy whose dp.grad codec is a container: mpc, zstd)
switch     the rank's divergence-guard policy switch raises at ITER (pair it with spike:ITER)
=========  ==========================================================================================

Nothing here runs unless ``ZPP_TEST_FAULT`` is set; every check is a dictionary lookup otherwise.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from pathlib import Path

import torch.distributed as dist

KINDS = ("kill", "hang", "spike", "nan", "save", "verify", "load", "data", "codec", "switch")

# The trainer keeps iteration (1-based) and micro_batch (in the iteration) current.
state: dict = {"iteration": 0, "micro_batch": 0, "faults": []}


def configure(spec: str | None) -> None:
    """Parse ``ZPP_TEST_FAULT``; errors name the value and the valid kinds."""
    state["faults"] = [_parse(item) for item in spec.split(",")] if spec else []


def _parse(item: str) -> tuple[str, int | None, int]:
    kind, *numbers = item.split(":")
    try:
        rank, iteration = (None, int(numbers[0])) if len(numbers) == 1 else (int(numbers[0]), int(numbers[1]))
    except (ValueError, IndexError):
        rank = iteration = None
    if kind not in KINDS or iteration is None or len(numbers) > 2:
        raise ValueError(f"ZPP_TEST_FAULT={item!r}: expected KIND:ITER or KIND:RANK:ITER (comma-separated), KIND one "
                         f"of {', '.join(KINDS)}")
    return kind, rank, iteration


def active(kind: str, iteration: int | None = None) -> bool:
    """Whether a ``kind`` fault fires on this rank at ``iteration`` (default: the current one)."""
    if not state["faults"]:
        return False
    at = state["iteration"] if iteration is None else iteration
    return any(k == kind and it == at and r in (None, dist.get_rank()) for k, r, it in state["faults"])


def _announce(kind: str, iteration: int) -> None:
    print(f"[fault injection] rank {dist.get_rank()}: {kind} at iteration {iteration}", flush=True)


def raise_if(kind: str, iteration: int | None = None) -> None:
    """Raise the ``kind`` fault's error (save, load, data, switch) when it fires here."""
    if not active(kind, iteration):
        return
    at = state["iteration"] if iteration is None else iteration
    _announce(kind, at)
    if kind == "save":
        raise OSError(errno.ENOSPC, f"No space left on device (injected into the save of iteration {at})")
    if kind in ("load", "data"):
        raise OSError(errno.EIO, f"Input/output error (injected into the {kind} of iteration {at})")
    raise RuntimeError(f"injected failure in the {kind} at iteration {at}")


def corrupt_first_file(files: list[Path], iteration: int) -> None:
    """``verify``: flip a byte in the middle of the first of ``files`` (this rank's share to verify)."""
    if not files or not active("verify", iteration):
        return
    _announce("verify", iteration)
    raw = bytearray(files[0].read_bytes())
    if raw:
        raw[len(raw) // 2] ^= 0x10
        files[0].write_bytes(bytes(raw))


def process_fault() -> None:
    """``kill`` / ``hang`` in the first forward of the iteration (call at each micro-batch's start)."""
    first = state["micro_batch"] == 0
    state["micro_batch"] += 1
    if not first:
        return
    for kind in ("kill", "hang"):
        if active(kind):
            _announce(kind, state["iteration"])
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait()  # forever: only the watchdog's os._exit (or a signal) ends this process


def loss_factor() -> float:
    return 100.0 if active("spike") else float("nan") if active("nan") else 1.0


def install_payload_corruption(codec) -> None:
    """``codec``: wrap the decoders of ``codec``'s class so that the first payload this rank decodes in the fault's
    iteration has one byte of its body flipped (a copy: the sender's buffer is left alone). The container's
    checksum then fails on this rank, the receiver, only."""
    if not any(kind == "codec" for kind, _, _ in state["faults"]):
        return
    from megatron_zpp.compression.container import LENGTH_OFFSET

    cls = type(codec)
    done: set[int] = set()

    def corrupted(packed):
        iteration = state["iteration"]
        if iteration in done or not active("codec"):
            return packed
        done.add(iteration)
        _announce("codec", iteration)
        payload = packed.payload.clone()
        length = int.from_bytes(payload[LENGTH_OFFSET:LENGTH_OFFSET + 8].cpu().numpy().tobytes(), "little")
        payload[min(length, payload.numel()) - 1] ^= 0x5A  # the last byte of the body
        return type(packed)(payload=payload, shape=packed.shape, dtype=packed.dtype)

    for name in ("decode", "decode_deferred"):
        # Wrap the class's own decoder, kept on first install: a second install (another in-process run) replaces
        # the wrapper, with its own `done`, instead of stacking one more flip on top.
        original = cls.__dict__.get(f"_zpp_unfaulted_{name}") or getattr(cls, name, None)
        if original is None:
            continue
        setattr(cls, f"_zpp_unfaulted_{name}", original)

        def wrapper(self, packed, *args, _original=original, **kwargs):
            return _original(self, corrupted(packed), *args, **kwargs)

        setattr(cls, name, wrapper)


def install_policy_faults(hooks) -> None:
    """``switch`` and ``codec`` faults, on the installed hooks (``MegatronHooks``) of this run."""
    kinds = {kind for kind, _, _ in state["faults"]}
    if "switch" in kinds:
        original = hooks.suspend_lossy

        def suspend_lossy(suspended: bool) -> None:
            raise_if("switch")
            original(suspended)

        hooks.suspend_lossy = suspend_lossy  # this instance only
    if "codec" in kinds:
        from megatron_zpp.compression import get_codec

        spec = hooks.policy.codec("dp.grad")
        if spec == "none" or get_codec(spec).fixed_size:
            raise ValueError(f"ZPP_TEST_FAULT codec corrupts a container payload: it needs a dp.grad codec that is "
                             f"one (mpc, zstd), this run's is {spec!r}")
        install_payload_corruption(get_codec(spec))
