"""tools/calibrate.py (alpha-beta fit, YAML writer) and tools/model_check.py (error statistics)."""

import csv
import dataclasses
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import calibrate  # noqa: E402
import model_check  # noqa: E402
import netemu  # noqa: E402

from megatron_zpp import advise  # noqa: E402
from megatron_zpp.perfmodel import ClusterSpec, from_dict, load_cluster, load_workload, predict  # noqa: E402


# ---------------------------------------------------------------------------------------------- alpha-beta fit


@pytest.mark.parametrize("alpha, bandwidth, steps", [(1.9e-3, 12.5e6, 1), (50e-6, 2e9, 3), (0.0, 1e8, 1)])
def test_fit_recovers_alpha_and_bandwidth(alpha, bandwidth, steps):
    sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20]
    times = [steps * alpha + x / bandwidth for x in sizes]
    fit = calibrate.fit_alpha_beta(sizes, times, steps=steps)
    assert fit.alpha == pytest.approx(alpha, rel=1e-9, abs=1e-15)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-9)
    assert fit.max_rel_residual < 1e-9


def test_fit_with_noise_is_least_squares():
    # +-1% alternating noise around 2 ms + x / 100 MB/s: the fit stays within a few percent of the truth and
    # reports the residual it could not explain.
    sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20]
    times = [(2e-3 + x / 1e8) * (1 + 0.01 * (-1) ** i) for i, x in enumerate(sizes)]
    fit = calibrate.fit_alpha_beta(sizes, times)
    assert fit.bandwidth == pytest.approx(1e8, rel=0.03)
    assert fit.alpha == pytest.approx(2e-3, rel=0.5)
    assert 0.001 < fit.max_rel_residual < 0.1


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="two distinct sizes"):
        calibrate.fit_alpha_beta([1024, 1024], [1.0, 1.1])
    with pytest.raises(ValueError, match="does not grow with size"):
        calibrate.fit_alpha_beta([1024, 2048, 4096], [3.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="2 sizes but 3 times"):
        calibrate.fit_alpha_beta([1, 2], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="size 'lots'.*64K"):
        calibrate.parse_size("lots")
    assert calibrate.parse_size("64K") == 65536 and calibrate.parse_size("8MB") == 8 << 20


# ---------------------------------------------------------------------------------------------- YAML writer


def _calibration(**overrides) -> calibrate.Calibration:
    def fit(alpha, bw):
        return calibrate.Fit(alpha=alpha, bandwidth=bw, intercept=alpha, max_rel_residual=0.01,
                             points=[(1.0, 2.0), (3.0, 4.0)])

    fields = dict(
        nodes=2, ranks_per_node=2, backend="gloo", intra=fit(2e-4, 3e8), inter=fit(1e-3, 11.25e6),
        inter_unshaped=fit(1.1e-3, 6e8), nominal_rate_bits=100e6,
        layer={"hidden": 256, "heads": 8, "seq_length": 256, "micro_batch": 4, "fwd_bwd_s": 0.3, "spread": 0.05,
               "impl": "test layer"},
        gamma=0.97, gamma_covered=True, codecs={"int8": {"quantize": 1e10, "dequantize": 3e10},
                                                "int4": {"quantize": 9e9, "dequantize": 2.5e10}},
        reduce_throughput=7e9, optimizer_params_per_s=2e8, optimizer_fixed_s=-1e-4, small_collective_s=2e-3,
        step_collectives=2,
        cross_checks=[{"kind": "all_gather_into_tensor", "rate": "100mbit", "shard_bytes": 1 << 20,
                       "measured_s": 0.26, "predicted_s": 0.28, "name": "ag"}])
    return calibrate.Calibration(**{**fields, **overrides})


def _assert_close(a, b, where="cluster"):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-3), where
    else:
        assert a == b, where


