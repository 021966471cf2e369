"""Codec library: tensor <-> packed wire payload (layer 1; imports nothing distributed).

    from megatron_zpp.compression import get_codec
    codec = get_codec("int8:block=256")  # "int4:block=128", "int4:block=128,rounding=stochastic", "none"
    packed = codec.encode(x)              # fp32 / bf16 / fp16, any shape and numel
    y = codec.decode(packed)              # same shape and dtype as x
    codec.wire_bytes(x.numel())           # exact payload bytes

Codecs are registered below and nowhere else.
"""

from megatron_zpp.compression.base import Codec, Packed
from megatron_zpp.compression.blockwise import BlockwiseQuantCodec, Int4Config, Int8Config
from megatron_zpp.compression.identity import IdentityCodec, NoneConfig
from megatron_zpp.compression.registry import (
    available_codecs,
    canonical_spec,
    get_codec,
    parse_spec,
    register_codec,
)

register_codec("none", NoneConfig, IdentityCodec)
register_codec("int8", Int8Config, lambda cfg: BlockwiseQuantCodec(8, cfg, canonical_spec("int8", cfg)))
register_codec("int4", Int4Config, lambda cfg: BlockwiseQuantCodec(4, cfg, canonical_spec("int4", cfg)))

__all__ = [
    "Codec",
    "Packed",
    "available_codecs",
    "canonical_spec",
    "get_codec",
    "parse_spec",
    "register_codec",
]
