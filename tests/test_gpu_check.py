"""The GPU check's orchestration on CPU (tools/gpu_check.py): steps enumerated, a failing step recorded
with its exit code and output tail and the next one run, a hanging step killed with its whole process
group at its limit, the report's schema; and every GPU step script refusing cleanly without a GPU."""

import base64
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tools" / "gpu_steps"))

import gpu_check  # noqa: E402
from gpu_check import Step, orchestrate, validate_report  # noqa: E402

GPU_STEPS = ["build", "kernels", "throughput", "sanitizer", "comm_cuda", "pretrain_gpt", "megatron_lm"]


def py_step(name: str, code: str, limit: float = 20, setup: bool = False) -> Step:
    """A step running ``code`` with ``sys.argv[1]`` = its result folder."""
    return Step(name, limit, limit, f"test step {name}", setup=setup, cmd=("{python}", "-c", code, "{out}"))


def result_code(name: str, status: str, exit_code: int = 0, extra: str = "") -> str:
    return (f"import json,os,sys\n{extra}\n"
            f"json.dump({{'status':{status!r},'figures':{{'n':1}},'rows':[{{'a':1}}],'detail':'d {name}'}},"
            f"open(os.path.join(sys.argv[1],{name + '.json'!r}),'w'))\nsys.exit({exit_code})")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped by its parent) is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_orchestrate_records_every_outcome_and_goes_on(tmp_path):
    hang = ("import subprocess,sys,time,os\n"
            "c=subprocess.Popen([sys.executable,'-c','import time; time.sleep(300)'])\n"
            "open(os.path.join(sys.argv[1],'child.pid'),'w').write(str(c.pid))\n"
            "print('hanging now', flush=True)\ntime.sleep(300)")
    steps = [
        py_step("ok", result_code("ok", "pass")),
        py_step("crash", "import sys\nfor i in range(200): print('line', i)\nraise SystemExit('boom: the crash step')"),
        py_step("says_fail", result_code("says_fail", "fail", exit_code=2)),
        py_step("hang", hang, limit=3),
        py_step("no_result", "print('exits 0 without a result')"),
        py_step("liar", result_code("liar", "pass", exit_code=1)),
        py_step("bad_status", result_code("bad_status", "green")),
        py_step("unsupported", result_code("unsupported", "unsupported")),
        py_step("after", result_code("after", "skipped")),
    ]
    t0 = time.perf_counter()
    report = orchestrate(steps, tmp_path, budget_s=0, argv=["test"])
    assert time.perf_counter() - t0 < 60  # the hang did not hold the run (killed at 3 s, grace 5 s)
    by = {s["name"]: s for s in report["steps"]}
    assert [s["name"] for s in report["steps"]] == [s.name for s in steps]  # every step ran, in order
    assert by["ok"]["status"] == "pass" and by["ok"]["figures"] == {"n": 1} and by["ok"]["rows"] == [{"a": 1}]
    crash = by["crash"]
    assert crash["status"] == "fail" and crash["exit_code"] == 1
    assert "boom: the crash step" in crash["tail"] and "line 199" in crash["tail"] and "line 100" not in crash["tail"]
    assert len(crash["tail"].splitlines()) <= gpu_check.TAIL_LINES
    assert by["says_fail"]["status"] == "fail" and by["says_fail"]["exit_code"] == 2
    h = by["hang"]
    assert h["status"] == "timeout" and h["timed_out"] and h["exit_code"] != 0 and "hanging now" in h["tail"]
    assert 3 <= h["wall_s"] < 15
    child = int((tmp_path / "steps" / "child.pid").read_text())
    deadline = time.time() + 10
    while alive(child) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive(child), "the hanging step's child survived: the process group was not killed"
    assert by["no_result"]["status"] == "fail" and "no no_result.json" in by["no_result"]["detail"]
    assert by["liar"]["status"] == "fail" and "disagrees" in by["liar"]["detail"]
    assert by["bad_status"]["status"] == "fail" and "'green'" in by["bad_status"]["detail"]
    assert by["unsupported"]["status"] == "unsupported"
    assert by["after"]["status"] == "skipped" and by["after"]["wall_s"] > 0  # it ran after the hang
    assert report["ok"] is False
    assert report["summary"] == {"pass": 1, "fail": 5, "timeout": 1, "unsupported": 1, "skipped": 1}
    assert validate_report(report) == []
    on_disk = json.loads((tmp_path / "gpu_report.json").read_text())
    assert validate_report(on_disk) == [] and on_disk["steps"][3]["status"] == "timeout"
    md = (tmp_path / "gpu_report.md").read_text()
    assert "| step | status | wall s |" in md and "| hang | TIMEOUT |" in md and "## Failures" in md
    assert "boom: the crash step" in md and "## Environment" in md
    assert (tmp_path / "logs" / "crash.log").read_text().count("line ") == 200  # the full log is kept


