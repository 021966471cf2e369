"""What the benchmarks measure with: the communication timers, the NIC byte window, and hooks
that restore Megatron exactly after timing its methods."""

import time

import pytest
import torch

import measurement_checks as checks
from megatron_zpp.comm.stats import CommTimers
from megatron_zpp.testing import run_distributed


def test_timers_count_nested_waits_once_and_subtract_codec_time():
    t = CommTimers()
    with t.wait():
        time.sleep(0.02)
        with t.wait():  # Megatron's finish_grad_sync calling start_grad_sync: one wait, not two
            time.sleep(0.02)
            with t.codec():
                time.sleep(0.03)
    assert 0.03 <= t.codec_s < 0.06, t.codec_s
    assert 0.04 <= t.wait_s < 0.07, t.wait_s  # 0.07 s in all, minus the 0.03 s of codec inside
    with pytest.raises(RuntimeError):
        with t.wait():
            raise RuntimeError("a failing collective")
    before = t.wait_s
    with t.wait():  # depth restored after the exception: counted again
        time.sleep(0.01)
    assert t.wait_s >= before + 0.009


def test_timers_split_the_exposed_wait_by_the_outermost_site(monkeypatch):
    """A fake clock: each site gets exactly its outermost wait's time less the codec time inside; inner sites get
    nothing; the sites sum to wait_s; reset clears them."""
    import megatron_zpp.comm.stats as stats

    now = [0.0]
    monkeypatch.setattr(stats.time, "perf_counter", lambda: now[0])
    t = CommTimers()
    with t.wait("finish_param_sync"):
        now[0] += 2.0
        with t.wait("start_param_sync"):  # finish_param_sync dispatching a gather: counted by the outer site
            now[0] += 1.0
            with t.codec():
                now[0] += 4.0
    with t.wait("finish_grad_sync"):
        now[0] += 0.5
    assert t.sites() == {"finish_param_sync": 3.0, "finish_grad_sync": 0.5}
    assert t.wait_s == 3.5 and t.codec_s == 4.0
    t.reset()
    assert t.sites() == {} and t.wait_s == 0.0


def test_nic_window_counts_one_reader_per_node_and_tolerates_mixed_environments():
    # 2 nodes x 2 ranks; node 0 measures lo, node 1 has no ZPP_NIC on one rank and a missing
    # interface on the other: nobody hangs, and only node 0's bytes are reported.
    results = run_distributed(checks.nic_window, 4, {0: "lo", 1: "lo", 2: "no-such-nic0"}, ranks_per_node=2)
    assert all(r == results[0] for r in results)
    r = results[0]
    assert r["nodes"] == 1 and r["interface"] == "lo"
    # About the megabyte sent, or more (loopback also carries the ranks' gloo traffic meanwhile); the
    # header estimate is exact for data segments, not for the handshake's larger options.
    assert r["payload_bytes"] >= 0.99 * (1 << 20), r


def test_nic_window_without_zpp_nic_reports_nothing():
    assert run_distributed(checks.nic_window, 2, {}, ranks_per_node=1) == [None, None]


def test_uninstall_restores_megatron_exactly_and_one_install_at_a_time():
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buf

    from megatron_zpp.megatron.hooks import MegatronHooks
    from megatron_zpp.policy import ZppConfig, resolve_policy

    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.core.tensor_parallel import layers, mappings

    classes = [pgb._ParamAndGradBucketGroup, fsdp_buf.AllGatherPipeline, fsdp_buf.GradReducePipeline,
               fsdp_buf.ParamAndGradBuffer, megatron_fsdp.MegatronFSDP, p2p_communication, layers, mappings,
               layers.LinearWithGradAccumulationAndAsyncCommunication]
    before = [dict(vars(c)) for c in classes]
    # tp and pp codecs too: the model-parallel hooks patch module functions and a staticmethod.
    first = MegatronHooks(resolve_policy(ZppConfig(policy="fair", tp="int8", pp="int8"))).install()
    changed = sum(vars(c)[k] is not v for c, b in zip(classes, before) for k, v in b.items() if k in vars(c))
    assert changed >= 9 + 8  # DP/FSDP methods and waits; p2p ops, TP collectives, the linear's backward
    with pytest.raises(RuntimeError, match="another MegatronHooks is installed"):
        MegatronHooks(resolve_policy(ZppConfig(policy="zeropp"))).install()
    first.uninstall()
    assert [dict(vars(c)) for c in classes] == before
    MegatronHooks(resolve_policy(ZppConfig(policy="none"))).install().uninstall()  # free again
    assert [dict(vars(c)) for c in classes] == before


