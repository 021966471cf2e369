"""kernel_workout.py under valgrind's memcheck: invalid reads/writes, uses of uninitialised values and bad frees in
our C++ extension, the ordinary -O3 build users load (docs/reliability/heap-corruption.md, section "valgrind").

    python tools/heapcheck/valgrind.py                  # out/valgrind/: memcheck logs and results.md

CPython and torch are not clean under memcheck (CPython's small-object allocator reads uninitialised memory by
design, which ``PYTHONMALLOC=malloc`` turns off; torch and its BLAS have their own reports), so every error
record is kept in the log and sorted: *ours* when a frame of its stack is in this repository's ``csrc/`` or its
``megatron_zpp/_C*.so``, *elsewhere* otherwise (a crash inside a kernel is a record too: "Process terminating"). Exit status 1 if any error is ours or the workout failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKOUT = REPO / "tools" / "heapcheck" / "kernel_workout.py"
# A frame is ours when it is in our sources (memcheck prints the file of a frame with debug info, its full path
# with --fullpath-after=) or, without line info, in our shared object; torch has its own _C*.so, so the object is
# matched by its full path under this repository.
OURS = re.compile("|".join([re.escape(str(REPO / "csrc")) + "/",
                            r"\(in " + re.escape(str(REPO / "megatron_zpp")) + r"/_C[^)]*\.so\)"]))
ERROR_KINDS = re.compile(r"(Invalid |Conditional jump|Use of uninitialised|Syscall param|Mismatched |"
                         r"Source and destination overlap|Argument '.*' of function|Jump to the invalid address|"
                         r"Process terminating with default action of signal|.* bytes? .* (?:lost|are definitely))")


def error_records(log: str) -> list[str]:
    """memcheck's error records: a line ``==pid== <kind>`` then its ``at``/``by`` frames, up to a blank line."""
    records, current = [], []
    for line in log.splitlines():
        body = re.sub(r"^==\d+== ?", "", line)
        if not line.startswith("=="):
            continue
        if not body.strip():
            if current:
                records.append("\n".join(current))
            current = []
            continue
        if current or ERROR_KINDS.match(body):
            current.append(body)
    if current:
        records.append("\n".join(current))
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "out" / "valgrind")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--timeout", type=float, default=3600.0)
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("memcheck.*.txt"):
        old.unlink()
    env = dict(os.environ, PYTHONMALLOC="malloc", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = ["valgrind", "--tool=memcheck", "--error-limit=no", "--num-callers=40", "--leak-check=no", "--fullpath-after=",
           "--track-origins=yes", f"--log-file={args.out}/memcheck.%p.txt", args.python, str(WORKOUT)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    seconds = time.perf_counter() - t0
    logs = sorted(args.out.glob("memcheck.*.txt"))
    records = [r for path in logs for r in error_records(path.read_text(errors="replace"))]
    ours = [r for r in records if OURS.search(r)]
    workout = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-500:]
    version = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()
    lines = [f"# valgrind memcheck over tools/heapcheck/kernel_workout.py ({time.strftime('%Y-%m-%d')})", "",
             f"- command: `PYTHONMALLOC=malloc OMP_NUM_THREADS=1 {' '.join(cmd)}`",
             f"- {version}; {seconds:.0f} s; exit {done.returncode}",
             f"- workout: {workout}",
             f"- error records: **{len(ours)} in megatron_zpp's extension**, {len(records) - len(ours)} elsewhere "
             "(CPython, torch, libraries)", ""]
    for r in ours:
        lines += ["```", r, "```", ""]
    (args.out / "results.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 1 if ours or done.returncode != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
