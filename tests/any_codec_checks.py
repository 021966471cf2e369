"""Worker bodies for the multi-process tests of the any-codec collectives (``comm/any_codec.py``).

Every rank regenerates every rank's input from a seed, so each can compute its expected output
two ways: the uncompressed algorithm (``codec="none"``: lossless codecs must match it bit for
bit) and a single-process replay of the compressed algorithm with the codec's own encode/decode
(lossy codecs must match it bit for bit, and stay close to the exact float64 result).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_zpp.comm import Topology, comm_stats, compressed_all_reduce, qgz_reduce_scatter, quantized_all_gather
from megatron_zpp.comm.any_codec import _SIZE_BYTES, slot_bytes
from megatron_zpp.compression import get_codec

LOSSLESS = ("mpc", "zstd:level=1")
LOSSY = ("zfp:rate=8", "zfp:rate=16,dims=1")
SIZES = (1, 7, 1000)
DTYPES = (torch.float32, torch.bfloat16)
OUT_EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-9}  # half an ulp: the output's own rounding


def gen(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1000 + rank)


def data(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = gen(seed, rank)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(3 * torch.rand(n, generator=g) - 1.5)
    return x.to(dtype)


def roundtrip(spec: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(spec)
    return codec.decode(codec.encode(x.contiguous()))


def payload_len(spec: str, x: torch.Tensor) -> int:
    codec = get_codec(spec)
    packed = codec.encode(x.contiguous())
    return codec.payload_nbytes(packed)


def replay_reduce_scatter(inputs: list[torch.Tensor], topo: Topology, spec: str, dest: int, divisor: int):
    """The two-hop reduce-scatter of ``any_codec.py`` for destination ``dest``, in one process."""
    nodes, local = topo.num_nodes, topo.node_size
    size, dtype = topo.size, inputs[0].dtype
    length = inputs[0].numel() // size
    chunks = [t.view(nodes, local, length) for t in inputs]  # rank r = node * local + l

    def stack_sum(parts):
        return torch.sum(torch.stack(parts), dim=0, dtype=torch.float32)

    j, dest_node = dest % local, dest // local
    if nodes > 1 and local > 1:
        hop2 = []
        for m in range(nodes):
            # each member of node m sends rank j of the node its [nodes, length] slice
            parts = [roundtrip(spec, chunks[m * local + i][:, j, :].reshape(-1)).view(nodes, length)
                     for i in range(local)]
            partial = stack_sum(parts).to(dtype)
            hop2.append(roundtrip(spec, partial[dest_node]).view(1, length))
        acc = stack_sum(hop2)
    else:
        acc = stack_sum([roundtrip(spec, inputs[r].view(size, length)[dest]).view(1, length) for r in range(size)])
    if divisor != 1:
        acc = acc / divisor
    return acc.view(-1).to(dtype)


def collectives_worker(seed: int) -> dict:
    """Reduce-scatter, all-gather and all-reduce with lossless and lossy codecs on this layout."""
    topo = Topology(None)
    size, rank = topo.size, topo.rank
    report: dict = {"lossless_equal": [], "lossy_replayed": [], "lossy_rel_err": {}}
    for dtype in DTYPES:
        for length in SIZES:
            inputs = [data(seed, r, size * length, dtype) for r in range(size)]
            reference = torch.empty(length, dtype=dtype)
            qgz_reduce_scatter(reference, inputs[rank].clone(), topo, codec="none")
            exact = torch.stack([t.view(size, length)[rank].double() for t in inputs]).sum(0) / size
            shard = inputs[rank][:length].clone()
            gathered_ref = torch.empty(size * length, dtype=dtype)
            dist.all_gather_into_tensor(gathered_ref, shard)
            for spec in LOSSLESS + LOSSY:
                key = f"{spec} {dtype} {length}"
                out = torch.full((length,), float("nan"), dtype=dtype)
                handle = qgz_reduce_scatter(out, inputs[rank].clone(), topo, codec=spec, async_op=length > 1)
                if handle is not None:
                    handle.wait()
                gathered = torch.full((size * length,), float("nan"), dtype=dtype)
                quantized_all_gather(gathered, shard, topo, codec=spec)
                if spec in LOSSLESS:
                    assert torch.equal(out, reference), f"reduce-scatter {key}: lossless != uncompressed"
                    # the output a view of the input, as Megatron passes it
                    bucket = inputs[rank].clone()
                    aliased = bucket.view(size, length)[rank]
                    qgz_reduce_scatter(aliased, bucket, topo, codec=spec)
                    assert torch.equal(aliased, reference), f"reduce-scatter {key}: output aliasing the input"
                    assert torch.equal(gathered, gathered_ref), f"all-gather {key}: lossless != torch"
                    report["lossless_equal"].append(key)
                    continue
                replay = replay_reduce_scatter(inputs, topo, spec, rank, size)
                assert torch.equal(out, replay), f"reduce-scatter {key}: differs from the single-process replay"
                expect_ag = torch.cat([roundtrip(spec, inputs[r][:length]) for r in range(size)])
                assert torch.equal(gathered, expect_ag), f"all-gather {key}: differs from decode(encode(shard))"
                # relative to the terms' magnitude: a mean near zero (cancellation) has no relative precision
                magnitude = torch.stack([t.view(size, length)[rank].double().abs() for t in inputs]).sum(0) / size
                rel = float((out.double() - exact).norm() / magnitude.norm())
                # The codec's own relative error on one tensor of this data and dtype, the unit the
                # collective's error is measured in (two encodes of a sum of a few such tensors).
                x = inputs[rank].double()
                one = float((roundtrip(spec, inputs[rank]).double() - x).norm() / x.norm())
                report["lossy_rel_err"][key] = (rel, one + OUT_EPS[dtype])
                report["lossy_replayed"].append(key)
    return report


def all_reduce_worker() -> dict:
    """compressed_all_reduce with any codec: lossless equals the uncompressed all-reduce bit for bit;
    every codec leaves identical values on every rank."""
    topo = Topology(None)
    size, rank = topo.size, topo.rank
    out = {}
    for spec in LOSSLESS + LOSSY:
        for numel in (1, 7, 1000):
            for dtype in DTYPES:
                x = data(60, rank, numel, dtype)
                ref = x.clone()
                compressed_all_reduce(ref, topo, codec="none")
                t = x.clone()
                handle = compressed_all_reduce(t, topo, codec=spec, async_op=True)
                handle.wait()
                everyone = [torch.empty_like(t) for _ in range(size)]
                dist.all_gather(everyone, t)
                assert all(torch.equal(e, everyone[0]) for e in everyone), f"replicas differ ({spec}, {numel})"
                if spec in LOSSLESS:
                    assert torch.equal(t, ref), f"all-reduce {spec} {dtype} {numel}: lossless != uncompressed"
                exact = torch.stack([data(60, r, numel, dtype).double() for r in range(size)]).sum(0) / size
                out[(spec, str(dtype), numel)] = float((t.double() - exact).norm() / exact.norm())
    return out


def bytes_worker(length: int) -> dict:
    """Counted bytes of the variable-size paths equal the payload sizes (plus size messages)."""
    topo = Topology(None)
    size, rank = topo.size, topo.rank
    stats = comm_stats()
    inputs = [data(70, r, size * length, torch.bfloat16) for r in range(size)]
    result = {}
    for spec in ("mpc", "zfp:rate=8"):
        fixed = get_codec(spec).fixed_size
        shard = inputs[rank][:length].clone()
        full = torch.empty(size * length, dtype=torch.bfloat16)
        stats.reset()
        quantized_all_gather(full, shard, topo, codec=spec, tag="m")
        s = stats.get("m")
        biggest = max(payload_len(spec, inputs[r][:length]) for r in range(size))
        if not fixed:  # variable-size payloads travel in 16-byte slots (any_codec.py: alignment)
            biggest = -(-biggest // 16) * 16
            assert slot_bytes(biggest) == biggest
        result[(spec, "ag")] = (s.intra_bytes + s.inter_bytes,
                                (size - 1) * (biggest + (0 if fixed else _SIZE_BYTES)))
        stats.reset()
        out = torch.empty(length, dtype=torch.bfloat16)
        qgz_reduce_scatter(out, inputs[rank].clone(), topo, codec=spec, tag="m")
        s = stats.get("m")
        result[(spec, "rs_total")] = s.intra_bytes + s.inter_bytes
        result[(spec, "rs_uncompressed")] = s.uncompressed_intra_bytes + s.uncompressed_inter_bytes
    return result


def nan_worker() -> dict:
    """A NaN on one rank reaches the owner's output through every codec; elsewhere stays finite."""
    topo = Topology(None)
    size, rank, length = topo.size, topo.rank, 256
    found = {}
    for spec in LOSSLESS + LOSSY:
        x = data(80, rank, size * length, torch.float32)
        if rank == size - 1:
            x[5] = float("nan")
        out = torch.empty(length, dtype=torch.float32)
        qgz_reduce_scatter(out, x, topo, codec=spec)
        found[spec] = (bool(torch.isnan(out[5])) if rank == 0 else None,
                       bool(torch.isfinite(out[64:]).all()))
    return found


