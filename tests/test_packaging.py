"""Packaging: what pip needs from setup.py on a fresh machine."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

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


def test_setup_metadata_without_runtime_dependencies():
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"setup.py --name failed without runtime dependencies:\n{out.stderr[-3000:]}"
    assert out.stdout.strip().splitlines()[-1] == "megatron_zpp", out.stdout
