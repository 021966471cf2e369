"""Megatron-Core integration on CPU/gloo: the none policy is bit-identical to no plugin; zeropp trains,
keeps replicas identical and sends the analytic share of the bytes."""

import argparse

import re

import pytest

import megatron_checks as checks
from megatron_zpp.policy import ZppConfig, resolve_policy
from megatron_zpp.testing import run_distributed
from megatron_zpp.training.arguments import build_parser, validate_args

ITERS = 5
# FAIR_GRAD: cross-node dp.grad bytes, summed over ranks, for a gradient buffer of M bytes on 2 nodes x 2:
# gloo's reduce-scatter is a ring all-reduce, 2 (p - 1) / p M = 1.5 M per rank, on a ring whose
# 2 node-crossing edges carry 3 M; the hierarchical one sends each rank's M / 4 once: M. Ratio 1/3.
# Analytic inter-node byte ratios of [2] for fp32 tensors (4 bytes/element): payload + fp32 scales.
QWZ_FP32 = (1 + 4 / 256) / 4  # int8:block=256
QGZ_FP32 = (0.5 + 4 / 128) / 4  # int4:block=128


def _check(result, grad_ratio=QGZ_FP32, param_ratio=QWZ_FP32, fair_grad_ratio=1 / 3):
    """``fair_grad_ratio``: the fair baseline's cross-node dp.grad bytes over Megatron's on gloo."""
    for key in result:
        if key.startswith("none") and key != "none_traffic":
            absent = result[key.replace("none", "absent")]
            assert result[key] == absent, (key, result[key], absent)  # bit-identical losses
    fair = result["fair"]
    assert fair["finite"] and fair["dp_replicas_identical"], fair
    # Another summation order than Megatron's: equal losses up to fp32 rounding, not bit for bit.
    assert fair["losses"] == pytest.approx(result["absent"], rel=1e-4, abs=1e-4), (fair["losses"], result["absent"])
    # The gradient norm before clipping sees any scaling error (mean vs sum, a missing 1/DP) that
    # Adam and clipping would hide from the losses.
    assert fair["grad_norms"] == pytest.approx(result["absent_grad_norms"], rel=1e-4), \
        (fair["grad_norms"], result["absent_grad_norms"])
    fair_grad, none_grad = fair["traffic"]["dp.grad"], result["none_traffic"]["dp.grad"]
    assert fair_grad["inter_ratio"] == 1.0  # nothing compressed
    ratio = fair_grad["inter_bytes"] / none_grad["inter_bytes"]
    assert abs(ratio - fair_grad_ratio) <= 0.02 * fair_grad_ratio, (ratio, fair_grad, none_grad)
    z = result["zeropp"]
    assert z["finite"] and z["dp_replicas_identical"], z
    assert z["losses"][-1] < z["losses"][0] - 0.3, z["losses"]  # trains
    traffic = z["traffic"]
    assert abs(traffic["dp.grad"]["inter_ratio"] - grad_ratio) <= 0.02 * grad_ratio, traffic["dp.grad"]
    if param_ratio is not None:
        assert abs(traffic["dp.param"]["inter_ratio"] - param_ratio) <= 0.02 * param_ratio, traffic["dp.param"]
    else:
        assert "dp.param" not in traffic
    print(f"\nzeropp losses {[round(v, 3) for v in z['losses']]}; dp.grad x{traffic['dp.grad']['inter_ratio']:.4f} "
          f"(analytic {grad_ratio:.4f})" + (f"; dp.param x{traffic['dp.param']['inter_ratio']:.4f} (analytic "
                                           f"{param_ratio:.4f})" if param_ratio else ""))


def test_dp4_distributed_optimizer_2x2_with_and_without_overlap():
    result = run_distributed(checks.run_policies, 4, ["--use-distributed-optimizer"], ITERS, 2, True,
                             ranks_per_node=2, timeout_s=300)
    _check(result[0])
    assert all(r == result[0] for r in result[1:])  # every rank saw the same losses


def test_tp2_dp2_distributed_optimizer():
    result = run_distributed(checks.run_policies, 4, ["--use-distributed-optimizer",
                                                      "--tensor-model-parallel-size", "2"], ITERS, 2, False,
                             ranks_per_node=2, timeout_s=300)
    # Each DP group ({0, 2}, {1, 3}) has one rank per node: gloo's all-reduce sends M per rank, all
    # of it across nodes; the hierarchical reduce-scatter M / 2.
    _check(result[0], fair_grad_ratio=1 / 2)


