"""Step ``sanitizer``: compute-sanitizer memcheck and racecheck over a small kernel test set.

Runs ``kernels.py --sanitize-set`` (every CUDA kernel once or twice on small inputs, compared with
the CPU) under each tool::

    compute-sanitizer --tool memcheck|racecheck --error-exitcode 86 python tools/gpu_steps/kernels.py ...

with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: every tensor its own cudaMalloc, so an out-of-bounds access
past a tensor's end is outside any allocation (the caching allocator would hide it inside its pool).
A tool passes when its "ERROR SUMMARY" says 0 errors and the kernel set passed. ``--quick``: memcheck only. Where
compute-sanitizer is missing, or runs but never attaches (no ERROR SUMMARY line, e.g. the driver
refuses the instrumentation), the step reports "unsupported" with why, never "pass".
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, StepOutcome, parser, require_cuda, run_step
from env import find_tools

HERE = Path(__file__).resolve().parent
ERROR_EXIT = 86
TOOLS = ("memcheck", "racecheck")


def classify(tool: str, rc: int, output: str, inner_status: str | None) -> tuple[str, str]:
    """(status, why) of one tool's run from its exit code, its output and the kernel set's own result."""
    m = re.search(r"ERROR SUMMARY:\s*(\d+) error", output) or \
        re.search(r"RACECHECK SUMMARY:\s*\d+ hazards? displayed \((\d+) error", output)
    if m is None:
        tail = " | ".join(output.strip().splitlines()[-6:])[-1200:]
        return "unsupported", (f"{tool}: compute-sanitizer did not attach (no ERROR SUMMARY line; exit {rc}): "
                               f"{tail}")
    errors = int(m.group(1))
    if errors:
        first = re.search(r"=========\s+(Invalid .*|.*[Hh]azard.*|Program hit .*)", output)
        return "fail", f"{tool}: {errors} errors" + (f", first: {first.group(1)[:300]}" if first else "")
    if inner_status != "pass":
        return "fail", f"{tool}: 0 sanitizer errors, but the kernel set itself ended {inner_status} (exit {rc})"
    if rc not in (0,):
        return "fail", f"{tool}: 0 errors reported, but exit {rc}"
    return "pass", f"{tool}: 0 errors"


def body(args):
    require_cuda("compute-sanitizer")
    found = find_tools("compute-sanitizer")
    if not found:
        raise StepOutcome("unsupported", "compute-sanitizer not found ($CUDA_HOME/bin, PATH, /usr/local/cuda*, "
                          "pip's nvidia packages); a CUDA toolkit has it (or pip install nvidia-cuda-sanitizer-api)")
    tool_path = found[0]
    version = subprocess.run([str(tool_path), "--version"], capture_output=True, text=True).stdout.strip()
    figures = {"compute_sanitizer": str(tool_path), "version": version.splitlines()[-1] if version else None}
    rows = []
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    deadline = float(os.environ["ZPP_GPU_CHECK_DEADLINE"]) if os.environ.get("ZPP_GPU_CHECK_DEADLINE") else None
    tools = TOOLS if not args.quick else TOOLS[:1]
    if args.quick:
        rows.append(dict(tool="racecheck", status="skipped", detail="racecheck: left out of --quick"))
    for i, tool in enumerate(tools):
        name = f"sanitizer-{tool}"
        result = args.out / f"{name}.json"
        result.unlink(missing_ok=True)
        cmd = [str(tool_path), "--tool", tool, "--error-exitcode", str(ERROR_EXIT), "--print-limit", "20",
               sys.executable, str(HERE / "kernels.py"), "--out", str(args.out), "--sanitize-set", "--name", name]
        print("+", " ".join(cmd), flush=True)
        timeout = None
        if deadline is not None:  # leave each remaining tool its share of what is left
            timeout = max(10.0, (deadline - time.time() - 10) / (len(tools) - i))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            rows.append(dict(tool=tool, status="fail", seconds=round(time.perf_counter() - t0, 1),
                             detail=f"{tool} ran past {timeout:.0f} s: {out[-600:]}"))
            continue
        (args.out / f"{name}.log").write_text(output)
        print(output[-4000:], flush=True)
        inner = None
        if result.exists():
            import json

            inner = json.loads(result.read_text())["status"]
        status, why = classify(tool, rc, output, inner)
        rows.append(dict(tool=tool, status=status, exit_code=rc, kernel_set=inner,
                         seconds=round(time.perf_counter() - t0, 1), detail=why))
    figures.update({r["tool"]: r["status"] for r in rows})
    detail = "; ".join(r["detail"] for r in rows)
    if any(r["status"] == "fail" for r in rows):
        return "fail", figures, rows, detail
    if any(r["status"] == "unsupported" for r in rows):
        return "unsupported", figures, rows, detail
    return "pass", figures, rows, detail


if __name__ == "__main__":
    sys.exit(run_step("sanitizer", body, parser("sanitizer", __doc__)))