def test_fsdp_premul_sum_becomes_scale_then_sum_under_our_reduction():
    """Megatron-FSDP fuses 1/DP into NCCL's PREMUL_SUM for non-bf16 gradients; our reductions take
    SUM, so while ours run the gradients are scaled first (Megatron's unfused branch)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buf

    from megatron_zpp.megatron.hooks import MegatronHooks
    from megatron_zpp.policy import ZppConfig, resolve_policy

    cfg = SimpleNamespace(average_in_collective=False, gradient_reduce_div_fusion=True)
    original = fsdp_buf.gradient_reduce_preprocessing
    for policy, ours in (("fair", True), ("none", False)):
        hooks = MegatronHooks(resolve_policy(ZppConfig(policy=policy)))
        grad = torch.full((4,), 3.0)
        with hooks._route_fsdp_reduce([], fsdp_buf):
            op = fsdp_buf.gradient_reduce_preprocessing(grad, 0.25, cfg)
        assert fsdp_buf.gradient_reduce_preprocessing is original
        if ours:
            assert op == dist.ReduceOp.SUM and torch.equal(grad, torch.full((4,), 0.75))
        else:  # Megatron's own collective: its fused op, gradients untouched
            assert op != dist.ReduceOp.SUM and torch.equal(grad, torch.full((4,), 3.0))


def test_fsdp_strategies_that_bypass_the_routing_are_refused():
    from types import SimpleNamespace

    from megatron_zpp.megatron.hooks import MegatronHooks
    from megatron_zpp.policy import ZppConfig, resolve_policy

    fair = MegatronHooks(resolve_policy(ZppConfig(policy="fair")))
    for strategy in ("no_shard", "optim"):
        with pytest.raises(NotImplementedError, match=f"data_parallel_sharding_strategy='{strategy}'"):
            fair._check_fsdp_supported(SimpleNamespace(data_parallel_sharding_strategy=strategy))
    with pytest.raises(NotImplementedError, match="outer data-parallel group"):
        fair._check_fsdp_supported(SimpleNamespace(data_parallel_sharding_strategy="optim_grads_params"), True)
    fair._check_fsdp_supported(SimpleNamespace(data_parallel_sharding_strategy="optim_grads_params"))
    # Megatron's own collectives under `none`: nothing to refuse.
    MegatronHooks(resolve_policy(ZppConfig(policy="none")))._check_fsdp_supported(
        SimpleNamespace(data_parallel_sharding_strategy="no_shard"))


def test_a_weight_install_invalidates_only_its_own_buffers_hpz_copies():
    """Megatron-FSDP installs each model chunk's buffer in turn (virtual pipeline stages, chained optimizers):
    one chunk's install marks its own hpZ copies stale and leaves the other chunk's, which may be refreshed or
    in flight already, as they are; a checkpoint load (no buffer) marks every copy stale."""
    from types import SimpleNamespace

    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buf

    from megatron_zpp.megatron.hooks import MegatronHooks
    from megatron_zpp.policy import ZppConfig, resolve_policy

    class Copy:  # an HpzShard's freshness, as invalidate() changes it
        valid = True

        def invalidate(self):
            self.valid = False

    config = SimpleNamespace(data_parallel_sharding_strategy="optim_grads_params")
    buffers = [SimpleNamespace(parameter_groups=[], ddp_config=config) for _ in range(2)]
    pipelines = [SimpleNamespace(buffer=b) for b in buffers]
    hooks = MegatronHooks(resolve_policy(ZppConfig(policy="sdp4bit"))).install()
    try:
        copies = {}
        for chunk, pipeline in enumerate(pipelines):
            for key in ((id(pipeline), 0), ("qwd", id(pipeline), 1)):  # a plain hpZ copy and a qWD one
                copies[chunk, key[0]] = hooks._keep_hpz_shard(key, pipeline, Copy())
        hooks._hpz_shards["unowned"] = unowned = Copy()  # kept without an owner: an install must not leave it fresh
        fsdp_buf.ParamAndGradBuffer.copy_main_weights_to_model_weights(buffers[1])  # the hooked install
        assert {k: c.valid for k, c in copies.items()} == {k: k[0] == 0 for k in copies}
        assert not unowned.valid
        # A later pipeline whose id() a key reuses does not inherit the copy (the key's owner is another buffer).
        assert hooks._kept_hpz_shard((id(pipelines[0]), 0), pipelines[0]) is copies[0, id(pipelines[0])]
        assert hooks._kept_hpz_shard((id(pipelines[0]), 0), SimpleNamespace(buffer=buffers[1])) is None
        hooks.invalidate_secondary()
        assert not any(c.valid for c in copies.values())
    finally:
        hooks.uninstall()