def test_plain_dp4_all_reduce():
    # Without the distributed optimizer the gradient all-reduce is a qgZ reduce-scatter plus an INT4
    # gather of the result: both halves carry the INT4 ratio; no ZeRO shards, so no dp.param traffic.
    result = run_distributed(checks.run_policies, 4, [], ITERS, 2, True, ranks_per_node=2, timeout_s=300)
    # fair: hierarchical reduce-scatter (M across nodes, summed over the 4 ranks) plus a ring
    # all-gather of the shards (1.5 M) vs gloo's ring all-reduce (3 M): 2.5 / 3.
    _check(result[0], param_ratio=None, fair_grad_ratio=2.5 / 3)


def test_policy_mismatch_across_ranks_fails_naming_the_field():
    for msg in run_distributed(checks.policy_mismatch, 2, ranks_per_node=1):
        assert "dp.grad" in msg and "int8:block=256" in msg and "int4:block=128" in msg, msg


def test_unknown_codec_and_bad_policy_fail_clearly():
    with pytest.raises(ValueError, match="unknown codec 'int3'.*valid codecs"):
        resolve_policy(ZppConfig(policy="zeropp", dp_grad="int3"))
    with pytest.raises(ValueError, match="neither a preset.*hybrid.*none.*zeropp"):
        resolve_policy(ZppConfig(policy="zeroplusplus"))
    with pytest.raises(ValueError, match="block=7 is not valid"):
        resolve_policy(ZppConfig(policy="none", dp_param="int8:block=7"))
    with pytest.raises(ValueError, match="dp_grad_until=1.5"):
        resolve_policy(ZppConfig(policy="zeropp", dp_grad_until=1.5))


