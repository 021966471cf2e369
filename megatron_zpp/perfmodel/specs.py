"""Typed inputs of the performance model, loaded from YAML: a cluster (calibration data) and a workload.

Units everywhere: seconds, bytes, bytes/s, FLOP/s. YAML numbers such as ``12.5e9`` (which YAML 1.1 reads as a
string) are accepted. Every loader rejects unknown keys and missing fields and names the valid ones, so a typo
in a calibration file fails loudly instead of silently keeping a default.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

ZERO_MODES = ("distopt", "fsdp", "ddp")
MOE_TOKEN_DISPATCHERS = ("allgather", "alltoall")  # the host-side dispatchers megatron_zpp hooks (flex: GPU kernels)
BACKENDS = ("nccl", "gloo")
CODEC_OPS = ("quantize", "dequantize")


@dataclass(kw_only=True)
class CodecThroughput:
    """Measured throughput of one codec's kernels on one rank (memory-bound; ``tools/bench_codecs.py``)."""

    quantize: float
    """Bytes/s of *uncompressed* input encoded (e.g. fp32 bytes in / seconds)."""
    dequantize: float
    """Bytes/s of *uncompressed* output decoded."""
    ratio_fp32: float | None = None
    """Variable-size (lossless) codecs: measured compression ratio, raw / payload bytes, on fp32 data.
    Fixed-size codecs leave it unset (their payload size follows from the shape)."""
    ratio_16bit: float | None = None
    """The same on bf16 data (16-bit tensors compress differently: their exponent byte is half the bytes)."""

    def __post_init__(self) -> None:
        for name in CODEC_OPS:
            _positive(f"codec throughput {name}", getattr(self, name))
        for name in ("ratio_fp32", "ratio_16bit"):
            if getattr(self, name) is not None:
                _positive(f"codec {name}", getattr(self, name))

    def ratio(self, dtype_bytes: int) -> float | None:
        return self.ratio_fp32 if dtype_bytes >= 4 else self.ratio_16bit


@dataclass(kw_only=True)
class MeasuredLayer:
    """A measured transformer-layer time; used instead of ``compute_flops`` for workloads of this exact shape."""

    hidden: int
    """Hidden size of the measured layer."""
    seq_length: int
    """Sequence length of the measured micro-batch."""
    micro_batch: int
    """Sequences per micro-batch."""
    tp: int = 1
    """Tensor-parallel size the layer was measured with (time is per TP rank)."""
    fwd_bwd_s: float
    """Seconds of one layer's forward + backward for one micro-batch on one rank, no communication, no
    activation recomputation."""

    def __post_init__(self) -> None:
        for name in ("hidden", "seq_length", "micro_batch", "tp", "fwd_bwd_s"):
            _positive(f"measured layer {name}", getattr(self, name))