def test_written_yaml_loads_and_round_trips(tmp_path):
    c = _calibration()
    fields = calibrate.cluster_fields(c, "emulated-test", "unit test: 'quotes' and: colons")
    path = tmp_path / "c.yaml"
    loaded = calibrate.write_cluster(path, fields, c)
    assert loaded == load_cluster(path)
    # The file says what was measured, to the 4 significant digits it writes.
    _assert_close(dataclasses.asdict(loaded), dataclasses.asdict(from_dict(ClusterSpec, fields, "fields")))
    assert loaded.source == "unit test: 'quotes' and: colons"
    # Derived numbers: efficiency = achieved / nominal; alpha from the unshaped fit; FLOPs / time; clamped gamma;
    # the Adam intercept clamped at 0 plus 2 small collectives.
    assert loaded.inter_link_efficiency == pytest.approx(11.25e6 / 12.5e6, rel=1e-3)
    assert loaded.inter_alpha == pytest.approx(1.1e-3, rel=1e-3)
    assert loaded.inter_bandwidth_cap == pytest.approx(6e8, rel=1e-3)
    assert loaded.compute_flops == pytest.approx(3 * calibrate.layer_forward_flops(256, 256, 4) / 0.3, rel=1e-3)
    assert loaded.gamma == 1.0
    assert loaded.optimizer_overhead_s == pytest.approx(4e-3, rel=1e-3)
    assert loaded.measured_layers[0].fwd_bwd_s == pytest.approx(0.3, rel=1e-3)
    assert loaded.codec("int4").dequantize == pytest.approx(2.5e10, rel=1e-3)
    # Written again from what was loaded: the same cluster (4 significant digits are a fixed point).
    again = calibrate.write_cluster(tmp_path / "d.yaml", dataclasses.asdict(loaded))
    assert again == loaded


def test_writer_keeps_no_invalid_file(tmp_path):
    fields = calibrate.cluster_fields(_calibration(), "bad", "")
    fields["inter_link_efficiency"] = 3.0
    with pytest.raises(ValueError, match=r"inter_link_efficiency=3.0 must be in \(0, 1.2\]"):
        calibrate.write_cluster(tmp_path / "c.yaml", fields)
    assert not any(tmp_path.iterdir())


def test_add_iteration_adds_or_replaces_one_shape_and_the_model_uses_it(tmp_path):
    """--add-iteration's YAML edit: a new shape appended, the same shape replaced, every other line kept, and a
    workload of that shape then predicted from the measurement instead of the layer's FLOPs."""
    path = ROOT / "configs" / "clusters" / "emulated-2x2.yaml"
    copy = tmp_path / "c.yaml"
    copy.write_text(path.read_text())
    before = load_cluster(copy)
    tiny = load_workload(ROOT / "configs" / "workloads" / "tiny-gpt-2x2.yaml")
    # A micro-batch the committed file has no measurement of (it has 4, and 1 since 2026-11-28).
    tiny = dataclasses.replace(tiny, layout=dataclasses.replace(tiny.layout, micro_batch=2, global_batch=8))
    m = tiny.model
    entry = dict(layers=m.layers, hidden=m.hidden, seq_length=m.seq_length, micro_batch=2, vocab=m.vocab, fwd_bwd_s=0.4)
    measured = {"per_process_s": [0.41, 0.43], "step_s": 0.43}
    from_flops = predict(before, tiny, "fair").compute_s
    after = calibrate.add_measured_iteration(copy, entry, measured, note="unit test")
    n = len(before.measured_iterations)
    assert after.measured_iterations[:-1] == before.measured_iterations and len(after.measured_iterations) == n + 1
    assert after.measured_iterations[-1].fwd_bwd_s == pytest.approx(0.4)
    assert dataclasses.replace(after, measured_iterations=before.measured_iterations) == before
    # Every other line kept, in order: the file gained exactly the new entry, right after the old one.
    old_lines, new_lines = path.read_text().splitlines(), copy.read_text().splitlines()
    added = [i for i, x in enumerate(new_lines) if "micro_batch: 2," in x]
    assert len(added) == 1 and new_lines[:added[0]] + new_lines[added[0] + 1:] == old_lines
    assert "measured_iterations" in new_lines[added[0] - 1 - n] and "unit test" in new_lines[added[0]]
    assert predict(after, tiny, "fair").compute_s == pytest.approx(0.4, rel=1e-3) != from_flops
    # The same shape again: replaced, not duplicated.
    again = calibrate.add_measured_iteration(copy, {**entry, "fwd_bwd_s": 0.5})
    assert len(again.measured_iterations) == n + 1 and again.measured_iterations[-1].fwd_bwd_s == pytest.approx(0.5)
    # An invalid entry keeps the file as it was.
    text = copy.read_text()
    with pytest.raises(ValueError, match="fwd_bwd_s"):
        calibrate.add_measured_iteration(copy, {**entry, "micro_batch": 3, "fwd_bwd_s": -1.0})
    assert copy.read_text() == text and not (tmp_path / "c.yaml.tmp").exists()


