"""Resolve a ``ZppConfig`` into a ``Policy``: parallel dimension -> codec spec, plus hop settings.

A policy is data: YAML presets in ``configs/policies/`` (or a user's file), overridden per
dimension from the command line, validated against the codec registry and checked once at
start-up to be identical on every rank.

YAML keys::

    codecs:            {dp.grad: SPEC, dp.param: SPEC, tp: SPEC, pp: SPEC, ep.dispatch: SPEC,
                        ep.dispatch.grad: SPEC, ep.combine: SPEC, ep.combine.grad: SPEC}   (missing = none)
    dp_grad_intra:     SPEC or null     qgZ intra-node hop codec (default: dp.grad's)
    hpz_size:          INT or "node"    hpZ secondary partition size (ZeRO-3 only; 1 = off)
    qgz_stages:        INT              pipelined hops (Algorithm 2)
    dp_grad_until:     FLOAT in (0, 1]  compress dp.grad for this fraction of the iterations
    dp_uncompressed:   megatron | hierarchical   who runs DP collectives whose codec is none
    error_feedback:    BOOL             error feedback on a lossy dp.grad codec (default false)
    dp_param_difference: BOOL           qWD: gather weight differences with the dp.param codec (default false)
    dp_param_resync_interval: INT       with qWD, a full-precision gather every N iterations (0: at start and
                                        after a checkpoint load only)
    description:       free text

DeepSpeed's ZeRO++ keys are accepted as aliases: ``zero_quantized_weights: true`` (dp.param
int8:block=256), ``zero_quantized_gradients: true`` (dp.grad int4:block=128),
``zero_hpz_partition_size: N`` (hpz_size).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from megatron_zpp.compression import get_codec
from megatron_zpp.policy.config import ZppConfig
from megatron_zpp.policy.errors import ConfigError

DIMENSIONS = ("dp.grad", "dp.param", "tp", "pp", "ep.dispatch", "ep.dispatch.grad", "ep.combine", "ep.combine.grad")
EP_DIMENSIONS = DIMENSIONS[4:]  # MoE token dispatch / combine all-to-alls, forward and backward
PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "policies"
ZEROPP_WEIGHTS, ZEROPP_GRADS = "int8:block=256", "int4:block=128"
_YAML_KEYS = ("codecs", "dp_grad_intra", "hpz_size", "qgz_stages", "dp_grad_until", "dp_uncompressed", "error_feedback",
              "dp_param_difference", "dp_param_resync_interval", "description",
              "zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")
# Codecs with fused kernels: the only ones hpZ's secondary partition and qgZ's pipelined stages take
# (any registered codec runs on every dimension otherwise: comm/any_codec.py).
BLOCKWISE_CODECS = ("none", "int8", "int4")
# Who runs an uncompressed data-parallel collective (see ZppConfig.dp_uncompressed).
DP_UNCOMPRESSED = ("megatron", "hierarchical")


@dataclass(frozen=True)
class Policy:
    """A resolved policy; ``codecs`` maps every dimension of ``DIMENSIONS`` to a canonical spec."""

    name: str
    codecs: dict[str, str] = field(default_factory=dict)
    dp_grad_intra: str | None = None
    hpz_size: int | None = 1  # 1: off; None: the whole node
    ranks_per_node: int | None = None
    qgz_stages: int = 1
    dp_grad_until: float = 1.0
    dp_uncompressed: str = "megatron"
    error_feedback: bool = False
    param_difference: bool = False  # qWD: dp.param gathers weight differences (distributed optimizer)
    param_resync_interval: int = 0  # qWD: full-precision gather every N iterations (0: start and load only)
    description: str = ""

    def codec(self, dimension: str) -> str:
        return self.codecs[dimension]

    def compresses(self, dimension: str) -> bool:
        return self.codecs[dimension] != "none"

    @property
    def weight_scheme(self) -> tuple:
        """What the replicas' weights are gathered with (dp.param codec, qWD, hpZ size): a switch that changes it
        drops the held copies (qWD's shards, hpZ's secondary copy); a qWD scheme starts again from a full-precision
        gather."""
        return self.codecs["dp.param"], self.param_difference, self.hpz_size

    @property
    def is_identity(self) -> bool:
        """Whether installing the policy leaves Megatron's training bit-identical."""
        return all(c == "none" for c in self.codecs.values()) and self.dp_uncompressed == "megatron"

    def hpz_partition(self, node_size: int) -> int:
        """The hpZ secondary partition of a data-parallel group with ``node_size`` members per node: ``hpz_size``
        (``None``: the node), or where the group cannot hold it (an MoE expert-data-parallel group often has fewer
        members per node than the dense one) the largest partition both allow, their gcd. 1 means no secondary
        copy for that group: hpZ over one rank would hold every shard, and ZeRO++'s partition of 1 is hpZ off. The
        one rule for the hooks (``MegatronHooks.topology``) and the performance model."""
        if self.hpz_size == 1:
            return 1
        return node_size if self.hpz_size is None else math.gcd(self.hpz_size, node_size)

    def summary(self) -> str:
        """One line for the startup log: every dimension's codec, then each knob that is not its default (the
        intra-node hop, hpZ, qWD), so a log says everything the run's traffic depends on."""
        parts = [f"{d}={c}" for d, c in self.codecs.items()]
        if self.dp_grad_intra is not None and self.dp_grad_intra != self.codecs["dp.grad"]:
            parts.insert(1, f"dp.grad.intra={self.dp_grad_intra}")
        if self.hpz_size != 1:
            parts.append(f"hpz_size={'node' if self.hpz_size is None else self.hpz_size}")
        if self.qgz_stages != 1:
            parts.append(f"qgz_stages={self.qgz_stages}")
        if self.dp_grad_until != 1.0:
            parts.append(f"dp_grad_until={self.dp_grad_until}")
        if self.dp_uncompressed != "megatron":
            parts.append(f"dp_uncompressed={self.dp_uncompressed}")
        if self.error_feedback:
            parts.append("error_feedback")
        if self.param_difference:
            n = self.param_resync_interval
            parts.append(f"param_difference (exact resync {f'every {n} iterations and ' if n else ''}at start and load)")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("description")
        return d


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _load_yaml(policy: str) -> tuple[str, dict]:
    import yaml  # a core dependency; imported here to keep `import megatron_zpp` light

    path = Path(policy)
    if policy in available_presets():
        path = PRESET_DIR / f"{policy}.yaml"
    elif not (path.suffix in (".yaml", ".yml") and path.is_file()):
        raise ConfigError(f"policy {policy!r} is neither a preset ({', '.join(available_presets())}), auto, "
                          f"nor an existing .yaml file")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"policy file {path} must hold a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_YAML_KEYS))
    if unknown:
        raise ConfigError(f"policy file {path}: unknown key(s) {unknown}; valid: {', '.join(_YAML_KEYS)}")
    return path.stem, data


