"""Scratch buffers of the collectives: a bounded pool per topology shape, leased per call.

A collective takes every temporary it needs (packed rows, receive buffers, padded copies) through a
:class:`Scratch` lease at the call and gives it back at ``wait()`` (``execution.py``). On CPU the
lease draws from the topology's :class:`BufferPool`, so steady-state training, whose buckets repeat
their sizes every iteration, allocates nothing on the comm path; on CUDA it allocates from the caching
allocator under the comm stream. Invariant: a buffer is back in the pool only after the call that took
it has finished (its ``finish`` step), never while a hop may still read or write it.

:func:`release_buffers` and :func:`scratch_pool_usage` see every topology's pool (one per shape,
``topology._TopologyGroups``): the soak's memory counters read the latter.
"""

from __future__ import annotations

import os
from collections import deque

import torch

DEFAULT_POOL_CACHE_BYTES = int(os.environ.get("ZPP_POOL_CACHE_MB", "2048")) << 20


class BufferPool:
    """Reusable uint8 scratch buffers for CPU tensors, keyed by exact size and device, bounded.

    A collective takes its scratch buffers through a :class:`Scratch` lease at the call and gives
    them back at ``wait()``, so several calls may be in flight (Megatron issues every bucket before
    waiting on any) and steady-state training, whose buckets repeat sizes every iteration,
    allocates nothing on the comm path. At most ``max_cached_bytes`` of free buffers are kept
    (``ZPP_POOL_CACHE_MB``, default 2048); beyond that the least recently returned are freed.
    ``release()`` frees them all. CUDA scratch does not come from here: the caching allocator,
    used under the comm stream, ties each block to that stream (``execution.py``).
    """

    def __init__(self, max_cached_bytes: int = DEFAULT_POOL_CACHE_BYTES) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._order: deque[tuple[tuple, torch.Tensor]] = deque()  # least recently returned first
        self.max_cached_bytes = max_cached_bytes
        self.cached_bytes = 0  # free buffers held now
        self.in_use_bytes = 0  # taken by calls not yet waited on
        self.allocated_bytes = 0  # ever allocated; flat in steady state

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        key = (nbytes, device)
        free = self._free.get(key)
        if free:
            buf = free.pop()
            self._forget(buf)
            self.cached_bytes -= nbytes
            self.in_use_bytes += nbytes
            return buf
        self.allocated_bytes += nbytes
        self.in_use_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        key = (buffer.numel(), buffer.device)
        self.in_use_bytes -= buffer.numel()
        self._free.setdefault(key, []).append(buffer)
        self._order.append((key, buffer))
        self.cached_bytes += buffer.numel()
        while self.cached_bytes > self.max_cached_bytes and self._order:
            old_key, old = self._order.popleft()
            self._free[old_key] = [b for b in self._free[old_key] if b is not old]
            self.cached_bytes -= old.numel()

    def _forget(self, buf: torch.Tensor) -> None:
        for i, (_, b) in enumerate(self._order):
            if b is buf:
                del self._order[i]
                return

    def release(self) -> None:
        """Free every cached buffer (e.g. before evaluation or a checkpoint, or to cap memory)."""
        self._free.clear()
        self._order.clear()
        self.cached_bytes = 0

    clear = release

    def lease(self, device: torch.device) -> Scratch:
        return Scratch(self, device)


class Scratch:
    """The scratch buffers of one call; ``release()`` gives the pooled ones back.

    On CUDA every take is a fresh allocation from the caching allocator on the current stream (the
    comm stream, when called from a collective's steps): dropping the last reference returns it there."""

    __slots__ = ("_pool", "_device", "_taken")

    def __init__(self, pool: BufferPool, device: torch.device) -> None:
        self._pool, self._device, self._taken = pool, device, []

    def take(self, nbytes: int) -> torch.Tensor:
        if self._device.type == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        buf = self._pool.take(nbytes, self._device)
        self._taken.append(buf)
        return buf

    def release(self) -> None:
        for buf in self._taken:
            self._pool.give(buf)
        self._taken = []


_TOPOLOGY_POOLS: list[BufferPool] = []  # one per topology shape (topology._GROUP_CACHE), in creation order


def topology_pool() -> BufferPool:
    """A new pool for one topology shape, seen by :func:`release_buffers` and :func:`scratch_pool_usage`."""
    pool = BufferPool()
    _TOPOLOGY_POOLS.append(pool)
    return pool


def release_buffers() -> None:
    """Free the cached scratch buffers of every topology."""
    for pool in _TOPOLOGY_POOLS:
        pool.release()


def scratch_pool_usage() -> dict[str, int]:
    """What the CPU scratch pools of every topology of this process hold now (no communication).

    ``held_bytes``: free cached buffers plus buffers leased to calls not yet waited on, i.e. the
    pools' share of resident memory; ``allocated_bytes``: bytes ever allocated by the pools, which
    stays flat once every bucket size has been seen (growth means the pools stopped reusing);
    ``cached_buffers``: free buffers kept; ``pools``: how many topologies own a pool.
    """
    pools = _TOPOLOGY_POOLS
    cached = sum(p.cached_bytes for p in pools)
    in_use = sum(p.in_use_bytes for p in pools)
    return {"pools": len(pools), "held_bytes": cached + in_use, "cached_bytes": cached, "in_use_bytes": in_use,
            "allocated_bytes": sum(p.allocated_bytes for p in pools),
            "cached_buffers": sum(len(free) for p in pools for free in p._free.values())}
