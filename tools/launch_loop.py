"""Launch loop: run the smallest Megatron-FSDP launch that once died of heap corruption, N times, and count.

The crash (docs/reliability/heap-corruption.md): one launch in about 170 of Megatron-FSDP training on gloo/CPU
(4 ranks as 2 simulated nodes x 2, policy ``none``) died with ``malloc(): unaligned tcache chunk detected``.
This tool repeats the smallest such launch (``pretrain_gpt.py``, tiny GPT, 2 iterations) with glibc's heap
checks on and records every launch that does not end cleanly:

- ``MALLOC_CHECK_=3`` through ``LD_PRELOAD=libc_malloc_debug.so`` (glibc >= 2.34 honours MALLOC_CHECK_ only
  with that library preloaded; without it the variable does nothing);
- ``MALLOC_PERTURB_`` (``--perturb``, default 165): freed memory is overwritten with that byte and fresh
  memory with its complement, so a read through a dangling pointer sees garbage instead of the old values
  (a use-after-free becomes a wrong loss or a crash instead of going unnoticed).

Each launch's log is kept only when it failed (``fail-<n>.txt``); ``results.json`` and ``results.md`` say how
many launches ran, how many failed and how, and the exact command and environment. Exit status 1 when any
launch failed.

    nice -n 10 python tools/launch_loop.py --launches 40 --out out/launch-loop
    python tools/launch_loop.py --minutes 50 --out out/launch-loop      # as many as fit in 50 minutes
    python tools/launch_loop.py --launches 5 --extra --zpp-policy zeropp  # any pretrain_gpt flag after --extra
    python tools/launch_loop.py --minutes 120 --alternate               # cycle malloc-check x flight recorder

``--alternate`` cycles four variants, one launch each in turn: glibc's checks on and off (``MALLOC_CHECK_=3``
turns off the tcache check that printed the original message, so half the launches run without it) crossed
with torch's flight recorder off (our gloo default since issue 22) and on at torch's default size (2000, as on
the day of the crash). Failures are then counted per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from process_group import stop_process_group  # noqa: E402

# The launch of docs/performance.md's crash, made as short as it can be: the soak's tiny GPT (tools/soak.py),
# Megatron-FSDP with both overlaps (the crashing path), policy none (Megatron's own collectives), 2 iterations
# (the crash came before the first step; the second covers the first optimizer step and the gather after it).
SMALLEST_FSDP_LAUNCH = ["--zpp-policy", "none", "--zpp-ranks-per-node", "2",
                        "--use-megatron-fsdp", "--overlap-grad-reduce", "--overlap-param-gather",
                        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                        "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-iters", "1",
                        "--train-iters", "2", "--log-interval", "1"]

# What glibc (and the sanitizers) print on heap corruption.
HEAP_MESSAGE = re.compile(r"(malloc\(\)[^\n]*|free\(\)[^\n]*|corrupted [^\n]*|double free[^\n]*|"
                          r"munmap_chunk\(\)[^\n]*|realloc\(\)[^\n]*|ERROR: AddressSanitizer[^\n]*)")
CHILD_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")


def malloc_debug_library() -> str | None:
    """glibc's ``libc_malloc_debug.so`` (needed for MALLOC_CHECK_ since glibc 2.34), None if absent."""
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"):
        p = Path(d) / "libc_malloc_debug.so.0"
        if p.exists():
            return str(p)
    return None


# (name, MALLOC_CHECK_ on?, TORCH_FR_BUFFER_SIZE or None for our default: off on gloo)
VARIANTS = (("check,fr-off", True, None), ("plain,fr-off", False, None),
            ("check,fr-2000", True, "2000"), ("plain,fr-2000", False, "2000"))


def launch_env(args, malloc_check: bool | None = None, flight_recorder: str | None = None) -> dict[str, str]:
    variant = malloc_check is not None
    malloc_check = args.malloc_check if malloc_check is None else malloc_check
    env = dict(os.environ)
    if variant:  # a variant's settings, whatever the shell had: nothing inherited may relabel it
        for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "MALLOC_CHECK_"):
            env.pop(name, None)
        preload = [lib for lib in env.get("LD_PRELOAD", "").split() if "libc_malloc_debug" not in lib]
        env["LD_PRELOAD"] = " ".join(preload)
        if not env["LD_PRELOAD"]:
            del env["LD_PRELOAD"]
    if flight_recorder is not None:
        env["TORCH_FR_BUFFER_SIZE"] = flight_recorder
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OMP_WAIT_POLICY", "passive")
    if malloc_check:
        lib = malloc_debug_library()
        if lib is None:
            raise SystemExit("--malloc-check: glibc's libc_malloc_debug.so.0 was not found; MALLOC_CHECK_ would "
                             "do nothing without it (glibc >= 2.34). Pass --no-malloc-check to run anyway.")
        env["LD_PRELOAD"] = " ".join(filter(None, [env.get("LD_PRELOAD"), lib]))
        env["MALLOC_CHECK_"] = "3"
    if args.perturb:
        env["MALLOC_PERTURB_"] = str(args.perturb)
    return env