def test_real_cluster_without_rate_has_no_cap_and_unit_efficiency(tmp_path):
    c = _calibration(inter_unshaped=None, nominal_rate_bits=None)
    loaded = calibrate.write_cluster(tmp_path / "c.yaml", calibrate.cluster_fields(c, "real", ""), c)
    assert loaded.inter_bandwidth_cap is None and loaded.inter_link_efficiency == 1.0
    assert loaded.inter_alpha == pytest.approx(1e-3, rel=1e-3)  # the only fit there is
    with pytest.raises(ValueError, match="no inter_bandwidth_cap"):
        advise.at_link_rate(loaded, None)


def test_link_rate_uses_efficiency_and_cap():
    c = load_cluster(ROOT / "configs/clusters/emulated-2x2.yaml")
    c = dataclasses.replace(c, inter_link_efficiency=0.9, inter_bandwidth_cap=5e8)
    assert advise.at_link_rate(c, 100e6).inter_bandwidth == pytest.approx(0.9 * 12.5e6)
    assert advise.at_link_rate(c, 1e12).inter_bandwidth == 5e8  # the host's ceiling
    assert advise.at_link_rate(c, None).inter_bandwidth == 5e8
    assert advise.with_inter_bandwidth(c, 1e6, nominal=False).inter_bandwidth == 1e6


# ---------------------------------------------------------------------------------------------- model_check


def _cluster() -> ClusterSpec:
    return from_dict(ClusterSpec, calibrate.cluster_fields(_calibration(), "synthetic", ""), "synthetic")


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_model_check_error_statistics(tmp_path, capsys):
    """Rows measured at known offsets from the model's predictions: the statistics must report those offsets."""
    cluster = _cluster()
    workloads = model_check.load_workloads()
    cases = [("100mbit", 100e6, "megatron", 0.10), ("100mbit", 100e6, "zeropp", -0.02),
             ("unshaped", None, "fair", 0.04), ("unshaped", None, "megatron", -0.30)]
    rows = []
    for rate, bits, policy, offset in cases:
        p = predict(advise.at_link_rate(cluster, bits), workloads["distopt"], policy)
        rows.append({"path": "distopt", "rate": rate, "rate_bits_per_s": bits or "", "policy": policy,
                     "iterations": 5, "seconds_per_iteration": p.step_time_s / (1 + offset),
                     "exposed_comm_s": 0.1, "codec_s": 0.0,
                     "inter_bytes_per_iteration": model_check.counted_like(p, workloads["distopt"], 5) * 1.01})
    path = tmp_path / "training.csv"
    _write_csv(path, rows)
    with open(path) as f:
        checks = model_check.check_rows(list(csv.DictReader(f)), cluster, workloads)
    assert [round(c.rel_error, 9) for c in checks] == [o for *_, o in cases]
    stats = model_check.error_stats(checks, lambda c: c.rate)
    assert stats["all"]["median"] == pytest.approx((0.04 + 0.10) / 2)
    assert stats["all"]["max"] == pytest.approx(0.30)
    assert stats["100mbit"]["max"] == pytest.approx(0.10) and stats["unshaped"]["median"] == pytest.approx(0.17)
    assert stats["all"]["bytes_max"] == pytest.approx(1 - 1 / 1.01)  # counted 1% above the model
    # The shaped rows see nominal x efficiency, the unshaped ones the cap: a slower link, a longer step.
    assert checks[0].predicted_s > checks[3].predicted_s
    assert model_check.main([str(path), "--cluster", str(tmp_path / "c.yaml")]) == 2  # no such cluster file
    calibrate.write_cluster(tmp_path / "c.yaml", calibrate.cluster_fields(_calibration(), "synthetic", ""))
    assert model_check.main([str(path), "--cluster", str(tmp_path / "c.yaml")]) == 0
    out = capsys.readouterr().out
    assert "all rows     4 rows: step time |error| median   7.0%, max  30.0%" in out and "NOT met" in out


