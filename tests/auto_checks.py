"""Per-rank bodies of the ``--zpp-policy auto`` tests (spawned gloo processes, CPU shim)."""

from __future__ import annotations

import torch.distributed as dist

from megatron_zpp.training.arguments import PROJECT_RECIPE
from megatron_zpp.training.trainer import pretrain

SMALL = PROJECT_RECIPE + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "constant",
         "--log-interval", "1000", "--eval-iters", "0", "--zpp-ranks-per-node", "2"]


def _quiet(*args, **kwargs) -> None:
    pass


def scripted_switches(parallel: list[str], script: str, iterations: int) -> dict:
    """Train under ``--zpp-policy auto`` switching presets by script, with the replica check on: every module's
    weights at every use compared across data-parallel replicas, across every switch."""
    run = pretrain(SMALL + parallel + ["--train-iters", str(iterations), "--zpp-policy", "auto", "--zpp-auto-script",
                                       script, "--check-replica-weights"], log=_quiet)
    return {"replica_check": run["replica_check"], "finite": run["finite"], "losses": run["losses"],
            "auto": run["auto_policy"], "traffic": {k: v for k, v in run.get("traffic", {}).items()}}


def skewed_decision(parallel: list[str], iterations: int, slow_rank0: bool) -> dict:
    """``--zpp-policy auto`` whose startup calibration measures different links on each rank: rank 0 3 MB/s ones
    (``slow_rank0``; compression pays) or 30 GB/s ones (it does not), every other rank the opposite. The decision
    must be rank 0's on every rank."""
    import dataclasses

    import megatron_zpp.training.auto_policy as auto

    original = auto.calibrate

    def skewed(probe, budget_s, **kwargs):
        m = original(probe, budget_s, **kwargs)
        slow = (dist.get_rank() == 0) == slow_rank0
        link = dict(bandwidth=3e6, alpha=1e-3) if slow else dict(bandwidth=3e10, alpha=1e-6)
        return dataclasses.replace(m, inter=dataclasses.replace(m.inter, **link),
                                   intra=dataclasses.replace(m.intra, **link))

    auto.calibrate = skewed
    try:
        run = pretrain(SMALL + parallel + ["--train-iters", str(iterations), "--zpp-policy", "auto",
                                           "--zpp-auto-calibration-s", "1", "--zpp-auto-recheck-interval", "0"],
                       log=_quiet)
    finally:
        auto.calibrate = original
    return {"auto": run["auto_policy"], "finite": run["finite"]}


def calibration_bound(budget_s: float) -> dict:
    """The startup calibration alone on a gloo world of 2 nodes x 2 ranks: its agreed duration and inputs."""
    import torch

    from megatron_zpp.comm import Topology
    from megatron_zpp.training.auto_policy import calibrate
    from megatron_zpp.training.calibration import Probe

    topo = Topology(None, ranks_per_node=2)
    probe = Probe(torch.device("cpu"), topo.node_size, topo.intra_group)
    m = calibrate(probe, budget_s, max_bytes=64 << 20, dtype=torch.float32, optimizer_params=1 << 20)
    return m.summary()


