"""What goes on the wire, shared by every collective in this package: codec resolution (``WireFormat``),
per-call-site, per-rank rounding seeds, the first-use cross-rank agreement check, argument checks and the
timed codec kernels (``codec_ops``). Invariant: every rank of a group resolves the same wire format for
a collective, or the first call raises (:func:`agree`): payload sizes never silently differ."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_zpp.compression import Codec, get_codec
from megatron_zpp.compression.blockwise import BlockwiseQuantCodec
from megatron_zpp.compression.identity import IdentityCodec
from megatron_zpp.comm.execution import CommHandle  # noqa: F401  (re-exported)
from megatron_zpp.comm.stats import comm_timers
from megatron_zpp.comm.topology import Topology

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class WireFormat:
    """A codec as a collective needs it.

    ``bits is None`` and not ``generic``: the tensor's own bytes (codec ``none``). ``bits`` set: a
    blockwise INT8/INT4 codec, run by the fused kernels. ``generic``: any other codec (ZFP,
    lossless), run through the codec interface by ``any_codec.py``.
    """

    codec: Codec
    bits: int | None
    block: int
    stochastic: bool
    generic: bool = False
    hadamard: int = 0  # blockwise: the Walsh-Hadamard run length (0: off), passed to every op
    calls: dict = field(default_factory=dict, compare=False, repr=False)  # call site -> calls so far

    @property
    def spec(self) -> str:
        return self.codec.spec

    @property
    def compressed(self) -> bool:
        return self.bits is not None or self.generic

    @property
    def blockwise(self) -> bool:
        return self.bits is not None

    def seed(self, group_rank: int, site: str) -> int:
        """Stochastic rounding seed of the next call at ``site`` (e.g. ``"dp.grad/qgz.hop1"``).

        A fresh stream per call, a distinct one per rank (the rounding errors of the ranks being
        summed are independent) and per call site: the n-th call at a site in a rounding epoch
        (a training step, see :func:`set_rounding_epoch`) gets the same seed whatever other sites
        did, in this run, a rerun or a resumed run."""
        if not self.stochastic:
            return 0
        return next_site_seed(self.calls, self.codec.seed, site, group_rank)


def _mix32(x: int) -> int:
    """The kernels' 32-bit hash (quant_math.h ``mix32``) on a Python int: no tensor on the comm path."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def site_seed(base: int, site: str, call: int, rank: int) -> int:
    """64-bit stochastic-rounding seed of call number ``call`` at ``site`` on ``rank``, from ``base``."""
    h = _mix32(zlib.crc32(site.encode()) ^ _mix32(base))
    lo = _mix32(h ^ _mix32(call) ^ (call >> 32))
    hi = _mix32(_mix32(h ^ 0x9E3779B9) ^ _mix32(rank))
    return (hi << 32) | lo


_EPOCH_KEY = object()
_rounding_epoch = 0


def set_rounding_epoch(epoch: int) -> None:
    """Restart every call site's stochastic-rounding seed stream at ``epoch`` (the training step).

    Seeds are then a function of (epoch, call site, call number within the epoch, rank): two runs
    of the same step, a second run in the same process or a run resumed from a checkpoint, round
    identically. The Megatron hooks set it from the iteration number."""
    global _rounding_epoch
    _rounding_epoch = int(epoch)


def next_site_seed(calls: dict, base: int, site: str, rank: int) -> int:
    """Count one more call at ``site`` in ``calls`` (restarted when the epoch changed) and seed it."""
    if calls.get(_EPOCH_KEY) != _rounding_epoch:
        calls.clear()
        calls[_EPOCH_KEY] = _rounding_epoch
    n = calls[site] = calls.get(site, 0) + 1
    return site_seed(base ^ _mix32(_rounding_epoch) ^ (_rounding_epoch >> 32), site, n, rank)


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
        fmt = WireFormat(c, c.bits, c.block, c.stochastic, hadamard=c.hadamard)
    else:
        from megatron_zpp.compression.container import ContainerCodec

        if not c.fixed_size and not isinstance(c, ContainerCodec):
            # any_codec.py reads a variable-size payload's length from the container header
            raise ValueError(f"{what}: codec {c.spec!r} has variable-size payloads outside the container format "
                             "(compression/container.py); the collectives cannot size them")
        fmt = WireFormat(c, None, 0, False, generic=True)
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


def wait(work) -> None:
    """Wait on a torch.distributed work (``None``: a group of one, nothing in flight)."""
    if work is not None:
        work.wait()


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


class _TimedOps:
    """``megatron_zpp.compression.ops`` with every call's host time added to ``comm_timers().codec_s``
    (the step-time breakdown's codec share)."""

    def __init__(self) -> None:
        self._cache: dict[str, object] = {}

    def __getattr__(self, name: str):
        fn = self._cache.get(name)
        if fn is None:
            from megatron_zpp.compression import ops

            raw = getattr(ops, name)

            def fn(*args, **kwargs):
                with comm_timers().codec():
                    return raw(*args, **kwargs)
            self._cache[name] = fn
        return fn


codec_ops = _TimedOps()
