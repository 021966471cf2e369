"""Build the C++ extension with AddressSanitizer + UndefinedBehaviorSanitizer and run tests under it.

    python tools/sanitize.py                          # build, then the default suite below (make sanitize)
    python tools/sanitize.py --build-only
    python tools/sanitize.py -- tests/test_kernels.py -k zfp     # any pytest arguments after --
    python tools/sanitize.py --run -- python my_script.py        # any command after --, with --run

The sanitized copy is built out of place (``--out``, default ``out/sanitize``; ``ZPP_SANITIZE`` in
setup.py), never over the in-place ``megatron_zpp/_C*.so`` that ordinary runs load: a shadow package
``<out>/shadow/megatron_zpp`` links every file of the real package except the extension, which is the
sanitized one, and comes first on ``PYTHONPATH``. The interpreter and torch are not instrumented, so the
sanitizer runtimes are preloaded (``LD_PRELOAD=$(gcc -print-file-name=libasan.so)`` and libubsan): ASan then
owns malloc/free for the whole process (torch and gloo included) and checks every access made by our
kernels and by the libc calls it intercepts (memcpy, memset, read/recv into buffers), which is how a write
into freed memory by gloo's worker thread would show.

ASAN_OPTIONS: ``detect_leaks=0`` (CPython and torch keep allocations until exit by design),
``abort_on_error=1`` (a report kills the process: a test fails, the log keeps the report),
``protect_shadow_gap=0`` (the CUDA build of torch maps memory where ASan would protect its gap),
``allocator_may_return_null=1``. UBSan aborts at the first report (``-fno-sanitize-recover``).
Each test file's log goes to ``<out>/logs/``; ``<out>/results.md`` lists what ran, the outcome, and every
sanitizer report found in the logs.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# What the sanitizers print when they find something.
REPORT = re.compile(r"(ERROR: AddressSanitizer[^\n]*|runtime error:[^\n]*|SUMMARY: (?:Address|UndefinedBehavior)"
                    r"Sanitizer[^\n]*|ERROR: LeakSanitizer[^\n]*)")
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=1:halt_on_error=1:protect_shadow_gap=0:allocator_may_return_null=1:" \
               "detect_odr_violation=0:symbolize=1:print_summary=1"
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1:abort_on_error=1"

# The default suite: the codecs and kernels (all of them), a few collectives (sync, async in flight, inside
# Megatron's coalescing manager), and training: the distributed optimizer and Megatron-FSDP, with a
# compressing policy (our kernels run) and with none (Megatron-FSDP's own collectives, the crash's policy).
DEFAULT_SUITE = [
    ["tests/test_codecs.py"],
    ["tests/test_kernels.py"],
    ["tests/test_comm.py", "-k", "test_collectives_match_torch_and_codec_bounds or test_nan_and_inf_reach_the_output "
     "or test_inside_coalescing_manager or test_many_async_calls_in_flight or test_compressed_all_reduce"],
    ["tests/test_megatron.py", "-k", "test_dp4_distributed_optimizer_2x2_with_and_without_overlap "
     "or test_megatron_fsdp_zeropp_2x2 or test_none_is_megatron_without_ranks_per_node"],
]


def runtime_library(name: str) -> str:
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    if not path or not os.path.isabs(path) or not Path(path).exists():
        raise SystemExit(f"gcc does not know {name} (got {path!r}); install gcc's sanitizer runtimes")
    return path


def build(out: Path, sanitizers: str) -> Path:
    """Builds the extension into ``out/lib`` and returns the shadow package root (``out/shadow``)."""
    env = dict(os.environ, ZPP_SANITIZE=sanitizers, ZPP_BUILD_CUDA="0")
    cmd = [sys.executable, "setup.py", "build_ext", "--build-lib", str(out / "lib"), "--build-temp", str(out / "tmp")]
    print("$ ZPP_SANITIZE=" + sanitizers + " " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    built = sorted((out / "lib" / "megatron_zpp").glob("_C*.so"))
    if not built:
        raise SystemExit(f"the build left no megatron_zpp/_C*.so under {out / 'lib'}")
    shadow = out / "shadow" / "megatron_zpp"
    shutil.rmtree(shadow.parent, ignore_errors=True)
    shadow.mkdir(parents=True)
    for entry in (REPO / "megatron_zpp").iterdir():
        if entry.name.startswith("_C") and entry.suffix == ".so" or entry.name == "__pycache__":
            continue
        (shadow / entry.name).symlink_to(entry)
    shutil.copy2(built[0], shadow / built[0].name)
    return shadow.parent


def sanitizer_env(shadow_root: Path, sanitizers: str) -> dict[str, str]:
    preload = [runtime_library("libasan.so")] if "address" in sanitizers else []
    if "undefined" in sanitizers:
        preload.append(runtime_library("libubsan.so"))
    # libstdc++ preloaded too: python does not link it, torch loads it later with dlopen, and ASan's
    # __cxa_throw interceptor, resolved at start-up, then finds no real __cxa_throw: the first C++ exception
    # (any TORCH_CHECK) aborts with "CHECK failed: asan_interceptors.cpp ... real___cxa_throw" (measured).
    preload.append(runtime_library("libstdc++.so.6"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shadow_root), str(REPO), os.environ.get("PYTHONPATH")]))
    env["LD_PRELOAD"] = " ".join(filter(None, preload + [os.environ.get("LD_PRELOAD", "")]))
    env["ASAN_OPTIONS"] = os.environ.get("ASAN_OPTIONS", ASAN_OPTIONS)
    env["UBSAN_OPTIONS"] = os.environ.get("UBSAN_OPTIONS", UBSAN_OPTIONS)
    env["ZPP_JIT"] = "0"  # the sanitized _C or nothing: never a silent fallback to an unsanitized JIT build
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OMP_WAIT_POLICY", "passive")
    return env


def check_loaded(env: dict[str, str]) -> str:
    """Proves that the sanitized extension is what ``import megatron_zpp`` loads under ``env``."""
    code = ("import megatron_zpp.compression._extension as e, megatron_zpp._C as c; assert e.load(); "
            "print(c.__file__)")
    r = subprocess.run([sys.executable, "-P", "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"the sanitized extension does not load:\n{r.stdout}\n{r.stderr[-3000:]}")
    path = r.stdout.strip().splitlines()[-1]
    linked = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    if "libasan" not in linked and "libubsan" not in linked and "libtsan" not in linked:
        raise SystemExit(f"{path} is not linked against a sanitizer runtime:\n{linked}")
    return path


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> dict:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    text = log.read_text(errors="replace")
    tail = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    return {"command": " ".join(cmd), "returncode": code, "seconds": round(time.perf_counter() - t0),
            "reports": sorted(set(REPORT.findall(text))), "pytest": tail[-1] if tail else "", "log": str(log)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "out" / "sanitize")
    p.add_argument("--sanitizers", default="address,undefined", help="ZPP_SANITIZE value (default address,undefined)")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--no-build", action="store_true", help="reuse the build in --out")
    p.add_argument("--run", action="store_true", help="the arguments after -- are a command, not pytest arguments")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per test file (or command)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="after --: pytest arguments (or a command with --run)")
    a = p.parse_args(argv)
    a.rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    if a.run and not a.rest:
        p.error("--run needs a command after --")
    return a


def main(argv=None) -> int:
    from megatron_zpp.compression._extension import sanitizer_flags

    args = parse_args(argv)
    sanitizer_flags(args.sanitizers)  # a bad value fails here, before any build
    args.out.mkdir(parents=True, exist_ok=True)
    shadow_root = args.out / "shadow"
    if not args.no_build:
        shadow_root = build(args.out, args.sanitizers)
    elif not (shadow_root / "megatron_zpp").exists():
        raise SystemExit(f"--no-build: no earlier build in {args.out}")
    env = sanitizer_env(shadow_root, args.sanitizers)
    loaded = check_loaded(env)
    print(f"sanitized extension: {loaded}\nLD_PRELOAD={env['LD_PRELOAD']}\nASAN_OPTIONS={env['ASAN_OPTIONS']}",
          flush=True)
    if args.build_only:
        return 0
    if args.run:
        jobs = [args.rest]
    else:
        suites = [args.rest] if args.rest else DEFAULT_SUITE
        # -P: no working directory on sys.path, else the repository's own megatron_zpp (with the ordinary
        # extension) shadows the sanitized one (check_loaded caught exactly that).
        jobs = [[sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s", *s] for s in suites]
    (args.out / "logs").mkdir(exist_ok=True)
    results: list[dict] = []
    for i, cmd in enumerate(jobs):
        name = re.sub(r"[^\w.-]+", "_", Path(next((c for c in cmd if c.endswith(".py")), "command")).stem)
        print(f"$ {' '.join(cmd)}", flush=True)
        r = run_logged(cmd, env, args.out / "logs" / f"{i}-{name}.log", args.timeout)
        results.append(r)
        print(f"  exit {r['returncode']} in {r['seconds']} s; {r['pytest']}; sanitizer reports: "
              f"{r['reports'] or 'none'}", flush=True)
        write_results(args, env, loaded, results, pending=len(jobs) - i - 1)  # after each job: a cut-off run keeps them
    print(f"results in {args.out / 'results.md'}")
    return 0 if all(r["returncode"] == 0 and not r["reports"] for r in results) else 1


def write_results(args, env: dict[str, str], loaded: str, results: list[dict], pending: int) -> None:
    lines = [f"# Sanitizer run ({args.sanitizers})", "", f"- extension: `{loaded}`",
             f"- `LD_PRELOAD={env['LD_PRELOAD']}`", f"- `ASAN_OPTIONS={env['ASAN_OPTIONS']}`",
             f"- `UBSAN_OPTIONS={env['UBSAN_OPTIONS']}`", f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}", "",
             "| command | exit | seconds | pytest | sanitizer reports |", "|---|---|---|---|---|"]
    lines += [f"| `{r['command'].replace(sys.executable, 'python')}` | {r['returncode']} | {r['seconds']} | "
              f"{r['pytest']} | {'; '.join(r['reports']) or 'none'} |" for r in results]
    if pending:
        lines.append(f"\n{pending} more job(s) not run yet.")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
