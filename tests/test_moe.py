"""Mixture-of-Experts in pretrain_gpt.py (issue 25): Megatron-LM's flags, their checks, and expert buckets under
every ZeRO path and policy, with the expert-data-parallel replicas compared at every use."""

import argparse
import re
from pathlib import Path

import moe_checks as checks
import pytest

from megatron_zpp.policy import ConfigError
from megatron_zpp.testing import run_distributed
from megatron_zpp.training.arguments import build_parser, validate_args
from megatron_zpp.training.moe import moe_freq_type


def _args(*flags: str, world: int = 4) -> argparse.Namespace:
    return validate_args(build_parser().parse_args(list(flags)), world)


@pytest.mark.parametrize("text", ["1", "2", "([1]*3+[0]*1)*3", "[0]+[1]*23", "([1]*3+[0]*2)*2", "[1,0,1]"])
def test_moe_layer_freq_reads_what_megatron_lm_reads(text):
    from megatron.training.arguments import moe_freq_type as megatron_moe_freq_type

    assert moe_freq_type(text) == megatron_moe_freq_type(text)


@pytest.mark.parametrize("text", ["[2,0]", "__import__('os')", "[1]*x", "one"])
def test_moe_layer_freq_refuses_what_is_not_a_pattern(text):
    with pytest.raises(argparse.ArgumentTypeError, match="moe-layer-freq|pattern|integer"):
        moe_freq_type(text)


def test_expert_parallel_sizes_follow_the_world():
    args = _args("--num-experts", "8", "--expert-model-parallel-size", "2", world=4)
    assert (args.expert_tensor_parallel_size, args.expert_data_parallel_size) == (1, 2)
    assert args.moe_ffn_hidden_size == args.ffn_hidden_size
    dense = _args(world=4)
    assert dense.expert_data_parallel_size is None and dense.num_experts is None


@pytest.mark.parametrize("flags,message", [
    (["--num-experts", "6", "--expert-model-parallel-size", "4"],
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4; valid expert-parallel sizes: 1, 2, 3, 6"),
    (["--num-experts", "8", "--expert-model-parallel-size", "8"],
     "world size 4 is not divisible by expert-tensor .1. x expert-model .8. x pipeline .1. parallel size = 8"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 without --num-experts"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk 5 must be between 1 and --num-experts 4"),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], "needs DeepEP or HybridEP .*valid here: "
                                                                    "allgather, alltoall"),
    (["--num-experts", "4", "--num-layers", "2", "--moe-layer-freq", "[1,0,1]"],
     "--moe-layer-freq pattern has 3 entries; it needs one per layer .--num-layers 2."),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff",
      "0.1"], "one coefficient per --moe-router-load-balancing-type"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], "needs --sequence-parallel"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     "--expert-tensor-parallel-size 2: this GPT's linear layers have biases"),
])
def test_bad_moe_flags_name_the_value_and_the_valid_choices(flags, message):
    with pytest.raises(ConfigError, match=message):
        _args(*flags)


def test_grouped_gemm_is_refused_without_a_gpu():
    from megatron_zpp.training.moe import check_moe_runs_here

    args = _args("--num-experts", "4", "--moe-grouped-gemm")
    with pytest.raises(ConfigError, match="--moe-grouped-gemm runs Transformer Engine's grouped GEMM on a GPU and "
                                          "this machine has no GPU; drop the flag"):
        check_moe_runs_here(args, cuda=False, impl="local")
    check_moe_runs_here(args, cuda=True, impl="transformer_engine")  # where it can run: no error


MOE_LAYOUTS = {
    "distopt-overlap-both": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                             "--ddp-bucket-size", "20000", "--moe-token-dispatcher-type", "alltoall"],
    "fsdp-hpz": ["--use-megatron-fsdp", "--bf16", "--overlap-grad-reduce", "--overlap-param-gather",
                 "--moe-token-dispatcher-type", "alltoall"],
    "distopt-allgather": ["--use-distributed-optimizer", "--moe-token-dispatcher-type", "allgather"],
}


