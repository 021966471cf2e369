"""Step ``build``: compile ``megatron_zpp._C`` with its CUDA kernels against the installed torch, for
this GPU's own architecture, in place in the repository.

    ZPP_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=<major.minor>+PTX CUDA_HOME=<root of nvcc> \
        python setup.py build_ext --inplace

The architecture comes from ``torch.cuda.get_device_capability()``. nvcc is chosen among
$CUDA_HOME, PATH, /usr/local/cuda* and pip's nvidia packages, preferring torch's CUDA version (a
different major version makes torch refuse the build). A pip CUDA tree (``nvidia/cu13``) has no
``lib64`` nor an unversioned ``libcudart.so``; a shim CUDA_HOME in the step's folder supplies them.

The build is reused when the sources, torch, the architecture and nvcc are those of the last build
(``build/gpu_check_stamp.json``) and the extension still loads with CUDA kernels;
``ZPP_GPU_CHECK_REBUILD=1`` forces a build. Afterwards a fresh interpreter loads the extension, runs
one kernel on the GPU and compares it with the CPU kernel, and ``cuobjdump`` lists the embedded
architectures: a build that loads but has no code for this GPU ("no kernel image") fails here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, StepOutcome, parser, require_cuda, run_step
from env import find_tools, nvcc_version

STAMP = REPO / "build" / "gpu_check_stamp.json"

VERIFY = r"""
import json, sys, torch
res = {}
try:
    import megatron_zpp._C as C
    res["so"] = C.__file__
except Exception as e:
    res["import_error"] = f"{type(e).__name__}: {e}"
from megatron_zpp.compression import _extension, ops
res.update(cpu=_extension.load(), cuda=_extension.has_cuda_kernels(), loaded_from=_extension.loaded_from(),
           load_error=_extension.load_error())
if res["cuda"]:
    try:
        x = torch.randn(4099, device="cuda")
        got = ops.quantize(x, 8, 256, backend="kernel")
        torch.cuda.synchronize()
        res["smoke_equal_cpu"] = bool(torch.equal(got.cpu(), ops.quantize(x.cpu(), 8, 256, backend="kernel")))
    except Exception as e:
        res["smoke_error"] = f"{type(e).__name__}: {e}"
