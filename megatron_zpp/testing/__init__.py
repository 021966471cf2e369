"""Test and benchmark support: multi-process gloo runs on one box (simulated nodes).

Never imported by the training path.
"""

from megatron_zpp.testing.spawn import run_distributed

__all__ = ["run_distributed"]
