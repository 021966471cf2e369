"""Finds the compiled ``torch.ops.megatron_zpp`` kernels, building the CPU ones on first use if needed.

Order: the extension built by ``pip install`` (``megatron_zpp._C``), else a JIT
build of ``csrc/`` cached under ``$ZPP_EXTENSION_DIR`` (default
``~/.cache/megatron_zpp``), else nothing: the ops then use the pure-PyTorch
reference with a warning on CPU and raise on CUDA (``ops.py``); ``load_error()``
says why. ``ZPP_JIT=0`` disables the JIT build (e.g. where no compiler is
installed). The JIT build has CPU kernels only; CUDA kernels come from
``pip install --no-build-isolation .`` with a CUDA toolkit matching torch's CUDA
(``ZPP_BUILD_CUDA=1`` to insist). The nvcc flags (architectures, PTX) are computed
here too, for setup.py and tools/cuda_build.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import warnings
from pathlib import Path

import torch

_PACKAGE = Path(__file__).resolve().parents[1]
# A source checkout (editable install) has csrc/ beside the package; an installed wheel carries a copy as
# megatron_zpp/_csrc (setup.py's build_py), which is what a pure-Python wheel JIT-builds from.
_CSRC = next((p for p in (_PACKAGE.parent / "csrc", _PACKAGE / "_csrc") if (p / "ops_registration.cpp").exists()),
             _PACKAGE.parent / "csrc")

# -ffp-contract=off: an FMA would round differently from the reference's
# separate multiply and add (bit-exactness is tested). No -march: the build must
# run on every CPU of its architecture (a login node and the compute nodes may
# differ); on x86-64 quant_cpu.cpp compiles its loops for x86-64-v3 (AVX2) and
# x86-64-v4 (AVX-512) too and picks the best the CPU has at run time.
CPU_CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-std=c++20"]

# ZPP_SANITIZE=address,undefined (any of SANITIZERS, comma-separated) builds the CPU kernels with those
# sanitizers, for tools/sanitize.py (docs/reliability/heap-corruption.md). Such a build only loads into a
# process that preloads the sanitizer runtimes (LD_PRELOAD=$(gcc -print-file-name=libasan.so)), since the
# Python interpreter itself is not instrumented; never install it for ordinary use.
SANITIZERS = ("address", "undefined", "leak", "thread")


def sanitizer_flags(value: str | None) -> list[str]:
    """Compiler and linker flags for ``ZPP_SANITIZE``: none when it is unset or empty. Raises SystemExit
    naming the bad entry and the valid choices (setup.py's error must be readable, not a traceback)."""
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    if not names:
        return []
    bad = [n for n in names if n not in SANITIZERS]
    if bad:
        raise SystemExit(f"ZPP_SANITIZE={value!r}: unknown sanitizer {bad[0]!r}; choose from {', '.join(SANITIZERS)} "
                         "(comma-separated, e.g. ZPP_SANITIZE=address,undefined)")
    if "thread" in names and ("address" in names or "leak" in names):
        raise SystemExit(f"ZPP_SANITIZE={value!r}: 'thread' cannot be combined with 'address' or 'leak'")
    # -g and frame pointers: readable stacks in the reports. -fno-sanitize-recover: UBSan aborts at the
    # first report like ASan does, so a test cannot pass over undefined behaviour.
    return [f"-fsanitize={','.join(names)}", "-fno-omit-frame-pointer", "-g"] + \
        (["-fno-sanitize-recover=undefined"] if "undefined" in names else [])


# --fmad=false backs up the explicit _rn intrinsics: device code must not contract multiply+add either.
NVCC_BASE_FLAGS = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "--fmad=false"]