@pytest.mark.parametrize("layout", ["distopt-overlap-both", "fsdp-hpz",
                                    pytest.param("distopt-allgather", marks=pytest.mark.slow)])
def test_expert_replicas_compute_with_identical_weights_at_every_use(layout):
    """A MoE GPT (4 experts, top-2, EP=2 on 2 simulated nodes x 2: expert-data-parallel 2, data-parallel 4):
    dense modules compared over the data-parallel group and expert modules over the expert-data-parallel group at
    every forward and backward use, under none (bit-identical to no plugin), fair, zeropp with error feedback,
    sdp4bit (on Megatron-FSDP the expert-data-parallel group has one member per node, so no hpZ copy: its expert
    buckets gather with qwZ's INT8 while the dense ones take 4-bit weight differences) and the hybrid codecs
    (mzhybrid: ZFP gradients, MPC weights and MPC on ep; zhybrid: ZFP weights); the aux loss is logged."""
    policies = ["none", "fair", "zeropp-ef", "sdp4bit", "mzhybrid", "zhybrid"]
    results = run_distributed(checks.moe_replicas, 4, MOE_LAYOUTS[layout], policies, 3, ranks_per_node=2,
                              timeout_s=600)
    for rank, by_policy in enumerate(results):
        for policy, r in by_policy.items():
            print(f"\n{layout} rank {rank} {policy}: {r['uses_compared']} uses compared ({r['expert_uses_compared']}"
                  f" of expert modules), {r['mismatches']} mismatches {r['first_mismatches'][:3]}; aux "
                  f"{ {k: v[-1] for k, v in r['aux'].items()} }")
            assert r["finite"], (layout, policy)
            assert r["expert_uses_compared"] > 0 and r["mismatches"] == 0, (layout, rank, policy, r)
            assert len(r["aux"]["load_balancing_loss"]) == 3, r["aux"]
        assert by_policy["none"]["losses"] == by_policy["absent"]["losses"], (layout, by_policy)
        assert by_policy["none"]["aux"] == by_policy["absent"]["aux"]
        if layout.startswith("distopt"):  # error feedback keeps expert and dense residuals apart
            ef = by_policy["zeropp-ef"]["ef_buckets"]
            assert any(n.startswith("ddp.expert.") for n in ef) and any(n.startswith("ddp.bucket") for n in ef), ef


@pytest.mark.parametrize("layout", ["distopt-overlap-both",
                                    # Megatron-FSDP's expert buckets also run in the replica test above
                                    pytest.param("fsdp-hpz", marks=pytest.mark.slow)])
def test_expert_buckets_travel_on_the_expert_data_parallel_group(layout):
    """Megatron hands each expert bucket's collective its expert-data-parallel group; the hooks build that group's
    own topology (here one rank per node: the whole exchange is inter-node) on a communicator of its own, distinct
    from the dense data-parallel group's; the aux loss is in the iteration log line."""
    results = run_distributed(checks.expert_bucket_groups, 4, MOE_LAYOUTS[layout], "zeropp", ranks_per_node=2,
                              timeout_s=600)
    for rank, r in enumerate(results):
        assert r["finite"]
        # EP=2 over ranks {0,1} and {2,3}: expert-data-parallel groups {0,2} and {1,3}, across the two nodes
        assert r["expert_dp"] == (rank % 2, rank % 2 + 2) and r["dense_dp"] == (0, 1, 2, 3), r
        assert set(r["groups"]) == {r["expert_dp"], r["dense_dp"]}, r["groups"]
        assert r["groups"][r["expert_dp"]]["nodes"] == 2 and r["groups"][r["expert_dp"]]["per_node"] == 1
        assert r["groups"][r["dense_dp"]]["nodes"] == 2 and r["groups"][r["dense_dp"]]["per_node"] == 2
        assert r["groups"][r["expert_dp"]]["private"] != r["groups"][r["dense_dp"]]["private"]
    lines = [line for line in results[0]["lines"] if " iteration " in line and "lm loss" in line]
    assert len(lines) == 2 and all(re.search(r"lm loss: \S+ \| load_balancing_loss: \d\.\d{6}E[+-]\d\d \|", x)
                                   for x in lines), lines
    print(f"\n{layout}: groups {results[0]['groups']}\n{lines[-1]}")


