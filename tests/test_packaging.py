"""Packaging: what pip needs from setup.py on a fresh machine, the dependency ranges that keep an installed
torch, the CUDA-toolkit decision of setup.py, and the offline GPU kit (tools/gpu_kit.py)."""

import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from megatron_zpp.compression._extension import decide_cuda_build

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# pip runs setup.py for metadata before it installs the dependencies: the venv then has torch and setuptools
# only (the Makefile installs with --no-build-isolation). Runtime dependencies are blocked here, and the
# package itself must not be imported (its codecs import numpy, zfpy, ...).
_PROBE = """
import sys
for name in ("numpy", "yaml", "zfpy", "megatron", "megatron_zpp"):
    sys.modules[name] = None
sys.argv = ["setup.py", "--name"]
exec(compile(open("setup.py").read(), "setup.py", "exec"), {"__file__": "setup.py", "__name__": "__main__"})
"""


def _setup_name(env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)


def test_setup_metadata_without_runtime_dependencies():
    out = _setup_name()
    assert out.returncode == 0, f"setup.py --name failed without runtime dependencies:\n{out.stderr[-3000:]}"
    assert out.stdout.strip().splitlines()[-1] == "megatron_zpp", out.stdout


def _requirement(name: str, python: str = "3.12") -> Requirement:
    found = [r for r in map(Requirement, PYPROJECT["project"]["dependencies"])
             if r.name == name and (r.marker is None or r.marker.evaluate({"python_version": python}))]
    assert len(found) == 1, (name, python, found)
    return found[0]


def test_dependencies_are_tested_ranges_that_keep_an_installed_torch():
    torch_req = _requirement("torch")
    # the oldest (make test-oldest-torch), a CUDA image's local version, and the newest (make test)
    for ok in ("2.11.0", "2.11.0+cu130", "2.13.0", "2.15.0"):
        assert torch_req.specifier.contains(ok, prereleases=False), (str(torch_req), ok)
    for untested in ("2.10.0", "2.16.0"):
        assert not torch_req.specifier.contains(untested), (str(torch_req), untested)
    for version in ("0.16.1", "0.19.2"):
        assert _requirement("megatron-core").specifier.contains(version), version
    assert not _requirement("megatron-core").specifier.contains("0.20.0")
    assert _requirement("megatron-core", "3.11").specifier.contains("0.16.1")  # 0.17 on need Python 3.12
    assert not _requirement("megatron-core", "3.11").specifier.contains("0.17.1")
    # An isolated build must not install a second torch: the build system names none.
    build_requires = [Requirement(r).name for r in PYPROJECT["build-system"]["requires"]]
    assert "torch" not in build_requires, build_requires


@pytest.mark.skipif(not os.environ.get("ZPP_EXPECT_TORCH"),
                    reason="runs in `make test-oldest-torch`, which sets ZPP_EXPECT_TORCH to the torch it installed")
def test_installing_the_package_kept_the_environments_torch():
    """make test-oldest-torch installs torch 2.11 first, then this package with its dependencies
    (--no-build-isolation): pip must have kept that torch, and the oldest megatron-core with it."""
    expected = os.environ["ZPP_EXPECT_TORCH"]
    assert torch.__version__.split("+")[0].startswith(expected + "."), (torch.__version__, expected)
    assert metadata.version("torch").startswith(expected + "."), metadata.version("torch")
    if os.environ.get("ZPP_EXPECT_MCORE"):
        assert metadata.version("megatron-core").startswith(os.environ["ZPP_EXPECT_MCORE"] + ".")
    assert metadata.version("megatron_zpp")  # the package itself was installed by pip, not just on sys.path
    import megatron_zpp.compression._extension as ext

    assert ext.load() and ext.loaded_from() == "megatron_zpp._C", (ext.loaded_from(), ext.load_error())


# --- setup.py's CUDA decision --------------------------------------------------------------------------


def test_cuda_decision_from_the_toolkit_and_torch_versions():
    assert decide_cuda_build(None, "/usr/local/cuda", "13.0", "13.0").build_cuda
    assert decide_cuda_build(None, "/usr/local/cuda", "13.0", "13.2").build_cuda  # minor versions may differ
    assert not decide_cuda_build(None, None, "13.0", None).build_cuda
    assert decide_cuda_build(None, None, "13.0", None).warning is None  # no toolkit: the usual CPU install
    assert not decide_cuda_build(None, "/usr/local/cuda", None, "12.4").build_cuda  # a CPU-only torch
    assert not decide_cuda_build("0", "/usr/local/cuda", "13.0", "13.0").build_cuda
    mismatch = decide_cuda_build(None, "/opt/cuda-12", "13.0", "12.4")
    assert not mismatch.build_cuda
    assert "12.4" in mismatch.warning and "13.0" in mismatch.warning and "ZPP_BUILD_CUDA=1" in mismatch.warning
    with pytest.raises(SystemExit, match=r"ZPP_BUILD_CUDA=1 but the CUDA toolkit at /opt/cuda-12 is 12.4 .*13.0"):
        decide_cuda_build("1", "/opt/cuda-12", "13.0", "12.4")
    with pytest.raises(SystemExit, match="ZPP_BUILD_CUDA=1 but no CUDA toolkit found"):
        decide_cuda_build("1", None, "13.0", None)
    with pytest.raises(SystemExit, match="ZPP_BUILD_CUDA='yes': use 1 .*, 0 .* or leave it unset"):
        decide_cuda_build("yes", None, "13.0", None)


