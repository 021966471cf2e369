"""Collective benchmark: time and intra/inter-node bytes of ZeRO++'s collectives vs uncompressed ones.

For each world layout (nodes x ranks per node, simulated on this box with gloo
processes) and model size M (elements of the flat buffer being gathered / reduced),
every collective runs ``--repeats`` times after a warm-up; the time is the median
over repeats of the slowest rank (measured). Bytes come from ``comm_stats``: each call
accounts what each rank sends from its payload sizes and the algorithm's send pattern
(analytic: computed per call, not counted on the wire), summed over ranks; "x M" is the
cross-node bytes *per node* in units of the model's bytes, the unit of the ZeRO++ paper's
Table 1. The "formula" column is the closed-form payload + scales expression, a check on
the per-call accounting.

  all-gather    torch all_gather_into_tensor (codec none) | qwZ int8:block=256
  backward AG   ZeRO-3 gathers again over the world       | hpZ: from the secondary copy, in the node
  reduce-scat.  gloo reduce_scatter_tensor (an all-reduce) | ring RS over send/recv (NCCL's algorithm)
                | hierarchical 2-hop RS, uncompressed      | qgZ int4:block=128 (+ INT8 intra, 2 stages)

Then Table 1 (analytic, from the per-call accounting): cross-node volume of ZeRO-3 and
ZeRO++ per iteration in units of M. Times on one box measure CPU work
(quantization, reduction, memcpy), not a network: use the netemu recipe for links.

    python tools/bench_collectives.py [--layouts 2x4,4x2] [--sizes 1M,8M] [--dtype bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_zpp.comm import (HpzShard, Topology, comm_stats, hpz_all_gather, qgz_reduce_scatter,  # noqa: E402
                               quantized_all_gather, ring_reduce_scatter, torch_reduce_scatter)
from megatron_zpp.compression import get_codec  # noqa: E402
from megatron_zpp.testing import run_distributed  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QWZ, QGZ, QGZ_INTRA = "int8:block=256", "int4:block=128", "int8:block=256"

# name -> (role, what), in print order
OPS = {
    "ag_none": ("fwd AG", "all_gather_into_tensor (uncompressed)"),
    "ag_qwz": ("fwd AG", f"qwZ {QWZ}"),
    "bwd_ag_none": ("bwd AG", "ZeRO-3: all-gather again (uncompressed)"),
    "bwd_hpz": ("bwd AG", f"hpZ gather from secondary ({QWZ} rows)"),
    "rs_torch": ("grad RS", "gloo reduce_scatter_tensor (all-reduce inside)"),
    "rs_ring": ("grad RS", "ring reduce-scatter (send/recv)"),
    "rs_hier": ("grad RS", "hierarchical 2-hop RS, uncompressed"),
    "rs_qgz": ("grad RS", f"qgZ {QGZ}"),
    "rs_qgz_mixed": ("grad RS", f"qgZ {QGZ_INTRA} intra / {QGZ} inter"),
    "rs_qgz_2st": ("grad RS", f"qgZ {QGZ}, 2 pipelined stages"),
}


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(s[:-1] if s[-1] in "KMG" else s) * mult


def parse_layout(s: str) -> tuple[int, int]:
    try:
        nodes, per_node = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise SystemExit(f"bad layout {s!r}; expected NODESxRANKS, e.g. 2x4") from None
    return nodes, per_node


def _worker(sizes: list[int], dtype_name: str, repeats: int) -> dict:
    dtype = DTYPES[dtype_name]
    topo = Topology(None)
    size, rank = topo.size, topo.rank
    stats = comm_stats()
    results = {}
    for model_numel in sizes:
        shard = model_numel // size
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(shard, generator=g).to(dtype)
        full = torch.empty(size * shard, dtype=dtype)
        grads = torch.randn(size * shard, generator=g).to(dtype)
        y = torch.empty(shard, dtype=dtype)
        hpz = HpzShard(topo, shard, dtype, QWZ)
        quantized_all_gather(full, x, topo, codec=QWZ, hpz_shard=hpz, tag="warm")
        ops = {
            "ag_none": lambda: quantized_all_gather(full, x, topo, codec="none", tag="b"),
            "ag_qwz": lambda: quantized_all_gather(full, x, topo, codec=QWZ, tag="b"),
            "bwd_ag_none": lambda: quantized_all_gather(full, x, topo, codec="none", tag="b"),
            "bwd_hpz": lambda: hpz_all_gather(full, hpz, tag="b"),
            "rs_torch": lambda: torch_reduce_scatter(y, grads.clone(), topo, tag="b"),
            "rs_ring": lambda: ring_reduce_scatter(y, grads, topo, tag="b"),
            "rs_hier": lambda: qgz_reduce_scatter(y, grads, topo, codec="none", tag="b"),
            "rs_qgz": lambda: qgz_reduce_scatter(y, grads, topo, codec=QGZ, tag="b"),
            "rs_qgz_mixed": lambda: qgz_reduce_scatter(y, grads, topo, codec=QGZ, intra_codec=QGZ_INTRA, tag="b"),
            "rs_qgz_2st": lambda: qgz_reduce_scatter(y, grads, topo, codec=QGZ, stages=2, tag="b"),
        }
        for name, fn in ops.items():
            fn()  # warm-up (and the one-time settings check)
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times.append(float(t))
            stats.reset()
            fn()
            b = stats.summed_over_ranks()["b"]
            results[(model_numel, name)] = {"seconds": statistics.median(times), "intra_bytes": b.intra_bytes,
                                            "inter_bytes": b.inter_bytes}
    return results


def analytic_inter_bytes(name: str, nodes: int, per_node: int, shard: int, elem: int) -> float:
    """Cross-node bytes summed over ranks, from the algorithms' definitions and the payload+scales
    formula ``ceil(n * bits / 8) + 4 * ceil(n / block)`` (written out here, not the package's code)."""
    size = nodes * per_node
    crossings = nodes if nodes > 1 else 0  # a node-major ring crosses a node boundary once per node

    def row(n: int, bits: int, block: int) -> int:
        return math.ceil(n * bits / 8) + 4 * math.ceil(n / block)
    row8, row4 = row(shard, 8, 256), row(shard, 4, 128)
    return {
        "ag_none": crossings * (size - 1) * shard * elem,
        "ag_qwz": crossings * (size - 1) * row8,
        "bwd_ag_none": crossings * (size - 1) * shard * elem,
        "bwd_hpz": 0,
        "rs_torch": 2 * crossings * (size - 1) * shard * elem,
        "rs_ring": crossings * (size - 1) * shard * elem,
        "rs_hier": size * (nodes - 1) * shard * elem,
        "rs_qgz": size * (nodes - 1) * row4,
        "rs_qgz_mixed": size * (nodes - 1) * row4,
        "rs_qgz_2st": size * (nodes - 1) * 2 * row(math.ceil(shard / 2), 4, 128),
    }[name]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="2x4,4x2", help="comma-separated NODESxRANKS_PER_NODE")
    p.add_argument("--sizes", default="1M,8M", help="model sizes M in elements (K/M/G suffixes)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the results (measured times, analytic bytes) here")
    args = p.parse_args()
    elem = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    report = []
    print(f"# bench_collectives: gloo on one box, dtype {args.dtype}, median of {args.repeats} "
          f"(slowest rank), measured; bytes: analytic per-call accounting summed over ranks; "
          f"'x M' = cross-node bytes per node / model bytes")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads in this process; qwZ/qgZ bound "
          f"codecs: {get_codec(QWZ).spec}, {get_codec(QGZ).spec}")
    for layout_s in args.layouts.split(","):
        nodes, per_node = parse_layout(layout_s)
        size = nodes * per_node
        sizes = [parse_size(s) // size * size for s in args.sizes.split(",")]
        per_rank = run_distributed(_worker, size, sizes, args.dtype, args.repeats, ranks_per_node=per_node,
                                   timeout_s=600)
        res = per_rank[0]
        for model_numel in sizes:
            shard = model_numel // size
            model_bytes = model_numel * elem
            base_t = {"fwd AG": res[(model_numel, "ag_none")]["seconds"],
                      "bwd AG": res[(model_numel, "bwd_ag_none")]["seconds"],
                      "grad RS": res[(model_numel, "rs_ring")]["seconds"]}
            print(f"\n## layout {nodes}x{per_node}, M = {model_numel / 2**20:.2f}M elements "
                  f"({model_bytes / 2**20:.1f} MiB {args.dtype}); time ratio vs the first uncompressed row "
                  "of its role (ring RS for grad RS)")
            print("| role | collective | ms (measured) | x base time | intra MiB | inter MiB | inter x M per node "
                  "(accounted) | formula x M | inter vs best uncompressed |")
            print("|---|---|---|---|---|---|---|---|---|")
            best = {}
            for name, (role, _) in OPS.items():
                if name in ("ag_none", "bwd_ag_none", "rs_torch", "rs_ring", "rs_hier"):
                    b = res[(model_numel, name)]["inter_bytes"]
                    best[role] = min(best.get(role, b), b)
            for name, (role, what) in OPS.items():
                r = res[(model_numel, name)]
                per_node_m = r["inter_bytes"] / nodes / model_bytes
                analytic = analytic_inter_bytes(name, nodes, per_node, shard, elem) / nodes / model_bytes
                vs_best = r["inter_bytes"] / best[role] if best[role] else float("nan")
                row = {"layout": f"{nodes}x{per_node}", "model_numel": model_numel, "op": name, "role": role,
                       "what": what, **r, "inter_x_M_per_node": per_node_m, "analytic_x_M_per_node": analytic,
                       "inter_vs_best_uncompressed": vs_best, "time_vs_base": r["seconds"] / base_t[role]}
                report.append(row)
                print(f"| {role} | {what} | {r['seconds'] * 1e3:.1f} | {row['time_vs_base']:.2f} | "
                      f"{r['intra_bytes'] / 2**20:.2f} | {r['inter_bytes'] / 2**20:.2f} | {per_node_m:.4f} | "
                      f"{analytic:.4f} | {vs_best:.4f} |")
            t1 = {k: res[(model_numel, k)]["inter_bytes"] / nodes / model_bytes
                  for k in ("ag_none", "ag_qwz", "bwd_ag_none", "bwd_hpz", "rs_ring", "rs_hier", "rs_qgz")}
            print(f"\nTable 1 (analytic cross-node volume per node from the per-call byte accounting, units of "
                  f"M = {model_bytes / 2**20:.1f} MiB; "
                  f"paper: ZeRO-3 M, M, M = 3M; ZeRO++ 0.5M, 0, 0.25M = 0.75M)")
            print("| | forward all-gather | backward all-gather | gradient reduce-scatter | total |")
            print("|---|---|---|---|---|")
            z3 = (t1["ag_none"], t1["bwd_ag_none"], t1["rs_ring"])
            z3h = (t1["ag_none"], t1["bwd_ag_none"], t1["rs_hier"])
            zpp = (t1["ag_qwz"], t1["bwd_hpz"], t1["rs_qgz"])
            for label, row in (("ZeRO-3 (ring RS)", z3), ("ZeRO-3 (hierarchical RS)", z3h), ("ZeRO++", zpp)):
                print(f"| {label} | {row[0]:.4f}M | {row[1]:.4f}M | {row[2]:.4f}M | {sum(row):.4f}M |")
            print(f"| ZeRO++ / ZeRO-3 (ring) | {zpp[0] / z3[0]:.4f} | {zpp[1] / z3[1]:.4f} | {zpp[2] / z3[2]:.4f} "
                  f"| {sum(zpp) / sum(z3):.4f} |")
            print(f"| ZeRO++ / best uncompressed | {zpp[0] / z3h[0]:.4f} | {zpp[1] / z3h[1]:.4f} | "
                  f"{zpp[2] / min(z3[2], z3h[2]):.4f} | {sum(zpp) / min(sum(z3), sum(z3h)):.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