def test_all_passing_run_is_ok_and_the_budget_cuts_later_steps(tmp_path):
    steps = [py_step("setup", result_code("setup", "pass", extra="import time; time.sleep(1.5)"), setup=True),
             py_step("slow", result_code("slow", "pass", extra="import time; time.sleep(3)")),
             py_step("late", result_code("late", "pass"))]
    report = orchestrate(steps, tmp_path, budget_s=7, argv=["test"])
    by = {s["name"]: s for s in report["steps"]}
    assert by["setup"]["status"] == "pass"  # setup time does not count against the budget
    assert by["slow"]["status"] == "pass" and by["slow"]["limit_s"] == 7
    # what is left (< 5 s) is no time to run a step in
    assert by["late"]["status"] == "skipped" and "the 7 s budget of the run is spent" in by["late"]["detail"]
    assert report["ok"] is True and validate_report(report) == []
    report = orchestrate(steps[:1], tmp_path / "again", argv=["test"])
    assert report["ok"] is True and report["summary"]["pass"] == 1


def test_the_deadline_counts_setup_and_each_step_leaves_a_report(tmp_path, monkeypatch):
    # the step after setup reads the report on disk: the setup step must already be in it, marked unfinished
    peek = ("r=json.load(open(os.path.join(os.path.dirname(sys.argv[1]),'gpu_report.json')))\n"
            "n=[s['name'] for s in r['steps']]; assert n==['setup'], n\n"
            "assert r['complete'] is False and r['not_reached']==['peek','late'], r['not_reached']\n"
            "assert 'RUN NOT FINISHED' in open(os.path.join(os.path.dirname(sys.argv[1]),'gpu_report.md')).read()")
    steps = [py_step("setup", result_code("setup", "pass", extra="import time; time.sleep(2)"), setup=True),
             # then sleeps until 18 s after the run started (wall clock: timing-proof on a loaded machine)
             py_step("peek", result_code("peek", "pass", extra=peek + "\nimport time, datetime\n"
                     "time.sleep(max(0, datetime.datetime.fromisoformat(r['started']).timestamp() + 18 - time.time()))")),
             py_step("late", result_code("late", "pass"))]
    monkeypatch.setattr(gpu_check, "KILL_MARGIN_S", 4.0)  # steps must end by 21 s: "late" gets < 5 s, skipped
    report = orchestrate(steps, tmp_path, budget_s=0, deadline_s=25, argv=["test"])
    by = {s["name"]: s for s in report["steps"]}
    assert by["setup"]["status"] == "pass" and by["peek"]["status"] == "pass", by["peek"]["tail"]
    assert by["peek"]["limit_s"] <= 21 - by["setup"]["wall_s"] + 0.1  # clipped to what the deadline left
    assert report["complete"] is True and report["not_reached"] == []
    assert by["late"]["status"] == "skipped" and "25 s deadline" in by["late"]["detail"]
    assert report["mode"]["deadline_s"] == 25 and report["ok"] is True
    assert json.loads((tmp_path / "gpu_report.json").read_text())["steps"][-1]["name"] == "late"


def test_validate_report_names_what_is_wrong(tmp_path):
    report = orchestrate([py_step("ok", result_code("ok", "pass"))], tmp_path, argv=["test"])
    assert validate_report(report) == []
    broken = json.loads(json.dumps(report))
    broken["steps"][0]["status"] = "green"
    del broken["steps"][0]["tail"]
    broken["ok"] = "yes"
    problems = validate_report(broken)
    assert any("steps[0].status 'green'" in p for p in problems)
    assert any("steps[0].tail" in p for p in problems)
    assert any(p.startswith("ok:") for p in problems)
    wrong_sum = json.loads(json.dumps(report))
    wrong_sum["summary"]["pass"] = 2
    assert validate_report(wrong_sum) == ["summary counts do not add up to the steps"]


def test_cli_dry_run_with_a_failing_and_a_hanging_step(tmp_path):
    """The command as a user runs it: every step enumerated (stubs, env real), the fake failing step
    recorded with exit code and tail, the hanging one killed at its limit, the steps after both run."""
    env = dict(os.environ, ZPP_GPU_CHECK_FAKE_STEPS="fail,hang,pass", ZPP_GPU_CHECK_FAKE_LIMIT="4")
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a step failed
    report = json.loads((out / "gpu_report.json").read_text())
    assert validate_report(report) == []
    names = [s["name"] for s in report["steps"]]
    assert names == ["kit", "env", "fake_fail", "fake_hang", "fake_pass", "build", "kernels", "throughput",
                     "comm_cuda", "pretrain_gpt", "megatron_lm", "sanitizer"]
    by = {s["name"]: s for s in report["steps"]}
    assert by["fake_fail"]["status"] == "fail" and by["fake_fail"]["exit_code"] == 3
    assert "the fake step failed" in by["fake_fail"]["tail"]
    assert by["fake_hang"]["status"] == "timeout" and by["fake_hang"]["limit_s"] == 4
    assert by["fake_pass"]["status"] == "pass"
    assert by["env"]["status"] == "pass" and report["environment"]["torch"] == torch.__version__
    for name in GPU_STEPS + ["kit"]:
        assert by[name]["status"] == "skipped" and by[name]["detail"].startswith("dry run: would run"), name
    assert report["mode"] == {"quick": False, "dry_run": True, "budget_s": 900.0, "deadline_s": 0}
    md = (out / "gpu_report.md").read_text()
    assert "| fake_fail | FAIL |" in md and "| fake_hang | TIMEOUT |" in md and "| sanitizer | skipped |" in md