# Without TORCH_CUDA_ARCH_LIST or a visible GPU at build time: Ampere (A100), Hopper (H100/H200),
# Blackwell data-centre (B200, sm_100) and Blackwell consumer/workstation (sm_120), plus PTX of the newest
# so that later GPUs JIT-compile it. The kernels use bf16 arithmetic, hence nothing before 8.0.
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0;12.0"
MIN_CUDA_ARCH = (8, 0)
# Torch's names for arch groups (TORCH_CUDA_ARCH_LIST accepts them), from 8.0 on.
_NAMED_ARCHS = {"ampere": "8.0;8.6", "ada": "8.9", "hopper": "9.0", "blackwell": "10.0;12.0"}
_ARCH_RE = re.compile(r"^(\d+)\.(\d)([af]?)(\+ptx)?$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True, order=True)
class CudaArch:
    """One compute capability to compile for: ``major.minor`` plus nvcc's arch-specific suffix (``a``,
    ``f``, or none) and whether its PTX is embedded as well as its machine code."""

    major: int
    minor: int
    suffix: str = ""
    ptx: bool = False

    @property
    def code(self) -> str:  # "90a", "100", "120"
        return f"{self.major}{self.minor}{self.suffix}"

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{self.suffix}" + ("+PTX" if self.ptx else "")


def parse_cuda_arch_list(text: str, *, source: str = "TORCH_CUDA_ARCH_LIST") -> list[CudaArch]:
    """Parses a ``TORCH_CUDA_ARCH_LIST``-style string ("8.0;9.0+PTX", "9.0a 10.0", "Hopper"), separated by
    ``;``, spaces or commas. Raises ValueError naming the bad entry and the accepted forms."""
    archs: list[CudaArch] = []
    for item in re.split(r"[;,\s]+", text.strip()):
        if not item:
            continue
        named = _NAMED_ARCHS.get(item.lower().removesuffix("+ptx"))
        if named is not None:
            parsed = parse_cuda_arch_list(named, source=source)
            if item.lower().endswith("+ptx"):
                parsed[-1] = dataclasses.replace(parsed[-1], ptx=True)
            archs += parsed
            continue
        match = _ARCH_RE.match(item)
        if match is None:
            raise ValueError(
                f"{source}={text!r}: cannot read {item!r}; give compute capabilities like '8.0;9.0;10.0+PTX' "
                f"(major.minor, optional 'a'/'f' suffix, optional '+PTX') or one of "
                f"{sorted(n.capitalize() for n in _NAMED_ARCHS)}")
        arch = CudaArch(int(match[1]), int(match[2]), match[3].lower(), match[4] is not None)
        if (arch.major, arch.minor) < MIN_CUDA_ARCH:
            raise ValueError(f"{source}={text!r}: {item!r} is older than the kernels support (they need compute "
                             f"capability >= {MIN_CUDA_ARCH[0]}.{MIN_CUDA_ARCH[1]} for bf16 arithmetic)")
        archs.append(arch)
    if not archs:
        raise ValueError(f"{source}={text!r} names no architecture; e.g. '8.0;9.0;10.0+PTX'")
    return archs


def _device_arch_list() -> str | None:
    """The visible GPUs' compute capabilities ("9.0;9.0"), None without a usable GPU."""
    try:
        if not torch.cuda.is_available():
            return None
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    except Exception:  # a driver that cannot initialise: build for the defaults instead
        return None
    return ";".join(f"{major}.{minor}" for major, minor in sorted(caps)) or None


def cuda_arch_list(env: dict[str, str] | None = None, device_archs: str | None = "detect") -> list[CudaArch]:
    """The architectures to build the CUDA kernels for: ``TORCH_CUDA_ARCH_LIST`` when set, else the visible
    GPUs' (at build time), else ``DEFAULT_CUDA_ARCHS``. Sorted, duplicates merged, and the newest always
    carries PTX so that a GPU newer than every listed one still runs the kernels (JIT from PTX) instead of
    failing with "no kernel image is available". ``device_archs``: "detect" asks torch; tests pass a string
    or None."""
    env = os.environ if env is None else env
    if env.get("TORCH_CUDA_ARCH_LIST", "").strip():
        archs = parse_cuda_arch_list(env["TORCH_CUDA_ARCH_LIST"])
    else:
        found = _device_arch_list() if device_archs == "detect" else device_archs
        archs = parse_cuda_arch_list(found, source="the visible GPUs") if found else \
            parse_cuda_arch_list(DEFAULT_CUDA_ARCHS, source="DEFAULT_CUDA_ARCHS")
    merged: dict[tuple[int, int, str], CudaArch] = {}
    for arch in archs:
        key = (arch.major, arch.minor, arch.suffix)
        merged[key] = dataclasses.replace(arch, ptx=arch.ptx or (key in merged and merged[key].ptx))
    archs = sorted(merged.values())
    newest = max(archs, key=lambda a: (a.major, a.minor))
    return [dataclasses.replace(a, ptx=True) if a == newest else a for a in archs]


def nvcc_arch_flags(archs: list[CudaArch]) -> list[str]:
    """``-gencode`` flags: machine code for each arch, plus PTX where asked. PTX is generated for the
    family-portable target (``compute_90`` for "9.0a"): arch-specific PTX would not run on a later GPU.
    Passing any -gencode makes torch's BuildExtension skip its own TORCH_CUDA_ARCH_LIST handling, which is
    why this reads that variable itself."""
    flags = [f"-gencode=arch=compute_{a.code},code=sm_{a.code}" for a in archs]
    for a in archs:
        if a.ptx:
            flags.append(f"-gencode=arch=compute_{a.major}{a.minor},code=compute_{a.major}{a.minor}")
    return list(dict.fromkeys(flags))


def nvcc_flags(archs: list[CudaArch] | None = None) -> list[str]:
    """All nvcc flags for the kernels; ``archs`` defaults to ``cuda_arch_list()``."""
    return NVCC_BASE_FLAGS + nvcc_arch_flags(cuda_arch_list() if archs is None else archs)


def _cuda_major(version: str | None) -> int | None:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return None


def nvcc_version(cuda_home: str | os.PathLike) -> str | None:
    """``release X.Y`` of ``<cuda_home>/bin/nvcc --version``; None where it does not run or says no release."""
    nvcc = Path(cuda_home) / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match[1] if match else None


@dataclasses.dataclass(frozen=True)
class CudaBuildDecision:
    build_cuda: bool
    warning: str | None = None  # printed once by setup.py when the CUDA part is left out


def decide_cuda_build(zpp_build_cuda: str | None, cuda_home: str | None, torch_cuda: str | None,
                      toolkit_version: str | None) -> CudaBuildDecision:
    """Whether setup.py compiles the CUDA kernels. ``ZPP_BUILD_CUDA=0``: never. ``=1``: always, and a
    missing toolkit, a CPU-only torch or a toolkit whose major version differs from torch's CUDA fail
    here with the reason (nvcc would fail later, less clearly). Unset: when a toolkit is found whose major
    version matches torch's; otherwise a CPU-only build, with a warning when a toolkit was found but cannot
    serve (the install must not fail because of an unrelated system CUDA)."""
    if zpp_build_cuda not in (None, "", "0", "1"):
        raise SystemExit(f"ZPP_BUILD_CUDA={zpp_build_cuda!r}: use 1 (build the CUDA kernels), 0 (CPU only) "
                         f"or leave it unset (CUDA when a toolkit matching torch's CUDA is found)")
    if zpp_build_cuda == "0":
        return CudaBuildDecision(False)
    how = ("to build the CUDA kernels, point CUDA_HOME at a CUDA {want}.x toolkit (or `pip install "
           "nvidia-cuda-nvcc=={want}.*`) and reinstall with ZPP_BUILD_CUDA=1 pip install --no-build-isolation .")
    if cuda_home is None or torch_cuda is None:
        problem = ("no CUDA toolkit found (CUDA_HOME unset, no nvcc on PATH)" if cuda_home is None else
                   f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)")
        if zpp_build_cuda == "1":
            raise SystemExit(f"ZPP_BUILD_CUDA=1 but {problem}")
        return CudaBuildDecision(False)  # the ordinary CPU-only install: nothing to warn about
    want, have = _cuda_major(torch_cuda), _cuda_major(toolkit_version)
    if have is None or have != want:
        found = (f"the CUDA toolkit at {cuda_home} is {toolkit_version}" if toolkit_version else
                 f"the nvcc at {cuda_home}/bin/nvcc did not report a CUDA release")
        problem = f"{found} but torch {torch.__version__} was built with CUDA {torch_cuda}"
        if zpp_build_cuda == "1":
            raise SystemExit(f"ZPP_BUILD_CUDA=1 but {problem}: the major versions must match; "
                             + how.format(want=want))
        return CudaBuildDecision(False, f"megatron_zpp: building the CPU kernels only: {problem}; "
                                 + how.format(want=want))
    return CudaBuildDecision(True)


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
        sanitize = sanitizer_flags(os.environ.get("ZPP_SANITIZE"))
        if sanitize:  # never mixed with the cached ordinary build
            build_dir = build_dir.with_name(build_dir.name + "-sanitize-" + os.environ["ZPP_SANITIZE"].replace(",", "-"))
        build_dir.mkdir(parents=True, exist_ok=True)
        jit_load(
            name="megatron_zpp_C",
            sources=[str(p) for p in cpu_sources()],
            extra_include_paths=[str(p) for p in include_dirs()],
            extra_cflags=CPU_CFLAGS + sanitize,
            extra_ldflags=["-fopenmp"] + sanitize,
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