@dataclass(kw_only=True)
class MeasuredIteration:
    """A measured training iteration without communication (Agarwal et al.'s T_comp from a run with no
    communication): ``pretrain_gpt.py`` with data-parallel size 1 in as many concurrent processes as the
    cluster has ranks per host, each with one rank's share of the batch. Unlike ``measured_layers`` it
    includes the logits, the loss and the framework's own per-micro-batch overhead; a workload of exactly
    this shape (TP = PP = 1) uses it for its compute."""

    layers: int
    """Transformer layers of the measured model."""
    hidden: int
    """Hidden size."""
    seq_length: int
    """Sequence length."""
    micro_batch: int
    """Sequences per micro-batch."""
    vocab: int
    """Vocabulary before padding."""
    fwd_bwd_s: float
    """Seconds of one micro-batch's forward + backward through the whole model on one rank (the iteration's
    time less its optimizer step, per micro-batch; the slowest concurrent process, which sets the pace of
    synchronous training)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "seq_length", "micro_batch", "vocab", "fwd_bwd_s"):
            _positive(f"measured iteration {name}", getattr(self, name))


@dataclass(kw_only=True)
class ClusterSpec:
    """A cluster as the model sees it: two network tiers, compute, codec kernels, optimizer.

    Bandwidth convention (explicit because it decides every inter-node term): ``intra_bandwidth`` is per rank
    (each GPU's own NVLink/NVSwitch port, not shared); ``inter_bandwidth`` is per *node*, the sum of the node's
    NICs, shared by all of its ranks. A cross-node phase costs (bytes leaving one node) / ``inter_bandwidth``.
    """

    name: str
    """Free-text identifier, printed by the advisor."""
    source: str = ""
    """Where the numbers come from (paper, datasheet, or the calibration run and its date)."""
    nodes: int
    """Number of nodes."""
    ranks_per_node: int
    """Ranks (GPUs, or CPU processes on an emulated cluster) per node."""
    backend: str = "nccl"
    """Collective backend: nccl or gloo. Decides the default of ``reduce_scatter_is_all_reduce``."""
    reduce_scatter_is_all_reduce: bool | None = None
    """True when torch's reduce_scatter_tensor runs as a full ring all-reduce (gloo), so Megatron's baseline
    reduce-scatter costs twice the bytes; default: true for gloo, false for nccl."""
    intra_alpha: float
    """Seconds of latency per step of an intra-node collective (one ring step, one all-to-all peer)."""
    intra_bandwidth: float
    """Bytes/s one rank can send to another rank of its node (per rank, not shared)."""
    inter_alpha: float
    """Seconds of latency per step of a collective step that crosses nodes."""
    inter_bandwidth: float
    """Bytes/s leaving one node, all NICs together, shared by the node's ranks (e.g. 1 x 100 Gbit/s IB =
    12.5e9)."""
    inter_link_efficiency: float = 1.0
    """Achieved / nominal inter-node bandwidth (0 < e <= 1.2), measured by ``tools/calibrate.py`` (TCP over a
    tc-shaped link reaches ~0.9 of its rate). What-if sweeps at a *nominal* link rate (``advise --bandwidth``,
    ``advise.with_inter_bandwidth``) use nominal x efficiency; ``inter_bandwidth`` itself is already achieved."""
    inter_bandwidth_cap: float | None = None
    """Bytes/s per node the inter-node path reaches at most whatever the link's rate: the host's ceiling, measured
    on an emulated cluster with the link unshaped (gloo on shared CPU cores). Caps nominal x efficiency in what-if
    sweeps and is the bandwidth of an unshaped run; None: no cap known."""
    compute_flops: float
    """Achieved FLOP/s of one rank on the model's matmuls (dense fwd/bwd, no communication)."""
    measured_layers: list[MeasuredLayer] = field(default_factory=list)
    """Measured per-layer fwd+bwd times; a workload matching one exactly uses it instead of compute_flops."""
    measured_iterations: list[MeasuredIteration] = field(default_factory=list)
    """Measured no-communication iterations; a workload matching one exactly uses it before measured_layers."""
    gamma: float = 1.0
    """Compute slowdown while communication overlaps it (Agarwal et al.'s gamma, >= 1): backward time with
    concurrent communication / backward time alone."""
    codec_throughput: dict[str, CodecThroughput] = field(default_factory=dict)
    """Per codec name (int8, int4): measured quantize / dequantize throughput."""
    reduce_throughput: float
    """Bytes/s of received uncompressed data summed into an fp32 accumulator (the local reduction of every
    reduce-scatter / all-reduce)."""
    optimizer_params_per_s: float
    """Parameters per second one rank's optimizer step updates (Adam on fp32 main weights; memory-bound)."""
    optimizer_overhead_s: float = 0.0
    """Fixed seconds per optimizer step (grad-norm, clipping, launch overheads)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node", "intra_bandwidth", "inter_bandwidth", "compute_flops", "gamma",
                     "reduce_throughput", "optimizer_params_per_s"):
            _positive(f"cluster {name}", getattr(self, name))
        for name in ("intra_alpha", "inter_alpha", "optimizer_overhead_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"cluster {name}={getattr(self, name)!r} must be >= 0 (seconds)")
        if not 0 < self.inter_link_efficiency <= 1.2:
            raise ValueError(f"cluster inter_link_efficiency={self.inter_link_efficiency!r} must be in (0, 1.2] "
                             "(achieved / nominal bandwidth)")
        if self.inter_bandwidth_cap is not None:
            _positive("cluster inter_bandwidth_cap", self.inter_bandwidth_cap)
        if self.gamma < 1:
            raise ValueError(f"cluster gamma={self.gamma!r} must be >= 1 (a slowdown factor)")
        _choice("cluster backend", self.backend, BACKENDS)
        if self.reduce_scatter_is_all_reduce is None:
            self.reduce_scatter_is_all_reduce = self.backend == "gloo"

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def codec(self, name: str) -> CodecThroughput:
        if name not in self.codec_throughput and name.endswith("+hadamard"):
            # not measured on this cluster: the plain codec's kernels, which underestimates the rotation's cost
            name = name.removesuffix("+hadamard")
        if name not in self.codec_throughput:
            raise ValueError(f"cluster {self.name!r} has no codec_throughput for {name!r}; measured: "
                             f"{', '.join(sorted(self.codec_throughput)) or '(none)'} (tools/bench_codecs.py)")
        return self.codec_throughput[name]


@dataclass(kw_only=True)
class ModelSpec:
    """A GPT (Megatron's ``GPTModel``: learned or rotary positions, pre-LN blocks, tied embeddings)."""

    layers: int
    """Transformer layers."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention heads (for validation; the FLOP count does not depend on it)."""
    seq_length: int
    """Tokens per sequence s."""
    vocab: int
    """Tokenizer vocabulary size, before Megatron pads it."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times TP."""
    ffn_hidden: int | None = None
    """MLP hidden size; default 4h."""
    learned_position_embeddings: bool = True
    """True: an s x h position table (GPT-2/3, Megatron's default); false: rotary (no parameters)."""
    num_experts: int | None = None
    """Mixture of Experts: experts per MoE layer (Megatron's --num-experts); None: a dense model."""
    moe_topk: int = 2
    """Experts each token is routed to (--moe-router-topk)."""
    moe_ffn_hidden: int | None = None
    """Each expert's FFN hidden size (--moe-ffn-hidden-size); default ffn_hidden."""
    moe_layer_freq: int = 1
    """A MoE layer every this many layers, from the first (--moe-layer-freq N); the others are dense."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_length", "vocab", "make_vocab_size_divisible_by",
                     "moe_topk", "moe_layer_freq"):
            _positive(f"model {name}", getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(f"model hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.hidden
        if self.num_experts is not None:
            _positive("model num_experts", self.num_experts)
            if self.moe_topk > self.num_experts:
                raise ValueError(f"model moe_topk={self.moe_topk} exceeds num_experts={self.num_experts}")
            if self.moe_ffn_hidden is None:
                self.moe_ffn_hidden = self.ffn_hidden

    @property
    def moe_layers(self) -> int:
        """MoE layers of the model (0 for a dense one)."""
        if self.num_experts is None:
            return 0
        return sum(1 for i in range(self.layers) if i % self.moe_layer_freq == 0)


@dataclass(kw_only=True)
class LayoutSpec:
    """How the model is trained: batch, parallel sizes, precision, ZeRO mode, buckets, overlap."""

    micro_batch: int
    """Sequences per micro-batch per rank."""
    global_batch: int
    """Sequences per iteration (all data-parallel ranks, all micro-batches)."""
    tp: int = 1
    """Tensor-parallel size (innermost in the rank order, as in Megatron: tp, dp, pp)."""
    pp: int = 1
    """Pipeline-parallel size (outermost); 1F1B schedule."""
    ep: int = 1
    """MoE expert-parallel size: the experts divided over ep ranks (innermost in the expert rank order, expert
    tensor parallelism 1); expert weights replicated over tp x dp / ep ranks (the expert-data-parallel group)."""
    moe_token_dispatcher: str = "allgather"
    """MoE token exchange (--moe-token-dispatcher-type; Megatron's default allgather): ``alltoall`` sends each
    token to its top-k experts' ranks; ``allgather`` gathers every token of the EP group to every member and sums the
    experts' outputs back with a reduce-scatter."""
    dp: int
    """Data-parallel size; tp * pp * dp must equal the cluster's world size."""
    param_bytes: int = 2
    """Bytes per parameter on the wire uncompressed (2: bf16/fp16, 4: fp32); also activations' bytes."""
    grad_bytes: int = 4
    """Bytes per gradient element reduced (4: Megatron's fp32 grad buffers; 2: fp16/bf16 reduction)."""
    zero_mode: str = "distopt"
    """distopt: ZeRO-1/2 distributed optimizer (grad reduce-scatter + param all-gather once per iteration);
    fsdp: ZeRO-3 / Megatron-FSDP (param all-gather in forward and backward, grad reduce-scatter, every
    micro-batch); ddp: plain data parallel (grad all-reduce)."""
    bucket_size: int | None = None
    """Parameters per communication bucket; default Megatron's max(40M, 1M x dp), or one transformer layer
    for fsdp (its per-module units)."""
    overlap_grad_reduce: bool = True
    """Gradient reduction overlaps the backward pass (Megatron --overlap-grad-reduce)."""
    overlap_param_gather: bool = True
    """Parameter all-gathers overlap the forward pass (Megatron --overlap-param-gather / FSDP prefetch);
    for fsdp, also the backward gathers."""
    activation_recompute: bool = False
    """Full activation recomputation (one more forward per layer in the backward pass)."""
    compressed_reduce_overlaps: bool = True
    """False models megatron_zpp's current Megatron-FSDP path, where a compressed (qgZ) reduce-scatter is
    issued synchronously, so it is not hidden behind the backward pass."""

    def __post_init__(self) -> None:
        for name in ("micro_batch", "global_batch", "tp", "pp", "dp", "ep"):
            _positive(f"layout {name}", getattr(self, name))
        if (self.tp * self.dp) % self.ep:
            raise ValueError(f"layout ep={self.ep} must divide tp x dp = {self.tp * self.dp} (the ranks of a pipeline "
                             "stage)")
        _choice("layout zero_mode", self.zero_mode, ZERO_MODES)
        _choice("layout moe_token_dispatcher", self.moe_token_dispatcher, MOE_TOKEN_DISPATCHERS)
        for name in ("param_bytes", "grad_bytes"):
            _choice(f"layout {name}", getattr(self, name), (2, 4))
        if self.global_batch % (self.micro_batch * self.dp):
            raise ValueError(f"layout global_batch={self.global_batch} is not a multiple of micro_batch x dp = "
                             f"{self.micro_batch} x {self.dp}")
        if self.bucket_size is not None:
            _positive("layout bucket_size", self.bucket_size)

    @property
    def microbatches(self) -> int:
        """Micro-batches per iteration per data-parallel rank."""
        return self.global_batch // (self.micro_batch * self.dp)


@dataclass(kw_only=True)
class WorkloadSpec:
    """A training job: a model and its layout."""

    name: str
    """Free-text identifier, printed by the advisor."""
    model: ModelSpec
    """The GPT's shape."""
    layout: LayoutSpec
    """Batch, parallel sizes, precision, ZeRO mode."""


# ---------------------------------------------------------------------------------------------- YAML


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read a cluster YAML (schema: ``ClusterSpec``'s fields; see ``configs/clusters/``)."""
    return from_dict(ClusterSpec, _read_yaml(path), f"cluster file {path}")


def load_workload(path: str | Path) -> WorkloadSpec:
    """Read a workload YAML (``name``, ``model:`` ModelSpec, ``layout:`` LayoutSpec)."""
    return from_dict(WorkloadSpec, _read_yaml(path), f"workload file {path}")


def _read_yaml(path: str | Path) -> dict:
    import yaml  # a core dependency; imported here to keep `import megatron_zpp.perfmodel` light

    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping, got {type(data).__name__}")
    return data


def from_dict(cls: type, data: dict, where: str):
    """Build dataclass ``cls`` from ``data``, strictly: unknown keys, missing fields and bad types raise
    ``ValueError`` naming the value and what is valid. Nested dataclasses, lists and dicts of them work."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {', '.join(fields)}")
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; required: {', '.join(required)}")
    values = {name: _convert(hints[name], raw, f"{where}: {name}") for name, raw in data.items()}
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _convert(annotation, raw, where: str):
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        (annotation,) = [a for a in args if a is not type(None)]
        return _convert(annotation, raw, where)
    if origin is list:
        if not isinstance(raw, list):
            raise ValueError(f"{where}={raw!r} must be a list")
        return [_convert(args[0], item, f"{where}[{i}]") for i, item in enumerate(raw)]
    if origin is dict:
        if not isinstance(raw, dict):
            raise ValueError(f"{where}={raw!r} must be a mapping")
        return {str(k): _convert(args[1], v, f"{where}.{k}") for k, v in raw.items()}
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, raw, where)
    if annotation is bool:
        if not isinstance(raw, bool):
            raise ValueError(f"{where}={raw!r} must be true or false")
        return raw
    if annotation is int:
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise ValueError(f"{where}={raw!r} must be an integer")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{where}={raw!r} must be an integer") from None
        if not value.is_integer():
            raise ValueError(f"{where}={raw!r} must be an integer")
        return int(value)
    if annotation is float:
        if isinstance(raw, bool):
            raise ValueError(f"{where}={raw!r} must be a number")
        try:
            return float(raw)  # YAML 1.1 reads 12.5e9 as a string
        except (TypeError, ValueError):
            raise ValueError(f"{where}={raw!r} must be a number") from None
    if annotation is str:
        if not isinstance(raw, str):
            raise ValueError(f"{where}={raw!r} must be a string")
        return raw
    return raw


def _positive(what: str, value) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{what}={value!r} must be a positive finite number")


def _choice(what: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{what}={value!r} is not valid; valid: {', '.join(map(str, choices))}")
