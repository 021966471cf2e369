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


def all_to_all_worker(codec: str) -> dict:
    """One variable-split all-to-all over the world (2 simulated nodes x 2): rows of 96 values, some destinations
    sent no rows, a NaN in rank 1's rows for rank 0; the exact exchange as the reference."""
    import torch
    import torch.distributed as dist

    from megatron_zpp.comm import comm_stats, compressed_all_to_all

    rank, size = dist.get_rank(), dist.get_world_size()
    send = [(rank * 3 + p * 5) % 7 for p in range(size)]
    recv = [(p * 3 + rank * 5) % 7 for p in range(size)]
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(sum(send), 96, generator=g) * (rank + 1)
    if rank == 1:
        x[0, 3] = float("nan")  # the first row goes to rank 0 (send[0] = 3)
    reference = torch.empty(sum(recv), 96)
    dist.all_to_all_single(reference, x, output_split_sizes=recv, input_split_sizes=send)
    comm_stats().reset()
    out = compressed_all_to_all(x, recv, send, None, codec, "ep.test", ranks_per_node=2)
    return {"out": out, "reference": reference, "recv": recv, "send": send, "stats": comm_stats().get("ep.test")}


def moe_ep_codecs(flags_by_name: dict[str, list[str]], iterations: int, dispatcher: str = "alltoall",
                  parallel: tuple[str, ...] = ()) -> dict:
    """The MoE GPT (distributed optimizer, the given token dispatcher and extra layout flags) under each set of
    flags: losses and the ep and tp byte counters (this rank's)."""
    base = MOE + ["--use-distributed-optimizer", "--moe-token-dispatcher-type", dispatcher, "--train-iters",
                  str(iterations), "--zpp-ranks-per-node", "2", "--eval-iters", "0", *parallel]
    out = {}
    for name, flags in flags_by_name.items():
        run = pretrain(base + flags, log=_quiet, plugin=name != "absent")
        out[name] = {"losses": run["losses"], "finite": run["finite"],
                     "traffic": {t: s for t, s in run.get("traffic", {}).items() if t.startswith(("ep.", "tp"))}}
    return out
