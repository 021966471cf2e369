"""Codec library: tensor <-> packed wire payload (layer 1; imports nothing distributed).

    from megatron_zpp.compression import get_codec
    codec = get_codec("int8:block=256")  # "int4:block=128", "int4:block=128,rounding=stochastic", "none",
                                          # "zfp:rate=8" (zfp fixed rate, zfpy's bitstream)
    packed = codec.encode(x)              # fp32 / bf16 / fp16, any shape and numel
    y = codec.decode(packed)              # same shape and dtype as x
    codec.wire_bytes(x.numel())           # exact payload bytes (an upper bound when not codec.fixed_size)
    get_codec("mpc")                      # lossless, variable size (base.py, lossless.md); also
                                          # "zstd:level=1" (CPU) and "nvcomp:algo=ans" (CUDA)

Codecs are registered below and nowhere else.
"""

from megatron_zpp.compression.base import Codec, Packed
from megatron_zpp.compression.blockwise import BlockwiseQuantCodec, Int4Config, Int8Config
from megatron_zpp.compression.container import PayloadError
from megatron_zpp.compression.identity import IdentityCodec, NoneConfig
from megatron_zpp.compression.mpc import MpcCodec, MpcConfig
from megatron_zpp.compression.nvcomp_codec import NvcompCodec, NvcompConfig
from megatron_zpp.compression.zstd_codec import ZstdCodec, ZstdConfig
from megatron_zpp.compression.registry import (
    available_codecs,
    canonical_spec,
    get_codec,
    parse_spec,
    register_codec,
)
from megatron_zpp.compression.zfp import ZfpCodec, ZfpConfig

register_codec("none", NoneConfig, IdentityCodec)
register_codec("int8", Int8Config, lambda cfg: BlockwiseQuantCodec(8, cfg, canonical_spec("int8", cfg)))
register_codec("int4", Int4Config, lambda cfg: BlockwiseQuantCodec(4, cfg, canonical_spec("int4", cfg)))
register_codec("mpc", MpcConfig, lambda cfg: MpcCodec(cfg, canonical_spec("mpc", cfg)))
register_codec("zstd", ZstdConfig, lambda cfg: ZstdCodec(cfg, canonical_spec("zstd", cfg)))
register_codec("nvcomp", NvcompConfig, lambda cfg: NvcompCodec(cfg, canonical_spec("nvcomp", cfg)))
register_codec("zfp", ZfpConfig, lambda cfg: ZfpCodec(cfg, canonical_spec("zfp", cfg)))

__all__ = [
    "Codec",
    "Packed",
    "PayloadError",
    "available_codecs",
    "canonical_spec",
    "get_codec",
    "parse_spec",
    "register_codec",
]