def test_model_check_ranks_policies_and_reports_the_picks_regret(tmp_path, capsys):
    """At each (path, rate) the pick is the policy the model predicts fastest; its regret is its measured time over
    the measured best's. Measured times are set so the model's pick loses at 100 Mbit/s and wins unshaped."""
    cluster = _cluster()
    workloads = model_check.load_workloads()
    rows = []
    for rate, bits in (("100mbit", 100e6), ("unshaped", None)):
        pred = {pol: predict(advise.at_link_rate(cluster, bits), workloads["distopt"], pol).step_time_s
                for pol in ("megatron", "zeropp")}
        fast = min(pred, key=pred.get)
        slow = max(pred, key=pred.get)
        measured = {fast: 1.25, slow: 1.0} if rate == "100mbit" else {fast: 1.0, slow: 2.0}
        for pol, seconds in measured.items():
            # repeats count by their median: the means and extremes of these patterns would rank otherwise
            for repeat in ((0.5, 1.0, 1.1) if pol == fast else (0.4, 1.0, 3.0)):
                rows.append(dict(path="distopt", rate=rate, rate_bits_per_s=bits or "", policy=pol, iterations=5,
                                 seconds_per_iteration=seconds * repeat, inter_bytes_per_iteration=1.0))
    rows.append(dict(path="fsdp", rate="1gbit", rate_bits_per_s=1e9, policy="zeropp", iterations=5,
                     seconds_per_iteration=1.0, inter_bytes_per_iteration=1.0))  # alone at its rate: no ranking
    checks = model_check.check_rows([{k: str(v) for k, v in r.items()} for r in rows], cluster, workloads)
    picks = model_check.ranking(checks)
    assert [(p.path, p.rate, p.policies) for p in picks] == [("distopt", "100mbit", 2), ("distopt", "unshaped", 2)]
    lost, won = picks
    assert lost.pick != lost.best and lost.regret == pytest.approx(1.25)
    assert lost.pick_s == pytest.approx(1.25) and lost.best_s == pytest.approx(1.0)
    assert won.pick == won.best and won.regret == 1.0 and won.best_s == pytest.approx(1.0)
    at100 = {c.policy: c.predicted_s for c in checks if c.rate == "100mbit"}
    assert lost.margin == pytest.approx(max(at100.values()) / min(at100.values()) - 1)  # the pick's predicted lead
    stats = model_check.ranking_stats(picks)
    assert stats["picked_best"] == 1 and stats["regret_median"] == pytest.approx(0.125)
    assert stats["regret_max"] == pytest.approx(0.25)
    text = model_check.ranking_report(picks)
    assert "picked the measured best in 1 of 2" in text and "median 12.5%" in text and "NOT met" in text


def test_model_check_names_bad_rows():
    cluster, workloads = _cluster(), model_check.load_workloads()
    row = {"path": "zero3", "rate": "1gbit", "rate_bits_per_s": "1e9", "policy": "fair", "iterations": "5",
           "seconds_per_iteration": "1.0", "inter_bytes_per_iteration": "1"}
    with pytest.raises(ValueError, match="row 1: path='zero3' has no workload; valid: distopt, fsdp"):
        model_check.check_rows([row], cluster, workloads)
    with pytest.raises(ValueError, match=r"row 1: missing column\(s\) \['seconds_per_iteration'\]"):
        model_check.check_rows([{k: v for k, v in row.items() if k != "seconds_per_iteration"}], cluster, workloads)


