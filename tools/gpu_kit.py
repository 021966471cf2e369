"""Builds the offline GPU kit (``make gpu-kit``): everything a bare GPU machine without network needs
beyond its preinstalled torch, in one folder (default ``.gpukit/``, git-ignored).

Target: Python 3.12, Linux x86_64 (manylinux), an image such as NGC's PyTorch container with
torch 2.11+cu130 and no megatron-core, zfpy, zstandard or einops. The kit holds

- ``megatron_zpp-<version>.tar.gz``: the sdist (with ``csrc/``), so that the machine builds the
  extension, CUDA kernels included, against *its* torch (``pip install --no-build-isolation``);
- wheels of the runtime dependencies that such an image lacks (``RUNTIME``), each downloaded for
  that platform with ``--no-deps`` so that no torch or nvidia-* wheel is ever pulled;
- ``requirements.txt``: the files to install, all with ``--no-deps``;
- ``manifest.json``: the same with sizes, sha256, the target and the install commands
  (tools/gpu_check.py reads it); ``README.md``: how to install by hand.

The total must stay within ``--max-mib`` (60): the target fails listing every file's size otherwise.
wandb (about 25 MiB with its dependencies) is left out: W&B logging is optional (training/log.py
imports it lazily). So is nvcc: the pip wheels for CUDA 13.0 (nvidia-cuda-nvcc 35.7 MiB, nvidia-nvvm
58.7 MiB, nvidia-cuda-crt 0.1 MiB) would not fit, and CUDA images (NGC) ship the full toolkit.

    python tools/gpu_kit.py [--out .gpukit] [--python-version 3.12] [--max-mib 60]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What the package and megatron.core / megatron.training import at run time that a torch image may lack.
# Ranges as in pyproject.toml; pip picks the newest matching wheel for the target Python.
RUNTIME = (
    "megatron-core>=0.16,<0.20",
    "numpy>=1.26",
    "packaging>=24.2",  # megatron-core's own dependency
    "pyyaml>=6",
    "zfpy==1.0.1",  # 1.0.1.post0 breaks numcodecs' version parsing (shared/notes/codecs.md)
    "zstandard>=0.23",
    "einops>=0.8",
    "psutil>=5.9",
    "ninja",  # torch's BuildExtension compiles in parallel with it (the extension build takes minutes without)
)
# Only for an isolated build of the sdist (no torch: a pure-Python install whose CPU kernels JIT-build);
# the GPU path installs with --no-build-isolation and uses the machine's setuptools.
BUILD = ("setuptools>=70.1",)
# Wheels built for glibc >= 2.17 up to 2.34 (NGC images are Ubuntu 22.04/24.04: glibc 2.35/2.39).
PLATFORMS = ("manylinux2014_x86_64",) + tuple(f"manylinux_2_{v}_x86_64" for v in (17, 24, 27, 28, 31, 34))

INSTALL_DOC = """# megatron_zpp offline GPU kit

Built by `make gpu-kit` ({built}) for Python {python}, Linux x86_64 (manylinux, glibc >= 2.17 .. 2.34).
It never contains torch: install into the environment that has the machine's CUDA torch, always with
`--no-deps` and `--no-index`, and build megatron_zpp with `--no-build-isolation` so that its kernels are
compiled against that torch:

    pip install --no-index --no-deps --find-links .gpukit -r .gpukit/requirements.txt
    pip install --no-index --no-deps --no-build-isolation --find-links .gpukit megatron_zpp

The second line compiles the C++ kernels, and the CUDA kernels when a CUDA toolkit whose major version
matches `torch.version.cuda` is found (CUDA_HOME or nvcc on PATH; NGC images have one). Set
`ZPP_BUILD_CUDA=1` to fail instead of falling back to a CPU-only build, and `TORCH_CUDA_ARCH_LIST`
(e.g. `9.0`) to compile for fewer architectures than the visible GPUs' (the default). Check with
`python -c "from megatron_zpp.compression import _extension as e; print(e.has_cuda_kernels())"`.

