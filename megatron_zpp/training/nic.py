"""Bytes this node's network interface sent during training, from the kernel's counters.

Set ``ZPP_NIC`` to the interface that carries inter-node traffic (``tools/netemu.py`` sets it to
the emulated node's ``eth0``); the trainer then reads ``/sys/class/net/$ZPP_NIC/statistics`` at
the start and the end of the training window, on local rank 0 of each node, and reports the
sum over nodes beside the byte accounting (``comm_stats``). Without ``ZPP_NIC`` nothing is read.

The interface must carry only this job's inter-node traffic for the figure to mean anything
(true inside netemu's namespaces; not on a shared host NIC).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

# Ethernet 14 + IPv4 20 + TCP 20 + timestamp option 12, once per counted packet (tools/netemu.py uses it too).
HEADER_BYTES = 66


def tcp_payload_bytes(counted_bytes: int, counted_packets: int) -> int:
    """TCP payload in a link's counted bytes: one header per counted packet (the counters see GSO
    super-packets, one header each; pure ACKs are all header)."""
    return max(counted_bytes - HEADER_BYTES * counted_packets, 0)


@dataclass
class NicDelta:
    tx_bytes: int = 0
    tx_packets: int = 0

    @property
    def payload_bytes(self) -> int:
        return tcp_payload_bytes(self.tx_bytes, self.tx_packets)


def _node_local_rank() -> int:
    """This process's rank within its node: torchrun's LOCAL_RANK; otherwise the global rank modulo
    LOCAL_WORLD_SIZE (or the whole world: one node) so exactly one process per node reads its NIC."""
    if os.environ.get("LOCAL_RANK") is not None:
        return int(os.environ["LOCAL_RANK"])
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if not per_node:
        per_node = dist.get_world_size() if dist.is_initialized() else 1
    return rank % per_node


class NicWindow:
    """Reads the counters on local rank 0 of each node. Every rank takes part in ``stop()``'s
    gather whatever its environment, so a node without ``ZPP_NIC`` (or without the interface)
    cannot leave the others waiting in a mismatched collective: it reports nothing, with a warning."""

    def __init__(self, interface: str | None = None) -> None:
        self.interface = interface if interface is not None else os.environ.get("ZPP_NIC") or None
        self.problem: str | None = None
        self.reader = self.interface is not None and _node_local_rank() == 0
        if self.reader and not (Path("/sys/class/net") / self.interface).exists():
            self.problem = (f"ZPP_NIC={self.interface!r}: no such network interface here; valid: "
                            + ", ".join(sorted(p.name for p in Path("/sys/class/net").iterdir())))
            warnings.warn(self.problem + "; NIC bytes are not measured on this node")
            self.reader = False
        self._start: tuple[int, int] | None = None

    def _read(self) -> tuple[int, int]:
        stats = Path("/sys/class/net") / self.interface / "statistics"
        return int((stats / "tx_bytes").read_text()), int((stats / "tx_packets").read_text())

    def start(self) -> None:
        # Every rank reaches the same point first, so no rank's earlier traffic is still being
        # sent when the counters are read (and none of the window's has started).
        dist.barrier()
        if self.reader:
            self._start = self._read()

    def stop(self) -> dict | None:
        """Bytes sent since ``start()``, summed over the nodes that measured; a collective on every
        rank. None when no node measured."""
        mine = None
        dist.barrier()
        if self.reader and self._start is not None:
            now = self._read()
            mine = (self.interface, now[0] - self._start[0], now[1] - self._start[1])
            self._start = None
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        measured = [m for m in everyone if m is not None]
        if not measured:
            return None
        total = NicDelta(sum(m[1] for m in measured), sum(m[2] for m in measured))
        return {"interface": measured[0][0], "nodes": len(measured), "tx_bytes": total.tx_bytes,
                "tx_packets": total.tx_packets, "payload_bytes": total.payload_bytes}