def error_feedback_worker(spec: str, steps: int) -> dict:
    """Error feedback over ``steps`` reduce-scatters (one hop: the whole error is fed back): the sum of the
    outputs equals the sum of the exact inputs minus what the final residuals still hold, to fp32 rounding;
    without feedback the same sum drifts by the codec's accumulated error."""
    topo = Topology(None)
    size, rank, length = topo.size, topo.rank, 1000
    residual = torch.zeros(size * length, dtype=torch.float32)
    total_out = torch.zeros(length, dtype=torch.float64)
    total_plain = torch.zeros(length, dtype=torch.float64)
    total_exact = torch.zeros(length, dtype=torch.float64)
    magnitude = torch.zeros(length, dtype=torch.float64)
    for t in range(steps):
        inputs = [data(90 + t, r, size * length, torch.float32) for r in range(size)]
        out = torch.empty(length, dtype=torch.float32)
        qgz_reduce_scatter(out, inputs[rank].clone(), topo, codec=spec, op="sum", residual=residual)
        plain = torch.empty(length, dtype=torch.float32)
        qgz_reduce_scatter(plain, inputs[rank].clone(), topo, codec=spec, op="sum")
        total_out += out.double()
        total_plain += plain.double()
        mine = torch.stack([x.view(size, length)[rank].double() for x in inputs])
        total_exact += mine.sum(0)
        magnitude += mine.abs().sum(0)
    everyone = [torch.empty_like(residual) for _ in range(size)]
    dist.all_gather(everyone, residual)
    left = torch.stack([e.view(size, length)[rank].double() for e in everyone]).sum(0)
    identity_err = float(((total_out + left) - total_exact).abs().max() / magnitude.max())
    return {"identity_err": identity_err,
            "drift_with": float((total_out - total_exact).norm() / total_exact.norm()),
            "drift_without": float((total_plain - total_exact).norm() / total_exact.norm()),
            "residual_norm": float(residual.norm())}


def error_feedback_non_finite_worker(spec: str) -> dict:
    """An Inf in one step's gradient must not poison the residual: the next, finite step is finite."""
    topo = Topology(None)
    size, rank, length = topo.size, topo.rank, 512
    residual = torch.zeros(size * length, dtype=torch.float32)
    x = data(95, rank, size * length, torch.float32)
    if rank == size - 1:
        x[3] = float("inf")
    out = torch.empty(length, dtype=torch.float32)
    qgz_reduce_scatter(out, x, topo, codec=spec, residual=residual)
    first_nonfinite = not bool(torch.isfinite(out[:64]).all()) if rank == 0 else None
    qgz_reduce_scatter(out, data(96, rank, size * length, torch.float32), topo, codec=spec, residual=residual)
    return {"inf_reached_owner": first_nonfinite, "next_step_finite": bool(torch.isfinite(out).all()),
            "residual_finite": bool(torch.isfinite(residual).all())}