@pytest.mark.parametrize("flags,world,message", [
    (["--tensor-model-parallel-size", "3"], 4, "world size 4 is not divisible by tensor \\(3\\)"),
    (["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "4"], 4, "= 8"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 2, "--global-batch-size 6 is not a multiple"),
    (["--tensor-model-parallel-size", "2", "--num-attention-heads", "3"], 2, "--num-attention-heads 3"),
])
def test_parallel_sizes_that_do_not_fit_fail_clearly(flags, world, message):
    with pytest.raises(ValueError, match=message):
        validate_args(build_parser().parse_args(flags), world)


def test_presets_and_deepspeed_aliases(tmp_path):
    zeropp = resolve_policy(ZppConfig(policy="zeropp"))
    assert zeropp.codec("dp.grad").startswith("int4:block=128") and zeropp.codec("dp.param").startswith("int8")
    assert resolve_policy(ZppConfig(policy="none")).is_identity
    fair = resolve_policy(ZppConfig(policy="fair"))
    assert fair.dp_uncompressed == "hierarchical" and not fair.is_identity
    assert all(c == "none" for c in fair.codecs.values())
    with pytest.raises(ValueError, match="dp_uncompressed='ring'; valid: megatron, hierarchical"):
        resolve_policy(ZppConfig(policy="none", dp_uncompressed="ring"))
    hybrid = resolve_policy(ZppConfig(policy="hybrid"))
    assert hybrid.dp_grad_intra.startswith("int8") and hybrid.codec("dp.grad").startswith("int4")
    assert hybrid.codec("tp").startswith("mpc") and hybrid.codec("pp").startswith("mpc")
    mz = resolve_policy(ZppConfig(policy="mzhybrid"))
    assert mz.codec("dp.grad").startswith("zfp:rate=8") and all(mz.codec(d).startswith("mpc")
                                                                for d in ("dp.param", "tp", "pp"))
    z = resolve_policy(ZppConfig(policy="zhybrid"))
    assert z.codec("dp.grad").startswith("zfp:rate=8") and all(z.codec(d).startswith("zfp:rate=16")
                                                               for d in ("dp.param", "tp", "pp"))
    # the startup log's summary names every knob the traffic depends on, not only the per-dimension codecs
    sdp = resolve_policy(ZppConfig(policy="sdp4bit", dp_param_resync_interval=50)).summary()
    assert "dp.grad.intra=int8:block=512" in sdp and "hpz_size=node" in sdp and "every 50 iterations" in sdp
    assert "intra" not in resolve_policy(ZppConfig(policy="zeropp")).summary()
    for preset in ("mzhybrid", "zhybrid", "hybrid"):  # each says where it comes from
        assert resolve_policy(ZppConfig(policy=preset)).description.strip()
    f = tmp_path / "ds.yaml"
    f.write_text("zero_quantized_weights: true\nzero_quantized_gradients: true\nzero_hpz_partition_size: 4\n")
    ds = resolve_policy(ZppConfig(policy=str(f), dp_grad="int4:block=64"))
    assert ds.codec("dp.param") == zeropp.codec("dp.param") and ds.hpz_size == 4
    assert ds.codec("dp.grad").startswith("int4:block=64")  # the command line overrides the file
    bad = tmp_path / "bad.yaml"
    bad.write_text("codecs: {dp.gradient: int4}\n")
    with pytest.raises(ValueError, match="unknown dimension.*dp.gradient.*valid: dp.grad"):
        resolve_policy(ZppConfig(policy=str(bad)))


def test_any_codec_on_any_dimension_and_what_needs_blockwise():
    p = resolve_policy(ZppConfig(policy="none", dp_grad="zfp:rate=8", dp_param="zstd", tp="zfp:rate=16", pp="mpc"))
    assert p.codec("dp.param").startswith("zstd") and p.codec("pp").startswith("mpc")
    with pytest.raises(ValueError, match="hpz_size=node.*dp.param.*none, int8, int4.*'mpc:dim=1'.*--zpp-hpz-size 1"):
        resolve_policy(ZppConfig(policy="zeropp", dp_param="mpc"))
    with pytest.raises(ValueError, match="qgz_stages=2 needs dp.grad codecs in none, int8, int4.*zfp:rate=8"):
        resolve_policy(ZppConfig(policy="zeropp", dp_grad="zfp:rate=8", hpz_size=1, qgz_stages=2))
    with pytest.raises(ValueError, match="unknown codec 'zfp8'.*valid codecs"):
        resolve_policy(ZppConfig(policy="mzhybrid", tp="zfp8"))
    with pytest.raises(ValueError, match="rate"):
        resolve_policy(ZppConfig(policy="zhybrid", pp="zfp:rate=0"))
    with pytest.raises(ValueError, match="dp_grad_intra='int8.*dp.grad='zfp:rate=8.*both be blockwise"):
        resolve_policy(ZppConfig(policy="mzhybrid", dp_grad_intra="int8:block=256"))
    from megatron_zpp.policy import check_policy_devices

    check_policy_devices(resolve_policy(ZppConfig(policy="mzhybrid")), "cuda")  # mpc and zfp run on both
    check_policy_devices(resolve_policy(ZppConfig(policy="none", tp="zstd")), "cpu")
    with pytest.raises(ValueError, match="tp: codec 'zstd:level=1' runs on cpu tensors, and this run's are on cuda"):
        check_policy_devices(resolve_policy(ZppConfig(policy="none", tp="zstd")), "cuda")
    with pytest.raises(ValueError, match="pp: codec 'nvcomp.*runs on cuda tensors, and this run's are on cpu"):
        check_policy_devices(resolve_policy(ZppConfig(policy="none", pp="nvcomp")), "cpu")
    assert resolve_policy(ZppConfig(policy="mzhybrid", dp_grad_error_feedback=True)).error_feedback
    assert not resolve_policy(ZppConfig(policy="mzhybrid")).error_feedback  # off by default
    with pytest.raises(ValueError, match="error feedback needs a lossy dp.grad codec.*'mpc:dim=1'"):
        resolve_policy(ZppConfig(policy="none", dp_grad="mpc", dp_grad_error_feedback=True))
    with pytest.raises(ValueError, match="error feedback needs a lossy dp.grad codec.*'none'"):
        resolve_policy(ZppConfig(policy="fair", dp_grad_error_feedback=True))


def test_zpp_flags_are_generated_from_the_config():
    parser = argparse.ArgumentParser()
    from megatron_zpp.policy import add_zpp_args, field_docs
    add_zpp_args(parser)
    flags = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings[0].startswith("--zpp")}
    docs = field_docs(ZppConfig)
    assert set(flags) == {"--zpp-" + f.replace("_", "-") for f in docs}
    assert all(docs[f.replace("--zpp-", "").replace("-", "_")].split(".")[0] in h for f, h in flags.items())


def test_save_and_load_resume_bit_exactly(tmp_path):
    r = run_distributed(checks.resume_matches_straight_run, 2, str(tmp_path), ranks_per_node=1, timeout_s=300)[0]
    assert r["straight"] == r["resumed"] and len(r["resumed"]) == 2, r


def test_error_feedback_on_megatron_fsdp(tmp_path):
    r = run_distributed(checks.error_feedback_fsdp, 4, str(tmp_path), ranks_per_node=2, timeout_s=600)
    for rank_result in r:
        names = rank_result["buckets_after_4"]
        assert names and names == rank_result["buckets_after_1"], rank_result  # one residual per bucket
        assert rank_result["finite"] and rank_result["resumed"] == rank_result["straight"], rank_result


def test_error_feedback_residuals_resume_from_checkpoints(tmp_path):
    """With --zpp-dp-grad-error-feedback the residuals are saved and restored: the resumed run equals the
    straight one bit for bit, and the same resume with zeroed residuals does not."""
    r = run_distributed(checks.resume_matches_straight_run, 2, str(tmp_path), ["--zpp-dp-grad-error-feedback"],
                        ranks_per_node=1, timeout_s=300)[0]
    print("\nresidual norms at iteration 4:", r["residual_norms"], "losses", r)
    assert r["residual_norms"] and all(n > 0 for n in r["residual_norms"]), r
    assert r["straight"] == r["resumed"] and len(r["resumed"]) == 2, r
    assert r["resumed_without_residuals"] != r["straight"], r


@pytest.mark.parametrize("layout", ["distopt-overlap-both", "fsdp-hpz"] + [
    pytest.param(name, marks=pytest.mark.slow) for name in ("plain-dp-overlap-grad", "tp2xdp2-sp", "pp2xdp2-interleaved")])
def test_none_is_megatron_without_ranks_per_node(layout):
    """``none`` installs nothing that can fail: with LOCAL_WORLD_SIZE unset and no --zpp-ranks-per-node
    it trains bit-identically to no plugin and creates exactly the process groups Megatron creates.
    (The replica test below also runs none in every layout, bit-identity included.)"""
    results = run_distributed(checks.none_is_megatron, 4, REPLICA_LAYOUTS[layout], 3, timeout_s=600,
                              node_env=False)
    for r in results:
        assert r["none"]["losses"] == r["absent"]["losses"], (layout, r)
        assert r["none"]["groups_created"] == r["absent"]["groups_created"], (layout, r)
    print(f"\n{layout}: none == absent {results[0]['none']['losses']}; process groups created "
          f"{results[0]['none']['groups_created']} (absent {results[0]['absent']['groups_created']})")


def test_schedule_applies_through_megatron_lm_iteration_counter():
    seen = run_distributed(checks.schedule_through_curr_iteration, 2, 4, ranks_per_node=1)[0]
    assert [c.startswith("int4:block=128") for c in seen] == [True, True, False, False] and seen[2:] == ["none"] * 2, seen


def test_dp_grad_schedule_switches_to_uncompressed():
    from megatron_zpp.megatron.hooks import MegatronHooks
    hooks = MegatronHooks(resolve_policy(ZppConfig(policy="zeropp", dp_grad_until=0.25)))
    seen = []
    for it in range(8):
        hooks.set_iteration(it, 8)
        seen.append(hooks.grad_codec)
    assert seen[:2] == [hooks.policy.codec("dp.grad")] * 2 and seen[2:] == ["none"] * 6


def test_unsupported_layouts_fail_clearly():
    parse = build_parser().parse_args
    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage 3 must divide the 2 layers"):
        validate_args(parse(["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                             "--num-layers-per-virtual-pipeline-stage", "3"]), 4)
    with pytest.raises(ValueError, match="with --use-megatron-fsdp is not supported"):
        validate_args(parse(["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--use-megatron-fsdp",
                             "--num-layers-per-virtual-pipeline-stage", "1"]), 4)
    with pytest.raises(ValueError, match="--overlap-param-gather needs"):
        validate_args(parse(["--overlap-param-gather"]), 4)


def _megatron_core_version() -> tuple[int, int]:
    from importlib.metadata import version
    return tuple(int(x) for x in version("megatron-core").split(".")[:2])


def test_megatron_fsdp_zeropp_2x2(tmp_path):
    """ZeRO-3: none is bit-identical to no plugin; zeropp trains with qwZ forward (0.5M + scales),
    hpZ backward (0 cross-node), qgZ (0.25M + scales) in units of the uncompressed bf16 volume;
    every rank decodes identical weights; a checkpoint resumed with hpZ continues bit-exactly."""
    iters = 5
    r = run_distributed(checks.fsdp_zeropp, 4, iters, str(tmp_path), ranks_per_node=2, timeout_s=600)[0]
    assert r["none"] == r["absent"], (r["none"], r["absent"])
    fair = r["fair"]
    # bf16 weights and gradients: another summation order moves losses by bf16 rounding, not more.
    assert fair["finite"] and fair["losses"] == pytest.approx(r["absent"], rel=1e-2), (fair["losses"], r["absent"])
    assert fair["grad_norms"] == pytest.approx(r["absent_grad_norms"], rel=1e-2), (fair["grad_norms"], r["absent_grad_norms"])
    fair_rs = fair["traffic"]["dp.grad"]["inter_bytes"] / r["none_traffic"]["dp.grad"]["inter_bytes"]
    assert abs(fair_rs - 1 / 3) <= 0.02 / 3, fair_rs  # see FAIR_GRAD comment at the top
    assert fair["traffic"]["dp.param"]["inter_bytes"] == r["none_traffic"]["dp.param"]["inter_bytes"]  # same ring
    z = r["zeropp"]
    assert z["finite"] and z["losses"][-1] < z["losses"][0] - 0.3, z["losses"]
    assert r["gathers_identical_on_all_ranks"] and r["gathers"] > 0
    assert z["hpz_bytes_per_rank"] > 0
    t = z["traffic"]
    fwd = t["dp.param"]["inter_bytes"] / t["dp.param"]["uncompressed_inter_bytes"]
    grad = t["dp.grad"]["inter_bytes"] / t["dp.grad"]["uncompressed_inter_bytes"]
    if _megatron_core_version() < (0, 19):
        grad *= 2  # 0.16's Megatron-FSDP reduces gradients in fp32: its uncompressed volume is 2 M
    # megatron-core 0.16's Megatron-FSDP keeps the forward-gathered weights for backward (no
    # backward gather at all); 0.19 reshards after forward and gathers again, from the hpZ copy.
    bwd = t.get("dp.param.bwd", {"inter_bytes": 0, "intra_bytes": None})
    bwd_inter = bwd["inter_bytes"]
    print(f"\nFSDP zeropp losses {[round(v, 3) for v in z['losses']]}; per iteration cross-node x M(bf16): "
          f"fwd {fwd:.4f}, bwd {bwd_inter} bytes, grad {grad:.4f}; hpZ copy {z['hpz_bytes_per_rank']} B/rank")
    assert abs(fwd - QWZ_FP32 * 2) <= 0.02 * QWZ_FP32 * 2  # bf16: (1 + 4/256) / 2
    assert abs(grad - QGZ_FP32 * 2) <= 0.02 * QGZ_FP32 * 2  # bf16: (0.5 + 4/128) / 2
    assert bwd_inter == 0 and (bwd["intra_bytes"] is None or bwd["intra_bytes"] > 0)
    assert r["resumed"] == z["losses"][3:], (r["resumed"], z["losses"])


@pytest.mark.parametrize("parallel,dim", [
    (["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], "pp"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "16"], "pp"),
    (["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"], "tp"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"], "tp"),
], ids=["pp2xdp2", "pp2xdp2-interleaved", "tp2xdp2", "tp2xdp2-sp"])
def test_pipeline_and_tensor_parallel_codecs(parallel, dim):
    r = run_distributed(checks.model_parallel_codecs, 4, parallel, dim, ITERS, ranks_per_node=2, timeout_s=300)[0]
    assert r["none"] == r["absent"], (r["none"], r["absent"])
    z = r["int8"]
    assert z["finite"] and z["losses"][-1] < z["losses"][0] - 0.3, z["losses"]
    # INT8 + one fp32 scale per 256 values on fp32 activations: (1 + 4/256) / 4 of the bytes.
    t = z["traffic"][dim]
    ratio = (t["intra_bytes"] + t["inter_bytes"]) / (t["uncompressed_intra_bytes"] + t["uncompressed_inter_bytes"])
    print(f"\n{dim} int8 {parallel}: losses {[round(v, 3) for v in z['losses']]} vs none "
          f"{[round(v, 3) for v in r['none']]}; bytes x{ratio:.4f}")
    assert abs(ratio - QWZ_FP32) <= 0.02 * QWZ_FP32
    assert abs(z["losses"][-1] - r["none"][-1]) < 0.05  # INT8 activations barely move the loss


@pytest.mark.parametrize("parallel,dim", [
    (["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"], "tp"),
    (["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], "pp"),
], ids=["tp2xdp2", "pp2xdp2"])
def test_hybrid_presets_and_lossless_model_parallel(parallel, dim):
    r = run_distributed(checks.hybrid_presets, 4, parallel, dim, 5, ranks_per_node=2, timeout_s=600)
    for rank_result in r:
        codec = checks.lossless_codec_for(dim)  # lossless on tp/pp: Megatron's losses, bit for bit, over 5 steps
        assert rank_result[f"{dim}-{codec}"] == rank_result["absent"], (codec, rank_result)
        for preset in ("mzhybrid", "zhybrid"):
            run = rank_result[preset]
            check = run["replica_check"]
            assert run["finite"] and check["uses_compared"] > 0 and check["mismatches"] == 0, (preset, check)
    r = r[0]
    for preset in ("mzhybrid", "zhybrid"):
        run, base = r[preset], r["absent"]
        ratios = {tag: (t["intra_bytes"] + t["inter_bytes"]) / (t["uncompressed_intra_bytes"]
                                                              + t["uncompressed_inter_bytes"])
                  for tag, t in run["traffic"].items() if t["uncompressed_intra_bytes"] + t["uncompressed_inter_bytes"]}
        print(f"\n{preset} {dim}: losses {[round(v, 4) for v in run['losses']]} vs Megatron "
              f"{[round(v, 4) for v in base]}; bytes / uncompressed {({k: round(v, 3) for k, v in ratios.items()})}")
        assert abs(run["losses"][-1] - base[-1]) < 0.05 * base[-1], (preset, run["losses"], base)
        # ZFP rate 8 on fp32 gradients: 8 of 32 bits (+ size-free fixed payloads)
        assert ratios["dp.grad"] <= 0.26, ratios
        # model-parallel traffic: MPC (lossless, ~1.1x on fp32 activations) or ZFP rate 16 (half of fp32)
        assert ratios[dim] < (1.0 if preset == "mzhybrid" else 0.51), ratios


@pytest.mark.parametrize("layout", ["distopt-overlap-both", "fsdp-hpz"])
def test_hybrid_presets_on_two_hop_data_parallel(layout):
    """DP4 as 2 nodes x 2: the any-codec reduce-scatter runs both hops (ZFP) and the weight gather is MPC
    (mzhybrid) or ZFP (zhybrid), on the distributed optimizer and Megatron-FSDP, with overlap; every replica
    uses identical weights at every use."""
    results = run_distributed(checks.replica_consistency, 4, REPLICA_LAYOUTS[layout], ["mzhybrid", "zhybrid"], 3,
                              ranks_per_node=2, timeout_s=600)
    for rank, by_policy in enumerate(results):
        for policy in ("mzhybrid", "zhybrid"):
            r = by_policy[policy]
            assert r["finite"] and r["uses_compared"] > 0 and r["mismatches"] == 0, (layout, rank, policy, r)
            assert abs(r["losses"][-1] - by_policy["absent"]["losses"][-1]) < 0.05 * by_policy["absent"]["losses"][-1]


# Every layout of the integration tests, with the flags that change how weights reach the modules.
DISTOPT = ["--use-distributed-optimizer"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
REPLICA_LAYOUTS = {
    "distopt": DISTOPT,
    "distopt-overlap-grad": DISTOPT + ["--overlap-grad-reduce"],
    "distopt-overlap-both": DISTOPT + OVERLAP,
    "plain-dp-overlap-grad": ["--overlap-grad-reduce"],
    "tp2xdp2": ["--tensor-model-parallel-size", "2"] + DISTOPT + OVERLAP,
    "tp2xdp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + DISTOPT + OVERLAP,
    "pp2xdp2-1f1b": ["--pipeline-model-parallel-size", "2"] + DISTOPT + OVERLAP,
    "pp2xdp2-interleaved": ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                            "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "16"]
                           + DISTOPT + OVERLAP,
    "fsdp-hpz": ["--use-megatron-fsdp", "--bf16"] + OVERLAP,
}


@pytest.mark.parametrize("layout", list(REPLICA_LAYOUTS))
def test_replicas_compute_with_identical_weights_at_every_use(layout):
    """Every module's forward and backward, every iteration, sees the same weights on every
    data-parallel replica: digests taken at the point of use (after Megatron's hooks), not after a
    final sync, with Megatron alone and under none, fair, zeropp and an INT8 dp.param; none is bit-identical
    to Megatron alone."""
    policies = ["none", "fair", "zeropp", "int8-param"]
    results = run_distributed(checks.replica_consistency, 4, REPLICA_LAYOUTS[layout], policies, 4,
                              ranks_per_node=2, timeout_s=600)
    for rank, by_policy in enumerate(results):
        for policy, r in by_policy.items():
            print(f"\n{layout} rank {rank} {policy}: {r['uses_compared']} uses compared, {r['mismatches']} "
                  f"mismatches {r['first_mismatches'][:3]}")
            assert r["finite"], (layout, policy)
            assert r["uses_compared"] > 0 and r["mismatches"] == 0, (layout, rank, policy, r["first_mismatches"])
        assert by_policy["none"]["losses"] == by_policy["absent"]["losses"], (layout, by_policy)


@pytest.mark.parametrize("layout,policy", [
    pytest.param("distopt", "zeropp", marks=pytest.mark.slow), ("distopt-overlap-both", "zeropp"),
    pytest.param("distopt-overlap-both", "sdp4bit", marks=pytest.mark.slow),
    # a periodic full-precision resync lands between a gather and the step: the exact shards must survive it
    ("distopt", "sdp4bit-resync2"),
])
def test_fp32_optimizer_steps_from_its_own_weights_under_a_lossy_gather(layout, policy, tmp_path):
    """fp32 weights on the distributed optimizer have no separate master copy: a lossy weight gather (zeropp's
    INT8 qwZ, sdp4bit's 4-bit weight differences) decodes over the optimizer's shard. Every optimizer step must
    still start from the weights the previous step produced, through a checkpoint save (which writes those,
    not the decoded ones), with and without overlapped gathers; replicas still compute with identical weights
    at every use, also in a run resumed from that checkpoint."""
    flags = {"zeropp": ["--zpp-policy", "zeropp"], "sdp4bit": ["--zpp-policy", "sdp4bit"],
             "sdp4bit-resync2": ["--zpp-policy", "sdp4bit", "--zpp-dp-param-resync-interval", "2"]}[policy]
    r = run_distributed(checks.optimizer_steps_from_its_own_weights, 4, REPLICA_LAYOUTS[layout], 4,
                        str(tmp_path / "ckpt"), flags, ranks_per_node=2, timeout_s=600)
    for rank, x in enumerate(r):
        print(f"\n{layout} {policy} rank {rank}: {x['steps']} steps, each from the previous one's weights: {x['continuous']}; "
              f"{x['replica_check']['uses_compared']} uses compared, {x['replica_check']['mismatches']} mismatches "
              f"{x['replica_check']['first_mismatches'][:2]}")
        assert x["finite"] and x["steps"] == 4 and all(x["continuous"]), x["continuous"]
        assert x["replica_check"]["mismatches"] == 0 and x["replica_check"]["uses_compared"] > 0
        resumed = x["resumed_replica_check"]
        print(f"  resumed: losses {x['resumed_losses']}, {resumed['uses_compared']} uses compared, "
              f"{resumed['mismatches']} mismatches {resumed['first_mismatches'][:2]}")
        assert len(x["resumed_losses"]) == 2 and resumed["mismatches"] == 0 and resumed["uses_compared"] > 0


@pytest.mark.parametrize("layout", [
    "distopt-overlap-both", "fsdp-hpz",
    *(pytest.param(layout, marks=pytest.mark.slow)
      for layout in ("distopt", "distopt-overlap-grad", "tp2xdp2", "pp2xdp2-interleaved")),
])
def test_weight_differences_keep_replicas_identical(layout):
    """The sdp4bit preset on the distributed optimizer (qWD: 4-bit weight differences, int4:block=2048, resync
    every 3 iterations; gradients INT8/512 inside the node, INT4/128 rotated in runs of 32 across): every
    module's forward and backward sees the same weights on every replica at every use, training stays finite
    and its loss close to Megatron's own; the gathers are weight differences, each bucket's first one and the
    one at iteration 3 in full precision."""
    results = run_distributed(checks.weight_difference_consistency, 4, REPLICA_LAYOUTS[layout], 5,
                              ranks_per_node=2, timeout_s=600)
    for rank, by_policy in enumerate(results):
        r, absent = by_policy["sdp4bit"], by_policy["absent"]
        counts = r["counts"]
        print(f"\n{layout} rank {rank} sdp4bit: {r['uses_compared']} uses compared, {r['mismatches']} mismatches; "
              f"{counts['gathers']} gathers, {counts['resyncs']} in full precision; "
              f"losses {[round(x, 4) for x in r['losses']]} vs Megatron's {[round(x, 4) for x in absent['losses']]}")
        buckets = counts["resyncs"] // 2
        assert buckets > 0 and counts["resyncs"] == 2 * buckets, counts
        if layout.startswith("fsdp"):
            # Megatron-FSDP: every gather (forward and backward) from the hpZ copy; at most one difference
            # exchange per bucket and weight update (5 updates, less those a resync replaced): a second one would
            # mean the copy was invalidated after the step's own prefetch had refreshed it.
            assert 3 * buckets <= counts["exchanges"] <= 5 * buckets < counts["gathers"], counts
            # ... and no copy exchanged more often than the weights were updated (5)
            assert counts["second_exchanges"] == 0 and counts["most_per_copy"] <= 5, counts
        else:
            # Per bucket: 2 full-precision gathers (its first, and at iteration 3), and one gather per
            # iteration (5), plus, with overlapped gathers, the one the last step's update dispatches.
            assert counts["gathers"] in (5 * buckets, 6 * buckets), counts
        assert r["finite"] and r["uses_compared"] > 0 and r["mismatches"] == 0, (layout, rank, r["first_mismatches"])
        assert abs(r["losses"][-1] - absent["losses"][-1]) < 0.05 * absent["losses"][-1]
        # the exposed communication split by where it was waited for adds up to it, at the path's own sites
        breakdown = r["breakdown"]
        by_site = breakdown["exposed_by_site"]
        if breakdown["codec_s"] is not None:  # CPU (no host breakdown on CUDA)
            assert sum(by_site.values()) == pytest.approx(breakdown["exposed_comm_s"], rel=1e-6, abs=1e-9), breakdown
            assert "other" not in by_site and min(by_site.values()) >= 0, by_site
            if layout.startswith("fsdp"):
                assert {"wait_bucket_ready", "wait_bucket_ready.bwd"} <= set(by_site), by_site
            else:  # finish_param_sync dispatches the overlapped gathers itself; without overlap the optimizer's
                # start_param_sync is the outermost wait
                overlap = "--overlap-param-gather" in REPLICA_LAYOUTS[layout]
                assert {"finish_grad_sync", "finish_param_sync" if overlap else "start_param_sync"} <= set(by_site)


@pytest.mark.slow
def test_weight_differences_resync_after_a_checkpoint_load(tmp_path):
    """qWD across a save and a resume: the resumed run's first gather of every bucket is in full precision
    (the loaded weights, not differences against a base it never had), the rest are differences, and every
    replica sees the same weights at every use."""
    r = run_distributed(checks.weight_difference_resume, 4, str(tmp_path), ranks_per_node=2, timeout_s=600)[0]
    print(f"\nfirst run {r['first']}, losses {r['saved_losses']}; resumed {r['resumed']}, losses "
          f"{r['resumed_losses']}")
    buckets = r["first"]["resyncs"]  # each bucket's first gather
    assert buckets > 0 and r["resumed"]["resyncs"] == buckets and r["resumed"]["gathers"] > buckets, r
    assert r["finite"] and r["replica_check"]["mismatches"] == 0 and r["replica_check"]["uses_compared"] > 0
    assert len(r["resumed_losses"]) == 2 and r["resumed_losses"][-1] < r["saved_losses"][0]


@pytest.mark.parametrize("flags, says", [
    (["--bf16"], "add --use-distributed-optimizer or --use-megatron-fsdp"),
    (["--use-megatron-fsdp", "--bf16", "--zpp-hpz-size", "1"], "--zpp-hpz-size 1 would hold the whole model"),
])
def test_weight_differences_refuse_what_they_cannot_run_on(flags, says):
    """qWD adds differences to the replicas' copy of the sharded weights (the distributed optimizer's gathered
    buffer, Megatron-FSDP's hpZ copy): plain DP (no sharded gather) is a configuration error naming the
    alternatives, before anything is built; so are a resync interval without qWD, and Megatron-LM's modes that
    reuse the buffer. (fp32 weights run: test_fp32_optimizer_steps_from_its_own_weights_under_a_lossy_gather.)"""
    from megatron_zpp.megatron import hooks_from_args
    from megatron_zpp.policy import ConfigError
    from megatron_zpp.training.arguments import build_parser

    qwd = ["--zpp-policy", "zeropp", "--zpp-dp-param", "int4:block=2048", "--zpp-dp-param-difference"]
    with pytest.raises(ConfigError, match=re.escape(says)):
        hooks_from_args(build_parser().parse_args(flags + qwd))
    args = build_parser().parse_args(["--use-distributed-optimizer", "--bf16"] + qwd)
    args.reuse_grad_buf_for_mxfp8_param_ag = True  # Megatron-LM's own flags (not in this driver's parser)
    with pytest.raises(ConfigError, match="reuse-grad-buf-for-mxfp8"):
        hooks_from_args(args)
    with pytest.raises(ConfigError, match="needs dp_param_difference"):
        hooks_from_args(build_parser().parse_args(["--zpp-dp-param-resync-interval", "5"]))


def test_megatron_lm_training_flags():
    """Recomputation changes no number (selective and full give the plain run's losses bit for bit);
    --init-method-std changes the start; --eval-interval evaluates mid-run (with overlapped parameter
    gathers) without changing training; --exit-interval stops early; --fp16 trains with loss scaling."""
    r = run_distributed(checks.megatron_lm_flags, 2, 5, ranks_per_node=1, timeout_s=600)[0]
    print("\n", {k: v for k, v in r.items()})
    assert r["selective"] == r["plain"] and r["full"] == r["plain"], r
    assert r["init_std"][0] != r["plain"][0]
    assert r["eval_losses"] == r["plain"] and len(r["eval_lines"]) == 2, r["eval_lines"]  # iterations 2 and 4
    assert r["exit"] == r["plain"][:3]
    fp16 = r["fp16"]
    assert fp16["finite"] and len(fp16["losses"]) == 5 and fp16["losses"][-1] < fp16["losses"][0], fp16
