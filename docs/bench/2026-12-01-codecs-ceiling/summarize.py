"""Median over round{1,2,3}.json of x memcpy and the in-cache ceiling, per op (run in a folder holding them)."""
import collections
import json
import statistics
import sys
from pathlib import Path

folder = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
d = collections.defaultdict(list)
for r in (1, 2, 3):
    for row in json.loads((folder / f"round{r}.json").read_text()):
        d[(row["op"], row["bits"], row["dtype"], row["numel"] >> 20)].append((row["x_memcpy"], row["x_memcpy_ceiling"]))
print("x memcpy at the op's size and in cache (1M values), each the median of the three rounds' medians; the rounds "
      "in brackets.\n")
print("| op | INT | dtype | size | x memcpy | in cache |")
print("|---|---|---|---|---|---|")
order = {"quantize": 0, "quantize_h": 1, "deq_red_quant": 2, "drq_h": 3}
for k, v in sorted(d.items(), key=lambda kv: (order[kv[0][0]], -kv[0][1], kv[0][2], kv[0][3])):
    xs, cs = [a for a, _ in v], [b for _, b in v]
    mark = " **<0.6 in cache**" if statistics.median(cs) < 0.6 else ""
    print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]}M | {statistics.median(xs):.2f} ({', '.join(f'{x:.2f}' for x in xs)}) | "
          f"{statistics.median(cs):.2f} ({', '.join(f'{x:.2f}' for x in cs)}){mark} |")
