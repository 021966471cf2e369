"""Compression policy (layer 3): parallel dimension -> codec, presets, cross-rank agreement. Data, not wiring.

    from megatron_zpp.policy import ZppConfig, resolve_policy
    policy = resolve_policy(ZppConfig(policy="zeropp", dp_grad="int4:block=64"))
    policy.codec("dp.grad")   # 'int4:block=64,rounding=nearest,seed=0'
"""

from megatron_zpp.policy.cli import add_dataclass_args, dataclass_from_args, field_docs
from megatron_zpp.policy.config import ZppConfig
from megatron_zpp.policy.errors import ConfigError
from megatron_zpp.policy.policy import (DIMENSIONS, EP_DIMENSIONS, Policy, available_presets, check_policy_agreement,
                                        check_policy_devices,
                                        resolve_policy)


def add_zpp_args(parser):
    """The ``--zpp-*`` flags, generated from ``ZppConfig`` (usable as Megatron's ``extra_args_provider``)."""
    add_dataclass_args(parser, ZppConfig, "zpp", "megatron_zpp compression")
    return parser


def zpp_config_from_args(args) -> ZppConfig:
    return dataclass_from_args(ZppConfig, args, "zpp")


__all__ = ["DIMENSIONS", "EP_DIMENSIONS", "ConfigError", "Policy", "ZppConfig", "add_zpp_args", "available_presets",
           "check_policy_agreement", "check_policy_devices", "field_docs", "resolve_policy", "zpp_config_from_args"]
