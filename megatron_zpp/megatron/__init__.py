"""Megatron-Core integration (layer 4): install a compression policy into megatron.core's collectives.

For users of Megatron-LM's own ``pretrain_gpt.py``::

    from megatron_zpp.megatron import zpp_extra_args_provider, install_from_args
    args = parse_and_validate_args(extra_args_provider=zpp_extra_args_provider)
    install_from_args(args)   # before pretrain() builds DDP and the optimizer

The CPU shim (``cpu_shim.py``) is only for machines without a GPU.
"""

from megatron_zpp.megatron.hooks import MegatronHooks
from megatron_zpp.policy import add_zpp_args, check_policy_agreement, resolve_policy, zpp_config_from_args


def zpp_extra_args_provider(parser):
    """Megatron-LM ``extra_args_provider``: adds the ``--zpp-*`` flags."""
    return add_zpp_args(parser)


def install_from_args(args) -> MegatronHooks:
    """Resolve the policy from parsed ``--zpp-*`` args, check it across ranks, install the hooks."""
    policy = resolve_policy(zpp_config_from_args(args))
    check_policy_agreement(policy)
    return MegatronHooks(policy, ranks_per_node=args.zpp_ranks_per_node).install()


__all__ = ["MegatronHooks", "install_from_args", "zpp_extra_args_provider"]