def test_cli_rejects_unknown_steps_and_lists_the_table():
    tool = str(ROOT / "tools" / "gpu_check.py")
    proc = subprocess.run([sys.executable, tool, "--steps", "kernels,warp_drive", "--dry-run"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "warp_drive not known; valid: kit, env, build, kernels" in proc.stderr
    listing = subprocess.run([sys.executable, tool, "--list"], capture_output=True, text=True, timeout=120).stdout
    assert [line.split()[0] for line in listing.splitlines()] == [s.name for s in gpu_check.STEPS]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU; this machine has one")
@pytest.mark.parametrize("name", GPU_STEPS)
def test_gpu_steps_refuse_cleanly_without_a_gpu(name, tmp_path):
    script = ROOT / "tools" / "gpu_steps" / f"{name}.py"
    if not script.exists():
        pytest.skip(f"{script.relative_to(ROOT)} is not in this branch")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", ZPP_JIT="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--quick"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["status"] in ("skipped", "unsupported"), result
    assert set(result) >= {"status", "figures", "rows", "detail"}
    assert "GPU" in result["detail"] or "CUDA" in result["detail"] or "cuda" in result["detail"], result["detail"]


def test_kernels_step_logic_on_cpu(tmp_path):
    """The kernels step with the C++ CPU kernels as the device under test and the reference as the
    oracle (its small set): every family checked, all equal."""
    env = dict(os.environ, ZPP_JIT="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_steps" / "kernels.py"), "--out", str(tmp_path),
                           "--device", "cpu", "--sanitize-set"], capture_output=True, text=True, env=env, timeout=600)
    result = json.loads((tmp_path / "kernels.json").read_text())
    assert proc.returncode == 0 and result["status"] == "pass", result["detail"]
    checks = {r["check"] for r in result["rows"] if r["status"] == "pass"}
    assert checks >= {"quantize_rows_", "dequantize_rows_", "reorder_quantize_", "dequant_reduce_quantize_",
                      "dequant_reduce_", "zfp", "mpc", "quantize_rows_+hadamard, reorder_quantize_",
                      "dequantize_rows_+hadamard, dequantize_add_rows_", "dequant_reduce_quantize_+hadamard",
                      "dequant_reduce_+hadamard"}
    sizes = {r.get("length") for r in result["rows"] if r["check"] == "quantize_rows_"}
    assert {0, 1, 4099} <= sizes  # empty, one element, odd and block-unaligned


def test_sanitizer_output_classification():
    from sanitizer import classify

    clean = "========= COMPUTE-SANITIZER\n[kernels] pass\n========= ERROR SUMMARY: 0 errors\n"
    assert classify("memcheck", 0, clean, "pass")[0] == "pass"
    race = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert classify("racecheck", 0, race, "pass")[0] == "pass"
    bad = ("========= Invalid __global__ read of size 4 bytes\n=========     at quantize_kernel+0x90\n"
           "========= ERROR SUMMARY: 3 errors\n")
    status, why = classify("memcheck", 86, bad, "pass")
    assert status == "fail" and "3 errors" in why and "Invalid __global__ read" in why
    assert classify("memcheck", 0, clean, "fail")[0] == "fail"  # the kernels themselves disagreed
    status, why = classify("memcheck", 1, "========= Error: Target application terminated before first "
                                           "instrumented API call\n", None)
    assert status == "unsupported" and "did not attach" in why and "first instrumented API call" in why


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel (one module) for the kit test, made without network."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": b"VALUE = 42\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return wheel


