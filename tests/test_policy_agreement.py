"""Where the policy is checked across ranks (issue 21 review): at a point every rank reaches together, never
from a routed collective, which pipeline stages reach at different times."""

import datetime
import os

import pytest
import torch.distributed as dist

from megatron_zpp.testing import run_distributed


def _hooks(rank: int):
    from megatron_zpp.megatron import MegatronHooks
    from megatron_zpp.policy import ZppConfig, resolve_policy

    # rank 1 passed another --zpp-dp-grad than rank 0
    spec = "int4:block=128" if rank == 0 else "int8:block=256"
    return MegatronHooks(resolve_policy(ZppConfig(policy="zeropp", dp_grad=spec)), ranks_per_node=1)


def _install_when_initialized_worker() -> dict:
    from megatron_zpp.megatron import hooks as hooks_module

    hooks = _hooks(dist.get_rank())
    try:
        hooks.install()
        return {"error": None}
    except ValueError as exc:
        return {"error": str(exc), "active": hooks_module._ACTIVE is not None, "installed": hooks.installed}


def _install_before_initialize_worker(store_dir: str) -> dict:
    """As under Megatron-LM: hooks installed before torch.distributed exists; the check runs right after
    Megatron's initialize_model_parallel; sync_iteration, on one rank alone, communicates nothing."""
    from megatron.core import parallel_state

    rank, size = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    original = parallel_state.initialize_model_parallel
    hooks = _hooks(rank).install()
    patched = parallel_state.initialize_model_parallel is not original
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store2", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    if rank == 0:
        hooks.sync_iteration()  # alone: a world collective here would wait for rank 1 until the timeout
    dist.barrier()
    try:
        parallel_state.initialize_model_parallel()
        error = None
    except ValueError as exc:
        error = str(exc)
    hooks.uninstall()
    return {"patched": patched, "error": error, "restored": parallel_state.initialize_model_parallel is original}


def test_install_checks_the_policy_when_torch_distributed_is_up():
    for r in run_distributed(_install_when_initialized_worker, 2, timeout_s=60):
        assert r["error"] and "compression policy differs across ranks" in r["error"], r
        assert "int4:block=128" in r["error"] and "int8:block=256" in r["error"], r["error"]
        assert not r["active"] and not r["installed"]  # a refused install leaves nothing patched


def test_policy_checked_after_megatron_initialize_model_parallel(tmp_path):
    results = run_distributed(_install_before_initialize_worker, 2, str(tmp_path), timeout_s=60, wall_limit_s=240)
    for r in results:
        assert r["patched"] and r["restored"], r
        assert r["error"] and "compression policy differs across ranks" in r["error"], r
