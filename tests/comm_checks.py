"""Error bounds and per-rank worker bodies for the multi-process tests of megatron_zpp.comm.

Workers run in spawned gloo processes (``megatron_zpp.testing.run_distributed``); every
rank regenerates every rank's input from a seed, so each can compute the exact answer
in float64 and the codec-derived error bound for its own output.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_zpp.comm import (HeldShard, HpzShard, Topology, comm_stats, compressed_all_reduce, hpz_all_gather,
                               qgz_reduce_scatter, quantized_all_gather, ring_reduce_scatter, torch_reduce_scatter,
                               weight_difference_all_gather)
from megatron_zpp.compression import get_codec, layout

SIZES = (1, 7, 300, 1000)  # one element, odd, not a multiple of any block, several blocks
DTYPES = (torch.float32, torch.bfloat16)
# (inter codec, intra codec, stages): plain INT8 / INT4, INT8 inside the node with INT4 across,
# pipelined hops with padding, stochastic rounding.
QGZ_CONFIGS = (
    ("int8:block=256", None, 1),
    ("int4:block=128", None, 1),
    ("int4:block=128", "int8:block=256", 1),
    ("int4:block=64", None, 3),
    ("int4:block=128,rounding=stochastic", None, 1),
)
# Relative rounding of the output dtype: half an ulp of bf16/fp16, a full ulp of fp32.
OUT_EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}
FP32_SLOP = 2.0**-20  # fp32 scale arithmetic and accumulation, relative to the magnitudes summed


def gen(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1000 + rank)


def heavy_tailed(n: int, g: torch.Generator) -> torch.Tensor:
    """Gradient-like data: normal values times a per-element log-uniform magnitude."""
    return torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(4 * torch.rand(n, generator=g) - 2)


def block_absmax(v: torch.Tensor, row_len: int, block: int) -> torch.Tensor:
    """Per element, the absmax of its quantization block; ``v[..., k * row_len]`` holds k rows."""
    rows = v.shape[-1] // row_len
    r = v.abs().reshape(*v.shape[:-1], rows, row_len)
    nb = layout.ceil_div(row_len, block)
    r = F.pad(r, (0, nb * block - row_len)).reshape(*v.shape[:-1], rows, nb, block)
    m = r.amax(-1, keepdim=True).expand_as(r).reshape(*v.shape[:-1], rows, nb * block)[..., :row_len]
    return m.reshape(v.shape)


def codec_params(spec: str) -> tuple[int, int, float]:
    """(bits, block, error per unit scale): 1/2 for round-to-nearest, 1 for stochastic."""
    c = get_codec(spec)
    return c.bits, c.block, (1.0 if c.stochastic else 0.5)


def all_gather_bound(full: torch.Tensor, shard_len: int, spec: str, dtype: torch.dtype) -> torch.Tensor:
    bits, block, k = codec_params(spec)
    scale = block_absmax(full, shard_len, block) / layout.qmax_for_bits(bits)
    # Quantization step (half of it for round-to-nearest), fp32 arithmetic, then the output
    # dtype's rounding of a value at most |x| + k * scale (OUT_EPS is half an ulp for bf16).
    return k * scale * (1 + FP32_SLOP) + FP32_SLOP * full.abs() + OUT_EPS[dtype] * (full.abs() + k * scale)


def qgz_expected_and_bound(inputs: list[torch.Tensor], topo: Topology, dest: int, codec: str,
                           intra: str | None, stages: int, divisor: int, dtype: torch.dtype):
    """The exact reduced chunk of ``dest`` and a bound on qgZ's error, from the codecs' step sizes.

    Hop 1 quantizes each rank's slice rows (error <= k * absmax / qmax per block); the node's
    partial sum of dequantized values is re-quantized for hop 2 (its absmax is at most the
    exact partial's plus hop 1's error); the errors of all terms add up, then the divisor
    and the output rounding apply.
    """
    size, n, nodes = topo.size, topo.node_size, topo.num_nodes
    length = inputs[0].numel() // size
    stages = min(stages, length)
    slice_len = layout.ceil_div(length, stages)
    padded = stages * slice_len
    x = torch.stack([F.pad(t.view(size, length)[dest].double(), (0, padded - length)) for t in inputs])
    exact = x.sum(0)
    magnitude = x.abs().sum(0)
    bits2, block2, k2 = codec_params(codec)
    bits1, block1, k1 = codec_params(intra or codec) if n > 1 else (bits2, block2, k2)
    e1 = k1 * block_absmax(x, slice_len, block1) / layout.qmax_for_bits(bits1)
    if n > 1 and nodes > 1:
        err = torch.zeros(padded, dtype=torch.float64)
        for m in range(nodes):
            members = slice(m * n, (m + 1) * n)
            part_err = e1[members].sum(0)
            partial_absmax = block_absmax(x[members].sum(0), slice_len, block2) + \
                block_absmax(part_err, slice_len, block2)
            err += part_err + k2 * partial_absmax / layout.qmax_for_bits(bits2)
    else:
        err = e1.sum(0)
    err = err * (1 + FP32_SLOP) + FP32_SLOP * magnitude
    mean = exact / divisor
    bound = err / divisor + OUT_EPS[dtype] * (mean.abs() + err / divisor)
    return mean[:length], bound[:length]


def check_close(what: str, out: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> float:
    """Assert |out - expected| <= bound element-wise; return the largest error / bound ratio."""
    err = (out.double() - expected).abs()
    bad = err > bound
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: element {i} is {float(out[i])}, expected {float(expected[i])} "
                             f"+- {float(bound[i])} ({int(bad.sum())} of {out.numel()} outside the bound)")
    return float((err / bound.clamp_min(1e-300)).max()) if out.numel() else 0.0


# ------------------------------------------------------------------------ workers -----
def collectives_worker(seed: int) -> dict:
    """Every collective, codec, dtype and size on this layout; returns the worst error/bound ratios."""
    topo = Topology(None)
    size, rank = topo.size, topo.rank
    worst: dict[str, float] = {}

    def note(key: str, ratio: float) -> None:
        worst[key] = max(worst.get(key, 0.0), ratio)

    for dtype in DTYPES:
        for length in SIZES:
            tag = f"{dtype}, {length} elements"
            # ---- all-gather: "none" equals torch's bit for bit; int8/int4 within the bound.
            shards = [heavy_tailed(length, gen(seed, r)).to(dtype) for r in range(size)]
            full = torch.cat(shards).double()
            ref = torch.empty(size * length, dtype=dtype)
            dist.all_gather_into_tensor(ref, shards[rank])
            out = torch.full_like(ref, float("nan"))
            quantized_all_gather(out, shards[rank], topo, codec="none")
            assert torch.equal(out, ref), f"all-gather none != torch ({tag})"
            for spec in ("int8:block=256", "int4:block=128", "int8:block=64"):
                out.fill_(float("nan"))
                handle = quantized_all_gather(out, shards[rank], topo, codec=spec, async_op=length > 1)
                if handle is not None:
                    handle.wait()
                note(f"qwZ {spec}", check_close(f"qwZ {spec} ({tag})", out, full,
                                                all_gather_bound(full, length, spec, dtype)))

            # ---- reduce-scatter "none": small integers, so every summation order is exact (bf16
            # included) and the comparison with torch can be bit for bit; float sums in another
            # order would differ in the last bits.
            ints = [torch.randint(-8, 8, (size * length,), generator=gen(seed + 1, r)).to(dtype)
                    for r in range(size)]
            ref_sum = torch.empty(length, dtype=dtype)
            dist.reduce_scatter_tensor(ref_sum, ints[rank].clone(), op=dist.ReduceOp.SUM)
            ref = ref_sum / size
            # op="sum": what Megatron's distributed optimizer asks for after pre-scaling.
            out = torch.full_like(ref, float("nan"))
            qgz_reduce_scatter(out, ints[rank].clone(), topo, codec="none", op="sum")
            assert torch.equal(out, ref_sum), f"qgZ none sum reduce-scatter != torch sum ({tag}): {out} vs {ref_sum}"
            for name, fn in (("qgZ none", lambda o, i: qgz_reduce_scatter(o, i, topo, codec="none")),
                             ("qgZ none stages=2", lambda o, i: qgz_reduce_scatter(o, i, topo, codec="none",
                                                                                   stages=2)),
                             ("ring", lambda o, i: ring_reduce_scatter(o, i, topo)),
                             ("torch", lambda o, i: torch_reduce_scatter(o, i, topo))):
                out = torch.full_like(ref, float("nan"))
                fn(out, ints[rank].clone())
                assert torch.equal(out, ref), f"{name} reduce-scatter != torch mean ({tag}): {out} vs {ref}"

            # ---- qgZ compressed: within the bound derived from the codecs.
            grads = [heavy_tailed(size * length, gen(seed + 2, r)).to(dtype) for r in range(size)]
            for i, (codec, intra, stages) in enumerate(QGZ_CONFIGS):
                for op, divisor in (("mean", size), ("sum", 1)):
                    if op == "sum" and i:
                        continue
                    out = torch.full((length,), float("nan"), dtype=dtype)
                    handle = qgz_reduce_scatter(out, grads[rank], topo, codec=codec, intra_codec=intra,
                                                stages=stages, op=op, async_op=bool(i % 2))
                    if handle is not None:
                        handle.wait()
                    expected, bound = qgz_expected_and_bound(grads, topo, rank, codec, intra, stages,
                                                             divisor, dtype)
                    note(f"qgZ {codec} intra={intra} stages={stages} {op}",
                         check_close(f"qgZ {codec} intra={intra} stages={stages} {op} ({tag})",
                                     out, expected, bound))

            # ---- output aliasing its input, as Megatron passes a view of the bucket.
            bucket = grads[rank].clone()
            alias = bucket.view(size, length)[rank]
            qgz_reduce_scatter(alias, bucket, topo, codec="int4:block=128")
            separate = torch.empty(length, dtype=dtype)
            qgz_reduce_scatter(separate, grads[rank], topo, codec="int4:block=128")
            assert torch.equal(alias, separate), f"qgZ with aliased output differs ({tag})"
    return worst


def mean_scale_worker() -> dict:
    """All ranks hold constant rank + 1: the mean is (size + 1) / 2 exactly; a sum over a node
    left undivided (DeepSpeed's suspected GPUs-per-node x mean) would be off by node_size."""
    topo = Topology(None)
    length = 512
    x = torch.full((topo.size * length,), float(topo.rank + 1))
    out = {}
    for codec in ("none", "int8:block=256", "int4:block=128"):
        y = torch.empty(length)
        qgz_reduce_scatter(y, x, topo, codec=codec, op="mean")
        out[codec] = (float(y.min()), float(y.max()))
    return {"expected": (topo.size + 1) / 2, "got": out, "node_size": topo.node_size}


def nan_worker() -> dict:
    """The last rank puts NaN (fp32) or Inf (bf16) in element 5 of the chunk owned by rank 0."""
    topo = Topology(None)
    size, rank, length = topo.size, topo.rank, 300
    found = {}
    for dtype, bad in ((torch.float32, float("nan")), (torch.bfloat16, float("inf"))):
        for codec in ("none", "int8:block=256", "int4:block=128"):
            x = heavy_tailed(size * length, gen(7, rank)).to(dtype)
            if rank == size - 1:
                x[5] = bad
            y = torch.empty(length, dtype=dtype)
            qgz_reduce_scatter(y, x, topo, codec=codec)
            shard = x[:length]  # holds element 5 on the last rank
            g = torch.empty(size * length, dtype=dtype)
            quantized_all_gather(g, shard, topo, codec=codec)
            # Lossy codecs poison the whole quantization block of element 5, and no more.
            block = get_codec(codec).block if codec != "none" else 1
            first, last = (5 // block) * block, (5 // block + 1) * block
            found[(str(dtype), codec)] = {
                "rs_nonfinite_at_5": not bool(torch.isfinite(y[first:last]).any()) if rank == 0 else None,
                "rs_finite_elsewhere": bool(torch.isfinite(torch.cat([y[:first], y[last:]])).all()) if rank == 0
                else bool(torch.isfinite(y).all()),
                "ag_nonfinite": [int(i) for i in (~torch.isfinite(g)).nonzero().view(-1)],
                "ag_expected": list(range((size - 1) * length + first, (size - 1) * length + last)),
            }
    return found


def bytes_worker(shard: int) -> dict:
    """Cross-node bytes of every collective on this layout, summed over ranks (bf16)."""
    topo = Topology(None)
    size, rank = topo.size, topo.rank
    stats = comm_stats()
    x = torch.randn(shard, generator=gen(3, rank)).to(torch.bfloat16)
    full = torch.empty(size * shard, dtype=torch.bfloat16)
    g = torch.randn(size * shard, generator=gen(4, rank)).to(torch.bfloat16)
    y = torch.empty(shard, dtype=torch.bfloat16)
    runs = {
        "allgather_none": lambda: quantized_all_gather(full, x, topo, codec="none", tag="m"),
        "qwz_int8": lambda: quantized_all_gather(full, x, topo, codec="int8:block=256", tag="m"),
        "rs_torch": lambda: torch_reduce_scatter(y, g, topo, tag="m"),
        "rs_ring": lambda: ring_reduce_scatter(y, g, topo, tag="m"),
        "rs_hierarchical_none": lambda: qgz_reduce_scatter(y, g, topo, codec="none", tag="m"),
        "qgz_int4": lambda: qgz_reduce_scatter(y, g, topo, codec="int4:block=128", tag="m"),
    }
    measured = {}
    for name, fn in runs.items():
        stats.reset()
        fn()
        s = stats.summed_over_ranks()["m"]
        measured[name] = (s.intra_bytes, s.inter_bytes)
        measured[name + ":uncompressed"] = (s.uncompressed_intra_bytes, s.uncompressed_inter_bytes)
    hpz = HpzShard(topo, shard, torch.bfloat16, "int8:block=256")
    quantized_all_gather(full, x, topo, codec="int8:block=256", hpz_shard=hpz, tag="fwd")
    stats.reset()
    backward = torch.empty_like(full)
    hpz_all_gather(backward, hpz, tag="m")
    s = stats.summed_over_ranks()["m"]
    measured["hpz_gather"] = (s.intra_bytes, s.inter_bytes)
    measured["hpz_equals_forward"] = bool(torch.equal(backward, full))
    return measured


def hpz_worker() -> dict:
    """hpZ for partition sizes 1..node_size and codecs int8 / none: the backward gather equals the
    forward one bit for bit, crosses no node, and refuses to run on an invalidated copy; a copy invalidated
    between its filling gather's call and wait stays stale."""
    results = {}
    base = Topology(None)
    for k in [d for d in range(1, base.node_size + 1) if base.node_size % d == 0]:
        topo = Topology(None, hpz_partition_size=k)
        for codec in ("int8:block=256", "none"):
            for length in (1, 301):
                x = heavy_tailed(length, gen(11, topo.rank)).to(torch.bfloat16)
                fwd = torch.empty(topo.size * length, dtype=torch.bfloat16)
                shard = HpzShard(topo, length, torch.bfloat16, codec)
                quantized_all_gather(fwd, x, topo, codec=codec, hpz_shard=shard)
                comm_stats().reset()
                bwd = torch.full_like(fwd, float("nan"))
                hpz_all_gather(bwd, shard, async_op=True).wait()
                s = comm_stats().get("dp.param.hpz")
                shard.invalidate()
                try:
                    hpz_all_gather(bwd, shard)
                    refused = False
                except RuntimeError:
                    refused = True
                # a weight install between a filling gather's call and its wait: the rows are the old weights'
                handle = quantized_all_gather(fwd, x, topo, codec=codec, hpz_shard=shard, async_op=True)
                shard.invalidate()
                handle.wait()
                results[(k, codec, length)] = {"equal": bool(torch.equal(fwd, bwd)), "inter": s.inter_bytes,
                                               "intra": s.intra_bytes, "refused_stale": refused,
                                               "stale_after_change": not shard.valid, "shard_bytes": shard.nbytes}
    return results


def megatron_dp_group_worker() -> dict:
    """Megatron's strided DP groups (TP=2: [0,2,4,6], [1,3,5,7]) on 2 nodes of 4 ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(t, world, 2))) for t in range(2)]  # created by all ranks
    dp = groups[rank % 2]
    topo = Topology(dp, ranks_per_node=4)
    length = 129
    grads = [heavy_tailed(topo.size * length, gen(21, r)).to(torch.float32) for r in range(topo.size)]
    y = torch.empty(length)
    qgz_reduce_scatter(y, grads[topo.rank], topo, codec="int4:block=128")
    expected, bound = qgz_expected_and_bound(grads, topo, topo.rank, "int4:block=128", None, 1, topo.size,
                                             torch.float32)
    check_close("qgZ over a strided DP group", y, expected, bound)
    return {"nodes": topo.num_nodes, "node_size": topo.node_size, "members": list(topo.members),
            "inter_group": dist.get_process_group_ranks(topo.inter_group)}


def coalescing_worker() -> bool:
    """Inside Megatron's ``_coalescing_manager`` block on the DP group our collectives still run
    (they use private groups) and the deferred reduce-scatter still completes."""
    topo = Topology(None)
    size, rank, length = topo.size, topo.rank, 256
    grads = [heavy_tailed(size * length, gen(31, r)).to(torch.float32) for r in range(size)]
    mine = grads[rank]
    plain_ref = torch.empty(length)
    dist.reduce_scatter_tensor(plain_ref, mine.clone())
    y_plain = torch.empty(length)
    y_qgz = torch.empty(length)
    gathered = torch.empty(size * length)
    with dist._coalescing_manager(group=dist.group.WORLD, async_ops=True) as cm:
        dist.reduce_scatter_tensor(y_plain, mine.clone(), group=dist.group.WORLD)
        h1 = qgz_reduce_scatter(y_qgz, mine, topo, codec="int4:block=128", async_op=True)
        h2 = quantized_all_gather(gathered, mine[:length], topo, codec="int8:block=256", async_op=True)
    cm.wait()
    h1.wait()
    h2.wait()
    assert torch.equal(y_plain, plain_ref)
    expected, bound = qgz_expected_and_bound(grads, topo, rank, "int4:block=128", None, 1, size, torch.float32)
    check_close("qgZ inside _coalescing_manager", y_qgz, expected, bound)
    full = torch.cat([g[:length] for g in grads]).double()
    check_close("qwZ inside _coalescing_manager", gathered, full,
                all_gather_bound(full, length, "int8:block=256", torch.float32))
    return True


class HostSyncError(RuntimeError):
    pass


def no_host_sync_worker() -> int:
    """After a first call (which checks settings across ranks once), the collectives never read
    tensor values on the host (``.item()``, ``.tolist()``, ``bool()``, ``int()``, ``float()`` raise)
    and allocate no new scratch buffers."""
    topo = Topology(None)
    size, length = topo.size, 300
    x = torch.randn(size * length)
    y = torch.empty(length)
    g = torch.empty(size * length)
    hpz = HpzShard(topo, length, torch.float32, "int8:block=256")

    def everything(async_op: bool) -> None:
        handles = [
            qgz_reduce_scatter(y, x, topo, codec="int4:block=128", intra_codec="int8:block=256", stages=2,
                               async_op=async_op),
            qgz_reduce_scatter(y, x, topo, codec="none", async_op=async_op),
            quantized_all_gather(g, x[:length], topo, codec="int8:block=256", hpz_shard=hpz, async_op=async_op),
        ]
        for h in handles:
            if h is not None:
                h.wait()
        h = hpz_all_gather(g, hpz, async_op=async_op)
        if h is not None:
            h.wait()

    everything(False)  # first use: settings handshake, scratch buffers allocated
    allocated = topo.buffers.allocated_bytes
    def forbid(*a, **k):
        raise HostSyncError("host read of a tensor value on the comm path")
    saved = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "__bool__", "__int__", "__float__")}
    calls = 0
    try:
        for n in saved:
            setattr(torch.Tensor, n, forbid)
        for async_op in (False, True, True):
            everything(async_op)
            calls += 4
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
    # Steady state reuses the pooled scratch buffers: nothing new was allocated.
    assert topo.buffers.allocated_bytes == allocated, (allocated, topo.buffers.allocated_bytes)
    return calls


def many_in_flight_worker() -> bool:
    """Megatron issues every bucket's reduce-scatter before waiting on any: eight async qgZ calls of
    different sizes in flight at once, waited in order, each correct."""
    topo = Topology(None)
    size, rank = topo.size, topo.rank
    lengths = [64, 1, 300, 64, 1000, 7, 64, 256]
    inputs = {i: [heavy_tailed(size * n, gen(40 + i, r)).to(torch.float32) for r in range(size)]
              for i, n in enumerate(lengths)}
    outs = [torch.empty(n) for n in lengths]
    handles = [qgz_reduce_scatter(outs[i], inputs[i][rank], topo, codec="int4:block=128", async_op=True,
                                  stages=1 + i % 2) for i in range(len(lengths))]
    for i, h in enumerate(handles):
        h.wait()
        expected, bound = qgz_expected_and_bound(inputs[i], topo, rank, "int4:block=128", None, 1 + i % 2,
                                                 size, torch.float32)
        check_close(f"in-flight call {i}", outs[i], expected, bound)
    return True


def mismatch_worker() -> str:
    """Rank 0 asks for INT8, the others for INT4: every rank gets a ValueError naming both."""
    topo = Topology(None)
    codec = "int8:block=256" if topo.rank == 0 else "int4:block=128"
    y = torch.empty(8)
    try:
        qgz_reduce_scatter(y, torch.randn(8 * topo.size), topo, codec=codec)
    except ValueError as e:
        return str(e)
    return "no error"


def topology_errors_worker() -> dict:
    """Bad layouts raise errors naming the bad value; every rank of a 4-rank world runs this."""
    out = {}
    group3 = dist.new_group([0, 1, 2])
    if dist.get_rank() < 3:
        try:
            Topology(group3, ranks_per_node=2)
        except ValueError as e:
            out["uneven"] = str(e)
    for bad in (0, -1, "2"):
        try:
            Topology(None, ranks_per_node=bad)
        except ValueError as e:
            out[f"rpn={bad!r}"] = str(e)
    try:
        Topology(None, ranks_per_node=2, hpz_partition_size=3)
    except ValueError as e:
        out["hpz"] = str(e)
    topo = Topology(None, ranks_per_node=2)
    for name, call in (
        ("bad_op", lambda: qgz_reduce_scatter(torch.empty(2), torch.empty(8), topo, op="max")),
        ("bad_codec", lambda: qgz_reduce_scatter(torch.empty(2), torch.empty(8), topo, codec="int3")),
        ("bad_size", lambda: qgz_reduce_scatter(torch.empty(3), torch.empty(8), topo)),
        ("bad_ag_size", lambda: quantized_all_gather(torch.empty(7), torch.empty(2), topo)),
        ("bad_dtype", lambda: qgz_reduce_scatter(torch.empty(2, dtype=torch.int32),
                                                 torch.empty(8, dtype=torch.int32), topo)),
        ("bad_stages", lambda: qgz_reduce_scatter(torch.empty(2), torch.empty(8), topo, stages=0)),
        ("mixed_none", lambda: qgz_reduce_scatter(torch.empty(2), torch.empty(8), topo, codec="none",
                                                  intra_codec="int8")),
    ):
        try:
            call()
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def expected_cross_node_ratio(bits: int, block: int, elem_bytes: int) -> float:
    """Analytic payload+scales bytes per element over uncompressed bytes per element."""
    return (bits / 8 + 4 / block) / elem_bytes


def ring_crossings(nodes: int) -> int:
    return nodes if nodes > 1 else 0


def analytic_cross_node_bytes(nodes: int, node_size: int, shard: int) -> dict[str, float]:
    """Total inter-node bytes (all ranks) of each algorithm for bf16 (2 bytes) and a shard of
    ``shard`` elements, from first principles (no package code)."""
    size = nodes * node_size
    row8 = shard * 1 + 4 * math.ceil(shard / 256)
    row4 = math.ceil(shard / 2) + 4 * math.ceil(shard / 128)
    ring = ring_crossings(nodes) * (size - 1)
    return {
        "allgather_none": ring * shard * 2,
        "qwz_int8": ring * row8,
        "rs_torch": 2 * ring * shard * 2,
        "rs_ring": ring * shard * 2,
        "rs_hierarchical_none": size * (nodes - 1) * shard * 2,
        "qgz_int4": size * (nodes - 1) * row4,
        "hpz_gather": 0,
    }


def all_reduce_worker() -> dict:
    """compressed_all_reduce: the mean within (reduce-scatter bound + gather bound of the result),
    identical on every rank; sizes that do not divide by the group size included."""
    topo = Topology(None)
    size, rank = topo.size, topo.rank
    out = {}
    for codec in ("int8:block=256", "int4:block=128", "none"):
        for numel in (1, 7, 1000):
            data = [heavy_tailed(numel, gen(50, r)).to(torch.float32) for r in range(size)]
            t = data[rank].clone()
            handle = compressed_all_reduce(t, topo, codec=codec, async_op=numel > 1)
            if handle is not None:
                handle.wait()
            chunk = layout.ceil_div(numel, size)
            padded = [F.pad(d, (0, chunk * size - numel)) for d in data]
            exact = torch.stack([p.double() for p in padded]).sum(0) / size
            if codec == "none":
                bound = 1e-6 * torch.stack([p.double().abs() for p in padded]).sum(0) / size
            else:
                rs_bound = torch.cat([qgz_expected_and_bound(padded, topo, d, codec, None, 1, size,
                                                             torch.float32)[1] for d in range(size)])
                bits, block, k = codec_params(codec)
                ag_step = k * (block_absmax(exact, chunk, block) + block_absmax(rs_bound, chunk, block)) \
                    / layout.qmax_for_bits(bits)
                bound = rs_bound + ag_step * (1 + FP32_SLOP) + FP32_SLOP * exact.abs()
            out[(codec, numel)] = check_close(f"all-reduce {codec} {numel}", t, exact[:numel], bound[:numel])
            everyone = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(everyone, t)
            assert all(torch.equal(e, everyone[0]) for e in everyone), f"replicas differ ({codec}, {numel})"
    return out


def issue_order_worker(seed: int) -> dict:
    """Async qgZ (two hops), qwZ and compressed all-reduce calls interleaved, with rank-dependent
    random host delays between calls and before waits. Every collective any of them issues is
    logged in issue order (group role, op, bytes): the order must be identical on every rank (NCCL
    requires it) whatever the timing, and no helper thread may exist."""
    import random
    import threading
    import time

    topo = Topology(None)
    groups = topo._groups
    roles = {id(g.group): name for name, g in (("flat", groups.flat), ("intra", groups.intra),
                                               ("inter", groups.inter), ("hpz", groups.hpz)) if g.group is not None}
    log: list = []
    threads: set = set()
    originals = {n: getattr(dist, n) for n in ("all_to_all_single", "all_gather_into_tensor")}

    def logged(name):
        def call(out, inp, *args, group=None, **kwargs):
            log.append((roles.get(id(group), "other"), name, inp.numel() * inp.element_size()))
            threads.add(threading.current_thread().name)
            return originals[name](out, inp, *args, group=group, **kwargs)
        return call

    rng = random.Random(seed * 1000 + topo.rank)
    size = topo.size
    xs = [torch.randn(size * n) for n in (64, 300, 1000, 7)]
    outs = [torch.empty(n) for n in (64, 300, 1000, 7)]
    gathered = torch.empty(size * 300)
    for n in originals:
        setattr(dist, n, logged(n))
    try:
        for _ in range(3):
            handles = []
            for i, (x, y) in enumerate(zip(xs, outs)):
                time.sleep(rng.random() * 0.02)
                handles.append(qgz_reduce_scatter(y, x, topo, codec="int4:block=128", async_op=True,
                                                  stages=1 + i % 2))
                if i == 1:
                    handles.append(quantized_all_gather(gathered, xs[1][:300], topo, codec="int8:block=256",
                                                        async_op=True))
            time.sleep(rng.random() * 0.02)
            handles.append(compressed_all_reduce(xs[3].clone(), topo, codec="int8:block=256", async_op=True))
            for h in reversed(handles) if rng.random() < 0.5 else handles:
                time.sleep(rng.random() * 0.01)
                h.wait()
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)
    return {"log": log, "threads": sorted(threads),
            "comm_threads": [t.name for t in threading.enumerate() if t.name.startswith("zpp")]}


def stochastic_reproducible_worker() -> list[str]:
    """Digests of stochastic-rounding qgZ / qwZ results over several async calls in flight."""
    import hashlib

    topo = Topology(None)
    size = topo.size
    digests = []
    for it in range(3):
        x = heavy_tailed(size * 300, gen(7 + it, topo.rank)).to(torch.float32)
        y = torch.empty(300)
        g = torch.empty(size * 300)
        h1 = qgz_reduce_scatter(y, x, topo, codec="int4:block=128,rounding=stochastic", async_op=True)
        h2 = quantized_all_gather(g, x[:300], topo, codec="int8:block=256,rounding=stochastic", async_op=True)
        h2.wait()
        h1.wait()
        digests += [hashlib.sha1(t.numpy().tobytes()).hexdigest() for t in (y, g)]
    return digests


def weight_difference_worker(dtype_name: str, codec: str, shard: int, steps: int, resync_at: int) -> dict:
    """qWD over ``steps`` optimizer-like updates: each rank writes its new shard into its slice of the gathered
    buffer (as Megatron's distributed optimizer does) and gathers differences. Per step: whether every rank
    holds the same bits, the worst error against this rank's new weights relative to its bound (INT4 step of
    the difference's block absmax, plus the dtype's rounding), and the bytes sent across nodes."""
    dtype = getattr(torch, dtype_name)
    topo = Topology(None)
    size, rank = topo.size, topo.rank
    bits, block, per_scale = codec_params(codec)
    qmax = layout.qmax_for_bits(bits)
    g = gen(23, rank)
    exact = heavy_tailed(shard, g).float() * 0.05
    buf = torch.zeros(size * shard, dtype=dtype)
    mine = buf.view(size, shard)[rank]  # the optimizer's view of its shard inside the gathered buffer
    held = HeldShard(shard, dtype)
    steps_out = []
    for step in range(steps):
        if step:
            exact += 1e-3 * torch.randn(shard, generator=g)  # an optimizer update
        if step == resync_at:
            held.invalidate()
        mine.copy_(exact.to(dtype))
        target = mine.clone()  # this rank's new weights, in the weights' dtype
        resync = not held.valid
        difference = None if resync else target.float() - held.value.float()
        comm_stats().reset()
        handle = weight_difference_all_gather(buf, mine, held, topo, codec=codec, async_op=step % 2 == 1)
        if handle is not None:
            handle.wait()
        inter = comm_stats().summed_over_ranks()["dp.param"].inter_bytes
        everyone = [torch.empty_like(buf) for _ in range(size)]
        dist.all_gather(everyone, buf)
        identical = all(torch.equal(e.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                    buf.view(torch.int16 if dtype != torch.float32 else torch.int32))
                        for e in everyone)
        got = buf.view(size, shard)[rank].float()
        if resync:
            worst = 0.0 if torch.equal(got, target.float()) else float("inf")
        else:
            step_bound = block_absmax(difference, shard, block) / qmax * per_scale
            # the cast of base + decoded rounds the *result*: half an ulp of the larger of the two magnitudes
            rounding = torch.maximum(got.abs(), target.float().abs()) * OUT_EPS[dtype]
            bound = step_bound + rounding + step_bound * FP32_SLOP + 1e-30
            worst = float(((got - target.float()).abs() / bound).max())
        steps_out.append({"resync": resync, "identical": identical, "worst": worst, "inter": inter,
                          "held_is_output": bool(torch.equal(held.value, buf.view(size, shard)[rank]))})
    # A NaN written by one rank reaches every replica (Megatron's checks see it), in its block only.
    if rank == 0:
        mine[3] = float("nan")
    weight_difference_all_gather(buf, mine, held, topo, codec=codec)
    nan_rows = torch.isnan(buf.view(size, shard).float()).any(dim=1).tolist()
    return {"steps": steps_out, "nan_rows": nan_rows,
            "row_bytes": layout.row_bytes(shard, bits, block), "qwz_row_bytes": layout.row_bytes(shard, 8, 256)}


# ------------------------------------------------ qgZ with Hadamard smoothing -----
def _rotate64(v: torch.Tensor, h: int) -> torch.Tensor:
    """The exact normalized Walsh-Hadamard transform of every full run of ``h`` values of each row (float64)."""
    from megatron_zpp.compression.reference import hadamard_rows

    return hadamard_rows(v, h) * (layout.hadamard_scale(h) * math.sqrt(h)) ** -1 if h else v


def _run_norms(v: torch.Tensor, h: int) -> torch.Tensor:
    """L2 norm of each run of ``h`` values of a [..., L] tensor (L a multiple of h), broadcast back per element."""
    r = v.reshape(*v.shape[:-1], -1, h).norm(dim=-1, keepdim=True)
    return r.expand(*v.shape[:-1], v.shape[-1] // h, h).reshape(v.shape)


def qgz_hadamard_bound(inputs: list[torch.Tensor], topo: Topology, dest: int, codec: str, intra: str | None,
                       divisor: int, dtype: torch.dtype, stages: int = 1):
    """The exact mean of ``dest``'s chunk and, per run of the inter-node codec's ``hadamard``, a bound on the L2
    norm of qgZ's error on that run (the chunk split into ``stages`` slices, each a multiple of the run).

    Unrotated hop 1 (intra): each element within k1 * absmax / qmax. A node's partial sum P + E (E: the hop-1
    errors) is rotated and quantized: an element of H(P + E) is at most |HP| + ||E_run||_2 (each row of H/sqrt(h)
    has unit norm), so each rotated block's error is within k2 * that block's bound / qmax per element, and
    sqrt(h) times that on a run in L2; rotating back keeps L2 norms. Hop 1 rotated alike (the intra codec's
    run equal to the inter one's): every error is in the rotated domain, bounded element by element, and the
    L2 norm of that bound vector on a run bounds the error's."""
    size, n, nodes = topo.size, topo.node_size, topo.num_nodes
    length = inputs[0].numel() // size
    slice_len = length // stages
    assert slice_len * stages == length
    x = torch.stack([t.view(size, length)[dest].double() for t in inputs])
    exact = x.sum(0)
    bits2, block2, k2 = codec_params(codec)
    h = get_codec(codec).hadamard
    assert h and slice_len % h == 0
    bits1, block1, k1 = codec_params(intra or codec) if n > 1 else (bits2, block2, k2)
    h1 = get_codec(intra or codec).hadamard if n > 1 else h
    assert h1 in (0, h)
    q1, q2 = layout.qmax_for_bits(bits1), layout.qmax_for_bits(bits2)
    if n == 1 or nodes == 1:  # one hop: every rank's rows rotated by the first hop's own codec (or not)
        e = k1 * block_absmax(_rotate64(x, h1) if h1 else x, slice_len, block1) / q1
        err = _run_norms(e.sum(0), h)
    elif h1:  # both hops rotated: the node's sums stay in the rotated domain
        rotated = _rotate64(x, h)
        e1 = k1 * block_absmax(rotated, slice_len, block1) / q1
        total = torch.zeros(length, dtype=torch.float64)
        for m in range(nodes):
            members = slice(m * n, (m + 1) * n)
            hop1 = e1[members].sum(0)
            peak = rotated[members].sum(0).abs() + hop1
            total += hop1 + k2 * block_absmax(peak, slice_len, block2) / q2
        err = _run_norms(total, h)
    else:
        e1 = k1 * block_absmax(x, slice_len, block1) / q1
        err = torch.zeros(length, dtype=torch.float64)
        for m in range(nodes):
            members = slice(m * n, (m + 1) * n)
            hop1 = _run_norms(e1[members].sum(0), h)  # ||E_run||_2
            peak = _rotate64(x[members].sum(0).unsqueeze(0), h)[0].abs() + hop1
            err += hop1 + math.sqrt(h) * k2 * block_absmax(peak, slice_len, block2) / q2
    err = err * (1 + FP32_SLOP) + FP32_SLOP * _run_norms(x.abs().sum(0), h)
    mean = exact / divisor
    return mean, err / divisor + OUT_EPS[dtype] * (_run_norms(mean, h) + err / divisor)


# (name, inter codec, intra codec, stages): SDP4Bit's two levels, both hops rotated (the sums stay rotated
# between them), pipelined stages; and plain INT4 to compare the error with.
QGZ_HADAMARD_CONFIGS = (
    ("int4+H", "int4:block=128,hadamard=32", "int8:block=512", 1),
    ("int4", "int4:block=128", "int8:block=512", 1),
    ("both rotated", "int4:block=128,hadamard=32", "int4:block=128,hadamard=32", 1),
    ("int4+H stages=2", "int4:block=128,hadamard=32", "int8:block=512", 2),
)


def qgz_hadamard_worker(seed: int) -> dict:
    """qgZ with rotated INT4 hops: the error of each run within the rotated bound, for every configuration of
    QGZ_HADAMARD_CONFIGS; and the relative L2 error of each on the same heavy-tailed gradients."""
    topo = Topology(None)
    size, rank = topo.size, topo.rank
    out: dict = {"ratio": {}}
    length = 1024
    errors: dict[str, float] = {}
    for dtype in DTYPES:
        grads = [heavy_tailed(size * length, gen(seed, r)).to(dtype) for r in range(size)]
        exact = torch.stack([g.view(size, length)[rank].double() for g in grads]).sum(0) / size
        for name, codec, intra, stages in QGZ_HADAMARD_CONFIGS:
            got = torch.full((length,), float("nan"), dtype=dtype)
            qgz_reduce_scatter(got, grads[rank], topo, codec=codec, intra_codec=intra, op="mean", stages=stages)
            errors[f"{name} {dtype}"] = float((got.double() - exact).norm() / exact.norm())
            if get_codec(codec).hadamard:
                mean, bound = qgz_hadamard_bound(grads, topo, rank, codec, intra, size, dtype, stages)
                run_error = _run_norms(got.double() - mean, 32)
                bad = run_error > bound
                assert not bad.any(), (f"qgZ {codec} intra={intra} stages={stages} {dtype}: {int(bad.sum())} "
                                       f"elements' runs over the bound, worst {float((run_error / bound).max()):.3f}")
                out["ratio"][name] = max(out["ratio"].get(name, 0.0), float((run_error / bound).max()))
    out["errors"] = errors
    return out


def hpz_weight_difference_worker(dtype_name: str, codec: str, shard: int, steps: int, resync_at: int,
                                 hpz_size: int) -> dict:
    """qWD on the hpZ secondary copy (ZeRO-3): per step an optimizer-like update of this rank's own shard (not
    part of the gathered buffer, as in Megatron-FSDP), then three gathers (a forward's, a backward's and the next
    micro-batch's). Per gather: whether every rank got the same bits, the worst error of every row against its
    owner's new weights relative to the bound (one quantization step of the last difference plus the dtype's
    rounding), and the bytes sent across nodes."""
    dtype = getattr(torch, dtype_name)
    from megatron_zpp.comm import hpz_weight_difference_all_gather

    topo = Topology(None, hpz_partition_size=hpz_size)
    size, rank = topo.size, topo.rank
    bits, block, per_scale = codec_params(codec)
    qmax = layout.qmax_for_bits(bits)
    gens = [gen(31, r) for r in range(size)]
    exact = [heavy_tailed(shard, gens[r]).float() * 0.05 for r in range(size)]  # every owner's, replayed here
    secondary = HpzShard(topo, shard, dtype, "none")
    held = HeldShard(shard, dtype)
    holds = [None] * size  # what the replicas should hold of each shard (the owners' held shards, replayed)
    out = []
    for step in range(steps):
        if step:
            for r in range(size):
                exact[r] += 1e-3 * torch.randn(shard, generator=gens[r])
            secondary.invalidate()  # the weights changed (Megatron-FSDP's copy_main_weights_to_model_weights)
        if step == resync_at:
            held.invalidate()
        mine = exact[rank].to(dtype)
        targets = torch.stack([e.to(dtype) for e in exact]).float()
        resync = not held.valid
        bases = None if resync else torch.stack([h.float() for h in holds])
        for use in range(3):
            output = torch.full((size * shard,), float("nan"), dtype=dtype)
            comm_stats().reset()
            handle = hpz_weight_difference_all_gather(output, mine, secondary, held, topo, codec=codec,
                                                      async_op=use == 1 or (use == 0 and step % 2 == 1))
            queued = len(topo._groups.in_flight)  # steps left for the next collective's start to issue
            if handle is not None:
                handle.wait()
            stats = comm_stats().summed_over_ranks()
            inter = sum(s.inter_bytes for s in stats.values())
            everyone = [torch.empty_like(output) for _ in range(size)]
            dist.all_gather(everyone, output)
            word = torch.int16 if dtype != torch.float32 else torch.int32
            identical = all(torch.equal(e.view(word), output.view(word)) for e in everyone)
            got = output.view(size, shard).float()
            if resync:
                worst = 0.0 if torch.equal(got, targets) else float("inf")
            else:
                difference = targets - bases
                step_bound = block_absmax(difference, shard, block) / qmax * per_scale
                rounding = torch.maximum(got.abs(), targets.abs()) * OUT_EPS[dtype]
                bound = step_bound + rounding + step_bound * FP32_SLOP + 1e-30
                worst = float(((got - targets).abs() / bound).max())
            out.append({"step": step, "use": use, "resync": resync, "identical": identical, "worst": worst,
                        "inter": inter, "queued": queued,
                        "held_is_output": bool(torch.equal(held.value, output.view(size, shard)[rank]))})
        holds = [output.view(size, shard)[r].clone() for r in range(size)]
    # Two gathers of the same stale copy dispatched before either is waited (the second waited first): one
    # difference, applied once; both outputs the same, within the bound.
    for r in range(size):
        exact[r] += 1e-3 * torch.randn(shard, generator=gens[r])
    secondary.invalidate()
    mine = exact[rank].to(dtype)
    targets = torch.stack([e.to(dtype) for e in exact]).float()
    bases = torch.stack([h.float() for h in holds])
    outputs = [torch.full((size * shard,), float("nan"), dtype=dtype) for _ in range(2)]
    handles = [hpz_weight_difference_all_gather(o, mine, secondary, held, topo, codec=codec, async_op=True)
               for o in outputs]
    for h in reversed(handles):
        h.wait()
    step_bound = block_absmax(targets - bases, shard, block) / qmax * per_scale
    got = outputs[0].view(size, shard).float()
    bound = step_bound + torch.maximum(got.abs(), targets.abs()) * OUT_EPS[dtype] + step_bound * FP32_SLOP + 1e-30
    overlapped = {"same": bool(torch.equal(outputs[0].float(), outputs[1].float())),
                  "worst": float(((got - targets).abs() / bound).max()),
                  "held_is_output": bool(torch.equal(held.value, outputs[1].view(size, shard)[rank]))}
    # A NaN in one owner's update reaches every replica, in that shard's block only.
    secondary.invalidate()
    mine = exact[rank].to(dtype)
    if rank == 0:
        mine[3] = float("nan")
    output = torch.empty(size * shard, dtype=dtype)
    hpz_weight_difference_all_gather(output, mine, secondary, held, topo, codec=codec)
    nan_rows = torch.isnan(output.view(size, shard).float()).any(dim=1).tolist()
    return {"gathers": out, "nan_rows": nan_rows, "row_bytes": layout.row_bytes(shard, bits, block),
            "secondary_bytes": secondary.nbytes, "overlapped": overlapped,
            "buckets": _hpz_difference_buckets(topo, dtype, codec, shard)}


def _hpz_difference_buckets(topo: Topology, dtype: torch.dtype, codec: str, shard: int, buckets: int = 3,
                            steps: int = 3) -> dict:
    """Megatron-FSDP's forward: every bucket's gather issued back to back, then each waited in order; bucket 1's
    input is the owner's slice of its output (Megatron's distributed optimizer layout). After the issues: the
    middle steps left queued and the intra-node gathers issued. Per wait: which buckets' copies are refreshed
    (``valid``). Per bucket and update: whether every rank got the same bits, whether they are exactly
    ``cast(fp32(held row) + decoded difference)`` by the pure-PyTorch reference codec, and the worst error
    relative to the bound. Then two orderings around a pending gather: weights changed again between a stale
    gather's call and its wait, and a stale gather issued while a full-precision resync is still pending."""
    from megatron_zpp.comm import hpz_weight_difference_all_gather
    from megatron_zpp.compression import reference

    size, rank = topo.size, topo.rank
    bits, block, per_scale = codec_params(codec)
    assert "hadamard" not in codec
    qmax = layout.qmax_for_bits(bits)
    rb = layout.row_bytes(shard, bits, block)
    gens = [gen(57, r) for r in range(size)]
    exact = [[heavy_tailed(shard, gens[r]).float() * 0.05 for r in range(size)] for _ in range(buckets)]
    secondary = [HpzShard(topo, shard, dtype, "none") for _ in range(buckets)]
    held = [HeldShard(shard, dtype) for _ in range(buckets)]
    holds = [None] * buckets  # what the replicas held of each bucket after the last gather (weights' dtype)
    word = torch.int16 if dtype != torch.float32 else torch.int32
    out = {"refreshed": [], "queued": [], "node_gathers": [], "identical": [], "exact": [], "worst": 0.0}

    def update(b: int) -> None:
        for r in range(size):
            exact[b][r] += 1e-3 * torch.randn(shard, generator=gens[r])
        secondary[b].invalidate()

    def gather(b: int, output: torch.Tensor):
        if b == 1:  # the owner's slice of the output is the input
            output.view(size, shard)[rank].copy_(exact[b][rank].to(dtype))
            mine = output.view(size, shard)[rank]
        else:
            mine = exact[b][rank].to(dtype)
        return hpz_weight_difference_all_gather(output, mine, secondary[b], held[b], topo, codec=codec, async_op=True)

    def check(b: int, output: torch.Tensor, base: torch.Tensor | None) -> None:
        everyone = [torch.empty_like(output) for _ in range(size)]
        dist.all_gather(everyone, output)
        out["identical"].append(all(torch.equal(e.view(word), output.view(word)) for e in everyone))
        if base is None:
            return
        targets = torch.stack([e.to(dtype) for e in exact[b]])
        expected = base.clone()
        packed = torch.empty(size, rb, dtype=torch.uint8)
        reference.quantize_rows_(targets.float() - base.float(), packed, bits, block)
        reference.dequantize_add_rows_(packed, expected.view(-1), bits, block)
        out["exact"].append(torch.equal(expected.view(word), output.view(size, shard).view(word)))
        got, targets = output.view(size, shard).float(), targets.float()
        step_bound = block_absmax(targets - base.float(), shard, block) / qmax * per_scale
        bound = step_bound + torch.maximum(got.abs(), targets.abs()) * OUT_EPS[dtype] + step_bound * FP32_SLOP + 1e-30
        worst = float(((got - targets).abs() / bound).max())
        out["worst"] = max(out["worst"], worst if worst == worst else float("inf"))  # a NaN fails the check

    hpz = topo._groups.hpz
    issued = []  # the intra-node gathers issued so far (the stale copies' hop)
    hpz.all_gather = lambda o, i, _gather=type(hpz).all_gather: issued.append(1) or _gather(hpz, o, i)
    try:
        for step in range(steps):
            if step:
                for b in range(buckets):
                    update(b)
            outputs = [torch.full((size * shard,), float("nan"), dtype=dtype) for _ in range(buckets)]
            handles = [gather(b, outputs[b]) for b in range(buckets)]
            if step:
                out["queued"].append(len(topo._groups.in_flight))
                out["node_gathers"].append(len(issued))
            issued.clear()
            for b in range(buckets):
                handles[b].wait()
                if step:
                    out["refreshed"].append([s.valid for s in secondary])
            for b in range(buckets):
                check(b, outputs[b], holds[b] if step else None)
            holds = [o.view(size, shard).clone() for o in outputs]
    finally:
        del hpz.all_gather
    def blank() -> torch.Tensor:
        return torch.full((size * shard,), float("nan"), dtype=dtype)

    def invalidated_before_wait(b: int) -> tuple[torch.Tensor, bool]:
        """Bucket ``b``'s gather with its copy invalidated (a weight install) between the call and the wait:
        the output, and whether the copy was left stale."""
        output = blank()
        handle = gather(b, output)
        secondary[b].invalidate()
        handle.wait()
        return output, not secondary[b].valid

    # After a stale gather's call: the copy stays stale (the next gather exchanges anew), and both gathers give
    # what the replicas hold.
    update(0)
    output, out["stale_after_change"] = invalidated_before_wait(0)
    check(0, output, holds[0])
    again = blank()
    gather(0, again).wait()
    check(0, again, output.view(size, shard).clone())
    # A stale gather issued while a full-precision resync of the same bucket is pending: it gathers the resynced
    # copy (the exact weights), not the one before.
    held[2].invalidate()
    update(2)
    resynced, after = blank(), blank()
    pending = gather(2, resynced)
    update(2)
    handle = gather(2, after)
    pending.wait()
    handle.wait()
    check(2, after, resynced.view(size, shard).clone())
    # After a full-precision resync's call: its wait fills the copy, which stays stale.
    held[0].invalidate()
    update(0)
    _, out["fill_stale_after_change"] = invalidated_before_wait(0)
    return out
