"""tools/bench_codecs.py: the in-cache ceiling column and its verdict (figures are measured, so the test checks
the run's own numbers against each other, not against fixed values)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ceiling_column_is_printed_per_row_and_names_the_bound_below_the_goal(tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench_codecs.py"), "--sizes", "64K", "--ceiling-size", "16K",
         "--ops", "quantize,deq_red_quant", "--dtypes", "fp32", "--bits", "8", "--repeats", "3", "--ref-repeats", "0",
         "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())
    assert {r["op"] for r in rows} == {"quantize", "deq_red_quant"}
    acceptance = [line for line in run.stdout.splitlines() if line.startswith("  ")]
    for row in rows:
        assert row["ceiling_numel"] == 16 << 10 and row["ceiling_gbps"] > 0
        line = next(a for a in acceptance if a.split()[0] == row["op"])
        assert f"in cache {row['x_memcpy_ceiling']:.2f}x" in line
        assert ("bound by its instructions" in line) == (row["x_memcpy_ceiling"] < 0.6)
