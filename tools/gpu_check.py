"""The GPU check: one command on a GPU machine with the offline kit (``make gpu-kit``) and no network.

    python3 tools/gpu_check.py [--out DIR] [--quick] [--dry-run] [--kit .gpukit] [--steps a,b] [--budget S]
    make gpu-check [ARGS="--quick"]

Runs each step of ``STEPS`` as a subprocess with its own time limit (the whole process group is
killed at the limit), records its status, exit code, wall time and the tail of its output, and goes
on to the next step whatever happened. Writes ``DIR/gpu_report.json`` and ``DIR/gpu_report.md`` and
exits non-zero when a step failed or timed out.

Steps (``tools/gpu_steps/<name>.py --out DIR [--quick]`` writes ``DIR/<name>.json``, see
``tools/gpu_steps/_common.py``): ``kit`` installs the kit into ``DIR/site`` (never torch), ``env``
probes the machine, ``build`` compiles the CUDA extension for this GPU, ``kernels`` checks every CUDA
kernel against the CPU, ``throughput`` measures the codecs against a device copy, then the comm path
on CUDA tensors, ``pretrain_gpt.py`` on the GPU, Megatron-LM's own training loop with the plugin, and
last ``sanitizer`` (compute-sanitizer). ``kit``, ``env`` and ``build`` are setup; the time
budget (900 s, 300 s with ``--quick``) counts the steps after them, and a step never gets more than
what is left of it.

``--dry-run`` runs the orchestration with stubs in place of every step but ``env`` (a real probe, CPU
or GPU): the step table, limits, report and failure handling, without a GPU. For tests,
``ZPP_GPU_CHECK_FAKE_STEPS=fail,hang,pass`` adds fake steps after ``env`` (``ZPP_GPU_CHECK_FAKE_LIMIT``
seconds each, default 5).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from process_group import stop_process_group  # noqa: E402
STEPS_DIR = REPO / "tools" / "gpu_steps"
SCHEMA = "megatron_zpp.gpu_report/1"
STATUSES = ("pass", "fail", "timeout", "unsupported", "skipped")
FAILED = ("fail", "timeout")
TAIL_LINES = 60
TAIL_CHARS = 8000


@dataclass(frozen=True)
class Step:
    name: str
    """File stem in tools/gpu_steps/ and the result's name (``<out>/steps/<name>.json``)."""
    limit_s: float
    """Time limit of the full run; the process group is killed past it."""
    quick_limit_s: float
    """Time limit with --quick."""
    what: str
    """One line for the report."""
    setup: bool = False
    """Setup steps (kit, env, build) have their own limits and do not count against --budget."""
    cmd: tuple[str, ...] | None = None
    """The command; None: ``python tools/gpu_steps/<name>.py --out DIR [--quick]``."""

    def argv(self, out: Path, quick: bool) -> list[str]:
        if self.cmd is not None:
            return [a.replace("{out}", str(out)).replace("{python}", sys.executable) for a in self.cmd]
        return [sys.executable, str(STEPS_DIR / f"{self.name}.py"), "--out", str(out)] + (["--quick"] if quick else [])


# The step table. Limits are ceilings, not expectations: on one H100 a full run is expected to take
# ~10 minutes after the build (the budget enforces 15), --quick under 5.
STEPS: tuple[Step, ...] = (
    Step("kit", 240, 240, "install the offline kit (--no-deps, the image's torch kept)", setup=True),
    Step("env", 90, 90, "nvidia-smi, torch/CUDA, device, nvcc, compute-sanitizer, package versions", setup=True),
    Step("build", 720, 720, "CUDA extension built against the installed torch for this GPU", setup=True),
    Step("kernels", 360, 90, "every CUDA kernel vs the CPU reference, bit for bit, sizes 0..>2^31 bytes"),
    Step("throughput", 120, 45, "codec GB/s as a ratio of a device copy of the same bytes (goal >= 0.8x)"),
    Step("comm_cuda", 150, 60, "qwZ/hpZ/qgZ on CUDA tensors, several ranks on one GPU, vs the CPU path"),
    Step("pretrain_gpt", 240, 75, "pretrain_gpt.py on the GPU, bf16, distributed optimizer, zeropp vs none"),
    # quick: two runs of 55 s each at most (Megatron-LM's start-up alone takes ~35 s on an H100)
    Step("megatron_lm", 360, 120, "megatron.training.pretrain with the plugin vs without, loss and tokens/s"),
    # last: the slowest per byte checked, and what the budget should cut first
    Step("sanitizer", 240, 90, "compute-sanitizer memcheck + racecheck over a small kernel set"),
)