def test_counted_bytes_are_the_training_loop_only(tmp_path):
    """The trainer's byte window closes with the loop: the model's per-iteration bytes compare as they are."""
    workload = load_workload(ROOT / "configs/workloads/tiny-gpt-2x2.yaml")
    p = predict(_cluster(), workload, "megatron")
    assert model_check.counted_like(p, workload, 5) == p.inter_bytes


# ---------------------------------------------------------------------------------------------- on namespaces


def test_emulated_link_efficiency_is_plausible():
    """One TCP stream over a shaped emulated link delivers 80-100% of the nominal rate (what calibrate stores)."""
    ok, why = netemu.namespaces_available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    with netemu.EmulatedCluster(netemu.NetemuConfig(nodes=2, ranks_per_node=1, rate="200mbit")) as cluster:
        result = netemu.measure_stream(cluster, 8 << 20)
    efficiency = result["bits_per_s"] / 200e6
    assert 0.75 < efficiency <= 1.05, efficiency
    assert math.isfinite(efficiency)


def test_add_iteration_keeps_the_files_form(tmp_path):
    """The edit keeps what it does not own: the block line's comment, CRLF endings, comment lines between entries;
    a note without timings stays a comment; a shape listed twice ends up once."""
    base = (ROOT / "configs" / "clusters" / "emulated-2x2.yaml").read_text()
    head, rest = base.split("measured_iterations:\n", 1)
    body = rest.split("gamma:", 1)[1]
    entry = dict(layers=4, hidden=256, seq_length=256, micro_batch=3, vocab=257, fwd_bwd_s=0.7)
    from megatron_zpp.training.calibration import measured_iteration_line as line
    # '[]' with a comment; CRLF; a note alone.
    path = tmp_path / "a.yaml"
    path.write_bytes((head + "measured_iterations: []  # none yet\ngamma:" + body).replace("\n", "\r\n").encode())
    c = calibrate.add_measured_iteration(path, entry, note="by hand")
    raw = path.read_bytes().decode()
    assert "\n" not in raw.replace("\r\n", "") and "measured_iterations:  # none yet\r\n" in raw
    assert [m.micro_batch for m in c.measured_iterations] == [3] and "  # by hand\r\n" in raw
    # A comment line between entries, and the same shape twice: replaced once, the duplicate gone.
    path = tmp_path / "b.yaml"
    twice = line({**entry, "fwd_bwd_s": 0.1}) + "\n# a comment\n" + line({**entry, "fwd_bwd_s": 0.2}) + "\n"
    path.write_text(head + "measured_iterations:\n" + twice + "gamma:" + body)
    c = calibrate.add_measured_iteration(path, entry)
    assert [(m.micro_batch, m.fwd_bwd_s) for m in c.measured_iterations] == [(3, pytest.approx(0.7))]
    assert "# a comment" in path.read_text()


def test_add_iteration_refuses_a_real_clusters_yaml(tmp_path, capsys):
    real = tmp_path / "real.yaml"
    real.write_text((ROOT / "configs" / "clusters" / "emulated-2x2.yaml").read_text().replace("--emulate", ""))
    with pytest.raises(SystemExit):
        calibrate.main(["--add-iteration", str(ROOT / "configs" / "workloads" / "tiny-gpt-2x2.yaml"), "--out", str(real)])
    assert "it is for an emulated cluster's YAML" in capsys.readouterr().err


def test_add_iteration_needs_an_existing_cluster_yaml(tmp_path, capsys):
    with pytest.raises(SystemExit):
        calibrate.main(["--add-iteration", str(ROOT / "configs" / "workloads" / "tiny-gpt-2x2.yaml"),
                        "--out", str(tmp_path / "missing.yaml")])
    assert "--add-iteration adds to an existing cluster YAML" in capsys.readouterr().err
