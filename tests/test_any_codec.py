"""Multi-process gloo tests of the any-codec collectives (ZFP, lossless) on simulated nodes."""

import pytest

import any_codec_checks as checks
from megatron_zpp.comm.any_codec import _SIZE_BYTES
from megatron_zpp.testing import run_distributed

# one node, one rank per node, two hops, and an odd node size
LAYOUTS = [(1, 3), (3, 1), (2, 2)]


@pytest.mark.parametrize("nodes,per_node", LAYOUTS, ids=[f"{n}x{p}" for n, p in LAYOUTS])
def test_any_codec_collectives(nodes, per_node):
    """Lossless codecs reproduce the uncompressed reduce-scatter and torch's all-gather bit for bit; ZFP
    reproduces a single-process replay of the algorithm bit for bit, for fp32/bf16 and sizes 1/7/1000."""
    results = run_distributed(checks.collectives_worker, nodes * per_node, 11, ranks_per_node=per_node)
    expected = len(checks.DTYPES) * len(checks.SIZES)
    for r in results:
        assert len(r["lossless_equal"]) == len(checks.LOSSLESS) * expected
        assert len(r["lossy_replayed"]) == len(checks.LOSSY) * expected
    worst: dict[str, float] = {}
    for r in results:
        for key, (rel, unit) in r["lossy_rel_err"].items():
            spec = key.split(" ")[0]
            worst[spec] = max(worst.get(spec, 0.0), rel / unit)
    print(f"\n{nodes}x{per_node} worst relative L2 error of the reduce-scatter / the codec's own:", worst)
    # The bit-exact replay above is the real check; this one catches a replay that is wrong the same way.
    # On the path: two encodes (hop 1, hop 2) and, in 16-bit, two roundings (the partial sums, the
    # output), each about one unit: 4 units, with slack for the spread of one tensor's error.
    assert all(v < 8 for v in worst.values()), worst


def test_any_codec_all_reduce():
    results = run_distributed(checks.all_reduce_worker, 4, ranks_per_node=2)
    for (spec, dtype, numel), rel in results[0].items():
        if spec in checks.LOSSLESS:
            # equal to the uncompressed all-reduce (asserted in the worker): only bf16 rounding of the mean
            assert rel < (1e-2 if "bfloat16" in dtype else 1e-6), (spec, dtype, numel, rel)
        else:
            assert rel < 0.1, (spec, dtype, numel, rel)


def test_variable_size_bytes_are_the_payloads():
    """The counters hold the payloads' true sizes (lossless: less than raw on compressible data) plus one
    size message per peer; the all-gather counts the padding to the largest payload."""
    length = 4096
    results = run_distributed(checks.bytes_worker, 4, length, ranks_per_node=2)
    for r in results:
        for spec in ("mpc", "zfp:rate=8"):
            counted, expected = r[(spec, "ag")]
            assert counted == expected, (spec, counted, expected)
        # MPC on bf16 Gaussian data is ~1.28x: the reduce-scatter moves fewer bytes than uncompressed
        assert r[("mpc", "rs_total")] < r[("mpc", "rs_uncompressed")], r
        # ZFP rate 8 on 16-bit data: ~half (+ size-free fixed payloads)
        assert r[("zfp:rate=8", "rs_total")] <= 0.55 * r[("zfp:rate=8", "rs_uncompressed")], r
    assert _SIZE_BYTES == 8


def test_nan_reaches_the_output_through_every_codec():
    results = run_distributed(checks.nan_worker, 4, ranks_per_node=2)
    for spec, (nan_at_5, finite_elsewhere) in results[0].items():
        assert nan_at_5, spec
    for r in results:
        for spec, (_, finite_elsewhere) in r.items():
            assert finite_elsewhere, spec


@pytest.mark.parametrize("spec", ["int4:block=128", "int4:block=128,hadamard=32", "zfp:rate=8"])
@pytest.mark.parametrize("nodes,per_node", [(1, 4), (4, 1)], ids=["1x4", "4x1"])
def test_error_feedback_returns_what_the_codec_lost(spec, nodes, per_node):
    results = run_distributed(checks.error_feedback_worker, nodes * per_node, spec, 6, ranks_per_node=per_node)
    for r in results:
        # sum of outputs + residuals left == sum of exact inputs (fp32 arithmetic on the way)
        assert r["residual_norm"] > 0 and r["identity_err"] < 1e-5, r
    r = results[0]
    print(f"\n{spec} {nodes}x{per_node}: accumulated error over 6 steps with feedback {r['drift_with']:.2e}, "
          f"without {r['drift_without']:.2e}")


@pytest.mark.parametrize("spec", ["int4:block=128", "zfp:rate=8"])
def test_error_feedback_survives_a_non_finite_step(spec):
    results = run_distributed(checks.error_feedback_non_finite_worker, 4, spec, ranks_per_node=2)
    assert results[0]["inf_reached_owner"], results[0]  # the overflow is still seen by Megatron's check
    for r in results:
        assert r["next_step_finite"] and r["residual_finite"], r