def fake_steps(kinds: str, limit: float) -> list[Step]:
    """Steps that pass, fail (exit 3, no result file) or hang (a child that outlives a killed parent
    would hold the pipe: the whole group must go), for the orchestration tests."""
    code = {
        "pass": "import json,sys,os;print('fake pass');"
                "json.dump({'status':'pass','figures':{'x':1},'rows':[],'detail':'ok'},"
                "open(os.path.join(sys.argv[1],'fake_pass.json'),'w'))",
        "fail": "import sys\nfor i in range(100): print('fake fail line', i)\n"
                "print('Traceback: the fake step failed', file=sys.stderr); sys.exit(3)",
        "hang": "import subprocess,sys,time,os\n"
                "child=subprocess.Popen([sys.executable,'-c','import time; time.sleep(600)'])\n"
                "open(os.path.join(sys.argv[1],'fake_hang.child'),'w').write(str(child.pid))\n"
                "print('fake hang: sleeping', flush=True); time.sleep(600)",
    }
    steps = []
    for kind in filter(None, (k.strip() for k in kinds.split(","))):
        if kind not in code:
            raise SystemExit(f"ZPP_GPU_CHECK_FAKE_STEPS: {kind!r} is not one of {', '.join(code)}")
        steps.append(Step(f"fake_{kind}", limit, limit, f"fake step ({kind})",
                          cmd=("{python}", "-c", code[kind], "{out}")))
    return steps


def stub(step: Step) -> Step:
    """The dry-run stand-in of a step: writes a 'skipped' result naming what would have run."""
    detail = f"dry run: would run {step.name} ({step.what}) with a {step.limit_s:.0f} s limit"
    code = ("import json,os,sys;json.dump({'status':'skipped','figures':{},'rows':[],'detail':%r},"
            "open(os.path.join(sys.argv[1],%r),'w'))" % (detail, f"{step.name}.json"))
    return Step(step.name, step.limit_s, step.quick_limit_s, step.what, step.setup, ("{python}", "-c", code, "{out}"))


# ------------------------------------------------------------ running ---
def tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-TAIL_LINES:])[-TAIL_CHARS:]


KILL_MARGIN_S = 12.0  # stop_process_group's worst case (5 s + 5 s) and the report's write


