"""``ZppConfig``: what a user sets (flags ``--zpp-*`` or a YAML policy), before resolution."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class ZppConfig:
    policy: str = "none"
    """Compression policy: a preset in configs/policies (none, fair, zeropp, hybrid) or the path of a YAML
    policy file. The per-dimension flags below override its entries."""
    dp_grad: str | None = None
    """Codec of data-parallel gradient reduction (qgZ reduce-scatter with the distributed optimizer, a
    compressed all-reduce without), e.g. int4:block=128 (fused kernels), zfp:rate=8, mpc; none for
    uncompressed."""
    dp_grad_intra: str | None = None
    """Codec of qgZ's intra-node hop when it differs from --zpp-dp-grad (e.g. int8:block=256 inside the
    node, INT4 across)."""
    dp_param: str | None = None
    """Codec of the ZeRO parameter all-gather (qwZ), e.g. int8:block=256; any codec without hpZ (hpZ
    needs none, int8 or int4)."""
    tp: str | None = None
    """Codec of tensor-parallel activation collectives (all-gather, reduce-scatter, all-reduce): any codec,
    e.g. mpc or zstd (lossless, bit-exact), zfp:rate=16 (lossy, high rate), int8:block=256; none leaves
    Megatron's collectives in place."""
    pp: str | None = None
    """Codec of pipeline-parallel p2p activations and gradients: any codec, e.g. mpc (lossless; its
    length is sent first), zfp:rate=16, int8:block=256; none leaves Megatron's p2p in place."""
    ep_dispatch: str | None = None
    """MoE expert parallelism: codec of the token dispatch (the tokens on their way to their experts, forward: the
    alltoall dispatcher's all-to-all, the allgather dispatcher's all-gather), e.g. int8:block=128 (lossy: opt-in,
    as DeepSeek-V3's FP8 dispatch) or mpc (lossless); none leaves Megatron-Core's exchange."""
    ep_dispatch_grad: str | None = None
    """Codec of the dispatch's backward (the gradients of the dispatched tokens, travelling back); default none."""
    ep_combine: str | None = None
    """Codec of the token combine (the experts' outputs on their way back, forward: an all-to-all, or the allgather
    dispatcher's reduce-scatter); default none (DeepSeek-V3 keeps combine in bf16)."""
    ep_combine_grad: str | None = None
    """Codec of the combine's backward (the output gradients on their way to the experts); default none."""
    hpz_size: int | None = None
    """hpZ secondary partition size in ranks (ZeRO-3 / Megatron-FSDP only); 1 disables; default: the
    policy's (zeropp: the whole node)."""
    ranks_per_node: int | None = None
    """Ranks per node, to tell intra- from inter-node peers; default LOCAL_WORLD_SIZE. On one machine a
    smaller value simulates several nodes."""
    qgz_stages: int | None = None
    """Pipeline stages of qgZ's two hops (ZeRO++ Algorithm 2); default the policy's (1)."""
    dp_uncompressed: str | None = None
    """Who runs a data-parallel collective whose codec is none: megatron (Megatron's own
    torch.distributed calls, bit-identical to no plugin; on gloo its reduce-scatter is an
    all-reduce) or hierarchical (the project's uncompressed algorithms: intra- then inter-node
    reduce-scatter, ring all-gather; the fair baseline). Default: the policy's (megatron)."""
    dp_grad_until: float | None = None
    """Compress dp.grad only for this fraction of --train-iters, then reduce uncompressed (ZeRO++ Table 5
    schedule); default the policy's (1.0: always)."""
    dp_grad_error_feedback: bool | None = None
    """Error feedback for a lossy dp.grad codec (off by default): each rank adds what the previous
    reduction's first hop lost of its gradient to the next one (a residual the size of its gradient
    buffer, fp32, saved in checkpoints). See megatron_zpp/comm/error_feedback.md."""
    dp_param_difference: bool | None = None
    """qWD (SDP4Bit): gather the quantized *difference* of each weight shard from what every replica holds,
    with the dp.param codec (e.g. int4:block=2048), instead of the weights; every replica adds the same decoded
    difference, so all hold identical weights and the quantization error is carried into the next step.
    Distributed optimizer only; default the policy's (off)."""
    dp_param_resync_interval: int | None = None
    """With --zpp-dp-param-difference: gather the weights in full precision every this many iterations (0:
    only at the start and after a checkpoint load, which always resync); default the policy's (0)."""
