"""Step ``env``: what the GPU check ran on (the report's environment section).

nvidia-smi's view of the GPUs, torch and its CUDA, the device's name, capability and memory, every
nvcc and compute-sanitizer found (CUDA_HOME, PATH, /usr/local/cuda, pip's nvidia packages), Python,
the CPU, and the versions of the packages the plugin needs. Runs anywhere (no GPU: the probe says so
and passes); fails only when torch cannot be imported.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from _common import REPO, StepOutcome, parser, run_step

PACKAGES = ("torch", "megatron-core", "zfpy", "zstandard", "einops", "numpy", "nvidia-nvcomp-cu13",
            "nvidia-nvcomp-cu12", "pytest", "setuptools", "ninja", "wandb", "transformer-engine", "apex")


def _run(cmd: list[str], timeout: float = 30) -> tuple[int, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, (proc.stdout + proc.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, f"{type(exc).__name__}: {exc}"


def _pip_nvidia_roots() -> list[Path]:
    """The bin/ parents of pip's CUDA packages (nvidia/cu13, nvidia/cuda_nvcc, ...)."""
    roots = []
    for entry in sys.path:
        base = Path(entry) / "nvidia"
        if base.is_dir():
            roots += [p for p in sorted(base.iterdir()) if (p / "bin").is_dir()]
    return roots


def find_tools(name: str) -> list[Path]:
    """Every executable called ``name`` in the usual places, best first: $CUDA_HOME, PATH,
    /usr/local/cuda*, pip's nvidia packages. Duplicates (same real path) once."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / name)
    which = shutil.which(name)
    if which:
        candidates.append(Path(which))
    candidates += [Path("/usr/local/cuda/bin") / name]
    candidates += sorted(Path("/usr/local").glob(f"cuda-*/bin/{name}"), reverse=True)
    candidates += [root / "bin" / name for root in _pip_nvidia_roots()]
    if name == "compute-sanitizer":  # its own folder in a toolkit
        candidates += [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "compute-sanitizer" / name]
        candidates += [root / "compute-sanitizer" / name for root in _pip_nvidia_roots()]
    seen, found = set(), []
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK) and c.resolve() not in seen:
            seen.add(c.resolve())
            found.append(c)
    return found


def nvcc_version(nvcc: Path) -> str | None:
    rc, text = _run([str(nvcc), "--version"])
    m = re.search(r"release (\d+\.\d+)", text)
    return m.group(1) if rc == 0 and m else None


def probe() -> dict:
    env: dict = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
                 "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "repo": str(REPO)}
    rc, text = _run(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    env["repo_commit"] = text if rc == 0 else None
    rc, text = _run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
    env["repo_dirty"] = bool(text) if rc == 0 else None
    smi = shutil.which("nvidia-smi")
    if smi:
        rc, text = _run([smi, "--query-gpu=name,driver_version,memory.total,compute_cap,pci.bus_id",
                         "--format=csv,noheader"])
        env["nvidia_smi"] = text if rc == 0 else f"nvidia-smi failed (exit {rc}): {text[-500:]}"
        rc, text = _run([smi])
        m = re.search(r"CUDA Version:\s*([\d.]+)", text)
        env["driver_cuda"] = m.group(1) if m else None
    else:
        env["nvidia_smi"] = "not found"
    try:
        import torch
    except ImportError as exc:
        raise StepOutcome("fail", f"torch cannot be imported ({exc}): the GPU check needs the image's CUDA torch",
                          figures=env)
    env.update(torch=torch.__version__, torch_cuda=torch.version.cuda, torch_file=torch.__file__,
               cuda_available=torch.cuda.is_available(), device_count=torch.cuda.device_count())
    try:  # a tuple in recent torch, an int in old ones
        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    except Exception as exc:  # noqa: BLE001  (a probe reports, it does not fail on this)
        env["nccl"] = f"unknown ({type(exc).__name__}: {exc})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0),
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                   device_memory_gib=round(props.total_memory / 2**30, 1), sm_count=props.multi_processor_count,
                   torch_arch_list=torch.cuda.get_arch_list())
    env["nvcc"] = [{"path": str(p), "version": nvcc_version(p)} for p in find_tools("nvcc")]
    env["compute_sanitizer"] = [str(p) for p in find_tools("compute-sanitizer")]
    env["cuobjdump"] = [str(p) for p in find_tools("cuobjdump")]
    env["CUDA_HOME"] = os.environ.get("CUDA_HOME")
    env["TORCH_CUDA_ARCH_LIST"] = os.environ.get("TORCH_CUDA_ARCH_LIST")
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    env["packages"] = versions
    try:  # where the plugin's kernels would load from now (before or after the build step)
        from megatron_zpp.compression import _extension

        env["zpp_kernels"] = {"cpu": _extension.load(), "cuda": _extension.has_cuda_kernels(),
                              "loaded_from": _extension.loaded_from(), "error": _extension.load_error()}
    except Exception as exc:  # noqa: BLE001  (a probe reports, it does not fail on this)
        env["zpp_kernels"] = {"error": f"{type(exc).__name__}: {exc}"}
    return env


def body(args):
    env = probe()
    where = env.get("device") or "no CUDA device"
    return "pass", env, [], f"torch {env['torch']} (CUDA {env['torch_cuda']}), {where}"


if __name__ == "__main__":
    sys.exit(run_step("env", body, parser("env", __doc__)))