def test_kit_step_installs_offline_and_never_torch(tmp_path):
    kit = tmp_path / "kit"
    kit.mkdir()
    _wheel(kit, "zpp_kit_probe", "1.0")
    (kit / "requirements.txt").write_text("zpp_kit_probe==1.0\ntorch==2.11.0\nnvidia-nccl-cu13==2.0\n"
                                          "megatron_zpp==0.1.0\nnumpy>=1.0  # the image's numpy is kept\n")
    site = tmp_path / "out" / "site"
    # the import check after the install: the probe module (not megatron.core etc., slow to import here)
    env = dict(os.environ, ZPP_GPU_CHECK_KIT=str(kit), ZPP_GPU_CHECK_SITE=str(site), PYTHONPATH=str(ROOT),
               ZPP_GPU_CHECK_KIT_MODULES="zpp_kit_probe")
    script = ROOT / "tools" / "gpu_steps" / "kit.py"
    proc = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "out")], capture_output=True,
                          text=True, env=env, timeout=600)
    result = json.loads((tmp_path / "out" / "kit.json").read_text())
    assert proc.returncode == 0 and result["status"] == "pass", result["detail"] + proc.stdout[-2000:]
    actions = {r["name"]: r["action"] for r in result["rows"]}
    assert actions["zpp-kit-probe"] == "install"
    assert actions["torch"].startswith("refused") and actions["nvidia-nccl-cu13"].startswith("refused")
    assert actions["megatron-zpp"].startswith("not installed")
    assert actions["numpy"].startswith("kept the image's")
    assert (site / "zpp_kit_probe.py").exists() and not (site / "torch").exists() and not (site / "numpy").exists()
    assert result["figures"]["torch_after"] == importlib.metadata.version("torch") == result["figures"]["torch_before"]
    # a folder it did not make is never emptied
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    env["ZPP_GPU_CHECK_SITE"] = str(foreign)
    proc = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "out2")], capture_output=True,
                          text=True, env=env, timeout=600)
    result = json.loads((tmp_path / "out2" / "kit.json").read_text())
    assert proc.returncode == 1 and result["status"] == "fail" and "refusing to empty it" in result["detail"]
    assert (foreign / "keep.txt").read_text() == "mine"


def test_build_step_picks_torchs_cuda_major_and_shims_a_pip_cuda_tree(tmp_path):
    """The build step's choices, which need no GPU: nvcc of torch's CUDA major version (another major
    is a clear failure naming what was found), and a CUDA_HOME with lib64/libcudart.so over a pip
    CUDA tree (nvidia/cu13 has lib/libcudart.so.13 only; the link step needs the unversioned name)."""
    from _common import StepOutcome
    from build import choose_nvcc, cuda_home_for
    from env import find_tools

    if not find_tools("nvcc") or torch.version.cuda is None:
        pytest.skip("no nvcc here (pip install -e '.[cuda-compile]')")
    nvcc, version, found = choose_nvcc(torch.version.cuda)
    assert version.split(".")[0] == torch.version.cuda.split(".")[0] and nvcc.exists()
    with pytest.raises(StepOutcome) as info:
        choose_nvcc("99.0")
    assert info.value.status == "fail" and "no nvcc for CUDA 99.x" in info.value.detail and str(nvcc) in info.value.detail
    home = cuda_home_for(nvcc, tmp_path)
    assert (home / "bin" / "nvcc").exists() and (home / "include" / "cuda_runtime.h").exists()
    assert (home / "lib64" / "libcudart.so").exists() or (home / "lib" / "libcudart.so").exists()


def test_kit_requirement_parsing():
    """Names from requirement lines and file names; the image's copy is kept only when it satisfies
    the line (else the kit's is installed)."""
    from kit import NEVER, requirement_name, satisfies

    assert requirement_name("megatron-core>=0.16,<0.20") == "megatron-core"
    assert requirement_name("Megatron_Core[dev] ; python_version>'3'") == "megatron-core"
    assert requirement_name("zfpy-1.0.1-cp312-cp312-manylinux_2_17_x86_64.whl") == "zfpy"
    assert requirement_name("megatron_zpp-0.1.0.tar.gz") == "megatron-zpp"
    assert satisfies("numpy>=1.26", "2.1.0") and not satisfies("numpy>=1.26", "1.24.4")
    assert satisfies("ninja", "1.11.1") and satisfies("zfpy-1.0.1-cp312-cp312-manylinux_2_17_x86_64.whl", "0.5")
    assert all(NEVER.match(n) for n in ("torch", "triton", "nvidia-nccl-cu13", "nvidia-cudnn-cu12"))
    assert not any(NEVER.match(n) for n in ("megatron-core", "einops", "torchmetrics"))


def test_doc_path_names_the_date_and_the_gpu():
    report = {"started": "2026-11-25T19:00:00+00:00", "environment": {"device": "NVIDIA H100 80GB HBM3"}}
    assert gpu_check.doc_path(report) == ROOT / "docs" / "gpu" / "2026-11-25-1900-nvidia-h100-80gb-hbm3.md"
    later = {"started": "2026-11-25T19:07:00+00:00", "environment": {}}
    assert gpu_check.doc_path(later).name == "2026-11-25-1907-no-gpu.md"