def run_step(step: Step, out: Path, quick: bool, limit: float, env: dict) -> dict:
    step_dir = out / "steps"
    step_dir.mkdir(parents=True, exist_ok=True)
    result_path = step_dir / f"{step.name}.json"
    result_path.unlink(missing_ok=True)  # never read a previous run's result
    log = out / "logs" / f"{step.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = step.argv(step_dir, quick)
    record = {"name": step.name, "what": step.what, "cmd": argv, "limit_s": round(limit, 1), "log": str(log),
              "figures": {}, "rows": [], "detail": "", "exit_code": None, "timed_out": False}
    if step.cmd is None and not Path(argv[1]).exists():
        record.update(status="fail", wall_s=0.0, detail=f"{Path(argv[1]).relative_to(REPO)} does not exist", tail="")
        return record
    step_env = dict(env, ZPP_GPU_CHECK_DEADLINE=str(time.time() + limit))
    t0 = time.perf_counter()
    print(f"== {step.name}: {step.what} (limit {limit:.0f} s)", flush=True)
    with open(log, "wb") as sink:
        try:
            proc = subprocess.Popen(argv, cwd=REPO, env=step_env, stdout=sink, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            record.update(status="fail", wall_s=round(time.perf_counter() - t0, 2), tail="",
                          detail=f"could not start {argv[0]}: {exc}")
            return record
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            record["timed_out"] = True
            stop_process_group(proc, term_grace_s=5.0)
        except KeyboardInterrupt:  # its own session does not get the terminal's Ctrl-C: end it too
            stop_process_group(proc, term_grace_s=5.0)
            raise
        else:
            try:  # the step is done; helpers it left behind in its group are not
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    record["wall_s"] = round(time.perf_counter() - t0, 2)
    record["exit_code"] = proc.returncode
    record["tail"] = tail(log)
    result = None
    if result_path.exists():
        try:
            result = json.loads(result_path.read_text())
        except json.JSONDecodeError as exc:
            record["detail"] = f"unreadable {result_path.name}: {exc}"
    if result is not None and not isinstance(result, dict):
        record["detail"] = f"{result_path.name} holds a {type(result).__name__}, not an object"
        result = None
    if result is not None:
        record.update(figures=result.get("figures") or {}, rows=result.get("rows") or [],
                      detail=str(result.get("detail", "")))
    claimed = result.get("status") if isinstance(result, dict) else None
    if record["timed_out"]:
        status = "timeout"
        record["detail"] = f"killed at its {limit:.0f} s limit (the whole process group)" + (
            f"; its result said {claimed}: {record['detail']}" if claimed else "")
    elif claimed not in ("pass", "fail", "unsupported", "skipped"):
        status = "fail"
        record["detail"] = (record["detail"] or f"no {result_path.name} written" if result is None else
                            f"invalid status {claimed!r} in {result_path.name}") + f" (exit {proc.returncode})"
    elif (claimed == "fail") != (proc.returncode != 0):
        status = "fail"
        record["detail"] = f"exit code {proc.returncode} disagrees with status {claimed!r}: {record['detail']}"
    else:
        status = claimed
    record["status"] = status
    first = record["detail"].splitlines()[0][:160] if record["detail"] else ""
    exit_note = f" (exit {proc.returncode})" if proc.returncode else ""
    print(f"   {step.name}: {status.upper()} in {record['wall_s']:.1f} s{exit_note} {first}", flush=True)
    return record


def step_env(out: Path, kit: Path, site: Path, quick: bool) -> dict:
    """The environment of every step: the repository first, then the kit's packages, then what the
    image has; the JIT build off (a step must use the built extension, not a CPU-only JIT copy)."""
    env = dict(os.environ)
    paths = [str(REPO), str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    # site/bin: console scripts of the kit's wheels (ninja: torch's extension build runs it from PATH)
    env["PATH"] = os.pathsep.join([str(site / "bin"), env.get("PATH", "")])
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", ZPP_JIT="0", ZPP_GPU_CHECK="1",
               ZPP_GPU_CHECK_KIT=str(kit), ZPP_GPU_CHECK_SITE=str(site), ZPP_GPU_CHECK_OUT=str(out),
               ZPP_GPU_CHECK_QUICK="1" if quick else "0")
    return env


def select(steps: list[Step], names: str | None) -> list[Step]:
    if not names:
        return steps
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {s.name: s for s in steps}
    bad = [n for n in wanted if n not in known]
    if bad:
        raise SystemExit(f"--steps: {', '.join(bad)} not known; valid: {', '.join(known)}")
    return [s for s in steps if s.name in wanted]


def orchestrate(steps: list[Step], out: Path, *, quick: bool = False, budget_s: float = 0, kit: Path | None = None,
                dry_run: bool = False, argv: list[str] | None = None, deadline_s: float = 0) -> dict:
    """Run ``steps`` in order, each with its limit (clipped to the budget left), and write the report.

    ``deadline_s`` (0: none) bounds the whole run, setup included: a lent GPU machine's call has a hard
    wall-clock limit and a slow build must shorten the checks, not lose the report to an outer kill.
    The report is rewritten after every step, so whatever kills the run still leaves the steps done."""
    out.mkdir(parents=True, exist_ok=True)
    kit = (kit or REPO / ".gpukit").resolve()
    site = out.resolve() / "site"
    env = step_env(out.resolve(), kit, site, quick)
    started = dt.datetime.now(dt.timezone.utc)
    t0 = time.perf_counter()
    budget_used = 0.0
    records = []

    def write(records: list[dict], complete: bool) -> dict:
        report = {
            "schema": SCHEMA,
            "started": started.isoformat(timespec="seconds"),
            "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(time.perf_counter() - t0, 1),
            "setup_s": round(sum(r["wall_s"] for r, s in zip(records, steps) if s.setup), 1),
            "checks_s": round(budget_used, 1),
            "mode": {"quick": quick, "dry_run": dry_run, "budget_s": budget_s, "deadline_s": deadline_s},
            "command": argv if argv is not None else sys.argv,
            "kit": str(kit),
            "environment": next((r["figures"] for r in records if r["name"] == "env"), {}),
            "steps": records,
            "summary": {s: sum(r["status"] == s for r in records) for s in STATUSES},
            # a report written between steps, before the run ended: the steps not reached are listed
            "complete": complete,
            "not_reached": [s.name for s in steps[len(records):]],
        }
        report["ok"] = not any(r["status"] in FAILED for r in records)
        problems = validate_report(report)
        if problems:  # a bug here, not in a step: say so loudly, still write what there is
            report["schema_problems"] = problems
        # atomically: an outer kill most likely lands while the report is being rewritten
        for name, text in (("gpu_report.json", json.dumps(report, indent=1, default=str)),
                           ("gpu_report.md", render_md(report))):
            tmp = out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, out / name)
        return report

    for step in steps:
        limit = step.quick_limit_s if quick else step.limit_s
        left, why = float("inf"), ""
        if not step.setup and budget_s > 0:
            left, why = budget_s - budget_used, f"the {budget_s:.0f} s budget of the run is spent"
        # a step cut at its limit takes up to KILL_MARGIN_S more to be killed (stop_process_group) and reported
        if deadline_s > 0 and deadline_s - KILL_MARGIN_S - (time.perf_counter() - t0) < left:
            left, why = (deadline_s - KILL_MARGIN_S - (time.perf_counter() - t0),
                         f"the run's {deadline_s:.0f} s deadline is near")
        if left < 5:
            records.append({"name": step.name, "what": step.what, "status": "skipped", "wall_s": 0.0,
                            "limit_s": 0.0, "exit_code": None, "timed_out": False, "figures": {}, "rows": [],
                            "tail": "", "cmd": step.argv(out / "steps", quick), "detail": f"not run: {why}"})
        else:
            record = run_step(step, out, quick, min(limit, left), env)
            if not step.setup:
                budget_used += record["wall_s"]
            records.append(record)
        write(records, complete=False)
    return write(records, complete=True)


