"""How Topology creates its process groups (gloo, simulated nodes): collectives over the caller's group
only, safe with a device-bound default group and with pipeline stages that build at different times,
and one process group per member set however many topologies use it."""

from collections import defaultdict

import pytest

import topology_checks as checks
from megatron_zpp.testing import run_distributed


def _creation_is_spmd_per_communicator(calls_by_rank: list[list[tuple]]) -> None:
    """Every split of a parent is entered by all of the parent's ranks, with the same lists, in the
    same order (what ncclCommSplit needs); every members-only new_group by all of its members, in an
    order that agrees on every pair of ranks that share two of them (else they wait on each other)."""
    splits: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    local: dict[int, list[tuple]] = defaultdict(list)
    for rank, calls in enumerate(calls_by_rank):
        for kind, ranks, extra in calls:
            if kind == "split_group":
                splits[ranks][rank].append(extra)
            elif extra:  # new_group(..., use_local_synchronization=True)
                assert rank in ranks, (rank, ranks)
                local[rank].append(ranks)
    for parent, by_rank in splits.items():
        assert sorted(by_rank) == sorted(parent), f"split of {parent} entered by ranks {sorted(by_rank)} only"
        sequences = {tuple(seq) for seq in by_rank.values()}
        assert len(sequences) == 1, f"ranks of {parent} split it differently: {dict(by_rank)}"
    for rank, groups in local.items():
        for ranks in groups:
            for other in ranks:
                assert ranks in local[other], f"rank {other} never created {ranks} with rank {rank}"
        for other, their in local.items():
            shared = [g for g in groups if g in their]
            assert shared == [g for g in their if g in groups], f"ranks {rank}, {other} disagree on order"


@pytest.mark.parametrize("bound", [True, False], ids=["device-bound", "unbound"])
def test_pipeline_stages_build_topologies_at_different_times(bound, tmp_path):
    """TP=2 x PP=2, then TP=2 x DP=2 with hpZ, on gloo with and without ``device_id``: stage 1 builds
    its TP topology only after stage 0 has built its own and sent; no creation waits for another
    stage, every collective through the groups is exact."""
    results = run_distributed(checks.bound_pipeline_worker, 4, str(tmp_path), bound, ranks_per_node=2,
                              timeout_s=60, wall_limit_s=300)
    assert all(r["bound"] is bound for r in results)
    assert [r["received"] for r in results[2:]] == [[1.0] * 4] * 2
    calls = [r["calls"] for r in results]
    for rank, r in enumerate(results):
        # bound: torch's new_group would split the world's communicator, which only the members enter (the hang)
        ours = [c for c in r["calls"] if c[0] == "new_group" and c[2]]
        assert not ours if bound else ours, (rank, r["calls"])
        assert all(c[0] == "split_group" for c in r["calls"]) if bound else True
        print(f"\nrank {rank} ({'bound' if bound else 'unbound'}): {r['calls']}")
    _creation_is_spmd_per_communicator(calls)
    # One communicator per member set: each Megatron group of 2 gets one private copy, whatever the shape.
    for r in results:
        assert len({c[1:] for c in r["calls"]}) == len(r["calls"]), r["calls"]
    built = {(members, rpn, hpz): groups for members, rpn, hpz, groups in results[0]["built"]}
    assert built[((0, 2), 2, 1)] == {"intra": None, "inter": [0, 2], "hpz": None}
    assert built[((0, 2), 4, 2)] == {"intra": [0, 2], "inter": None, "hpz": [0, 2]}


@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "device-bound"])
def test_topologies_over_the_same_ranks_share_process_groups(bound, tmp_path):
    """Megatron-FSDP's reduce (hpZ 1) and gather (hpZ 2) topologies over one group of 8 ranks on 2 nodes
    of 4 create 4 process groups on each rank (flat, intra, inter, then the hpZ pair), not 7; hpZ 4 (the
    node) and a one-node view of the same ranks create none. Each topology keeps its own queue."""
    results = run_distributed(checks.shared_groups_worker, 8, str(tmp_path), bound, ranks_per_node=4,
                              timeout_s=60, wall_limit_s=400)
    for rank, r in enumerate(results):
        print(f"\nrank {rank} ({'bound' if bound else 'unbound'}): groups after each topology {r['created']}, "
              f"creation calls {r['calls']}")
        assert r["created"] == [3, 4, 4, 4], r
        assert r["gather_shares_flat_intra_inter"] and r["hpz4_is_intra"] and r["one_node_intra_is_flat"], r
        assert r["own_queues"] == 4, r
        assert r["hpz2_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1], r
