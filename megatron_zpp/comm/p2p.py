"""Compressed point-to-point sends (pipeline-parallel activations and gradients).

A fixed-size codec's payload size follows from the tensor's shape, which both pipeline stages
know, so no size message is needed: the sender encodes into a payload, the receiver posts a
receive of ``payload_bytes(numel)`` bytes and decodes into its tensor when the request is waited
on. A variable-size (lossless) codec sends its true length first: the hook exchanges one int64
per direction, waits for it, then posts the payloads (``megatron/model_parallel.py``). On a GPU
that is host synchronization per p2p call (the size exchange) plus small device-to-host reads of
each container header (the sender's length, the receiver's validation): not run here (no GPU).
"""

from __future__ import annotations

import torch

from megatron_zpp.compression import Packed, get_codec, layout
from megatron_zpp.compression.blockwise import BlockwiseQuantCodec
from megatron_zpp.comm.stats import comm_stats, comm_timers
from megatron_zpp.comm.wire import FLOAT_DTYPES, codec_ops, next_site_seed

SIZE_MESSAGE_BYTES = 8  # the int64 a variable-size payload's length travels in


class P2PCodec:
    """Encode / decode one tensor for a send: blockwise INT8/INT4 with the fused row kernels, any other
    codec (ZFP, lossless) through the codec interface."""

    def __init__(self, spec: str) -> None:
        codec = get_codec(spec)
        if codec.spec == "none":
            raise ValueError("P2PCodec: codec 'none' needs no codec; leave Megatron's p2p as it is")
        self.codec = codec
        self.blockwise = isinstance(codec, BlockwiseQuantCodec)
        self.fixed_size = codec.fixed_size
        self._calls: dict = {}  # call site -> sends so far in this rounding epoch
        # Variable-size payloads received and decoded whose container checks have not reached the host:
        # they travel with the next p2p call's size read (model_parallel.py). Meanwhile a corrupt payload
        # has decoded to NaN on the device (ContainerCodec.decode_deferred).
        self.pending_checks: list = []

    def payload_bytes(self, numel: int) -> int:
        """The payload's size (fixed-size codecs), or its upper bound (variable-size)."""
        if self.blockwise:
            return layout.row_bytes(numel, self.codec.bits, self.codec.block)
        return self.codec.wire_bytes(numel)

    def encode(self, t: torch.Tensor, site: str = "p2p", rank: int = 0) -> torch.Tensor:
        """``t`` as a flat uint8 payload of exactly its bytes. ``site`` names the call site (e.g.
        ``"pp.send_next"``): each has its own reproducible stochastic-rounding seed stream."""
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"pipeline p2p compression takes {FLOAT_DTYPES}, got {t.dtype}")
        x = t.detach().contiguous()
        if not self.blockwise:
            with comm_timers().codec():
                packed = self.codec.encode(x)
                payload = packed.payload.view(-1)
                return payload if self.fixed_size else payload[:self.codec.payload_nbytes(packed)]
        payload = torch.empty(1, self.payload_bytes(t.numel()), dtype=torch.uint8, device=t.device)
        seed = 0
        if self.codec.stochastic:
            seed = next_site_seed(self._calls, self.codec.seed, site, rank)
        codec_ops.quantize_rows_(x.view(-1), payload, self.codec.bits, self.codec.block, self.codec.stochastic,
                                 seed, self.codec.hadamard)
        return payload.view(-1)

    def empty_payload(self, like: torch.Tensor, nbytes: int | None = None) -> torch.Tensor:
        """A receive buffer for a payload encoding ``like``; ``nbytes``: the announced size (variable-size)."""
        n = self.payload_bytes(like.numel()) if nbytes is None else nbytes
        return torch.empty(n, dtype=torch.uint8, device=like.device)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        # .data: Megatron's receive buffers require grad; the decode is not part of the graph.
        if self.blockwise:
            codec_ops.dequantize_rows_(payload.view(1, -1), out.data.view(-1), self.codec.bits, self.codec.block,
                                       self.codec.hadamard)
            return
        packed = Packed(payload=payload, shape=out.shape, dtype=out.dtype)
        with comm_timers().codec():
            if self.fixed_size:
                decoded = self.codec.decode(packed)
            else:
                decoded, check = self.codec.decode_deferred(packed)
                if check is not None:
                    self.pending_checks.append(check)
            out.data.copy_(decoded)


def record_p2p(tag: str, peer: int, me: int, ranks_per_node: int, payload_bytes: int, raw_bytes: int) -> None:
    """Record one send from global rank ``me`` to global rank ``peer``."""
    inter = peer // ranks_per_node != me // ranks_per_node
    comm_stats().record(tag, 0 if inter else payload_bytes, payload_bytes if inter else 0,
                        uncompressed=(0, raw_bytes) if inter else (raw_bytes, 0))


class DecodingRequest:
    """Wraps the requests of one batched send/receive; ``wait()`` waits them, then decodes."""

    def __init__(self, requests, decodes: list[tuple[P2PCodec, torch.Tensor, torch.Tensor]], keep) -> None:
        self._requests, self._decodes, self._keep = list(requests), decodes, keep

    def wait(self) -> None:
        for r in self._requests:
            r.wait()
        self._requests = []
        for codec, payload, out in self._decodes:
            codec.decode_into(payload, out)
        self._decodes, self._keep = [], None

    def is_completed(self) -> bool:
        return not self._requests and not self._decodes