def one_launch(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> dict:
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            code, timed_out = None, True
            stop_process_group(proc, term_grace_s=None)
        except BaseException:
            stop_process_group(proc, term_grace_s=None)
            raise
    text = log_path.read_text(errors="replace")
    record = {"returncode": code, "seconds": round(time.perf_counter() - t0, 1), "timed_out": timed_out}
    signals = sorted({int(c) for c in CHILD_EXIT.findall(text) if int(c) < 0})
    if signals:
        record["rank_signals"] = [signal.Signals(-c).name if -c in signal.Signals.__members__.values() else str(c)
                                  for c in signals]
    heap = HEAP_MESSAGE.search(text)
    if heap:
        record["heap_message"] = heap.group(1).strip()
    record["finished"] = "> summary:" in text
    record["ok"] = code == 0 and not timed_out and not heap and record["finished"]
    return record


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launches", type=int, default=0, help="launches to run (0: as many as --minutes allows)")
    p.add_argument("--minutes", type=float, default=0.0, help="stop starting launches after this many minutes")
    p.add_argument("--out", type=Path, default=REPO / "out" / "launch-loop")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before one launch counts as hung")
    p.add_argument("--perturb", type=int, default=165, help="MALLOC_PERTURB_ byte (0: off)")
    p.add_argument("--no-malloc-check", dest="malloc_check", action="store_false",
                   help="do not preload libc_malloc_debug.so with MALLOC_CHECK_=3")
    p.add_argument("--alternate", action="store_true",
                   help="cycle malloc-check on/off x flight recorder off/2000 (see the module docstring)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="flags appended to the launch (later flags override earlier ones)")
    a = p.parse_args(argv)
    if a.launches <= 0 and a.minutes <= 0:
        p.error("give --launches N (N > 0) or --minutes M (M > 0)")
    if a.alternate and not a.malloc_check:
        p.error("--alternate already runs half the launches without malloc-check; drop --no-malloc-check")
    if not 0 <= a.perturb <= 255:
        p.error(f"--perturb {a.perturb}: give a byte value 0..255 (0 turns MALLOC_PERTURB_ off)")
    return a


def write_results(out: Path, meta: dict, records: list[dict]) -> None:
    failures = [r for r in records if not r["ok"]]
    summary = dict(meta, launches=len(records), failures=len(failures),
                   mean_seconds=round(sum(r["seconds"] for r in records) / max(1, len(records)), 1))
    variants = sorted({r["variant"] for r in records if "variant" in r})
    if variants:
        summary["variants"] = {v: {"launches": sum(r.get("variant") == v for r in records),
                                   "failures": sum(r.get("variant") == v and not r["ok"] for r in records)}
                               for v in variants}
    (out / "results.json").write_text(json.dumps({"summary": summary, "launches": records}, indent=1))
    lines = [f"# Launch loop: {len(records)} launches, {len(failures)} failed", ""]
    if variants:
        lines += ["| variant | launches | failed |", "|---|---|---|"]
        lines += [f"| {v} | {c['launches']} | {c['failures']} |" for v, c in summary["variants"].items()]
        lines.append("")
    lines += [f"- command: `{meta['command']}`",
              f"- environment: {', '.join(f'`{k}={v}`' for k, v in meta['env'].items())}",
              f"- versions: {meta['versions']}",
              f"- started {meta['started']}, mean {summary['mean_seconds']} s per launch", ""]
    if failures:
        lines += ["| launch | variant | exit | signals | heap message | log |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['launch']} | {r.get('variant', '')} | {r['returncode']} | {', '.join(r.get('rank_signals', []))} | "
                  f"{r.get('heap_message', '')} | {r.get('log', '')} |" for r in failures]
    else:
        lines.append("No launch failed.")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def versions(python: str) -> str:
    code = ("import sys, torch, importlib.metadata as m; "
            "print(f'python {sys.version.split()[0]}, torch {torch.__version__}, '"
            "f'megatron-core {m.version(\"megatron-core\")}')")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        out = f"unknown ({exc})"
    return f"{out}, glibc {platform.libc_ver()[1]}"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = launch_env(args)
    variants = [(name, launch_env(args, check, fr)) for name, check, fr in VARIANTS] if args.alternate else None
    cmd = [args.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           str(REPO / "pretrain_gpt.py"), *SMALLEST_FSDP_LAUNCH, *args.extra]
    shown_env = {k: env[k] for k in ("LD_PRELOAD", "MALLOC_CHECK_", "MALLOC_PERTURB_", "OMP_NUM_THREADS") if k in env}
    if variants:  # the base environment above is not used: each variant sets its own
        shown_env = {k: v for k, v in shown_env.items() if k not in ("LD_PRELOAD", "MALLOC_CHECK_")}
        shown_env["variants"] = ("; ".join(f"{name}: MALLOC_CHECK_={'3 (libc_malloc_debug preloaded)' if check else 'unset'}"
                                           f", TORCH_FR_BUFFER_SIZE={fr or 'unset (pretrain_gpt: 0 on gloo)'}"
                                           for name, check, fr in VARIANTS))
    meta = {"command": " ".join(cmd), "env": shown_env, "versions": versions(args.python),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    records: list[dict] = []
    t0 = time.monotonic()
    n = 0
    while True:
        if args.launches and n >= args.launches:
            break
        if args.minutes and time.monotonic() - t0 > args.minutes * 60:
            break
        n += 1
        log_path = args.out / "current.txt"
        variant, launch_env_n = variants[(n - 1) % len(variants)] if variants else (None, env)
        record = dict(launch=n, **one_launch(cmd, launch_env_n, log_path, args.timeout))
        if variant:
            record["variant"] = variant
        if not record["ok"]:
            kept = args.out / f"fail-{n}.txt"
            log_path.rename(kept)
            record["log"] = kept.name
        records.append(record)
        print(f"launch {n}{f' [{variant}]' if variant else ''}: {'ok' if record['ok'] else 'FAILED'} in {record['seconds']} s"
              + (f" ({record.get('heap_message') or record.get('rank_signals') or record['returncode']})"
                 if not record["ok"] else ""), flush=True)
        write_results(args.out, meta, records)
    (args.out / "current.txt").unlink(missing_ok=True)
    failed = sum(not r["ok"] for r in records)
    print(f"{len(records)} launches, {failed} failed; results in {args.out}/results.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
