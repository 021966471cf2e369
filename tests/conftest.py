import pytest
import torch

from megatron_zpp.compression import ops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def kernel_device(device):
    """A device whose compiled kernels exist; CPU ones must (they build on install or JIT)."""
    if device.type == "cuda" and not ops.kernels_available(device):
        pytest.skip("the extension was built without CUDA kernels (ZPP_BUILD_CUDA=1 builds them)")
    assert ops.kernels_available(device), "C++ CPU kernels failed to build; see the warning above"
    return device
