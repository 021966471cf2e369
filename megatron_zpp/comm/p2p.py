"""Compressed point-to-point sends (pipeline-parallel activations and gradients).

A fixed-rate codec's payload size follows from the tensor's shape, which both pipeline
stages know, so no size message is needed: the sender encodes into a payload, the receiver
posts a receive of ``payload_bytes(shape)`` bytes and decodes into its tensor when the
request is waited on.
"""

from __future__ import annotations

import torch

from megatron_zpp.compression import get_codec, layout
from megatron_zpp.compression.blockwise import BlockwiseQuantCodec
from megatron_zpp.comm._common import FLOAT_DTYPES, VALID_COMM_CODECS, codec_ops, next_site_seed
from megatron_zpp.comm.stats import comm_stats


class P2PCodec:
    """Encode / decode one tensor for a send (blockwise INT8/INT4, one row)."""

    def __init__(self, spec: str) -> None:
        codec = get_codec(spec)
        if not isinstance(codec, BlockwiseQuantCodec):
            raise ValueError(f"pipeline p2p codec {spec!r} is not supported; valid: {VALID_COMM_CODECS}")
        self.codec, self.bits, self.block = codec, codec.bits, codec.block
        self._calls: dict = {}  # call site -> sends so far in this rounding epoch

    def payload_bytes(self, numel: int) -> int:
        return layout.row_bytes(numel, self.bits, self.block)

    def encode(self, t: torch.Tensor, site: str = "p2p", rank: int = 0) -> torch.Tensor:
        """``site`` names the call site (e.g. ``"pp.send_next"``): each has its own reproducible
        stochastic-rounding seed stream."""
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"pipeline p2p compression takes {FLOAT_DTYPES}, got {t.dtype}")
        payload = torch.empty(1, self.payload_bytes(t.numel()), dtype=torch.uint8, device=t.device)
        seed = 0
        if self.codec.stochastic:
            seed = next_site_seed(self._calls, self.codec.seed, site, rank)
        codec_ops.quantize_rows_(t.detach().contiguous().view(-1), payload, self.bits, self.block,
                           self.codec.stochastic, seed)
        return payload.view(-1)

    def empty_payload(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(self.payload_bytes(like.numel()), dtype=torch.uint8, device=like.device)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        # .data: Megatron's receive buffers require grad; the decode is not part of the graph.
        codec_ops.dequantize_rows_(payload.view(1, -1), out.data.view(-1), self.bits, self.block)


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
