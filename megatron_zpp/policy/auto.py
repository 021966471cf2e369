"""``--zpp-policy auto``'s choices, as data: its flags, what ``--zpp-auto-allow`` permits, the candidate policies.

The controller that measures, decides and switches is ``megatron_zpp/training/auto_policy.py``; this part is
what the hooks need before training starts (which tensor- / pipeline-parallel codec to install so that auto can
switch it on) and what tests enumerate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_zpp.policy.errors import ConfigError

AUTO = "auto"
ALLOW = ("lossy-grad", "lossy-param", "lossless-tp", "lossless-pp", "lossy-tp", "lossy-pp")
DEFAULT_ALLOW = "lossy-grad,lossy-param,lossless-tp,lossless-pp"
LOSSLESS_MP = "mpc"  # lossless on CPU and CUDA, exact (the hybrid presets' tp/pp codec)
LOSSY_MP = "zfp:rate=16"  # high-rate ZFP (MVAPICH's ZHybrid choice for activations)
START = "none"


@dataclass(kw_only=True)
class AutoPolicyConfig:
    allow: str = DEFAULT_ALLOW
    """What --zpp-policy auto may choose, comma-separated: lossy-grad (qgZ INT4, or the two-level Hadamard
    INT8/INT4 gradients), lossy-param (qwZ INT8 weights, or 4-bit weight differences), lossless-tp / lossless-pp
    (MPC on tensor- / pipeline-parallel activations), lossy-tp / lossy-pp (ZFP rate 16 there); 'none' allows only
    uncompressed policies (Megatron's collectives or the hierarchical ones)."""
    calibration_s: float = 8.0
    """Seconds the startup calibration may take, all ranks together (network fits, codec kernels, optimizer)."""
    warmup_iters: int = 4
    """Iterations trained before the choice, with the provisional pick (measured links, a matmul's rate as
    compute); all but the first are the measured compute."""
    recheck_interval: int = 20
    """Every this many iterations compare the measured step time with the prediction (0: never re-check)."""
    recheck_tolerance: float = 0.2
    """A drift of measured / predicted step time beyond this fraction (against the ratio at the choice) means
    the link changed: re-measure it and re-rank."""
    hysteresis: float = 0.05
    """After a re-measure, switch only to a policy predicted faster than the running one by more than this (and by
    enough to repay a switch into 4-bit weight differences before the run ends)."""
    explore_margin: float = 0.05
    """When runners-up are predicted within this fraction of the choice, also run two of them (once per decision;
    the best of each other gradient scheme first, then the closest; with the best uncompressed one, see
    --zpp-auto-explore-baseline-margin; within --zpp-auto-explore-share of the run) and keep the one measured
    fastest (at startup, the warm-up's measurement counts too), subject to --zpp-auto-explore-keep-margin."""
    explore_baseline_margin: float = 0.3
    """Also run the best uncompressed candidate when the choice compresses and is predicted less than this fraction
    faster (the model underrates codec costs on fast links); 0: only the explore-margin runners-up."""
    explore_iters: int = 4
    """Iterations each policy runs when exploring (the first after a switch is not timed)."""
    explore_share: float = 0.1
    """The share of the iterations left (--train-iters, --exit-interval) that exploring runners-up may take: on a
    run of thousands of iterations every close runner-up runs; on a short one, where their slower windows would
    cost more than a better pick can repay, few or none (the model's choice is kept)."""
    explore_keep_margin: float = 0.01
    """At the end of an exploration, leave the policy running then only for one measured faster by more than this
    fraction, net of that switch's one-off cost spread over the iterations left (--train-iters, --exit-interval).
    Only a switch into 4-bit weight differences from another weight scheme has one: an uncompressed gather of the
    weights (priced by the model on the measured link, or the largest measured on this link if more; 750 ms at
    100 Mbit/s on the emulated cluster). One window of a few iterations of one policy varies by about 1.4% there:
    a switch taken on noise costs at most one switch."""
    cluster_yaml: str = ""
    """Where rank 0 writes the calibrated cluster YAML (default: zpp-auto-cluster.yaml in --save, else in the
    system temp directory; the path is logged)."""
    script: str = ""
    """Tests and experiments: 'ITER:POLICY,...' switches to these presets (none, fair, zeropp, sdp4bit, hybrid,
    ...) before these 1-based iterations instead of calibrating and deciding."""


def add_auto_args(parser) -> None:
    from megatron_zpp.policy.cli import add_dataclass_args

    add_dataclass_args(parser, AutoPolicyConfig, "zpp-auto", "megatron_zpp --zpp-policy auto")


def auto_config_from_args(args) -> AutoPolicyConfig:
    from megatron_zpp.policy.cli import dataclass_from_args

    config = dataclass_from_args(AutoPolicyConfig, args, "zpp_auto")
    parse_allow(config.allow)
    parse_script(config.script)
    for name in ("warmup_iters", "explore_iters"):
        if getattr(config, name) < 2:
            raise ConfigError(f"--zpp-auto-{name.replace('_', '-')} {getattr(config, name)} must be >= 2 (the first "
                              "iteration after a switch is not timed)")
    if config.recheck_interval < 0:
        raise ConfigError(f"--zpp-auto-recheck-interval {config.recheck_interval} must be >= 0 (0: never)")
    if config.recheck_interval and config.recheck_interval < config.explore_iters:
        raise ConfigError(f"--zpp-auto-recheck-interval {config.recheck_interval} must be 0 or at least "
                          f"--zpp-auto-explore-iters {config.explore_iters}")
    if not 0 < config.calibration_s <= 600:
        raise ConfigError(f"--zpp-auto-calibration-s {config.calibration_s} must be in (0, 600] seconds")
    for name in ("recheck_tolerance", "hysteresis", "explore_margin", "explore_baseline_margin", "explore_keep_margin",
                 "explore_share"):
        if not 0 <= getattr(config, name) < 1:
            raise ConfigError(f"--zpp-auto-{name.replace('_', '-')} {getattr(config, name)} must be in [0, 1)")
    return config


def parse_allow(text: str) -> frozenset[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if items == ["none"]:
        return frozenset()
    bad = [x for x in items if x not in ALLOW]
    if bad or not items:
        raise ConfigError(f"--zpp-auto-allow {text!r}: {'unknown ' + ', '.join(map(repr, bad)) if bad else 'empty'}; "
                          f"valid: a comma-separated subset of {', '.join(ALLOW)}, or none")
    return frozenset(items)


def parse_script(text: str) -> dict[int, str]:
    from megatron_zpp.policy.policy import available_presets

    out: dict[int, str] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        it, _, name = item.partition(":")
        if not it.isdigit() or int(it) < 1 or name not in available_presets():
            raise ConfigError(f"--zpp-auto-script item {item!r} must be ITER:PRESET with ITER >= 1 and PRESET one of "
                              f"{', '.join(available_presets())}")
        out[int(it)] = name
    return out


# ---------------------------------------------------------------------------------------------- candidates


def candidates(allow: frozenset[str], *, zero_mode: str, tp: int, pp: int, ranks_per_node: int | None,
               nodes_ranks: int = 2, error_feedback: bool = False) -> list:
    """The policies auto ranks: every combination of a gradient scheme (none, zeropp's qgZ, sdp4bit's two-level
    Hadamard), a weight scheme (none, zeropp's INT8 qwZ, sdp4bit's 4-bit differences), who runs the uncompressed
    DP collectives (Megatron, or the hierarchical algorithms of ``fair``) and, with TP / PP > 1, their codecs,
    within ``allow`` (one codec per model-parallel dimension: :func:`model_parallel_codecs`). Combinations equal to a preset carry its name (none, fair, zeropp, sdp4bit). On
    Megatron-FSDP compressed weights use hpZ over the node (qWD needs it; ``nodes_ranks`` = ranks per node)."""
    from megatron_zpp.policy.config import ZppConfig
    from megatron_zpp.policy.policy import resolve_policy

    fair = resolve_policy(ZppConfig(policy="fair"))
    zeropp = resolve_policy(ZppConfig(policy="zeropp"))
    sdp = resolve_policy(ZppConfig(policy="sdp4bit"))
    grads = [("", "none", None)]
    params = [("", "none", False)]
    if "lossy-grad" in allow:
        grads += [("qgz", zeropp.codec("dp.grad"), zeropp.dp_grad_intra), ("qgz-h", sdp.codec("dp.grad"), sdp.dp_grad_intra)]
    if "lossy-param" in allow:
        params += [("qwz", zeropp.codec("dp.param"), False)]
        if zero_mode != "fsdp" or nodes_ranks > 1:
            params += [("qwd", sdp.codec("dp.param"), True)]
    installed = model_parallel_codecs(allow)
    mp = {dim: ["none"] + ([installed[dim]] if size > 1 and installed[dim] != "none" else [])
          for dim, size in (("tp", tp), ("pp", pp))}
    out = []
    for gname, gcodec, intra in grads:
        for pname, pcodec, difference in params:
            routes = ("megatron", "hierarchical") if "none" in (gcodec, pcodec) else ("megatron",)
            for route in routes:
                for tcodec in mp["tp"]:
                    for pcodec_pp in mp["pp"]:
                        hpz = None if zero_mode == "fsdp" and pcodec != "none" and nodes_ranks > 1 else 1
                        # the ep dimension (MoE) stays as the user runs it: none (auto does not choose it)
                        codecs = fair.codecs | {"dp.grad": gcodec, "dp.param": pcodec, "tp": tcodec, "pp": pcodec_pp}
                        name = _name(gname, pname, route, tcodec, pcodec_pp)
                        out.append(dataclasses.replace(
                            fair, name=name, codecs=codecs, dp_grad_intra=intra, hpz_size=hpz, ranks_per_node=ranks_per_node,
                            dp_uncompressed=route, error_feedback=error_feedback and gcodec != "none",
                            param_difference=difference, description=f"--zpp-policy auto candidate {name}"))
    return out


def model_parallel_codecs(allow: frozenset[str]) -> dict[str, str]:
    """The tensor- / pipeline-parallel codec auto may switch on (the hooks install it, off until chosen): lossless
    MPC where ``lossless-tp`` / ``lossless-pp`` is allowed, else high-rate ZFP where the lossy one is, else none."""
    from megatron_zpp.compression import get_codec

    return {dim: get_codec(LOSSLESS_MP).spec if f"lossless-{dim}" in allow else get_codec(LOSSY_MP).spec
            if f"lossy-{dim}" in allow else "none" for dim in ("tp", "pp")}


def _name(grad: str, param: str, route: str, tp: str, pp: str) -> str:
    preset = {("", "", "megatron"): "none", ("", "", "hierarchical"): "fair", ("qgz", "qwz", "megatron"): "zeropp",
              ("qgz-h", "qwd", "megatron"): "sdp4bit"}.get((grad, param, route))
    parts = [preset] if preset else [p for p in (grad, param) if p] + (["hier"] if route == "hierarchical" else [])
    parts += [f"{dim}:{codec.split(':')[0]}" for dim, codec in (("tp", tp), ("pp", pp)) if codec != "none"]
    return "+".join(parts)


def preset_for_job(name: str, *, zero_mode: str, ranks_per_node: int | None, nodes_ranks: int):
    """A preset as auto runs it on this job (``--zpp-auto-script``): hpZ only on Megatron-FSDP with compressed
    weights and several ranks per node (the candidates' rule)."""
    from megatron_zpp.policy.config import ZppConfig
    from megatron_zpp.policy.policy import resolve_policy

    from megatron_zpp.policy.policy import EP_DIMENSIONS

    p = resolve_policy(ZppConfig(policy=name))
    hpz = None if zero_mode == "fsdp" and p.codec("dp.param") != "none" and nodes_ranks > 1 else 1
    # the ep dimension stays none under auto, as in its candidates (a hybrid preset's MPC on MoE tokens included)
    return dataclasses.replace(p, codecs=p.codecs | {d: "none" for d in EP_DIMENSIONS}, hpz_size=hpz,
                               ranks_per_node=ranks_per_node)