def test_expert_parallel_one_trains_and_none_is_bit_identical():
    """EP=1 (every rank holds all experts; Megatron-Core's own layers need the CPU shim's fix there) on 2 ranks
    with the allgather dispatcher: replicas identical at every use, none bit-identical to no plugin."""
    flags = ["--use-distributed-optimizer", "--moe-token-dispatcher-type", "allgather",
             "--expert-model-parallel-size", "1"]
    results = run_distributed(checks.moe_replicas, 2, flags, ["none", "zeropp"], 2, ranks_per_node=1,
                              timeout_s=600)
    for r in results:
        for policy, run in r.items():
            assert run["finite"] and run["mismatches"] == 0 and run["expert_uses_compared"] > 0, (policy, run)
        assert r["none"]["losses"] == r["absent"]["losses"]
        assert r["zeropp"]["losses"] != r["absent"]["losses"]  # the compressed path did run


def test_local_layers_at_expert_parallel_one_are_refused_on_a_gpu():
    from megatron_zpp.training.moe import check_moe_runs_here

    args = _args("--num-experts", "4")
    with pytest.raises(ConfigError, match="--transformer-impl local at --expert-model-parallel-size 1 fails in "
                                          "Megatron-Core 0.19"):
        check_moe_runs_here(args, cuda=True, impl="local")
    check_moe_runs_here(args, cuda=True, impl="transformer_engine")
    check_moe_runs_here(args, cuda=False, impl="local")  # the CPU shim's fix
    check_moe_runs_here(_args("--num-experts", "4", "--expert-model-parallel-size", "2"), cuda=True, impl="local")


def _bits(t):
    import torch

    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("codec", ["none", "mpc", "int8:block=128", pytest.param("zfp:rate=16", marks=pytest.mark.slow)])