# ------------------------------------------------------------- report ---
STEP_KEYS = {"name": str, "status": str, "wall_s": (int, float), "limit_s": (int, float), "timed_out": bool,
             "figures": dict, "rows": list, "detail": str, "tail": str}


def validate_report(report: dict) -> list[str]:
    """What is wrong with a report's structure (empty when it is valid)."""
    problems = []
    for key, kind in (("schema", str), ("started", str), ("finished", str), ("wall_s", (int, float)),
                      ("mode", dict), ("environment", dict), ("steps", list), ("summary", dict), ("ok", bool)):
        if not isinstance(report.get(key), kind):
            problems.append(f"{key}: missing or not {kind}")
    if report.get("schema") != SCHEMA:
        problems.append(f"schema is {report.get('schema')!r}, expected {SCHEMA!r}")
    for i, step in enumerate(report.get("steps") or []):
        for key, kind in STEP_KEYS.items():
            if not isinstance(step.get(key), kind):
                problems.append(f"steps[{i}].{key}: missing or not {kind}")
        if step.get("status") not in STATUSES:
            problems.append(f"steps[{i}].status {step.get('status')!r} not in {STATUSES}")
        if "exit_code" not in step or not (step["exit_code"] is None or isinstance(step["exit_code"], int)):
            problems.append(f"steps[{i}].exit_code: missing or not int/None")
        if step.get("status") == "timeout" and not step.get("timed_out"):
            problems.append(f"steps[{i}]: status timeout without timed_out")
    if isinstance(report.get("summary"), dict) and isinstance(report.get("steps"), list):
        if sum(report["summary"].get(s, 0) for s in STATUSES) != len(report["steps"]):
            problems.append("summary counts do not add up to the steps")
        if report.get("ok") is not (not any(s.get("status") in FAILED for s in report["steps"])):
            problems.append("ok disagrees with the step statuses")
    return problems


