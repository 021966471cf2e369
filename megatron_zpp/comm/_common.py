"""What every collective in this package shares: codec resolution, the async handle,
argument checks, the first-use cross-rank agreement check and per-rank rounding seeds."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron_zpp.compression import Codec, get_codec
from megatron_zpp.compression.blockwise import BlockwiseQuantCodec
from megatron_zpp.compression.identity import IdentityCodec
from megatron_zpp.compression.reference import mix32_int
from megatron_zpp.comm.topology import Topology

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
VALID_COMM_CODECS = "none, int8[:block=..,rounding=..], int4[:block=..,rounding=..]"


@dataclass(frozen=True)
class WireFormat:
    """A codec as a collective needs it: ``bits is None`` means the tensor's own bytes."""

    codec: Codec
    bits: int | None
    block: int
    stochastic: bool

    @property
    def spec(self) -> str:
        return self.codec.spec

    @property
    def compressed(self) -> bool:
        return self.bits is not None

    def seed(self, group_rank: int) -> int:
        """Stochastic rounding seed: a fresh stream per call and a distinct one per rank,
        so the rounding errors of the ranks being summed are independent."""
        if not self.stochastic:
            return 0
        return self.codec.next_seed() ^ (mix32_int(0x9E3779B9 ^ group_rank) << 16)


def wire_format(topology: Topology, codec: str | Codec | None, what: str) -> WireFormat:
    """Resolve a codec spec once per topology (kept, so stochastic counters advance per call)."""
    if codec is None:
        codec = "none"
    cache = topology._groups.codecs
    key = codec if isinstance(codec, str) else id(codec)
    fmt = cache.get(key)
    if fmt is not None:
        return fmt
    c = get_codec(codec) if isinstance(codec, str) else codec
    if isinstance(c, IdentityCodec):
        fmt = WireFormat(c, None, 0, False)
    elif isinstance(c, BlockwiseQuantCodec):
        fmt = WireFormat(c, c.bits, c.block, c.stochastic)
    else:
        raise ValueError(f"{what}: codec {c.spec!r} cannot be used here; valid: {VALID_COMM_CODECS}")
    cache[key] = fmt
    return fmt


def agree(topology: Topology, what: str, **settings) -> None:
    """Check once per (collective, settings) that every rank of the group uses the same settings.

    A mismatch (one rank on int8, another on int4) would otherwise hang or silently
    garble: payload sizes differ. Runs on the first call with new settings only, so the
    steady-state path has no extra communication.
    """
    key = (what, tuple(sorted(settings.items())))
    groups = topology._groups
    if key in groups.agreed or topology.size == 1:
        return
    everyone: list = [None] * topology.size
    dist.all_gather_object(everyone, key, group=groups.flat.group)
    if any(k != key for k in everyone):
        detail = "; ".join(f"rank {i}: {dict(k[1])}" for i, k in enumerate(everyone))
        raise ValueError(f"{what}: ranks of {topology} disagree on settings: {detail}")
    groups.agreed.add(key)


class CommHandle:
    """Returned by ``async_op=True`` calls. ``wait()`` finishes the collective (decode and
    reduce into the output); the output must not be read before it. Waiting twice is a no-op."""

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None


def wait(work) -> None:
    """Wait on a torch.distributed work (``None``: a group of one, nothing in flight)."""
    if work is not None:
        work.wait()


def result_of(future: Future | None):
    return None if future is None else future.result()


def check_float(name: str, t: torch.Tensor, what: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what}: {name} has dtype {t.dtype}; compressed collectives take "
                        f"{', '.join(map(str, FLOAT_DTYPES))} (use codec='none' for others)")


def check_pair(output: torch.Tensor, input: torch.Tensor, what: str) -> None:
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous")
    if output.dtype != input.dtype:
        raise TypeError(f"{what}: output dtype {output.dtype} != input dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{what}: output is on {output.device}, input on {input.device}")


def reduce_divisor(op, size: int, what: str) -> int:
    """``mean`` -> ``size``, ``sum`` -> 1 (also ``ReduceOp.AVG`` / ``ReduceOp.SUM``)."""
    name = op
    if isinstance(op, dist.ReduceOp.RedOpType) or isinstance(op, dist.ReduceOp):
        name = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean"}.get(op, str(op))
    if name == "mean" or name == "avg":
        return size
    if name == "sum":
        return 1
    raise ValueError(f"{what}: op={op!r} is not supported; valid: 'mean', 'sum' (ReduceOp.AVG, ReduceOp.SUM)")
