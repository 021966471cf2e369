"""Step ``kit``: install the offline kit (``make gpu-kit`` -> ``.gpukit/``) into a scratch folder.

    pip install --no-index --find-links KIT --no-deps --target SITE -r REQUIREMENTS

``--no-deps`` and the filter below keep the image's torch (and its CUDA libraries) untouched:
requirements naming torch, triton or an ``nvidia-*`` package are refused, and a package the image
already has in a version the requirement accepts is kept, not shadowed (``ZPP_GPU_CHECK_KIT_FORCE=1``
installs those too). megatron_zpp
itself is not installed from the kit: the check runs the repository's copy, whose CUDA extension
the ``build`` step compiles. The orchestrator puts SITE on every later step's PYTHONPATH.

Inputs (set by tools/gpu_check.py): ``ZPP_GPU_CHECK_KIT`` (the kit folder), ``ZPP_GPU_CHECK_SITE``
(the target folder; emptied first when it carries this step's marker). The requirements file is
the first of ``requirements.txt``, ``manifest.txt`` in the kit; without one, every wheel in it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from _common import StepOutcome, parser, run_step

MANIFESTS = ("requirements.txt", "manifest.txt")
MARKER = ".zpp_gpu_check_site"
#: What the image's torch owns: never installed from the kit.
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|pytorch-triton|nvidia-.*)$")
#: Imported by the later steps; checked after the install (``ZPP_GPU_CHECK_KIT_MODULES``, comma-separated,
#: replaces the list).
NEEDED_MODULES = tuple(m for m in os.environ.get("ZPP_GPU_CHECK_KIT_MODULES", "megatron.core,zfpy,zstandard,einops")
                       .split(",") if m)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str:
    """The distribution name of a requirement line or a wheel / sdist file name."""
    base = Path(line).name
    if base.endswith(".whl"):
        return _norm(base.split("-")[0])
    if base.endswith((".tar.gz", ".zip")):
        return _norm(re.split(r"-\d", base, maxsplit=1)[0])
    return _norm(re.split(r"[\s<>=!~;\[@]", line.strip(), maxsplit=1)[0])


def read_requirements(kit: Path) -> tuple[Path | None, list[str]]:
    for name in MANIFESTS:
        path = kit / name
        if path.is_file():
            lines = [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()]
            return path, [ln for ln in lines if ln and not ln.startswith("-")]
    return None, sorted(str(p) for p in kit.glob("*.whl"))


def satisfies(requirement: str, version: str) -> bool:
    """Whether an installed ``version`` meets the requirement line's specifier (True without one, or
    when ``packaging`` is missing: then the image's copy is kept, as for a bare name)."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:
        return True
    try:
        return Requirement(requirement).specifier.contains(version, prereleases=True)
    except InvalidRequirement:  # a file name, not a requirement
        return True


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def import_check(env: dict | None = None) -> tuple[dict[str, str], dict]:
    """Modules of NEEDED_MODULES that do not import in a fresh interpreter (with ``env``) and why, and
    the torch that interpreter would import (its version and file, found without importing it)."""
    code = ("import importlib, importlib.metadata, importlib.util, json\nbad = {}\n"
            f"for m in {list(NEEDED_MODULES)!r}:\n"
            "    try: importlib.import_module(m)\n"
            "    except Exception as e: bad[m] = f'{type(e).__name__}: {e}'\n"
            "spec = importlib.util.find_spec('torch')\n"
            "print(json.dumps({'bad': bad, 'torch': importlib.metadata.version('torch') if spec else None,\n"
            "                  'torch_file': spec.origin if spec else None}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        return {"(interpreter)": proc.stderr[-2000:]}, {}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["bad"], result


def body(args):
    kit = Path(os.environ.get("ZPP_GPU_CHECK_KIT", ".gpukit")).resolve()
    site = Path(os.environ.get("ZPP_GPU_CHECK_SITE", args.out / "site")).resolve()
    force = os.environ.get("ZPP_GPU_CHECK_KIT_FORCE") == "1"
    # SITE is on our PYTHONPATH already (the orchestrator's environment is the same for every step):
    # what an earlier run left there must not count as "the image has it".
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != site]
    torch_spec = importlib.util.find_spec("torch")  # found, not imported: this step needs no torch itself
    if torch_spec is None:
        raise StepOutcome("fail", "torch is not installed: the GPU check runs on an image that has its CUDA torch")
    torch_before = (importlib.metadata.version("torch"), torch_spec.origin)
    figures: dict = {"kit": str(kit), "site": str(site), "torch_before": torch_before[0]}
    if not kit.is_dir():
        base_env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != site))
        bad, _ = import_check(base_env)
        if not bad:
            raise StepOutcome("skipped", f"no kit at {kit}; the image already has {', '.join(NEEDED_MODULES)}",
                              figures)
        raise StepOutcome("fail", f"no kit at {kit}, and the image lacks {', '.join(bad)}. To fix: run `make gpu-kit` "
                          "on a machine with network and copy the .gpukit folder here (or pass --kit DIR)",
                          figures, [{"module": m, "error": e} for m, e in bad.items()])
    manifest, requirements = read_requirements(kit)
    figures["manifest"] = str(manifest) if manifest else "(none: every wheel in the kit)"
    rows, chosen = [], []
    for req in requirements:
        name = requirement_name(req)
        have = installed_version(name)
        if NEVER.match(name):
            action = "refused (the image's torch and CUDA libraries stay)"
        elif name == "megatron-zpp":
            action = "not installed (the repository's copy is used; the build step compiles its CUDA kernels)"
        elif have is not None and not force and satisfies(req, have):
            action = f"kept the image's {have}"
        else:
            action = "install"
            chosen.append(req)
        rows.append({"requirement": req, "name": name, "preinstalled": have, "action": action})
    if site.exists():
        if not (site / MARKER).exists() and any(site.iterdir()):
            raise StepOutcome("fail", f"{site} exists, is not empty and was not made by this step: refusing to "
                              "empty it; pass another --out", figures, rows)
        shutil.rmtree(site)
    site.mkdir(parents=True)
    (site / MARKER).write_text("made by tools/gpu_steps/kit.py; emptied on every run\n")
    if chosen:
        req_file = args.out / "kit-requirements.txt"
        req_file.parent.mkdir(parents=True, exist_ok=True)
        req_file.write_text("\n".join(chosen) + "\n")
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(kit), "--no-deps",
               "--no-build-isolation", "--target", str(site), "--disable-pip-version-check", "-r", str(req_file)]
        print("+", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, text=True, capture_output=True)
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", flush=True)
        if proc.returncode != 0:
            raise StepOutcome("fail", f"pip install from the kit failed (exit {proc.returncode}):\n"
                              f"{proc.stderr[-3000:]}", figures, rows)
    figures["installed"] = [r["name"] for r in rows if r["action"] == "install"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    bad, after = import_check(env)
    figures["torch_after"] = after.get("torch")
    if after.get("torch_file") and Path(after["torch_file"]).resolve().is_relative_to(site):
        raise StepOutcome("fail", f"torch now imports from the kit's folder ({after['torch_file']}): the kit must "
                          "not carry torch", figures, rows)
    if after.get("torch") not in (None, torch_before[0]):
        raise StepOutcome("fail", f"torch changed from {torch_before[0]} to {after.get('torch')}", figures, rows)
    if bad:
        return "fail", figures, rows, "after the install these still do not import: " + "; ".join(
            f"{m}: {e}" for m, e in bad.items())
    return "pass", figures, rows, (f"installed {len(figures['installed'])} packages into {site}; torch "
                                   f"{torch_before[0]} kept; {', '.join(NEEDED_MODULES)} import")


if __name__ == "__main__":
    sys.exit(run_step("kit", body, parser("kit", __doc__)))