def link_change(parallel: list[str], iterations: int, change_at: int) -> dict:
    """Auto's re-check on a link that slows down at ``change_at``: the startup calibration finds 30 GB/s links (so
    the first choice is uncompressed); from ``change_at`` on, every uncompressed iteration's measured time grows by
    2 s and a re-measure of the link finds 300 KB/s. The drift triggers the re-measure and the re-ranked choice is
    taken."""
    import dataclasses

    import megatron_zpp.training.auto_policy as auto
    from megatron_zpp.training.calibration import Probe

    original_end, original_ladder, original_calibrate = auto.AutoPolicy.end, Probe.ring_ladder, auto.calibrate
    slowed = [False]

    def end(self, iteration, seconds):
        if iteration >= change_at:
            slowed[0] = True
            if self.current in ("none", "fair"):
                seconds += 2.0  # an uncompressed iteration on the slowed link
        return original_end(self, iteration, seconds)

    def ring_ladder(self, share_s, max_bytes, group=None, peers=0):
        fit = original_ladder(self, share_s, max_bytes, group, peers)
        return dataclasses.replace(fit, bandwidth=3e5) if slowed[0] else fit

    def fast(probe, budget_s, **kwargs):  # startup: fast links, so the first choice is uncompressed
        m = original_calibrate(probe, budget_s, **kwargs)
        return dataclasses.replace(m, inter=dataclasses.replace(m.inter, bandwidth=3e10, alpha=1e-5),
                                   intra=dataclasses.replace(m.intra, bandwidth=3e10, alpha=1e-5))

    auto.AutoPolicy.end, Probe.ring_ladder, auto.calibrate = end, ring_ladder, fast
    try:
        run = pretrain(SMALL + parallel + ["--train-iters", str(iterations), "--zpp-policy", "auto",
                                           "--zpp-auto-calibration-s", "1", "--zpp-auto-recheck-interval", "4",
                                           "--zpp-auto-explore-iters", "2", "--zpp-auto-explore-margin", "0",
                                           "--zpp-auto-allow", "lossy-grad,lossy-param", "--check-replica-weights"],
                       log=_quiet)
    finally:
        auto.AutoPolicy.end, Probe.ring_ladder, auto.calibrate = original_end, original_ladder, original_calibrate
    return {"auto": run["auto_policy"], "finite": run["finite"], "replica_check": run["replica_check"]}


def timed_calls(call_s: list[float], budget_s: float, min_reps: int, warm_counts: bool) -> dict:
    """``Probe.timed`` on a call whose n-th run sleeps ``call_s[n]`` (the last value repeats) on every rank: what it
    returns and how many calls it made."""
    import time

    import torch

    from megatron_zpp.training.calibration import Probe

    probe = Probe(torch.device("cpu"), dist.get_world_size())
    calls = [0]

    def fn():
        time.sleep(call_s[min(calls[0], len(call_s) - 1)])
        calls[0] += 1

    t = probe.timed(fn, budget_s, max_reps=5, min_reps=min_reps, warm_counts=warm_counts)
    return {"seconds": t, "calls": calls[0]}


def exploration(parallel: list[str], iterations: int, share: float) -> dict:
    """``--zpp-policy auto`` whose every candidate is 'close' (explore margin 0.99): with ``share`` of the run for
    exploring, the runners-up that fit run 2 iterations each and the judge keeps one; replicas checked at every use."""
    run = pretrain(SMALL + parallel + ["--train-iters", str(iterations), "--zpp-policy", "auto",
                                       "--zpp-auto-calibration-s", "1", "--zpp-auto-warmup-iters", "2",
                                       "--zpp-auto-explore-iters", "2", "--zpp-auto-explore-margin", "0.99",
                                       "--zpp-auto-explore-share", str(share), "--check-replica-weights"], log=_quiet)
    return {"auto": run["auto_policy"], "finite": run["finite"], "replica_check": run["replica_check"]}


def guarded_exploration(parallel: list[str], iterations: int, spike_at: int) -> dict:
    """:func:`exploration` (35% of the run for it) with the divergence guard on and the loss spiked x100 at
    ``spike_at`` (faults.py): the guard's 3-iteration fallback lands inside the exploration's plan."""
    import os

    os.environ["ZPP_TEST_FAULT"] = f"spike:{spike_at}"
    try:
        run = pretrain(SMALL + parallel + ["--train-iters", str(iterations), "--zpp-policy", "auto",
                                           "--zpp-auto-calibration-s", "1", "--zpp-auto-warmup-iters", "2",
                                           "--zpp-auto-explore-iters", "2", "--zpp-auto-explore-margin", "0.99",
                                           "--zpp-auto-explore-share", "0.35", "--zpp-divergence-guard",
                                           "--zpp-divergence-fallback-iters", "3", "--zpp-divergence-min-history", "3",
                                           "--check-replica-weights"], log=_quiet)
    finally:
        os.environ.pop("ZPP_TEST_FAULT", None)
    return {"auto": run["auto_policy"], "guard": run["divergence_guard"], "finite": run["finite"],
            "replica_check": run["replica_check"]}
