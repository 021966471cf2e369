"""Compile-check the CUDA sources without a GPU (CI runs this).

Compiles the kernels ``csrc/cuda/*.cu`` (blocked quantization, MPC, ZFP) with ``nvcc``
for the same architectures that setup.py builds for (``cuda_arch_list()`` in
megatron_zpp/compression/_extension.py: ``TORCH_CUDA_ARCH_LIST``, else the visible GPUs,
else sm_80, sm_90, sm_100, sm_120 with PTX for compute_120) and their torch bindings
``csrc/cuda/*_binding.cpp`` with the host compiler against torch's and CUDA's
headers. Nothing is linked or
run. ``nvcc`` comes from the pip package ``nvidia-cuda-nvcc``, pinned in
pyproject.toml's ``cuda-compile`` extra to torch's CUDA version (a newer cicc
emits PTX that the older ptxas rejects).

    python tools/cuda_build.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_zpp.compression._extension import CPU_CFLAGS, cuda_arch_list, nvcc_flags  # noqa: E402

KERNELS = ("quant_kernels", "mpc_kernels", "zfp_kernels")  # csrc/cuda/<name>.cu
BINDINGS = ("quant_cuda_binding", "mpc_cuda_binding", "zfp_cuda_binding")  # csrc/cuda/<name>.cpp


def cuda_root() -> Path:
    """The pip CUDA tree (nvidia/cu13: bin/nvcc, include/), else a system toolkit."""
    import nvidia

    for base in map(Path, nvidia.__path__):
        for sub in sorted(base.glob("cu*")):
            if (sub / "bin" / "nvcc").exists():
                return sub
    nvcc = shutil.which("nvcc")
    if nvcc:
        return Path(nvcc).resolve().parents[1]
    raise SystemExit("nvcc not found: pip install -e '.[cuda-compile]' (pins nvidia-cuda-nvcc to torch's CUDA)")


def run(cmd: list[str]) -> float:
    """One compile; its output is printed after it ends, so parallel compiles' errors do not interleave."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print("+", " ".join(cmd), f"({time.perf_counter() - t0:.1f}s)\n" + proc.stdout, end="", flush=True)
    if proc.returncode:
        raise SystemExit(f"compile failed (exit {proc.returncode}): {cmd[-3]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="where to put the objects (default: a temp dir)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="zpp_cuda_"))
    out.mkdir(parents=True, exist_ok=True)

    from torch.utils.cpp_extension import include_paths

    root = cuda_root()
    nvcc = root / "bin" / "nvcc"
    includes = [f"-I{ROOT / 'csrc' / 'include'}", f"-I{root / 'include'}"]
    subprocess.run([str(nvcc), "--version"], check=True)
    archs = cuda_arch_list()
    # nvcc's own list of targets: an architecture it lacks fails here by name, not deep in a compile.
    known = set(subprocess.run([str(nvcc), "--list-gpu-code"], capture_output=True, text=True, check=True).stdout.split())
    missing = [str(a) for a in archs if f"sm_{a.major}{a.minor}" not in known]
    if missing:
        raise SystemExit(f"{nvcc} cannot compile for {', '.join(missing)} (it knows {' '.join(sorted(known))}); "
                         "set TORCH_CUDA_ARCH_LIST to a subset or use a newer nvcc")
    flags = nvcc_flags(archs)
    torch_includes = [f"-I{p}" for p in include_paths()]  # ATen/cuda headers live here too
    kernels = [[str(nvcc), *flags, *includes, "-c", str(ROOT / "csrc/cuda" / f"{name}.cu"), "-o", str(out / f"{name}.o")]
               for name in KERNELS]
    bindings = [["g++", *CPU_CFLAGS, "-fPIC", "-DZPP_WITH_CUDA", *includes, *torch_includes,
                 f"-I{sysconfig.get_paths()['include']}", "-c", str(ROOT / "csrc/cuda" / f"{name}.cpp"),
                 "-o", str(out / f"{name}.o")] for name in BINDINGS]
    # The compiles are independent: one per core (each is single-threaded).
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(len(os.sched_getaffinity(0)), len(kernels) + len(bindings)))) as pool:
        seconds = list(pool.map(run, kernels + bindings))
    t_kernels, t_binding = sum(seconds[:len(kernels)]), sum(seconds[len(kernels):])
    sass = ", ".join(f"sm_{a.code}" for a in archs)
    ptx = ", ".join(f"compute_{a.major}{a.minor}" for a in archs if a.ptx)
    print(f"CUDA compile OK: kernels for {sass} + PTX {ptx} ({t_kernels:.1f}s of compiling), torch bindings "
          f"({t_binding:.1f}s), {time.perf_counter() - t0:.1f}s wall -> {out}")


if __name__ == "__main__":
    main()