def key_figures(step: dict, limit: int = 6) -> str:
    """A few scalar figures for the table (the JSON has them all)."""
    exact = [k for k in ("device", "capability", "torch", "torch_cuda", "driver_cuda", "goal_met", "min_int_x_copy")
             if k in step["figures"]]
    words = ("x_copy", "goal", "passed", "failed", "tokens", "loss", "peak", "compile", "memcheck", "racecheck")
    preferred = exact + [k for k in step["figures"] if k not in exact and any(w in k for w in words)]
    keys = preferred + [k for k in step["figures"] if k not in preferred]
    parts = []
    for k in keys:
        v = step["figures"][k]
        if isinstance(v, (int, float, str, bool)) and (not isinstance(v, str) or len(v) <= 40):
            parts.append(f"{k}={v}")
        if len(parts) >= limit:
            break
    return ", ".join(parts).replace("|", "/")


def render_md(report: dict) -> str:
    env = report["environment"]
    verdict = "all steps passed or were not applicable" if report["ok"] else "FAILURES"
    if not report.get("complete", True):
        verdict += f" so far; RUN NOT FINISHED, not reached: {', '.join(report['not_reached']) or 'none'}"
    mode = ("dry run" if report["mode"]["dry_run"] else "quick" if report["mode"]["quick"] else "full")
    lines = [f"# GPU check ({mode}), {report['started']}", "",
             f"Device: {env.get('device', 'no CUDA device')}; torch {env.get('torch')} (CUDA {env.get('torch_cuda')});"
             f" driver {env.get('nvidia_smi', '?')}. Wall {report['wall_s']} s (setup {report['setup_s']} s, checks"
             f" {report['checks_s']} s). Result: **{verdict}**"
             f" ({', '.join(f'{v} {k}' for k, v in report['summary'].items() if v)}).", "",
             "| step | status | wall s | limit s | key figures |", "|---|---|---:|---:|---|"]
    for s in report["steps"]:
        status = s["status"].upper() if s["status"] in FAILED else s["status"]
        lines.append(f"| {s['name']} | {status} | {s['wall_s']:.1f} | {s['limit_s']:.0f} | {key_figures(s)} |")
    lines += [""]
    for s in report["steps"]:
        lines.append(f"- **{s['name']}** ({s['status']}): {s['detail'].splitlines()[0][:400] if s['detail'] else ''}")
    failed = [s for s in report["steps"] if s["status"] in FAILED]
    if failed:
        lines += ["", "## Failures", ""]
        for s in failed:
            head = f"### {s['name']}: {s['status']} (exit {s['exit_code']}, {s['wall_s']:.1f} s of {s['limit_s']:.0f})"
            lines += [head, "", s["detail"][:3000], "", "Last lines of its output:", "", "```", s["tail"], "```", ""]
            bad_rows = [r for r in s["rows"] if isinstance(r, dict) and r.get("status") == "fail"][:20]
            if bad_rows:
                lines += ["Failing rows:", ""] + [f"- `{json.dumps(r, default=str)[:400]}`" for r in bad_rows] + [""]
    lines += ["", "## Environment", ""]
    for k, v in env.items():
        lines.append(f"- {k}: `{json.dumps(v, default=str)[:600]}`")
    if report.get("schema_problems"):
        lines += ["", "## Report schema problems (a bug in tools/gpu_check.py)", ""] + \
                 [f"- {p}" for p in report["schema_problems"]]
    return "\n".join(lines) + "\n"


