"""Finds the compiled ``torch.ops.megatron_zpp`` kernels, building the CPU ones on first use if needed.

Order: the extension built by ``pip install`` (``megatron_zpp._C``), else a JIT
build of ``csrc/`` cached under ``$ZPP_EXTENSION_DIR`` (default
``~/.cache/megatron_zpp``), else nothing: the ops then use the pure-PyTorch
reference with a warning on CPU and raise on CUDA (``ops.py``); ``load_error()``
says why. ``ZPP_JIT=0`` disables the JIT build (e.g. where no compiler is
installed). The JIT build has CPU kernels only; CUDA kernels come from
``ZPP_BUILD_CUDA=1 pip install --no-build-isolation -e .``.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

_CSRC = Path(__file__).resolve().parents[2] / "csrc"

# -ffp-contract=off: an FMA would round differently from the reference's
# separate multiply and add (bit-exactness is tested). No -march: the build must
# run on every CPU of its architecture (a login node and the compute nodes may
# differ); on x86-64 quant_cpu.cpp compiles its loops for x86-64-v3 (AVX2) and
# x86-64-v4 (AVX-512) too and picks the best the CPU has at run time.
CPU_CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-std=c++20"]

# Ampere (A100) and Hopper (H100/H200). --fmad=false backs up the explicit _rn
# intrinsics: device code must not contract multiply+add either.
CUDA_ARCHS = ("80", "90")
NVCC_FLAGS = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "--fmad=false"] + [
    f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS
]

_load_error: str | None = None
_loaded_from: str | None = None


def cpu_sources() -> list[Path]:
    return [_CSRC / "ops_registration.cpp", _CSRC / "cpu" / "quant_cpu.cpp", _CSRC / "cpu" / "mpc_cpu.cpp",
            _CSRC / "cpu" / "zfp_cpu.cpp"]


def include_dirs() -> list[Path]:
    return [_CSRC / "include"]


def _has_ops() -> bool:
    return hasattr(torch.ops, "megatron_zpp") and hasattr(torch.ops.megatron_zpp, "quantize_rows_")


@functools.cache
def load() -> bool:
    """Load the kernels once; True when ``torch.ops.megatron_zpp`` has CPU implementations."""
    global _load_error, _loaded_from
    try:
        import megatron_zpp._C  # noqa: F401  (registers the ops on import)

        _loaded_from = "megatron_zpp._C"
        return _has_ops()
    except ImportError as exc:
        _load_error = f"megatron_zpp._C is not built ({exc})"
    if os.environ.get("ZPP_JIT", "1") == "0":
        _load_error += "; ZPP_JIT=0 disables the JIT build"
        return False
    if not all(p.exists() for p in cpu_sources()):
        _load_error += f"; no C++ sources at {_CSRC} to JIT-build from"
        return False
    try:
        from torch.utils.cpp_extension import load as jit_load

        build_dir = Path(os.environ.get("ZPP_EXTENSION_DIR", Path.home() / ".cache" / "megatron_zpp"))
        build_dir = build_dir / f"torch{torch.__version__.split('+')[0]}"
        build_dir.mkdir(parents=True, exist_ok=True)
        jit_load(
            name="megatron_zpp_C",
            sources=[str(p) for p in cpu_sources()],
            extra_include_paths=[str(p) for p in include_dirs()],
            extra_cflags=CPU_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=os.environ.get("ZPP_JIT_VERBOSE") == "1",
        )
        _loaded_from = f"the CPU-only JIT build in {build_dir}"
        return _has_ops()
    except Exception as exc:  # compiler missing, headers missing, ...
        _load_error += f"; JIT build failed: {exc}"
        warnings.warn(f"megatron_zpp: the JIT build of the C++ kernels failed: {_load_error}", stacklevel=2)
        return False


def load_error() -> str | None:
    return _load_error


def loaded_from() -> str | None:
    """Where the loaded kernels came from (``megatron_zpp._C`` or the JIT build), None if none loaded."""
    return _loaded_from


def has_cuda_kernels() -> bool:
    """True when the extension was built with its CUDA implementations."""
    if not load():
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("megatron_zpp::quantize_rows_", "CUDA")
    except Exception:
        return False