def test_compressed_all_to_all_matches_the_exact_exchange(codec):
    """Variable splits (some zero), rows not a multiple of the block: lossless codecs and none bit-exact (NaN
    included), lossy ones within the codec's bound per received chunk, a NaN still NaN, the rows a rank keeps
    exact; bytes counted per peer's node: the inter-node bytes are the encoded payloads (padded to 16) sent to the
    other node."""
    import torch
    from test_codecs import error_bound

    from megatron_zpp.comm.any_codec import slot_bytes
    from megatron_zpp.compression import get_codec

    spec = get_codec(codec)
    results = run_distributed(checks.all_to_all_worker, 4, codec, ranks_per_node=2)
    for rank, r in enumerate(results):
        out, ref = r["out"], r["reference"]
        assert out.shape == ref.shape
        if spec.lossless:
            assert torch.equal(_bits(out), _bits(ref)), (codec, rank)
        else:
            for p, (o, e) in enumerate(zip(out.split(r["recv"]), ref.split(r["recv"]))):
                if p == rank or not e.numel():
                    assert torch.equal(_bits(o), _bits(e))  # kept exact
                    continue
                finite = torch.isfinite(e)
                assert torch.isnan(o[~finite]).all(), (codec, rank, p)
                # the codec block holding the NaN decodes to NaN (at most one block): the others are compared
                compared = finite & torch.isfinite(o)
                assert (~compared).sum() <= 128 * (~finite).sum(), (codec, rank, p)
                if codec.startswith("int8"):
                    bound = error_bound(e.reshape(-1).nan_to_num(0.0), spec).view_as(e)
                    assert ((o - e).abs() <= bound)[compared].all(), (codec, rank, p)
                else:  # ZFP rate 16 on Gaussian rows: a relative error bound
                    assert ((o - e).abs()[compared] <= 1e-2 * e[finite].abs().max()).all(), (codec, rank, p)
        s = r["stats"]
        sent_other_node = [n for p, n in enumerate(r["send"]) if p // 2 != rank // 2]
        assert s.uncompressed_inter_bytes == sum(sent_other_node) * 96 * 4
        if spec.fixed_size:
            expected = sum(slot_bytes(spec.wire_bytes(n * 96, torch.float32)) if n else 0 for n in sent_other_node) \
                if codec != "none" else sum(sent_other_node) * 96 * 4
            assert s.inter_bytes == expected, (codec, rank, s)
        print(f"\n{codec} rank {rank}: inter-node {s.inter_bytes} B of {s.uncompressed_inter_bytes} uncompressed "
              f"(x{s.inter_ratio:.3f}), intra-node {s.intra_bytes} B")


EP_LOSSLESS = ["--zpp-ep-dispatch", "mpc", "--zpp-ep-dispatch-grad", "mpc", "--zpp-ep-combine", "mpc",
               "--zpp-ep-combine-grad", "mpc"]


def test_lossless_ep_codecs_train_bit_identically_and_int8_dispatch_stays_close():
    """On the MoE GPT with EP=2 (alltoall dispatcher): MPC on all four ep sites trains bit-identically to none and
    to no plugin; INT8 dispatch trains, differs, stays within 1% of none's loss after 4 iterations and sends ~1/4
    of the dispatch bytes; every site's bytes are counted."""
    runs = {"absent": [], "none": ["--zpp-policy", "none"], "mpc": EP_LOSSLESS,
            "int8": ["--zpp-ep-dispatch", "int8:block=128"],
            "int8-grad": ["--zpp-ep-dispatch-grad", "int8:block=128"]}
    results = run_distributed(checks.moe_ep_codecs, 4, runs, 4, ranks_per_node=2, timeout_s=600)
    for r in results:
        assert r["absent"]["losses"] == r["none"]["losses"] == r["mpc"]["losses"], r
        assert r["int8"]["finite"] and r["int8"]["losses"] != r["none"]["losses"]
        assert abs(r["int8"]["losses"][-1] - r["none"]["losses"][-1]) <= 0.01 * r["none"]["losses"][-1]
        # the backward codec alone: the first forward is none's to the bit, the coded gradients change the rest
        grad = r["int8-grad"]["losses"]
        assert grad[0] == r["none"]["losses"][0] and grad[1:] != r["none"]["losses"][1:], (grad, r["none"]["losses"])
    r = results[0]
    assert set(r["none"]["traffic"]) == {"ep.dispatch", "ep.dispatch.grad", "ep.combine", "ep.combine.grad"}
    for name in ("none", "mpc", "int8"):
        for tag, s in sorted(r[name]["traffic"].items()):
            print(f"\n{name} {tag}: inter {s['inter_bytes']} B / {s['uncompressed_inter_bytes']} uncompressed "
                  f"(x{s['inter_ratio']:.3f}), intra {s['intra_bytes']} B")
    def ratio(s):  # EP=2 groups are {0,1} and {2,3} in Megatron's rank order: intra-node here
        return (s["intra_bytes"] + s["inter_bytes"]) / (s["uncompressed_intra_bytes"] + s["uncompressed_inter_bytes"])

    # the tokens at ~(1 + 4/128)/4 of their bytes; the routing probabilities (1/hidden of them) exact
    assert 0.2 < ratio(r["int8"]["traffic"]["ep.dispatch"]) < 0.32, r["int8"]["traffic"]
    assert ratio(r["int8"]["traffic"]["ep.combine"]) == 1.0
    assert ratio(r["int8"]["traffic"]["ep.dispatch.grad"]) == 1.0  # each site's codec on its own direction only
    assert ratio(r["int8-grad"]["traffic"]["ep.dispatch"]) == 1.0
    assert 0.2 < ratio(r["int8-grad"]["traffic"]["ep.dispatch.grad"]) < 0.32, r["int8-grad"]["traffic"]


def test_allgather_dispatcher_ep_codecs_lossless_bit_identical_and_tp_codec_leaves_moe_exchanges_exact():
    """The allgather dispatcher at TP 2 x EP 2 (sequence parallel; expert TP 1, so its gathers span the EP group):
    MPC on all four ep sites trains bit-identically to none; INT8 dispatch trains, differs, stays
    within 1% and sends ~1/4 of the token bytes; a lossless tp codec (MPC) compresses the tensor-parallel group's
    activations only and trains bit-identically too (the router's integer token counts and the TP x EP token
    exchanges, which travel through the same Megatron functions, are not tp traffic)."""
    # (none == no plugin is pinned in every layout elsewhere; four runs keep this test short)
    runs = {"none": ["--zpp-policy", "none"], "mpc": EP_LOSSLESS, "int8": ["--zpp-ep-dispatch", "int8:block=128"],
            "tp-mpc": ["--zpp-tp", "mpc"]}
    parallel = ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1")
    results = run_distributed(checks.moe_ep_codecs, 4, runs, 3, "allgather", parallel, ranks_per_node=2,
                              timeout_s=600)
    for r in results:
        assert r["none"]["losses"] == r["mpc"]["losses"] == r["tp-mpc"]["losses"], r
        assert r["int8"]["finite"] and r["int8"]["losses"] != r["none"]["losses"]
        assert abs(r["int8"]["losses"][-1] - r["none"]["losses"][-1]) <= 0.01 * r["none"]["losses"][-1]
    r = results[0]
    for name in ("none", "mpc", "int8", "tp-mpc"):
        for tag, s in sorted(r[name]["traffic"].items()):
            print(f"\n{name} {tag}: {s['calls']} calls, inter {s['inter_bytes']} B / {s['uncompressed_inter_bytes']} "
                  f"uncompressed (x{s['inter_ratio']:.3f}), intra {s['intra_bytes']} B")
    none, mpc, int8 = (r[n]["traffic"] for n in ("none", "mpc", "int8"))
    sites = {"ep.dispatch", "ep.dispatch.grad", "ep.combine", "ep.combine.grad"}
    assert set(none) == set(mpc) == sites
    for tag in sites:  # one token exchange per MoE layer and micro-batch, forward and backward; the bytes agree
        assert none[tag]["calls"] == mpc[tag]["calls"] == int8[tag]["calls"] > 0, tag
        assert (mpc[tag]["uncompressed_intra_bytes"], mpc[tag]["uncompressed_inter_bytes"]) == (
            none[tag]["intra_bytes"], none[tag]["inter_bytes"]), tag

    def total(s, raw=""):
        return s[f"{raw}intra_bytes"] + s[f"{raw}inter_bytes"]

    # the dispatched tokens at ~(1 + 4/128)/4 of their bytes (the routing map and probabilities exact), the combine
    # untouched (EP groups are {0,1} and {2,3} in Megatron's rank order: intra-node here)
    assert 0.2 < total(int8["ep.dispatch"]) / total(int8["ep.dispatch"], "uncompressed_") < 0.4, int8["ep.dispatch"]
    assert total(int8["ep.combine"]) == total(none["ep.combine"]) > 0
    assert r["tp-mpc"]["traffic"]["tp"]["calls"] > 0


@pytest.mark.parametrize("preset", ["mzhybrid", "hybrid"])
def test_hybrid_presets_run_lossless_ep_codecs_where_the_job_has_an_expert_parallel_exchange(preset):
    """mzhybrid and hybrid carry MPC on the four ep sites: on when the MoE exchange can take them, off (not an
    error) for a dense model, at EP 1 or with the overlapped exchange; a --zpp-ep-* flag is the user's own and is
    still refused there, naming the reason."""
    from megatron_zpp.megatron import hooks_from_args
    from megatron_zpp.policy import EP_DIMENSIONS

    moe = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    runs = hooks_from_args(_args("--zpp-policy", preset, *moe)).policy
    assert {d: runs.codec(d) for d in EP_DIMENSIONS} == dict.fromkeys(EP_DIMENSIONS, "mpc:dim=1")
    overlapped = _args("--zpp-policy", preset, *moe)
    overlapped.overlap_moe_expert_parallel_comm = True  # Megatron-LM's flags (its own script)
    shared_overlap = _args("--zpp-policy", preset, *moe)
    shared_overlap.moe_shared_expert_overlap = True
    for idle in (_args("--zpp-policy", preset), _args("--zpp-policy", preset, "--num-experts", "4"), overlapped,
                 shared_overlap):
        policy = hooks_from_args(idle).policy
        assert {d: policy.codec(d) for d in EP_DIMENSIONS} == dict.fromkeys(EP_DIMENSIONS, "none"), idle
        assert policy.codec("tp") == runs.codec("tp") == "mpc:dim=1"
    with pytest.raises(ConfigError, match="--zpp-ep-combine int8:block=128[^:]*: .*this model has no experts"):
        hooks_from_args(_args("--zpp-policy", preset, "--zpp-ep-combine", "int8:block=128"))
    # a policy file of the user's own is theirs, as a flag is: refused where it cannot run, not dropped
    mine = str(Path(__file__).resolve().parents[1] / "configs/policies/moe/zeropp-int8-dispatch.yaml")
    with pytest.raises(ConfigError, match="--zpp-ep-dispatch int8:block=128[^:]*: .*this model has no experts"):
        hooks_from_args(_args("--zpp-policy", mine))


@pytest.mark.parametrize("flags,message", [
    (["--zpp-ep-dispatch", "int8:block=128"], "this model has no experts"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex",
      "--zpp-ep-combine", "mpc"],  # refused before the ep check (flex needs GPU kernels)
     "--moe-token-dispatcher-type flex needs DeepEP or HybridEP"),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "alltoall", "--zpp-ep-dispatch", "mpc"],
     "--expert-model-parallel-size 1 sends no tokens"),
    (["--num-experts", "4", "--zpp-ep-dispatch", "int9"], "ep.dispatch"),
])
def test_ep_codecs_refused_where_they_cannot_run(flags, message):
    from megatron_zpp.megatron import hooks_from_args

    with pytest.raises(ConfigError, match=message):
        hooks_from_args(_args(*flags))