print("VERIFY " + json.dumps(res))
"""


def sources_digest() -> str:
    h = hashlib.sha256()
    files = sorted(p for p in (REPO / "csrc").rglob("*") if p.is_file())
    files += [REPO / "setup.py", REPO / "megatron_zpp" / "compression" / "_extension.py"]
    for p in files:
        h.update(str(p.relative_to(REPO)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def choose_nvcc(torch_cuda: str) -> tuple[Path, str, list[dict]]:
    """The nvcc to build with: same major version as torch's CUDA (torch refuses another), the same
    minor if there is one."""
    found = [{"path": str(p), "version": nvcc_version(p)} for p in find_tools("nvcc")]
    major, minor = torch_cuda.split(".")[:2]
    same_major = [f for f in found if f["version"] and f["version"].split(".")[0] == major]
    exact = [f for f in same_major if f["version"].split(".")[1] == minor]
    pick = (exact or same_major or [None])[0]
    if pick is None:
        have = ", ".join(f"{f['path']} ({f['version']})" for f in found) or "none"
        raise StepOutcome("fail", f"no nvcc for CUDA {major}.x (torch {torch_cuda}); found: {have}. To fix: set "
                          f"CUDA_HOME to a CUDA {major} toolkit, or pip install nvidia-cuda-nvcc (cu{major}) "
                          "pinned to torch's CUDA version (see docs: cuda-compile)",
                          {"nvcc_found": found})
    return Path(pick["path"]), pick["version"], found


def cuda_home_for(nvcc: Path, work: Path) -> Path:
    """CUDA_HOME for torch's build: the toolkit root, or a shim over a pip CUDA tree (no lib64, no
    unversioned libcudart.so, which the link step needs)."""
    root = nvcc.resolve().parents[1]
    if (root / "lib64" / "libcudart.so").exists() or (root / "lib" / "libcudart.so").exists():
        return root
    shim = work / "cuda-home"
    shim.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        link = shim / entry.name
        if entry.name != "lib64" and not link.exists():  # lib too: nvcc.profile's -L$(TOP)/lib
            link.symlink_to(entry)
    lib64 = shim / "lib64"
    lib64.mkdir(exist_ok=True)
    libdir = root / "lib64" if (root / "lib64").is_dir() else root / "lib"
    for lib in libdir.iterdir():
        link = lib64 / lib.name
        if not link.exists():
            link.symlink_to(lib)
        m = re.match(r"(lib\w+\.so)\.\d+$", lib.name)  # libcudart.so.13 -> libcudart.so
        if m and not (lib64 / m.group(1)).exists():
            (lib64 / m.group(1)).symlink_to(lib)
    return shim


def verify(env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", VERIFY], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("VERIFY "):
            return json.loads(line[len("VERIFY "):])
    return {"verify_error": f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"}


def embedded_archs(so: str | None) -> dict:
    tools = find_tools("cuobjdump")
    if not so or not tools:
        return {"cuobjdump": "not found" if not tools else "no extension file"}
    res = {}
    for flag, key in (("--list-elf", "sass"), ("--list-ptx", "ptx")):
        proc = subprocess.run([str(tools[0]), flag, so], capture_output=True, text=True, timeout=120)
        res[key] = sorted(set(re.findall(r"sm_\d+a?", proc.stdout)))
    return res


def body(args):
    require_cuda("building the CUDA kernels")
    import torch

    cap = torch.cuda.get_device_capability(0)
    arch_list = f"{cap[0]}.{cap[1]}+PTX"
    figures: dict = {"device": torch.cuda.get_device_name(0), "capability": f"{cap[0]}.{cap[1]}",
                     "TORCH_CUDA_ARCH_LIST": arch_list, "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if torch.version.cuda is None:
        raise StepOutcome("fail", "torch has no CUDA version (torch.version.cuda is None)", figures)
    nvcc, nvcc_ver, found = choose_nvcc(torch.version.cuda)
    figures.update(nvcc=str(nvcc), nvcc_version=nvcc_ver, nvcc_found=found)
    work = args.out / "build-work"
    cuda_home = cuda_home_for(nvcc, work)
    figures["CUDA_HOME"] = str(cuda_home)
    env = dict(os.environ, ZPP_BUILD_CUDA="1", TORCH_CUDA_ARCH_LIST=arch_list, CUDA_HOME=str(cuda_home),
               MAX_JOBS=str(os.cpu_count() or 4), PATH=f"{cuda_home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    stamp = {"sources": sources_digest(), "torch": torch.__version__, "arch": arch_list, "nvcc": nvcc_ver}
    reuse = (os.environ.get("ZPP_GPU_CHECK_REBUILD") != "1" and STAMP.exists()
             and json.loads(STAMP.read_text()) == stamp)
    result = verify(env) if reuse else {}
    if reuse and result.get("cuda") and result.get("smoke_equal_cpu"):
        figures.update(reused=True, compile_s=0.0, **{f"ext_{k}": v for k, v in result.items()})
        figures["embedded"] = embedded_archs(result.get("so"))
        return "pass", figures, [], f"reused the build for {arch_list} (sources, torch and nvcc unchanged)"
    STAMP.unlink(missing_ok=True)
    cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
    print("+", " ".join(f"{k}={env[k]}" for k in ("ZPP_BUILD_CUDA", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "MAX_JOBS")),
          " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env)  # output straight to the step's log
    figures.update(reused=False, compile_s=round(time.perf_counter() - t0, 1), build_exit=proc.returncode)
    if proc.returncode != 0:
        raise StepOutcome("fail", f"the CUDA build failed (exit {proc.returncode}); the log's tail says why", figures)
    result = verify(env)
    figures.update({f"ext_{k}": v for k, v in result.items()})
    figures["embedded"] = embedded_archs(result.get("so"))
    if not result.get("cuda"):
        raise StepOutcome("fail", f"built, but the extension has no CUDA kernels: {result}", figures)
    if not result.get("smoke_equal_cpu"):
        raise StepOutcome("fail", f"built, but a CUDA kernel did not run or differed from the CPU kernel: {result}",
                          figures)
    STAMP.parent.mkdir(parents=True, exist_ok=True)
    STAMP.write_text(json.dumps(stamp))
    sass = figures["embedded"].get("sass")
    return "pass", figures, [], (f"built for {arch_list} with nvcc {nvcc_ver} in {figures['compile_s']} s; "
                                 f"embedded: {sass if sass is not None else figures['embedded']}")


if __name__ == "__main__":
    sys.exit(run_step("build", body, parser("build", __doc__)))
