"""Builds megatron_zpp and its kernel extension ``megatron_zpp._C``.

CPU kernels always; CUDA kernels too when ``ZPP_BUILD_CUDA=1`` or when a CUDA
toolkit is found and ``ZPP_BUILD_CUDA`` is not ``0``. The build is portable (no
``-march=native``; the CPU loops carry per-instruction-set copies chosen at run
time, see ``csrc/cpu/quant_cpu.cpp``), so one install can serve a login node
and compute nodes with different CPUs. Needs torch at build time:
install with ``pip install --no-build-isolation -e .`` (the Makefile does).
Package metadata and dependency pins live in pyproject.toml.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _build_flags():
    """Loads ``megatron_zpp/compression/_extension.py`` by path: importing the package would import
    its codecs and their dependencies (numpy, ...), which a fresh venv does not have yet when pip
    asks this file for metadata."""
    spec = importlib.util.spec_from_file_location(
        "_zpp_build_flags", ROOT / "megatron_zpp" / "compression" / "_extension.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def extensions():
    try:
        from torch.utils import cpp_extension
    except ImportError:  # metadata-only invocations (e.g. an sdist without torch)
        return [], {}
    flags = _build_flags()
    CPU_CFLAGS, NVCC_FLAGS = flags.CPU_CFLAGS, flags.NVCC_FLAGS

    sources = ["csrc/ops_registration.cpp", "csrc/cpu/quant_cpu.cpp", "csrc/cpu/mpc_cpu.cpp", "csrc/cpu/zfp_cpu.cpp"]
    include_dirs = [str(ROOT / "csrc" / "include")]
    want_cuda = os.environ.get("ZPP_BUILD_CUDA")
    if want_cuda == "1" or (want_cuda != "0" and cpp_extension.CUDA_HOME is not None):
        ext = cpp_extension.CUDAExtension(
            "megatron_zpp._C",
            sources + ["csrc/cuda/quant_cuda_binding.cpp", "csrc/cuda/quant_kernels.cu",
                       "csrc/cuda/mpc_cuda_binding.cpp", "csrc/cuda/mpc_kernels.cu",
                       "csrc/cuda/zfp_cuda_binding.cpp", "csrc/cuda/zfp_kernels.cu"],
            include_dirs=include_dirs,
            extra_compile_args={"cxx": CPU_CFLAGS + ["-DZPP_WITH_CUDA"], "nvcc": NVCC_FLAGS},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = cpp_extension.CppExtension(
            "megatron_zpp._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": CPU_CFLAGS},
            extra_link_args=["-fopenmp"],
        )
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