Files (sizes in MiB, total {total:.1f} MiB):
{files}
"""


def _run(cmd: list[str], quiet: bool = False) -> None:
    print("+", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=quiet, text=True)
    if out.returncode != 0:
        raise SystemExit(f"failed ({out.returncode}): {' '.join(cmd)}\n{(out.stdout or '')[-3000:]}{(out.stderr or '')[-3000:]}")


def build_sdist(out: Path) -> Path:
    """The sdist, built without isolation (no network for build requirements; torch is not needed)."""
    before = set(out.glob("megatron_zpp-*.tar.gz"))
    _run([sys.executable, "-c", "from setuptools import build_meta; "
          f"print(build_meta.build_sdist({str(out)!r}))"], quiet=True)  # setuptools lists every file
    new = sorted(set(out.glob("megatron_zpp-*.tar.gz")) - before) or sorted(out.glob("megatron_zpp-*.tar.gz"))
    if not new:
        raise SystemExit(f"no megatron_zpp sdist appeared in {out}")
    return new[-1]


def download(requirements: tuple[str, ...], out: Path, python_version: str) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
          "--only-binary=:all:", *platforms, "--python-version", python_version, "--implementation", "cp",
          "-d", str(out), *requirements])


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path, python_version: str, max_mib: float) -> dict:
    t0 = time.perf_counter()
    out = out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        sdist_dir = Path(tmp)
        sdist = build_sdist(sdist_dir)
        shutil.copy2(sdist, out / sdist.name)
    sdist = out / sdist.name
    download(RUNTIME, out, python_version)
    runtime_files = sorted(p.name for p in out.glob("*.whl"))
    build_dir = out / "build"
    build_dir.mkdir()
    download(BUILD, build_dir, python_version)

    files = sorted(p for p in out.rglob("*") if p.is_file())
    sizes = {str(p.relative_to(out)): p.stat().st_size for p in files}
    total = sum(sizes.values())
    table = "\n".join(f"  {size / 2**20:8.2f}  {name}" for name, size in sorted(sizes.items(), key=lambda kv: -kv[1]))
    if total > max_mib * 2**20:
        raise SystemExit(f"the GPU kit is {total / 2**20:.1f} MiB, over the {max_mib:g} MiB limit:\n{table}")

    # Requirement lines are the ranges, not file names: pip then keeps whatever the machine already has
    # in range (an image's numpy, packaging) and installs the kit's wheel only where it is missing.
    (out / "requirements.txt").write_text(
        "# install with: pip install --no-index --no-deps --find-links .gpukit -r .gpukit/requirements.txt\n"
        "# (never torch: the machine's own torch stays; --no-deps keeps pip from reaching for it)\n"
        + "".join(f"{spec}\n" for spec in RUNTIME))
    manifest = {
        "schema": 1,
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": {"python": python_version, "platforms": list(PLATFORMS),
                   "torch": "preinstalled on the machine (never in the kit)"},
        "package": {"file": sdist.name, "kind": "sdist", "includes_csrc": True},
        "runtime": runtime_files,
        "requirements": list(RUNTIME),
        "build_fallback": sorted(str(p.relative_to(out)) for p in build_dir.glob("*.whl")),
        "install": [
            "pip install --no-index --no-deps --find-links {kit} -r {kit}/requirements.txt",
            "pip install --no-index --no-deps --no-build-isolation --find-links {kit} megatron_zpp",
        ],
        "env": {"ZPP_BUILD_CUDA": "1 to require the CUDA kernels (fails clearly on a toolkit/torch CUDA mismatch)",
                "TORCH_CUDA_ARCH_LIST": "optional; default: the visible GPUs' compute capabilities"},
        "files": {name: {"bytes": size, "sha256": _sha256(out / name)} for name, size in sizes.items()},
        "total_bytes": total,
        "max_bytes": int(max_mib * 2**20),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "README.md").write_text(INSTALL_DOC.format(built=manifest["built"], python=python_version,
                                                      total=total / 2**20, files=table))
    print(table)
    print(f"GPU kit OK: {len(files)} files, {total / 2**20:.1f} MiB (limit {max_mib:g}) in "
          f"{time.perf_counter() - t0:.0f}s -> {out}")
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".gpukit")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    ap.add_argument("--max-mib", type=float, default=60.0, help="fail when the kit is larger (default 60)")
    args = ap.parse_args()
    build(args.out, args.python_version, args.max_mib)


if __name__ == "__main__":
    main()
