"""Compare lossless float codecs on CPU: ratios (deterministic, seeded) and smoke speeds.

Candidates for the CPU lossless codec (lossless.md has the measured table and the choice):

- ``zstd-1``: zstd level 1 on the raw bytes (the baseline: no float awareness)
- ``bytegroup+zstd-1``: byte planes (byte b of every value together), each plane one zstd frame
- ``rot+bytegroup+zstd-1``: the sign bit rotated to the lowest bit first, so the high byte is the whole
  exponent (bf16 and fp32), then as above
- ``blosc2 shuffle+zstd-1``: python-blosc2, SHUFFLE filter (byte planes per block), zstd level 1
- ``zipnn``: the zipnn package (byte grouping, sign-bit reorder, Huffman/zstd per group), defaults
- ``mpc``: this project's MPC/MPC16 (C++), for reference

Data: seeded randn, relu(randn), gelu(randn) and real-ish tensors of a small transformer trained for a few
steps on random tokens (weights, gradients, FFN activations after GELU, block outputs), as bf16 and fp32.

    python tools/lossless_compare.py [--numel 1048576] [--markdown]

Speeds are one run each on whatever the machine is doing: a smoke figure, not a benchmark.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_zpp.compression import get_codec  # noqa: E402


def real_ish_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights, gradients and activations of a 2-layer transformer after 5 Adam steps on random tokens."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    vocab, d, ff, batch, seq = 1000, 256, 1024, 8, 128
    emb = torch.nn.Embedding(vocab, d)
    layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(d, 4, ff, dropout=0.0, activation="gelu",
                                                                  batch_first=True) for _ in range(2))
    head = torch.nn.Linear(d, vocab)
    params = [*emb.parameters(), *layers.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    captured: dict[str, torch.Tensor] = {}
    hook = layers[1].linear2.register_forward_hook(lambda m, inp, out: captured.__setitem__("ffn", inp[0].detach()))
    for _ in range(5):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        h = emb(tokens[:, :-1])
        for layer in layers:
            h = layer(h)
        captured["hidden"] = h.detach()
        loss = torch.nn.functional.cross_entropy(head(h).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    hook.remove()
    return {
        "weights": torch.cat([p.detach().reshape(-1) for p in params]),
        "grads": torch.cat([p.grad.reshape(-1) for p in params]),
        "ffn act (gelu)": captured["ffn"].reshape(-1),
        "block output": captured["hidden"].reshape(-1),
    }


def synthetic(numel: int, seed: int = 0) -> dict[str, torch.Tensor]:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return {"randn": x, "relu": torch.relu(x), "gelu": torch.nn.functional.gelu(x, approximate="tanh")}


def _planes(a: np.ndarray) -> list[bytes]:
    b = a.view(np.uint8).reshape(-1, a.itemsize)
    return [np.ascontiguousarray(b[:, i]).tobytes() for i in range(a.itemsize)]


def _rotate_sign(a: np.ndarray) -> np.ndarray:
    u = a.view(np.uint16 if a.itemsize == 2 else np.uint32)
    top = 8 * a.itemsize - 1
    return (u << 1) | (u >> top)


def candidates():
    import blosc2
    import zstandard
    import zipnn

    cctx, dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()

    # Each returns (compressed bytes, decompress() -> the raw bytes back), checked bit-exact by main().
    def zstd_raw(a):
        c = cctx.compress(a.tobytes())
        return len(c), lambda: dctx.decompress(c)

    def bytegroup(a, rotate=False):
        src = _rotate_sign(a) if rotate else a
        frames = [cctx.compress(p) for p in _planes(src)]

        def back():
            planes = np.stack([np.frombuffer(dctx.decompress(f), np.uint8) for f in frames], axis=1)
            v = planes.reshape(-1).view(src.dtype)
            if rotate:
                v = (v >> 1) | (v << (8 * a.itemsize - 1))
            return v.tobytes()
        return sum(map(len, frames)), back

    def blosc(a):
        c = blosc2.compress2(a, typesize=a.itemsize, codec=blosc2.Codec.ZSTD, clevel=1,
                             filters=[blosc2.Filter.SHUFFLE], nthreads=2)
        return len(c), lambda: blosc2.decompress2(c, nthreads=2)

    def zipnn_codec(t):
        # zipnn reorders its input's bytes in place: give it a copy.
        z = zipnn.ZipNN(input_format="torch", bytearray_dtype="bfloat16" if t.dtype == torch.bfloat16 else "float32",
                        threads=2)
        c = z.compress(t.clone())
        return len(c), lambda: z.decompress(c).contiguous().view(torch.uint8).numpy().tobytes()

    def mpc(t):
        codec = get_codec("mpc")
        p = codec.encode(t)
        return p.payload.numel(), lambda: codec.decode(p).view(torch.uint8).numpy().tobytes()

    def np_of(t):
        return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()

    return {
        "zstd-1": lambda t: zstd_raw(np_of(t)),
        "bytegroup+zstd-1": lambda t: bytegroup(np_of(t)),
        "rot+bytegroup+zstd-1": lambda t: bytegroup(np_of(t), rotate=True),
        "blosc2 shuffle+zstd-1": lambda t: blosc(np_of(t)),
        "zipnn": zipnn_codec,
        "mpc": mpc,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1 << 20, help="elements of each synthetic tensor")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    data = {**synthetic(args.numel), **real_ish_tensors()}
    codecs = candidates()
    print("| data | dtype | numel | " + " | ".join(codecs) + " |")
    print("|---|---|---|" + "---|" * len(codecs))
    speeds: dict[str, list[tuple[float, float]]] = {k: [] for k in codecs}
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for name, x in data.items():
            t = x.to(dtype).contiguous()
            raw = t.numel() * t.element_size()
            original = t.view(torch.uint8).numpy().tobytes()
            cells = []
            for cname, fn in codecs.items():
                t0 = time.perf_counter()
                size, decomp = fn(t)
                t1 = time.perf_counter()
                back = decomp()
                t2 = time.perf_counter()
                if bytes(back) != original:
                    raise SystemExit(f"{cname} did not round-trip {name} {dtype} bit-exactly")
                speeds[cname].append((raw / (t1 - t0) / 1e6, raw / (t2 - t1) / 1e6))
                cells.append(f"{raw / size:.3f}")
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | {t.numel()} | " + " | ".join(cells) + " |")
    print("\nsmoke speeds (median over the rows, MB/s of input, one run each, unreliable):")
    for cname, s in speeds.items():
        comp, decomp = np.median([a for a, _ in s]), np.median([b for _, b in s])
        print(f"  {cname:24s} compress {comp:7.0f}   decompress {decomp:7.0f}")


if __name__ == "__main__":
    main()
