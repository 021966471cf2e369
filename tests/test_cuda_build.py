"""The CUDA sources compile for sm_80 and sm_90 (no GPU needed: nvcc from the pinned pip package)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_cuda_sources_compile_for_sm80_and_sm90(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import cuda_build

        cuda_build.cuda_root()
    except (ImportError, SystemExit) as exc:
        pytest.skip(f"no nvcc: {exc}")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "cuda_build.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CUDA compile OK: kernels for sm_80, sm_90" in proc.stdout
    for name in ("quant_kernels", "quant_cuda_binding", "mpc_kernels", "mpc_cuda_binding", "zfp_kernels", "zfp_cuda_binding"):
        assert (tmp_path / f"{name}.o").stat().st_size > 0, name