def _fake_cuda_home(tmp_path: Path, release: str) -> Path:
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(f"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.99'\n")
    nvcc.chmod(0o755)
    return nvcc.parents[1]


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU-only torch never builds CUDA kernels")
def test_setup_falls_back_to_cpu_on_a_toolkit_that_does_not_match_torch(tmp_path):
    """A system toolkit of another major version than torch's CUDA: setup.py plans a CPU-only build with
    one warning naming both versions (the install goes on); ZPP_BUILD_CUDA=1 turns it into an error.
    Nothing is compiled: setup.py --name only decides."""
    other = "12.4" if not torch.version.cuda.startswith("12.") else "11.8"
    cuda_home = _fake_cuda_home(tmp_path, other)
    env = {k: v for k, v in os.environ.items() if k not in ("ZPP_BUILD_CUDA", "TORCH_CUDA_ARCH_LIST")}
    env["CUDA_HOME"] = str(cuda_home)
    out = _setup_name(env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "megatron_zpp"
    warnings = [line for line in out.stderr.splitlines() if "building the CPU kernels only" in line]
    assert len(warnings) == 1, out.stderr
    assert f"is {other}" in warnings[0] and f"CUDA {torch.version.cuda}" in warnings[0], warnings[0]
    assert "ZPP_BUILD_CUDA=1" in warnings[0]

    out = _setup_name({**env, "ZPP_BUILD_CUDA": "1"})
    assert out.returncode != 0
    assert f"ZPP_BUILD_CUDA=1 but the CUDA toolkit at {cuda_home} is {other}" in out.stderr, out.stderr[-3000:]


# --- the offline GPU kit -------------------------------------------------------------------------------


def _torch_only_site(dest: Path) -> Path:
    """A folder with torch and its own requirements only (linked from this venv): what a bare CUDA image
    has, so that an import the kit does not cover fails here as it would there."""
    seen, todo = set(), ["torch"]
    dest.mkdir()
    while todo:
        name = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        site = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "bin")}:
            if (site / top).exists() and not (dest / top).exists():
                (dest / top).symlink_to(site / top)
    return dest


@pytest.mark.slow
def test_gpu_kit_installs_offline_into_a_clean_folder(tmp_path):
    """`make gpu-kit` (built here when absent; needs the network then) installs with --no-index --no-deps
    into a scratch folder, and the package, megatron.core and megatron.training import from there next to
    nothing but torch and torch's own requirements."""
    kit = Path(os.environ.get("ZPP_GPU_KIT", ROOT / ".gpukit"))
    if not (kit / "manifest.json").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_kit.py"), "--out", str(kit)], check=True,
                       timeout=900)
    import json

    manifest = json.loads((kit / "manifest.json").read_text())
    assert manifest["total_bytes"] <= 60 * 2**20, manifest["total_bytes"]
    assert not [f for f in manifest["files"] if f.startswith(("torch-", "nvidia_"))], manifest["files"]
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-index", "--no-deps",
           "--find-links", str(kit), "--find-links", str(kit / "build"), "--target", str(target)]
    # The package: an isolated (torch-less) build from the sdist, with setuptools from the kit. The GPU
    # machine instead builds it with --no-build-isolation against its torch (manifest["install"]).
    for args in (["-r", str(kit / "requirements.txt")], ["megatron_zpp"]):
        out = subprocess.run(pip + args, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    torch_site = _torch_only_site(tmp_path / "torch_only")
    probe = ("import importlib, json, pkgutil, torch, megatron_zpp, megatron.core, megatron.training\n"
             "from megatron_zpp.compression import _extension\n"
             "failed = {}\n"
             "for m in pkgutil.walk_packages(megatron_zpp.__path__, 'megatron_zpp.'):\n"
             "    try: importlib.import_module(m.name)\n"
             "    except Exception as exc: failed[m.name] = repr(exc)\n"
             "print(json.dumps({'zpp': megatron_zpp.__file__, 'core': megatron.core.__file__,\n"
             "    'training': megatron.training.__file__, 'torch': torch.__version__,\n"
             "    'csrc': str(_extension._CSRC), 'failed': failed}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=f"{target}{os.pathsep}{torch_site}", ZPP_JIT="0")
    # -S: no site-packages, so nothing from this venv but the torch closure linked above is importable
    out = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("zpp", "core", "training", "csrc"):
        assert Path(found[key]).is_relative_to(target), (key, found[key])
    assert found["torch"] == torch.__version__
    assert found["failed"] == {}, found["failed"]
    assert (Path(found["csrc"]) / "cuda" / "quant_kernels.cu").exists()  # the JIT and CUDA sources came along