def doc_path(report: dict) -> Path:
    """docs/gpu/<date>-<HHMM UTC>-<gpu>.md, e.g. docs/gpu/2026-11-25-1900-nvidia-h100-80gb-hbm3.md: one per
    run, since a lent machine's short calls make several runs a day."""
    gpu = str(report["environment"].get("device") or "no-gpu").lower()
    slug = "-".join("".join(c if c.isalnum() else " " for c in gpu).split())
    started = report["started"]
    return REPO / "docs" / "gpu" / f"{started[:10]}-{started[11:13]}{started[14:16]}-{slug}.md"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="report folder (default out/gpu-check/<UTC time>)")
    ap.add_argument("--quick", action="store_true", help="the short variant of every step (budget 300 s)")
    ap.add_argument("--dry-run", action="store_true", help="stubs instead of the steps (env stays real): no GPU needed")
    ap.add_argument("--kit", type=Path, default=REPO / ".gpukit", help="the offline kit folder (make gpu-kit)")
    ap.add_argument("--steps", default=None, help="run only these steps, comma-separated (default: all)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the steps after setup (default 900, 300 with --quick; 0: no budget)")
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds for the whole run, setup included (0: none): later steps are cut to fit it")
    ap.add_argument("--list", action="store_true", help="print the step table and exit")
    ap.add_argument("--save-doc", action="store_true",
                    help="also copy the report to docs/gpu/<date>-<HHMM>-<gpu>.md (the issue's record of a GPU run)")
    args = ap.parse_args(argv)
    steps = list(STEPS)
    fakes = os.environ.get("ZPP_GPU_CHECK_FAKE_STEPS")
    if fakes:
        at = next(i for i, s in enumerate(steps) if s.name == "env") + 1
        steps[at:at] = fake_steps(fakes, float(os.environ.get("ZPP_GPU_CHECK_FAKE_LIMIT", "5")))
    steps = select(steps, args.steps)
    if args.list:
        for s in steps:
            setup = "setup  " if s.setup else ""
            print(f"{s.name:<14}{s.limit_s:>6.0f} s{s.quick_limit_s:>6.0f} s (quick)  {setup}{s.what}")
        return 0
    if args.dry_run:
        steps = [s if s.name == "env" or s.name.startswith("fake_") else stub(s) for s in steps]
    out = args.out or REPO / "out" / "gpu-check" / dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    budget = args.budget if args.budget is not None else (300.0 if args.quick else 900.0)
    report = orchestrate(steps, out, quick=args.quick, budget_s=budget, kit=args.kit, dry_run=args.dry_run,
                         deadline_s=args.deadline,
                         argv=sys.argv if argv is None else ["tools/gpu_check.py", *argv])
    print(f"\nreport: {out / 'gpu_report.md'} ({out / 'gpu_report.json'})")
    if args.save_doc:
        doc = doc_path(report)
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc.write_text((out / "gpu_report.md").read_text())
        print(f"copied to {doc.relative_to(REPO)}")
    for s in report["steps"]:
        print(f"  {s['name']:<14}{s['status']:<12}{s['wall_s']:>8.1f} s")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
