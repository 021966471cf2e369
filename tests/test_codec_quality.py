"""tools/codec_quality.py: its metrics on synthetic cases with known answers, the ZFP-vs-zfpy check on a
saved tensor set (and that it does report a difference), the CLI, and (slow) a real capture from training."""

import csv
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import codec_quality as cq  # noqa: E402

from megatron_zpp.compression import Codec, Packed, get_codec  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def small_set(dtype: torch.dtype, seed: int = 0) -> dict[str, list[dict]]:
    """Weights, gradients and activations of a tiny MLP after one backward: real-ish values whose sizes
    leave partial ZFP blocks (9360 = 146 x 64 + 16, 480, 370) and partial INT8/INT4 blocks."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 48))
    x = torch.randn(10, 48)
    hidden = model[1](model[0](x))
    out = model[2](hidden)
    out.square().mean().backward()
    params = list(model.parameters())

    def entries(site_tensors):
        return [{"rank": 0, "site": site, "tensor": t.detach().reshape(-1).to(dtype).clone()} for site, t in site_tensors]

    return {
        "weights": entries([("params", torch.cat([p.reshape(-1) for p in params]))]),
        "gradients": entries([("main_grad", torch.cat([p.grad.reshape(-1) for p in params]))]),
        "tp activations": entries([("tp.all_reduce", out), ("tp.backward_all_reduce", hidden[:, :37])]),
        "pp activations": entries([("pp.send_next", hidden)]),
    }


@pytest.fixture
def saved_set(tmp_path) -> Path:
    for dname, dtype in DTYPES.items():
        cq.save(tmp_path, dname, small_set(dtype), {"source": "tests/test_codec_quality.py"})
    return tmp_path


# ------------------------------------------------------------------------------------- zfp vs zfpy -----
def test_zfp_equals_zfpy_on_a_saved_tensor_set(saved_set):
    captured = cq.load(saved_set, list(DTYPES))
    rows = cq.check_zfp(captured)
    assert len(rows) == len(DTYPES) * len(cq.ZFP_RATES) * len(cq.ZFP_DIMS) * len(cq.KINDS)
    assert {(r["rate"], r["dims"]) for r in rows} == {(r, d) for r in (4, 8, 16, 32) for d in (1, 2, 3)}
    for r in rows:
        assert r["equal"], r
        numels = [e["tensor"].numel() for e in captured[r["dtype"]][r["kind"]]]
        codec = get_codec(f"zfp:rate={r['rate']},dims={r['dims']}")
        assert r["tensors"] == len(numels)
        assert r["ours_bytes"] == r["zfpy_bytes"] == sum(codec.wire_bytes(n) for n in numels)
    assert "DIFFERENT" not in cq.format_zfp_check(rows)


def test_zfp_check_reports_a_difference(saved_set, monkeypatch, capsys):
    """The check must be able to fail: one flipped byte in zfpy's stream, and a non-finite tensor is
    counted apart (our NaN marker differs from zfp on purpose), not compared."""
    real = cq.zfpy_stream

    def flipped(x, rate, dims):
        s = bytearray(real(x, rate, dims))
        s[len(s) // 2] ^= 0x10
        return bytes(s)

    captured = cq.load(saved_set, ["fp32"])
    bad = captured["fp32"]["pp activations"][0]["tensor"].clone()
    bad[3] = float("nan")
    captured["fp32"]["pp activations"].append({"rank": 0, "site": "nan", "tensor": bad})
    rows = cq.check_zfp(captured, rates=(8,), dims_list=(3,))
    pp = next(r for r in rows if r["kind"] == "pp activations")
    assert pp["equal"] and pp["tensors"] == 1 and pp["nonfinite_skipped"] == 1

    monkeypatch.setattr(cq, "zfpy_stream", flipped)
    rows = cq.check_zfp(captured, rates=(8,), dims_list=(3,))
    assert rows and not any(r["equal"] for r in rows)
    assert all(r["stream_diffs"] == r["tensors"] for r in rows)
    assert "DIFFERENT" in cq.format_zfp_check(rows)
    assert cq.main(["--load-captured", str(saved_set), "--dtypes", "fp32", "--check-zfp"]) == 1
    assert "DIFFERENT" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------- metrics -----
def test_identity_has_no_error_and_ratio_one():
    tensors = [e["tensor"] for e in small_set(torch.float32)["weights"] + small_set(torch.float32)["tp activations"]]
    m = cq.measure(get_codec("none"), tensors, repeats=1, device=torch.device("cpu"))
    assert m["rel_l2"] == 0 and m["max_abs"] == 0 and m["max_rel"] == 0
    assert m["ratio"] == 1 and m["payload_bytes"] == m["raw_bytes"] == 4 * sum(t.numel() for t in tensors)
    assert m["encode_gbps"] > 0 and m["decode_gbps"] > 0


class ShiftCodec(Codec):
    """A fake codec with a known error and size: sends half the bytes, decodes x + shift."""

    lossless = False
    spec = "shift"

    def __init__(self, shift: float) -> None:
        self.shift = shift
        self.sent: dict[int, torch.Tensor] = {}

    def wire_bytes(self, numel, dtype=torch.float32):
        return numel * torch.empty(0, dtype=dtype).element_size() // 2

    def encode(self, x):
        payload = torch.zeros(self.wire_bytes(x.numel(), x.dtype), dtype=torch.uint8)
        self.sent[payload.data_ptr()] = x.clone()
        return Packed(payload=payload, shape=x.shape, dtype=x.dtype)

    def decode(self, packed):
        return self.sent[packed.payload.data_ptr()] + self.shift


def test_metrics_of_a_known_error():
    xs = [torch.arange(-6.0, 6.0), torch.tensor([3.0, -8.0, 0.5, 2.0])]
    m = cq.measure(ShiftCodec(0.25), xs, repeats=1, device=torch.device("cpu"))
    n = sum(x.numel() for x in xs)
    norm = math.sqrt(sum(float(v) ** 2 for x in xs for v in x))
    assert m["rel_l2"] == pytest.approx(0.25 * math.sqrt(n) / norm, rel=1e-12)
    assert m["max_abs"] == 0.25 and m["max_rel"] == 0.25 / 8
    assert m["ratio"] == 2 and m["tensors"] == 2 and m["numel"] == n


@pytest.mark.parametrize("dname", list(DTYPES))
def test_int8_error_within_its_analytic_bound_and_ratio_is_wire_bytes(dname):
    """Blocked INT8 rounds to the nearest multiple of scale = absmax/127 per block of 256: every error is
    at most absmax/254 (blockwise.md), plus half an ulp of the output dtype for bf16."""
    dtype = DTYPES[dname]
    torch.manual_seed(3)
    xs = [(torch.randn(n) * s).to(dtype) for n, s in ((1000, 1.0), (4099, 1e-3), (256, 50.0))]
    codec = get_codec("int8:block=256")
    m = cq.measure(codec, xs, repeats=1, device=torch.device("cpu"))
    err2_bound = 0.0
    worst = 0.0
    for x in xs:
        xf = x.double()
        for blk in xf.split(256):
            absmax = float(blk.abs().max())
            per = absmax / 254 + (absmax * 2.0**-8 if dtype == torch.bfloat16 else absmax * 1e-6)
            err2_bound += blk.numel() * per**2
            worst = max(worst, per)
    norm = math.sqrt(sum(float(x.double().square().sum()) for x in xs))
    assert 0 < m["rel_l2"] <= math.sqrt(err2_bound) / norm
    assert 0 < m["max_abs"] <= worst
    raw = sum(x.numel() * x.element_size() for x in xs)
    assert m["raw_bytes"] == raw and m["payload_bytes"] == sum(codec.wire_bytes(x.numel(), dtype) for x in xs)
    assert m["ratio"] == raw / m["payload_bytes"]


def test_variable_size_ratio_is_the_true_payload():
    """zstd's wire_bytes is a worst case above the raw size; the ratio must use payload_nbytes."""
    pytest.importorskip("zstandard")
    codec = get_codec("zstd")
    xs = [torch.zeros(5000), torch.randn(3000)]
    m = cq.measure(codec, xs, repeats=1, device=torch.device("cpu"))
    true = sum(codec.payload_nbytes(codec.encode(x)) for x in xs)
    assert m["payload_bytes"] == true < sum(codec.wire_bytes(x.numel()) for x in xs)
    assert m["ratio"] == m["raw_bytes"] / true > 1.5  # the zero tensor compresses to almost nothing
    assert m["rel_l2"] == 0 and m["max_abs"] == 0


