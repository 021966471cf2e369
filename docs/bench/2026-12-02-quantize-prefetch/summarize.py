"""Median x memcpy per op over the rounds r<N>_a<ARM>.json of a folder, one column per arm (folder as argument)."""
import collections
import json
import statistics
import sys
from pathlib import Path

folder = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
d = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(folder.glob("r*_a*.json")):
    arm = f.stem.split("_a", 1)[1]
    for row in json.loads(f.read_text()):
        d[(row["op"], row["bits"], row["dtype"], row["numel"] >> 20)][arm].append(row["x_memcpy"])
arms = sorted({a for v in d.values() for a in v}, key=lambda a: (not a.isdigit(), int(a) if a.isdigit() else a))
print("| op | INT | dtype | size | " + " | ".join(arms) + " |")
print("|---|---|---|---|" + "---|" * len(arms))
for k in sorted(d, key=lambda k: (k[0], -k[1], k[2], k[3])):
    cells = [f"{statistics.median(d[k][a]):.2f} ({', '.join(f'{x:.2f}' for x in d[k][a])})" for a in arms]
    print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]}M | " + " | ".join(cells) + " |")
