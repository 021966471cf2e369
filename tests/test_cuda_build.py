"""The CUDA architectures the kernels are built for (flag computation, on CPU), and the CUDA sources compile
for the default list (no GPU needed: nvcc from the pinned pip package)."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_zpp.compression._extension import DEFAULT_CUDA_ARCHS, cuda_arch_list, nvcc_arch_flags, parse_cuda_arch_list

ROOT = Path(__file__).resolve().parents[1]


def _flags(env_value: str | None, devices: str | None = None) -> list[str]:
    env = {} if env_value is None else {"TORCH_CUDA_ARCH_LIST": env_value}
    return nvcc_arch_flags(cuda_arch_list(env, device_archs=devices))


def gencode(arch: str, code: str) -> str:
    return f"-gencode=arch=compute_{arch},code={code}"


def test_default_covers_ampere_hopper_and_blackwell_with_ptx_for_the_newest():
    assert _flags(None) == [gencode("80", "sm_80"), gencode("90", "sm_90"), gencode("100", "sm_100"),
                            gencode("120", "sm_120"), gencode("120", "compute_120")]


def test_torch_cuda_arch_list_is_honoured_and_the_newest_gets_ptx():
    assert _flags("8.0;9.0+PTX") == [gencode("80", "sm_80"), gencode("90", "sm_90"), gencode("90", "compute_90")]
    # the newest gets PTX even when the list asks for none; the order of the list does not matter
    assert _flags("10.0 8.0") == [gencode("80", "sm_80"), gencode("100", "sm_100"), gencode("100", "compute_100")]
    # an explicit +PTX on an older one is kept too; duplicates merge
    assert _flags("8.0+PTX;9.0;9.0") == [gencode("80", "sm_80"), gencode("90", "sm_90"),
                                         gencode("80", "compute_80"), gencode("90", "compute_90")]


def test_arch_specific_targets_get_portable_ptx():
    # sm_90a machine code (Hopper-only features); the PTX is compute_90, which later GPUs can JIT
    assert _flags("9.0a") == [gencode("90a", "sm_90a"), gencode("90", "compute_90")]
    assert _flags("Hopper") == [gencode("90", "sm_90"), gencode("90", "compute_90")]


def test_visible_devices_are_used_when_the_variable_is_unset():
    assert _flags(None, devices="9.0;9.0") == [gencode("90", "sm_90"), gencode("90", "compute_90")]
    assert _flags("", devices="12.0") == [gencode("120", "sm_120"), gencode("120", "compute_120")]
    assert _flags("8.0", devices="12.0") == [gencode("80", "sm_80"), gencode("80", "compute_80")]  # the variable wins


@pytest.mark.parametrize("value, needle", [
    ("sm_90", "cannot read 'sm_90'"),
    ("9", "cannot read '9'"),
    ("9.0+ptx;foo", "cannot read 'foo'"),
    ("7.5", "'7.5' is older than the kernels support"),
    (";", "names no architecture"),
])
def test_bad_arch_lists_fail_naming_the_value(value, needle):
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST=") as info:
        parse_cuda_arch_list(value)
    assert needle in str(info.value), str(info.value)
    if "cannot read" in needle:
        assert "'8.0;9.0;10.0+PTX'" in str(info.value) and "Hopper" in str(info.value)  # the accepted forms


def test_cuda_sources_compile_for_the_oldest_and_newest_architectures(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import cuda_build

        cuda_build.cuda_root()
    except (ImportError, SystemExit) as exc:
        pytest.skip(f"no nvcc: {exc}")
    # The two ends of the default list (each architecture costs the suite about a minute; `make cuda-build`
    # compiles the whole default list), also on a machine with a GPU, whose capability would otherwise be the list.
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;12.0")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "cuda_build.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CUDA compile OK: kernels for sm_80, sm_120 + PTX compute_120" in proc.stdout
    for name in ("quant_kernels", "quant_cuda_binding", "mpc_kernels", "mpc_cuda_binding", "zfp_kernels", "zfp_cuda_binding"):
        assert (tmp_path / f"{name}.o").stat().st_size > 0, name
