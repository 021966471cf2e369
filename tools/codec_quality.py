"""Codec quality on tensors captured from a real training run: ratio, error and speed per codec and kind.

1. **Capture.** A short run of the tiny GPT (2 layers, hidden 128, sequence 128) on Megatron-Core with
   tensor parallel 2 x pipeline parallel 2 on 4 CPU ranks with gloo (2 simulated nodes x 2, as the
   other tools), once in fp32 and once with ``--bf16``, Megatron's own collectives (no plugin). From
   the last iteration it keeps what each parallel dimension would send:

   - ``weights``: every rank's parameters (what qwZ's all-gather sends);
   - ``gradients``: every rank's main grads after backward, before ``finalize_model_grads`` reduces
     them (what qgZ's reduce-scatter sends). In the bf16 run Megatron accumulates and reduces them in
     fp32 (``grad_reduce_in_fp32``); the ``bf16`` rows use them rounded to bf16, what a bf16
     reduction would send;
   - ``tp activations``: the inputs of the tensor-parallel collectives, forward (``_reduce`` of the
     row-parallel outputs and the embedding) and backward (the input-gradient all-reduce of the
     column-parallel layers), plus the sequence-parallel all-gathers / reduce-scatters if used;
   - ``pp activations``: the tensors sent by the pipeline p2p (activations forward, their gradients
     backward).

   They are saved with ``torch.save`` to ``--capture-dir/captured-{fp32,bf16}.pt`` (default: a
   temporary directory); ``--load-captured DIR`` reuses such a directory without training.

2. **Table.** For each dtype, kind and codec (``--codecs``; default: none, int8, int4, zfp at rates
   4/8/16/32, mpc, zstd, and nvcomp when CUDA is available): compression ratio (raw bytes / payload
   bytes, the true length ``payload_nbytes`` for variable-size codecs), relative L2 error, max
   absolute error and that over max|x|, encode and decode GB/s (raw tensor bytes / seconds, the
   fastest of ``--repeats`` runs after a warm-up, or the median with ``--stat median``; every captured
   tensor is coded separately, as it is sent); ``--clock cpu`` divides by CPU seconds instead, which a
   loaded machine disturbs far less. Errors are summed over all tensors of a kind; the ratio is total raw over total payload bytes.
   Written to ``--out-dir`` (default ``docs/codec-quality/``) as ``codec-quality.csv`` and
   ``codec-quality.png``. ``--device cuda`` codes on the GPU (the capture always runs on CPU).

3. **``--check-zfp``** instead of the table: our ZFP payload equals zfpy's stream, and our decode
   zfpy's values, on every captured tensor for rates 4, 8, 16, 32 and dims 1, 2, 3 (the comparison
   of tests/test_zfp.py, on real tensors). Prints "equal" / "DIFFERENT" per dtype, rate, dims and kind
   with the byte counts; exits 1 on any difference.

    python tools/codec_quality.py [--steps 3] [--capture-dir DIR | --load-captured DIR]
        [--codecs none int8:block=256 zfp:rate=8 ...] [--repeats 5] [--stat best|median]
        [--clock wall|cpu] [--threads N] [--device cpu|cuda] [--out-dir DIR]
    python tools/codec_quality.py --check-zfp [--load-captured DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import inspect
import math
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_codecs import timed_seconds  # noqa: E402

from megatron_zpp.training.arguments import PROJECT_RECIPE  # noqa: E402
from megatron_zpp.compression import get_codec  # noqa: E402
from megatron_zpp.compression.zfp_reference import bits_equal, zfpy_stream, zfpy_values  # noqa: E402
from megatron_zpp.testing import run_distributed  # noqa: E402

KINDS = ("weights", "gradients", "tp activations", "pp activations")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ZFP_RATES = (4, 8, 16, 32)
ZFP_DIMS = (1, 2, 3)  # as tests/test_zfp.py
# The tiny GPT of tools/convergence.py; 2 layers = one per pipeline stage. Two micro-batches per
# iteration so that the pipeline runs a real 1F1B schedule (sends in both directions).
MODEL = PROJECT_RECIPE + ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--micro-batch-size", "4", "--global-batch-size", "8"]
# The fastest run that still has every kind (tests).
TINY_MODEL = PROJECT_RECIPE + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--micro-batch-size", "2", "--global-batch-size", "4"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def default_codecs(device: torch.device) -> list[str]:
    codecs = ["none", "int8:block=256", "int4:block=128", *(f"zfp:rate={r}" for r in ZFP_RATES), "mpc", "zstd"]
    if torch.cuda.is_available() and device.type == "cuda":
        codecs.append("nvcomp")
    return codecs


# ------------------------------------------------------------------------------------------- capture -----
class _Recorder:
    """Wraps Megatron's TP collectives, pipeline p2p and ``finalize_model_grads`` to copy what they
    send. Activations are collected per iteration and the last complete iteration's are kept, so the
    capture is one step's worth whatever the number of steps."""

    def __init__(self, grads_dtype: torch.dtype | None) -> None:
        self.grads_dtype = grads_dtype
        self.current: dict[str, list] = {"tp activations": [], "pp activations": []}
        self.last: dict[str, list] = {}
        self._restore: list[tuple[object, str, object]] = []

    def _patch(self, owner, name: str, value) -> None:
        # As model_parallel.py: the attribute as stored, so a staticmethod is restored as one.
        self._restore.append((owner, name, inspect.getattr_static(owner, name)))
        setattr(owner, name, value)

    def _keep(self, kind: str, site: str, t: torch.Tensor | None) -> None:
        if t is not None and t.is_floating_point() and t.numel():
            # A copy before the collective runs: all-reduces work in place.
            self.current[kind].append((site, t.detach().reshape(-1).clone()))

    @contextlib.contextmanager
    def installed(self):
        import megatron.core.distributed as mcore_dist
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import p2p_communication as p2p
        from megatron.core.tensor_parallel import layers, mappings

        rec = self
        try:
            original_reduce = mappings._reduce

            def reduce(input_, group):
                if group.size() > 1:
                    rec._keep("tp activations", "tp.all_reduce", input_)
                return original_reduce(input_, group)

            self._patch(mappings, "_reduce", reduce)
            for module in (mappings, layers):
                gather, scatter = module.dist_all_gather_func, module.dist_reduce_scatter_func

                def all_gather(output, input, *a, _orig=gather, **kw):
                    rec._keep("tp activations", "tp.all_gather", input)
                    return _orig(output, input, *a, **kw)

                def reduce_scatter(output, input, *a, _orig=scatter, **kw):
                    rec._keep("tp activations", "tp.reduce_scatter", input)
                    return _orig(output, input, *a, **kw)

                self._patch(module, "dist_all_gather_func", all_gather)
                self._patch(module, "dist_reduce_scatter_func", reduce_scatter)

            # The column-parallel layers all-reduce their input gradient with dist.all_reduce inside
            # their backward (not through mappings): watch dist.all_reduce only there.
            linear = layers.LinearWithGradAccumulationAndAsyncCommunication
            original_backward = linear.backward

            def backward(ctx, *grads):
                original_all_reduce = dist.all_reduce

                def all_reduce(tensor, *a, group=None, **kw):
                    if group is not None and group.size() > 1:
                        rec._keep("tp activations", "tp.backward_all_reduce", tensor)
                    return original_all_reduce(tensor, *a, group=group, **kw)

                dist.all_reduce = all_reduce
                try:
                    return original_backward(ctx, *grads)
                finally:
                    dist.all_reduce = original_all_reduce

            self._patch(linear, "backward", staticmethod(backward))

            for name in ("_batched_p2p_ops", "_p2p_ops"):  # looked up at call time by Megatron
                original_p2p = getattr(p2p, name)

                def p2p_ops(*, _orig=original_p2p, **kw):
                    rec._keep("pp activations", "pp.send_prev", kw.get("tensor_send_prev"))
                    rec._keep("pp activations", "pp.send_next", kw.get("tensor_send_next"))
                    return _orig(**kw)

                self._patch(p2p, name, p2p_ops)

            original_finalize = mcore_dist.finalize_model_grads

            def finalize(model, *a, **kw):
                rec._end_iteration(model)
                return original_finalize(model, *a, **kw)

            # The trainer imports it from megatron.core.distributed when pretrain() starts.
            self._patch(mcore_dist, "finalize_model_grads", finalize)
            yield self
        finally:
            for owner, name, value in reversed(self._restore):
                setattr(owner, name, value)
            self._restore = []

    def _end_iteration(self, model_chunks) -> None:
        """Backward is complete and the DP reduction has not run: snapshot weights and main grads."""
        params = [p for m in model_chunks for p in m.parameters() if p.requires_grad]
        weights = torch.cat([p.detach().reshape(-1) for p in params]).clone()
        grads = torch.cat([p.main_grad.detach().reshape(-1) for p in params])
        grads = grads.to(self.grads_dtype) if self.grads_dtype is not None else grads.clone()
        self.last = {"weights": [("params", weights)], "gradients": [("main_grad", grads)], **self.current}
        self.current = {"tp activations": [], "pp activations": []}


