"""Workers of tests/test_moe.py (spawned, so importable by name)."""

from __future__ import annotations

from megatron_zpp.training.trainer import pretrain
from megatron_checks import POLICIES, SMALL, _quiet

# A small MoE GPT: every layer a MoE layer of 4 experts, top-2, split over 2 expert-parallel ranks.
MOE = SMALL + ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
               "--moe-aux-loss-coeff", "1e-2", "--moe-ffn-hidden-size", "128"]

MOE_POLICIES = POLICIES | {"zeropp-ef": ["--zpp-policy", "zeropp", "--zpp-dp-grad-error-feedback"]}


def moe_replicas(parallel: list[str], policies: list[str], iterations: int) -> dict:
    """Train the MoE GPT with ``--check-replica-weights`` under each policy (and without the plugin): dense modules
    compared over the data-parallel group, expert modules over the expert-data-parallel group, at every use."""
    base = MOE + parallel + ["--train-iters", str(iterations), "--zpp-ranks-per-node", "2",
                             "--check-replica-weights", "--eval-iters", "0"]
    out = {}
    for name in ["absent"] + policies:
        run = pretrain(base + MOE_POLICIES.get(name, []), log=_quiet, plugin=name != "absent")
        out[name] = run["replica_check"] | {"finite": run["finite"], "losses": run["losses"],
                                            "aux": run["moe_aux_losses"], "traffic": run.get("traffic", {}),
                                            "ef_buckets": run["error_feedback_buckets"]}
    return out


def expert_bucket_groups(parallel: list[str], policy: str) -> dict:
    """Which data-parallel groups the hooks built topologies for (the groups Megatron passed with each bucket's
    collective), their node split, whether their communicators are distinct, and the log lines of rank 0."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zpp.megatron.hooks import MegatronHooks

    seen: dict = {}
    state: dict = {}
    original = MegatronHooks.topology

    def topology(self, group, hpz: bool = False):
        topo = original(self, group, hpz)
        ranks = tuple(dist.get_process_group_ranks(group))
        seen[ranks] = topo
        # parallel_state is torn down when pretrain returns: its groups are read here, while it trains
        state["expert_dp"] = tuple(dist.get_process_group_ranks(parallel_state.get_expert_data_parallel_group()))
        state["dense_dp"] = tuple(dist.get_process_group_ranks(parallel_state.get_data_parallel_group()))
        return topo

    MegatronHooks.topology = topology
    lines: list[str] = []
    try:
        run = pretrain(MOE + parallel + ["--train-iters", "2", "--zpp-ranks-per-node", "2", "--eval-iters", "0",
                                         "--log-interval", "1"] + MOE_POLICIES[policy], log=lines.append)
    finally:
        MegatronHooks.topology = original
    groups = {ranks: {"nodes": topo.num_nodes, "per_node": topo.node_size,
                      "private": id(topo.private_group) if topo.private_group is not None else None}
              for ranks, topo in seen.items()}
    return {"groups": groups, "expert_dp": state["expert_dp"], "dense_dp": state["dense_dp"], "lines": lines,
            "finite": run["finite"]}