def _canonical(spec, where: str, allowed: tuple[str, ...] | None = None) -> str:
    if spec is None or spec is False:
        return "none"
    if not isinstance(spec, str):
        raise ConfigError(f"{where}: codec must be a spec string like 'int8:block=256', got {spec!r}")
    try:
        codec = get_codec(spec)
    except ValueError as e:  # names the bad codec or parameter and the valid ones: the user's spec, not a bug
        raise ConfigError(f"{where}: {e}") from None
    name = codec.spec.split(":")[0]
    if allowed is not None and name not in allowed:
        raise ConfigError(f"{where}: codec {spec!r} cannot run on this dimension; valid: {', '.join(allowed)}")
    return codec.spec


def _is_int(value) -> bool:
    """An integer, not a bool: YAML reads ``true`` as a bool, which Python counts as the int 1, so
    ``qgz_stages: true`` would otherwise pass as one stage."""
    return isinstance(value, int) and not isinstance(value, bool)


def _family(spec: str) -> str:
    return spec.split(":")[0]


def resolve_policy(config: ZppConfig) -> Policy:
    """Preset/YAML, then aliases, then command-line overrides; every spec validated. ``auto`` resolves to the
    ``none`` preset named ``auto``, the policy it starts from (``megatron_zpp/training/auto_policy.py``)."""
    if config.policy == "auto":
        chosen = [f"--zpp-{f.name.replace('_', '-')}" for f in dataclasses.fields(config)
                  if f.name not in ("policy", "ranks_per_node", "dp_grad_error_feedback")
                  and getattr(config, f.name) is not None]
        if chosen:
            raise ConfigError(f"--zpp-policy auto chooses the codecs itself; drop {', '.join(chosen)} (or pick a "
                              f"fixed policy: {', '.join(available_presets())}), and limit its choices with "
                              "--zpp-auto-allow")
        start = resolve_policy(dataclasses.replace(config, policy="none", dp_grad_error_feedback=None))
        return dataclasses.replace(start, name="auto", error_feedback=bool(config.dp_grad_error_feedback),
                                   description="--zpp-policy auto: starts uncompressed, then runs its choice")
    name, data = _load_yaml(config.policy)
    if not isinstance(data.get("codecs") or {}, dict):
        raise ConfigError(f"policy {name!r}: codecs must be a mapping of dimension to codec spec (e.g. dp.grad: "
                          f"int4:block=128), got {data['codecs']!r}; valid dimensions: {', '.join(DIMENSIONS)}")
    codecs_raw = dict(data.get("codecs") or {})
    unknown = sorted(set(codecs_raw) - set(DIMENSIONS))
    if unknown:
        raise ConfigError(f"policy {name!r}: unknown dimension(s) {unknown}; valid: {', '.join(DIMENSIONS)}")
    if data.get("zero_quantized_weights"):
        codecs_raw.setdefault("dp.param", ZEROPP_WEIGHTS)
    if data.get("zero_quantized_gradients"):
        codecs_raw.setdefault("dp.grad", ZEROPP_GRADS)
    hpz = data.get("hpz_size", data.get("zero_hpz_partition_size", 1))  # absent: hpZ off
    overrides = {"dp.grad": config.dp_grad, "dp.param": config.dp_param, "tp": config.tp, "pp": config.pp,
                 "ep.dispatch": config.ep_dispatch, "ep.dispatch.grad": config.ep_dispatch_grad,
                 "ep.combine": config.ep_combine, "ep.combine.grad": config.ep_combine_grad}
    for dim, spec in overrides.items():
        if spec is not None:
            codecs_raw[dim] = spec
    codecs = {dim: _canonical(codecs_raw.get(dim), f"policy {name!r} {dim}") for dim in DIMENSIONS}
    intra = config.dp_grad_intra if config.dp_grad_intra is not None else data.get("dp_grad_intra")
    intra = None if intra in (None, "none") and codecs["dp.grad"] == "none" else intra
    if intra is not None:
        intra = _canonical(intra, f"policy {name!r} dp_grad_intra")
        if (intra == "none") != (codecs["dp.grad"] == "none"):
            raise ConfigError(f"policy {name!r}: dp_grad_intra={intra!r} and dp.grad={codecs['dp.grad']!r} must "
                              "both be none or both compressing")
    if config.hpz_size is not None:
        hpz = config.hpz_size
    if hpz == "node":
        hpz = None
    if hpz is not None and (not _is_int(hpz) or hpz < 1):
        raise ConfigError(f"policy {name!r}: hpz_size={hpz!r} must be a positive integer or 'node'")
    stages = config.qgz_stages if config.qgz_stages is not None else data.get("qgz_stages", 1)
    if not _is_int(stages) or stages < 1:
        raise ConfigError(f"policy {name!r}: qgz_stages={stages!r} must be a positive integer")
    if intra is not None and intra != "none" and \
            (_family(intra) in BLOCKWISE_CODECS) != (_family(codecs["dp.grad"]) in BLOCKWISE_CODECS):
        # the two hops run on one path: the fused kernels, or the codec interface (comm/any_codec.py)
        raise ConfigError(f"policy {name!r}: dp_grad_intra={intra!r} and dp.grad={codecs['dp.grad']!r} must both "
                          f"be blockwise ({', '.join(BLOCKWISE_CODECS[1:])}) or both not")
    if intra is not None and intra != "none" and _family(intra) in BLOCKWISE_CODECS[1:] and \
            _family(codecs["dp.grad"]) in BLOCKWISE_CODECS[1:]:
        run, block = get_codec(intra).hadamard, get_codec(codecs["dp.grad"]).block
        if run and block % run:
            # qgZ rotates the node's partial sums back one inter-node block at a time (reduce_scatter.py)
            raise ConfigError(f"policy {name!r}: dp_grad_intra={intra!r} rotates runs of {run}, which must divide "
                              f"dp.grad's block {block} ({codecs['dp.grad']!r}); use hadamard= a divisor of {block}")
    if hpz != 1 and _family(codecs["dp.param"]) not in BLOCKWISE_CODECS:
        raise ConfigError(f"policy {name!r}: hpz_size={'node' if hpz is None else hpz} keeps the weight gather's "
                          f"packed rows, which needs dp.param in {', '.join(BLOCKWISE_CODECS)}; dp.param is "
                          f"{codecs['dp.param']!r} (set --zpp-hpz-size 1 to turn hpZ off)")
    if stages != 1 and any(_family(c) not in BLOCKWISE_CODECS for c in (codecs["dp.grad"], intra) if c):
        raise ConfigError(f"policy {name!r}: qgz_stages={stages} needs dp.grad codecs in "
                          f"{', '.join(BLOCKWISE_CODECS)}; dp.grad is {codecs['dp.grad']!r}, dp_grad_intra {intra!r}")
    until = config.dp_grad_until if config.dp_grad_until is not None else data.get("dp_grad_until", 1.0)
    if isinstance(until, bool) or not isinstance(until, (int, float)) or not 0 < until <= 1:
        raise ConfigError(f"policy {name!r}: dp_grad_until={until!r} must be in (0, 1]")
    route = config.dp_uncompressed if config.dp_uncompressed is not None else data.get("dp_uncompressed",
                                                                                          "megatron")
    if route not in DP_UNCOMPRESSED:
        raise ConfigError(f"policy {name!r}: dp_uncompressed={route!r}; valid: {', '.join(DP_UNCOMPRESSED)}")
    feedback = config.dp_grad_error_feedback
    if feedback is None:
        feedback = data.get("error_feedback", False)
    if not isinstance(feedback, bool):
        raise ConfigError(f"policy {name!r}: error_feedback={feedback!r} must be true or false")
    if feedback and (codecs["dp.grad"] == "none" or get_codec(codecs["dp.grad"]).lossless):
        raise ConfigError(f"policy {name!r}: error feedback needs a lossy dp.grad codec (int8, int4, zfp); "
                          f"dp.grad is {codecs['dp.grad']!r}")
    difference = config.dp_param_difference
    if difference is None:
        difference = data.get("dp_param_difference", False)
    if not isinstance(difference, bool):
        raise ConfigError(f"policy {name!r}: dp_param_difference={difference!r} must be true or false")
    if difference and _family(codecs["dp.param"]) not in BLOCKWISE_CODECS[1:]:
        raise ConfigError(f"policy {name!r}: dp_param_difference gathers weight differences with a blockwise "
                          f"dp.param codec; valid: {', '.join(BLOCKWISE_CODECS[1:])} (e.g. int4:block=2048), "
                          f"dp.param is {codecs['dp.param']!r}")
    resync = config.dp_param_resync_interval
    if resync is None:
        resync = data.get("dp_param_resync_interval", 0)
    if not _is_int(resync) or resync < 0:
        raise ConfigError(f"policy {name!r}: dp_param_resync_interval={resync!r} must be an integer >= 0")
    if resync and not difference:
        raise ConfigError(f"policy {name!r}: dp_param_resync_interval={resync} resyncs weight differences; it needs "
                          "dp_param_difference (--zpp-dp-param-difference)")
    rpn = config.ranks_per_node
    if rpn is not None and rpn < 1:
        raise ConfigError(f"--zpp-ranks-per-node={rpn} must be a positive integer")
    return Policy(name=name, codecs=codecs, dp_grad_intra=intra, hpz_size=hpz, ranks_per_node=rpn,
                  qgz_stages=stages, dp_grad_until=float(until), dp_uncompressed=route, error_feedback=feedback,
                  param_difference=difference, param_resync_interval=resync, description=str(data.get("description", "")))


def check_policy_devices(policy: Policy, device_type: str) -> None:
    """Fail, naming the dimension, if a codec of ``policy`` cannot run on ``device_type`` ("cpu"/"cuda")."""
    for dim, spec in policy.codecs.items():
        codec = get_codec(spec)
        if device_type not in codec.devices:
            raise ConfigError(f"policy {policy.name!r} {dim}: codec {spec!r} runs on {', '.join(codec.devices)} "
                             f"tensors, and this run's are on {device_type}; pick another codec for {dim} "
                             "(e.g. mpc, lossless on CPU and CUDA)")


def check_policy_agreement(policy: Policy, group=None) -> None:
    """Fail on every rank, naming the differing fields, unless all ranks resolved the same policy."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, policy.to_dict(), group=group)
    mine = everyone[0]
    diffs = []
    for rank, other in enumerate(everyone):
        for key in mine:
            if other.get(key) != mine.get(key):
                diffs.append(f"{key}: rank 0 has {mine.get(key)!r}, rank {rank} has {other.get(key)!r}")
    if diffs:
        raise ConfigError("compression policy differs across ranks (every rank must pass the same --zpp-* "
                          "flags and policy file): " + "; ".join(diffs))