# --------------------------------------------------------------------------------------------- CLI -----
def test_cli_writes_the_table_csv_and_png(saved_set, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    codecs = ["none", "int8:block=256", "zfp:rate=8"]
    assert cq.main(["--load-captured", str(saved_set), "--codecs", *codecs, "--repeats", "1", "--out-dir", str(out),
                    "--clock", "cpu", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "| weights | int8:block=256 |" in printed
    with open(out / "codec-quality.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(DTYPES) * len(cq.KINDS) * len(codecs)
    assert {(r["clock"], r["threads"], r["stat"]) for r in rows} == {("cpu", "1", "best")}
    assert {(r["dtype"], r["kind"], r["codec"]) for r in rows} == {
        (d, k, c) for d in DTYPES for k in cq.KINDS for c in codecs}
    captured = cq.load(saved_set, list(DTYPES))
    for r in rows:
        if r["codec"] == "none":
            assert float(r["rel_l2"]) == 0 and float(r["ratio"]) == 1
        else:
            assert float(r["rel_l2"]) > 0 and float(r["ratio"]) > 1
        # all three are fixed-size: the ratio is the raw bytes over the exact wire bytes, tensor by tensor
        codec, tensors = get_codec(r["codec"]), [e["tensor"] for e in captured[r["dtype"]][r["kind"]]]
        raw = sum(t.numel() * t.element_size() for t in tensors)
        wire = sum(codec.wire_bytes(t.numel(), t.dtype) for t in tensors)
        assert (int(r["raw_bytes"]), int(r["payload_bytes"])) == (raw, wire)
        assert float(r["ratio"]) == pytest.approx(raw / wire, rel=1e-5)  # the CSV keeps 6 digits
    assert (out / "codec-quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,needle", [
    (["--dtypes", "fp64"], "'fp64' not valid; valid: fp32, bf16"),
    (["--codecs", "int9"], "--codecs: unknown codec 'int9'"),
    (["--codecs", "zfp:rate=99"], "rate=99.0 is not valid"),
    (["--steps", "0"], "--steps 0 must be >= 1"),
    (["--nproc", "2"], "--nproc 2 must be a multiple of 4"),
    (["--threads", "0"], "--threads 0 must be >= 1"),
    (["--clock", "gpu"], "argument --clock: invalid choice: 'gpu'"),
    (["--load-captured", "/nonexistent-zpp"], "captured-fp32.pt not found"),
])
def test_cli_rejects_bad_values(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cq.main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_recorder_restores_megatron_and_snapshots_the_last_iteration():
    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.tensor_parallel import layers, mappings
    import megatron.core.distributed as mcore_dist

    watched = [(mappings, "_reduce"), (mappings, "dist_all_gather_func"), (layers, "dist_reduce_scatter_func"),
               (p2p, "_batched_p2p_ops"), (p2p, "_p2p_ops"), (mcore_dist, "finalize_model_grads"),
               (layers.LinearWithGradAccumulationAndAsyncCommunication, "backward")]
    before = [getattr(o, n) for o, n in watched]
    rec = cq._Recorder(grads_dtype=torch.bfloat16)
    with rec.installed():
        assert all(getattr(o, n) is not b for (o, n), b in zip(watched, before))
        mappings._reduce(torch.ones(3), type("G", (), {"size": lambda self: 1})())  # TP size 1: not sent, not kept
        assert rec.current["tp activations"] == []
    assert all(getattr(o, n) is b for (o, n), b in zip(watched, before))

    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.main_grad = torch.full_like(p, 0.5)
    rec.current["pp activations"].append(("pp.send_next", torch.ones(4)))
    rec._end_iteration([model])
    assert rec.last["weights"][0][1].numel() == 8 and rec.last["gradients"][0][1].dtype == torch.bfloat16
    assert len(rec.last["pp activations"]) == 1 and rec.current["pp activations"] == []


# --------------------------------------------------------------------------------- real capture -----
@pytest.mark.slow
def test_capture_from_training_equals_zfpy(tmp_path):
    """A 1-step TP2 x PP2 run of the tiny GPT (~1 minute on 2 cores): every kind captured, in both dtypes,
    from the expected call sites; our ZFP equals zfpy on all of it at rates 4/8/16/32, dims 1/2/3."""
    captured = cq.capture(tmp_path, 1, list(DTYPES), cq.TINY_MODEL, timeout_s=600)
    assert sorted(p.name for p in tmp_path.glob("captured-*.pt")) == ["captured-bf16.pt", "captured-fp32.pt"]
    for dname, kinds in captured.items():
        sites = {e["site"] for entries in kinds.values() for e in entries}
        assert {"tp.all_reduce", "tp.backward_all_reduce", "pp.send_next", "pp.send_prev"} <= sites
        assert {e["rank"] for e in kinds["weights"]} == {0, 1, 2, 3}
        for entries in kinds.values():
            for e in entries:
                assert e["tensor"].dtype == DTYPES[dname] and bool(torch.isfinite(e["tensor"]).all())
        # TP ranks hold different halves of the model and different partial sums
        w = {e["rank"]: e["tensor"] for e in kinds["weights"]}
        assert not torch.equal(w[0], w[1])
    rows = cq.check_zfp(captured)
    assert len(rows) == len(DTYPES) * 4 * 3 * len(cq.KINDS) and all(r["equal"] for r in rows), \
        cq.format_zfp_check([r for r in rows if not r["equal"]])
    # the lossless codecs return every captured tensor bit for bit, and save bytes on it
    from megatron_zpp.compression import get_codec

    for spec in ("mpc", "zstd"):
        codec = get_codec(spec)
        for dname, kinds in captured.items():
            for kind, entries in kinds.items():
                raw = sum(e["tensor"].numel() * e["tensor"].element_size() for e in entries)
                sent = 0
                for e in entries:
                    x = e["tensor"].contiguous()
                    packed = codec.encode(x)
                    sent += codec.payload_nbytes(packed)
                    y = codec.decode(packed)
                    bits = torch.int32 if x.dtype == torch.float32 else torch.int16
                    assert torch.equal(y.view(bits), x.view(bits)), (spec, dname, kind, e["site"])
                assert sent < raw, (spec, dname, kind, raw / sent)


def test_timing_statistic_and_clock_are_checked():
    with pytest.raises(ValueError, match="stat='fastest' is not valid; valid: median, best"):
        cq.measure(get_codec("none"), [torch.ones(8)], repeats=1, device=torch.device("cpu"), stat="fastest")
    with pytest.raises(ValueError, match="clock='tsc' is not valid on cpu; valid: wall, cpu"):
        cq.measure(get_codec("none"), [torch.ones(8)], repeats=1, device=torch.device("cpu"), clock="tsc")