def test_ep_codecs_refused_with_the_flex_dispatcher_and_the_overlapped_exchange():
    """Megatron-LM's own script reaches the ep check without our MoE validation: the flex dispatcher and
    --overlap-moe-expert-parallel-comm are refused there, naming the flag and the reason."""
    from megatron_zpp.megatron import check_expert_parallel_codecs
    from megatron_zpp.policy import resolve_policy
    from megatron_zpp.policy.config import ZppConfig

    policy = resolve_policy(ZppConfig(policy="none", ep_combine="mpc"))
    args = _args("--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall")
    check_expert_parallel_codecs(args, policy)  # runs here
    args.moe_token_dispatcher_type = "flex"
    with pytest.raises(ConfigError, match="--zpp-ep-combine mpc:dim=1: the ep codecs hook the alltoall and allgather "
                                          "token dispatchers; --moe-token-dispatcher-type is flex; valid with ep "
                                          "codecs: alltoall, allgather"):
        check_expert_parallel_codecs(args, policy)
    args.moe_token_dispatcher_type, args.overlap_moe_expert_parallel_comm = "allgather", True
    with pytest.raises(ConfigError, match="--zpp-ep-combine mpc:dim=1: --overlap-moe-expert-parallel-comm"):
        check_expert_parallel_codecs(args, policy)
    # the allgather dispatcher's compressed collectives need the same members on every node
    args.overlap_moe_expert_parallel_comm, args.zpp_ranks_per_node = False, 3
    with pytest.raises(ConfigError, match="expert TP x EP = 2 consecutive ranks, which 3 ranks per node split "
                                          "unevenly"):
        check_expert_parallel_codecs(args, policy)
    args.moe_token_dispatcher_type = "alltoall"  # its all-to-all has no such constraint
    check_expert_parallel_codecs(args, policy)