def _capture_worker(model_args: list[str], steps: int, dtypes: list[str]) -> dict:
    """One rank: train ``steps`` iterations per dtype, return {dtype: {kind: [(site, tensor)]}}."""
    from megatron_zpp.training.quiet import install_warning_filters

    install_warning_filters()  # before Megatron is first imported in this fresh process
    from megatron_zpp.training.trainer import pretrain

    out = {}
    for dname in dtypes:
        recorder = _Recorder(grads_dtype=DTYPES[dname] if dname != "fp32" else None)
        argv = model_args + LAYOUT + ["--train-iters", str(steps), "--eval-iters", "0", "--log-interval", "1000",
                                      "--lr-decay-style", "constant", "--seed", "1234"]
        with recorder.installed():
            pretrain(argv + (["--bf16"] if dname == "bf16" else []), log=lambda *a, **k: None, plugin=False)
        out[dname] = recorder.last
    return out


@contextlib.contextmanager
def _cpu_only_children():
    """The capture trains on CPU with gloo even on a GPU machine (4 ranks, maybe 1 GPU): spawned ranks
    inherit this environment and see no GPU, so the trainer applies its CPU shim."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def capture(capture_dir: Path, steps: int, dtypes: list[str], model_args: list[str] | None = None,
            nproc: int = 4, ranks_per_node: int = 2, timeout_s: float = 900) -> dict[str, dict[str, list]]:
    """Train, save ``captured-<dtype>.pt`` per dtype under ``capture_dir``, return what ``load`` returns."""
    model_args = MODEL if model_args is None else model_args
    with _cpu_only_children():
        per_rank = run_distributed(_capture_worker, nproc, model_args, steps, dtypes, ranks_per_node=ranks_per_node,
                                   timeout_s=timeout_s)
    capture_dir.mkdir(parents=True, exist_ok=True)
    for dname in dtypes:
        kinds = {kind: [{"rank": rank, "site": site, "tensor": t}
                        for rank, result in enumerate(per_rank) for site, t in result[dname].get(kind, [])]
                 for kind in KINDS}
        missing = [k for k, v in kinds.items() if not v]
        if missing:
            raise RuntimeError(f"the {dname} capture has no {', '.join(missing)}: the layout must have TP > 1 and "
                               f"PP > 1 and at least one full iteration")
        save(capture_dir, dname, kinds, {"steps": steps, "model_args": model_args, "layout": LAYOUT, "nproc": nproc,
                                         "ranks_per_node": ranks_per_node, "torch": str(torch.__version__)})
    return load(capture_dir, dtypes)


def save(capture_dir: Path, dname: str, kinds: dict[str, list[dict]], meta: dict) -> Path:
    """Write ``captured-<dname>.pt``: {"meta", "kinds": {kind: [{"rank", "site", "tensor"}]}} (plain
    containers and tensors, so ``load`` can use ``weights_only``)."""
    path = Path(capture_dir) / f"captured-{dname}.pt"
    torch.save({"meta": {"dtype": dname, **meta}, "kinds": kinds}, path)
    return path


def load(capture_dir: Path, dtypes: list[str]) -> dict[str, dict[str, list]]:
    """{dtype: {kind: [{"rank", "site", "tensor"}]}} from ``captured-<dtype>.pt`` files."""
    out = {}
    for dname in dtypes:
        path = Path(capture_dir) / f"captured-{dname}.pt"
        if not path.exists():
            raise FileNotFoundError(f"{capture_dir}: {path.name} not found (captured dtypes there: "
                             f"{sorted(p.stem.removeprefix('captured-') for p in Path(capture_dir).glob('captured-*.pt'))})")
        saved = torch.load(path, weights_only=True)
        unknown = set(saved["kinds"]) - set(KINDS)
        if unknown:
            raise ValueError(f"{path}: unknown kinds {sorted(unknown)}; valid: {', '.join(KINDS)}")
        out[dname] = saved["kinds"]
    return out


# ------------------------------------------------------------------------------------------- metrics -----
def measure(codec, tensors: list[torch.Tensor], repeats: int, device: torch.device, stat: str = "best",
            clock: str = "wall") -> dict:
    """Ratio, errors and speed of ``codec`` over ``tensors``, each coded on its own (as it is sent).

    ratio = raw bytes / payload bytes (``payload_nbytes``: the true length of variable-size payloads);
    rel_l2 = ||y - x|| / ||x|| and max_abs over all tensors, in float64 against the input as it was
    (bf16 inputs against their bf16 values); max_rel = max_abs / max |x|; GB/s = raw bytes / seconds
    of coding all tensors once, the best (default) or median of ``repeats`` runs after a warm-up, in
    wall seconds or (``clock="cpu"``) this process's CPU seconds.
    """
    xs = [t.to(device).contiguous() for t in tensors]
    if not xs:
        raise ValueError("measure() needs at least one tensor")
    packs = [codec.encode(x) for x in xs]
    raw = sum(x.numel() * x.element_size() for x in xs)
    payload = 0
    for x, p in zip(xs, packs):
        n = codec.payload_nbytes(p)
        bound = codec.wire_bytes(x.numel(), x.dtype)
        if codec.fixed_size and n != bound or n > bound:
            raise AssertionError(f"{codec.spec}: payload of {n} bytes for {x.numel()} {x.dtype} values, wire_bytes "
                                 f"says {bound} ({'exact' if codec.fixed_size else 'an upper bound'})")
        payload += n
    err2 = ref2 = 0.0
    max_abs = max_x = 0.0
    for x, p in zip(xs, packs):
        y = codec.decode(p)
        if y.shape != x.shape or y.dtype != x.dtype:
            raise AssertionError(f"{codec.spec}: decoded {tuple(y.shape)} {y.dtype}, encoded {tuple(x.shape)} {x.dtype}")
        xd, d = x.double(), y.double() - x.double()
        err2 += float(d.square().sum())
        ref2 += float(xd.square().sum())
        max_abs = max(max_abs, float(d.abs().max()))
        max_x = max(max_x, float(xd.abs().max()))
    gb = raw / 1e9
    enc_s = timed_seconds(lambda: [codec.encode(x) for x in xs], repeats, device, stat, clock)
    dec_s = timed_seconds(lambda: [codec.decode(p) for p in packs], repeats, device, stat, clock)
    return {"tensors": len(xs), "numel": sum(x.numel() for x in xs), "raw_bytes": raw, "payload_bytes": payload,
            "ratio": raw / payload if payload else math.inf,
            "rel_l2": math.sqrt(err2 / ref2) if ref2 else (0.0 if err2 == 0 else math.inf),
            "max_abs": max_abs, "max_rel": max_abs / max_x if max_x else (0.0 if max_abs == 0 else math.inf),
            "encode_gbps": gb / enc_s, "decode_gbps": gb / dec_s}


def quality_table(captured: dict[str, dict[str, list]], codecs: list[str], repeats: int, device: torch.device,
                  stat: str = "best", clock: str = "wall", log=print) -> list[dict]:
    rows = []
    for spec in codecs:
        codec = get_codec(spec)
        codec_rows = []
        try:
            for dname, kinds in captured.items():
                for kind in KINDS:
                    tensors = [e["tensor"] for e in kinds.get(kind, [])]
                    if tensors:
                        codec_rows.append({"dtype": dname, "kind": kind, "codec": spec, "canonical": codec.spec,
                                           "lossless": codec.lossless,
                                           "fixed_size": codec.fixed_size, **measure(codec, tensors, repeats, device, stat, clock),
                                           "device": str(device), "threads": torch.get_num_threads(),
                                           "stat": stat, "clock": clock})
        except (RuntimeError, ImportError) as e:  # a codec this device or install lacks: zstd on CUDA, nvcomp on CPU
            log(f"# {codec.spec} on {device}: skipped ({str(e).splitlines()[0]})")
            continue
        rows += codec_rows
    return rows


def format_table(rows: list[dict]) -> str:
    lines = []
    for dname in dict.fromkeys(r["dtype"] for r in rows):
        sub = [r for r in rows if r["dtype"] == dname]
        numel = {r["kind"]: (r["tensors"], r["numel"]) for r in sub}
        lines.append(f"\n{dname}: " + "; ".join(f"{k} {n} values in {t} tensors" for k, (t, n) in numel.items()))
        lines.append("| kind | codec | ratio | rel. L2 error | max abs error | max err / max abs | encode GB/s | decode GB/s |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for kind in KINDS:
            for r in (r for r in sub if r["kind"] == kind):
                lines.append(f"| {kind} | {r['codec']} | {r['ratio']:.3f} | {r['rel_l2']:.3g} | {r['max_abs']:.3g} | "
                             f"{r['max_rel']:.3g} | {r['encode_gbps']:.3f} | {r['decode_gbps']:.3f} |")
    return "\n".join(lines)


FIELDS = ["dtype", "kind", "codec", "canonical", "lossless", "fixed_size", "tensors", "numel", "raw_bytes", "payload_bytes", "ratio",
          "rel_l2", "max_abs", "max_rel", "encode_gbps", "decode_gbps", "device", "threads", "stat", "clock"]


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items() if k in FIELDS})


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Ratio against relative L2 error, one panel per dtype, a colour per codec and a marker per kind.
    Lossless codecs (error 0) sit on a floor line below the smallest lossy error."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"the CSV is written; the PNG needs matplotlib: pip install -e '.[tools]' ({e})") from e
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    lossy = [r["rel_l2"] for r in rows if r["rel_l2"] > 0]
    floor = min(lossy) / 10 if lossy else 1e-9
    markers = dict(zip(KINDS, "osD^"))
    colours = {c: plt.cm.tab10(i % 10) for i, c in enumerate(codecs)}
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 5), squeeze=False, sharey=True)
    for ax, dname in zip(axes[0], dtypes):
        for r in (r for r in rows if r["dtype"] == dname):
            ax.scatter(r["ratio"], max(r["rel_l2"], floor), marker=markers[r["kind"]], color=colours[r["codec"]],
                       s=45, alpha=0.85)
        ax.axhline(floor, color="grey", lw=0.6, ls=":")
        ax.text(0.01, floor * 1.3, "lossless (error 0)", fontsize=7, color="grey", transform=ax.get_yaxis_transform())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("compression ratio (raw bytes / payload bytes)")
        ax.set_title(f"{dname} tensors")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("relative L2 error")
    handles = [plt.Line2D([], [], ls="", marker="o", color=colours[c], label=c) for c in codecs]
    handles += [plt.Line2D([], [], ls="", marker=markers[k], color="black", label=k) for k in KINDS]
    fig.legend(handles=handles, loc="center right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.8, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------- zfp check -----
def check_zfp(captured: dict[str, dict[str, list]], rates=ZFP_RATES, dims_list=ZFP_DIMS,
              device: torch.device = torch.device("cpu")) -> list[dict]:
    """Per dtype, rate, dims and kind: our payloads against zfpy's streams and our decoded values against
    zfpy's (rounded to the tensor's dtype, as our decode does), tensor by tensor. Tensors holding NaN/Inf
    are counted apart: there our marker differs from zfp on purpose (zfp.md)."""
    rows = []
    for dname, kinds in captured.items():
        for rate in rates:
            for dims in dims_list:
                codec = get_codec(f"zfp:rate={rate},dims={dims}")
                for kind in KINDS:
                    entries = kinds.get(kind, [])
                    if not entries:
                        continue
                    row = {"dtype": dname, "rate": rate, "dims": dims, "kind": kind, "tensors": 0, "ours_bytes": 0,
                           "zfpy_bytes": 0, "stream_diffs": 0, "value_diffs": 0, "nonfinite_skipped": 0}
                    for e in entries:
                        t = e["tensor"].reshape(-1)
                        if not bool(torch.isfinite(t).all()):
                            row["nonfinite_skipped"] += 1
                            continue
                        x = t.float().numpy()  # bf16 -> fp32 is exact: what our kernels code too
                        stream = zfpy_stream(x, rate, dims)
                        packed = codec.encode(t.to(device))
                        ours = packed.payload.cpu().numpy().tobytes()
                        row["tensors"] += 1
                        row["ours_bytes"] += len(ours)
                        row["zfpy_bytes"] += len(stream)
                        row["stream_diffs"] += ours != stream
                        expected = torch.from_numpy(zfpy_values(stream, t.numel(), rate, dims)).to(t.dtype)
                        got = codec.decode(packed).cpu()
                        row["value_diffs"] += not bits_equal(got.float().numpy(), expected.float().numpy())
                    row["equal"] = row["stream_diffs"] == 0 and row["value_diffs"] == 0 and row["tensors"] > 0
                    rows.append(row)
    return rows


def format_zfp_check(rows: list[dict]) -> str:
    lines = ["| dtype | rate | dims | kind | tensors | our bytes | zfpy bytes | result |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict = "equal" if r["equal"] else (f"DIFFERENT ({r['stream_diffs']} streams, {r['value_diffs']} decodes"
                                              f"{', no finite tensor' if not r['tensors'] else ''})")
        skipped = f", {r['nonfinite_skipped']} non-finite skipped" if r["nonfinite_skipped"] else ""
        lines.append(f"| {r['dtype']} | {r['rate']} | {r['dims']} | {r['kind']} | {r['tensors']} | {r['ours_bytes']} | "
                     f"{r['zfpy_bytes']} | {verdict}{skipped} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main -----
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="training iterations of each capture run (the last is kept)")
    ap.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated; valid: {', '.join(DTYPES)}")
    ap.add_argument("--capture-dir", type=Path, default=None,
                    help="save the captured tensors here (default: a temporary directory, deleted at the end)")
    ap.add_argument("--load-captured", type=Path, default=None, metavar="DIR",
                    help="reuse the captured-<dtype>.pt files of an earlier --capture-dir instead of training")
    ap.add_argument("--tiny", action="store_true", help="capture from an even smaller model (hidden 64, sequence 32)")
    ap.add_argument("--nproc", type=int, default=4, help="ranks of the capture run (TP2 x PP2 x DP nproc/4)")
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--codecs", nargs="+", default=None, metavar="SPEC",
                    help="codec specs (space-separated); default: none int8:block=256 int4:block=128 zfp:rate=4/8/16/32 "
                         "mpc zstd, plus nvcomp on CUDA")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per codec and kind")
    ap.add_argument("--stat", choices=("best", "median"), default="best",
                    help="which repeat gives the GB/s: the fastest (default: on a shared machine, the run other "
                         "jobs disturbed least) or the median")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall seconds, or this process's CPU seconds (CPU only; GB/s per CPU-second: on a loaded "
                         "machine, time spent waiting for a core is not counted)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the codecs (default: torch's)")
    ap.add_argument("--device", default="cpu", help="where the codecs run: cpu or cuda")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "codec-quality")
    ap.add_argument("--check-zfp", action="store_true",
                    help="instead of the table: compare our ZFP bitstreams and values with zfpy's on the captured "
                         "tensors (rates 4/8/16/32, dims 1/2/3); exit 1 on any difference")
    args = ap.parse_args(argv)

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        ap.error(f"--dtypes {args.dtypes!r}: {', '.join(map(repr, bad)) or 'empty'} not valid; valid: {', '.join(DTYPES)}")
    if args.steps < 1:
        ap.error(f"--steps {args.steps} must be >= 1")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats} must be >= 1")
    if args.nproc % 4 or args.nproc < 4:
        ap.error(f"--nproc {args.nproc} must be a multiple of 4 (tensor parallel 2 x pipeline parallel 2)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this machine has no usable GPU")
    if args.clock == "cpu" and device.type != "cpu":
        ap.error(f"--clock cpu measures CPU seconds and needs --device cpu, not {args.device}")
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads {args.threads} must be >= 1")
        torch.set_num_threads(args.threads)
    codecs = args.codecs or default_codecs(device)
    try:
        for spec in codecs:  # fail on a bad spec before the capture, naming it
            get_codec(spec)
    except ValueError as e:
        ap.error(f"--codecs: {e}")

    if args.load_captured:
        try:
            captured = load(args.load_captured, dtypes)
        except (FileNotFoundError, ValueError) as e:
            ap.error(f"--load-captured: {e}")
        source = f"loaded from {args.load_captured}"
    else:
        with contextlib.ExitStack() as stack:
            where = args.capture_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="zpp-capture-")))
            print(f"# capturing: tiny GPT, TP2 x PP2 on {args.nproc} CPU ranks (gloo, {args.nproc // args.ranks_per_node}"
                  f" nodes x {args.ranks_per_node}), {args.steps} steps, {', '.join(dtypes)} -> {where}", flush=True)
            captured = capture(where, args.steps, dtypes, TINY_MODEL if args.tiny else MODEL, args.nproc,
                               args.ranks_per_node)
        source = f"captured in {args.steps} steps" + (f", saved in {args.capture_dir}" if args.capture_dir else "")
    print(f"# tensors {source}")

    if args.check_zfp:
        rows = check_zfp(captured, device=device)
        print(format_zfp_check(rows))
        different = [r for r in rows if not r["equal"]]
        print(f"\n# zfp vs zfpy on captured tensors: {len(rows) - len(different)} of {len(rows)} (dtype, rate, dims, "
              f"kind) equal" + (f"; {len(different)} DIFFERENT" if different else ""))
        return 1 if different else 0

    print(f"# codecs on {device} ({torch.get_num_threads()} threads, {platform.processor() or platform.machine()}), "
          f"{args.stat} of {args.repeats} repeats, {args.clock} clock")
    rows = quality_table(captured, codecs, args.repeats, device, args.stat, args.clock)
    print(format_table(rows))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out_dir / "codec-quality.csv")
    plot(rows, args.out_dir / "codec-quality.png",
         f"codecs on tensors captured from the tiny GPT (TP2 x PP2 on 4 CPU ranks), coded on {device}")
    print(f"\n# wrote {args.out_dir / 'codec-quality.csv'} and codec-quality.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
