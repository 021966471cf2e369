"""Builds megatron_zpp and its kernel extension ``megatron_zpp._C``.

CPU kernels always (when torch is importable at build time); CUDA kernels too when
``ZPP_BUILD_CUDA=1``, or when it is unset and a CUDA toolkit whose major version
matches torch's CUDA is found. A toolkit that does not match gives a CPU-only
build with one warning instead of a failed install (``ZPP_BUILD_CUDA=1`` makes
it an error); see ``decide_cuda_build`` in ``megatron_zpp/compression/_extension.py``.
The CUDA architectures come from ``TORCH_CUDA_ARCH_LIST``, else the visible GPUs,
else 8.0/9.0/10.0/12.0, with PTX for the newest (``cuda_arch_list`` there).

The build is portable (no ``-march=native``; the CPU loops carry per-instruction-set
copies chosen at run time, see ``csrc/cpu/quant_cpu.cpp``), so one install can serve
a login node and compute nodes with different CPUs. The kernels build against the
environment's torch: install with ``pip install --no-build-isolation .`` (the
Makefile does). An isolated build has no torch (pyproject.toml's build-system does
not pull one), so it yields a pure-Python package; its CPU kernels then JIT-build on
first use from the C++ sources that every wheel carries as ``megatron_zpp/_csrc``.
Package metadata and dependency ranges live in pyproject.toml.

``ZPP_SANITIZE=address,undefined`` (see ``sanitizer_flags`` in ``_extension.py``) builds the CPU kernels
with AddressSanitizer/UndefinedBehaviorSanitizer, for debugging only: ``tools/sanitize.py`` builds such a
copy out of place and runs tests with the sanitizer runtimes preloaded (docs/reliability/heap-corruption.md).
"""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _build_flags():
    """Loads ``megatron_zpp/compression/_extension.py`` by path: importing the package would import
    its codecs and their dependencies (numpy, ...), which a fresh venv does not have yet when pip
    asks this file for metadata."""
    spec = importlib.util.spec_from_file_location(
        "_zpp_build_flags", ROOT / "megatron_zpp" / "compression" / "_extension.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class BuildPyWithSources(build_py):
    """Copies ``csrc/`` into the built package as ``megatron_zpp/_csrc``, so that an installed wheel
    built without torch (pure Python) can still JIT-build its CPU kernels (compression/_extension.py)."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "megatron_zpp" / "_csrc"
        if (ROOT / "csrc").is_dir():
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(ROOT / "csrc", target, ignore=shutil.ignore_patterns("*.o", "*.so", "__pycache__"))


def extensions():
    try:
        from torch.utils import cpp_extension
    except ImportError:  # an isolated build or metadata-only invocation: pure Python, kernels JIT-build
        return []
    import torch

    flags = _build_flags()
    sources = ["csrc/ops_registration.cpp", "csrc/cpu/quant_cpu.cpp", "csrc/cpu/mpc_cpu.cpp", "csrc/cpu/zfp_cpu.cpp"]
    include_dirs = [str(ROOT / "csrc" / "include")]
    sanitize = flags.sanitizer_flags(os.environ.get("ZPP_SANITIZE"))
    cuda_home = cpp_extension.CUDA_HOME
    decision = flags.decide_cuda_build(os.environ.get("ZPP_BUILD_CUDA"), cuda_home, torch.version.cuda,
                                       flags.nvcc_version(cuda_home) if cuda_home else None)
    if decision.warning:
        print(f"WARNING: {decision.warning}", file=sys.stderr, flush=True)
    if decision.build_cuda:
        archs = flags.cuda_arch_list()
        print(f"megatron_zpp: CUDA kernels for {', '.join(map(str, archs))} (CUDA_HOME={cuda_home})",
              file=sys.stderr, flush=True)
        return [cpp_extension.CUDAExtension(
            "megatron_zpp._C",
            sources + ["csrc/cuda/quant_cuda_binding.cpp", "csrc/cuda/quant_kernels.cu",
                       "csrc/cuda/mpc_cuda_binding.cpp", "csrc/cuda/mpc_kernels.cu",
                       "csrc/cuda/zfp_cuda_binding.cpp", "csrc/cuda/zfp_kernels.cu"],
            include_dirs=include_dirs,
            extra_compile_args={"cxx": flags.CPU_CFLAGS + sanitize + ["-DZPP_WITH_CUDA"],
                                "nvcc": flags.nvcc_flags(archs)},
            extra_link_args=["-fopenmp"] + sanitize,
        )]
    return [cpp_extension.CppExtension(
        "megatron_zpp._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": flags.CPU_CFLAGS + sanitize},
        extra_link_args=["-fopenmp"] + sanitize,
    )]


ext_modules = extensions()
cmdclass = {"build_py": BuildPyWithSources}
if ext_modules:
    from torch.utils.cpp_extension import BuildExtension

    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)
setup(ext_modules=ext_modules, cmdclass=cmdclass)
