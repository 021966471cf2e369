import pytest
import torch

from megatron_zpp.compression import ops
from megatron_zpp.testing.spawn import preload_rank_modules

if not torch.cuda.is_available():
    # Multi-process tests fork their ranks from one server that imported these once: four ranks importing
    # megatron.core cost ~30 s per test on a 2-core machine, forked ones well under a second. The server starts
    # here, so the preloaded modules see the session's environment; a rank still gets the test's environment,
    # directory, output and a fresh seed (megatron_zpp/testing/spawn.py).
    preload_rank_modules(["torch.distributed", "megatron.core", "megatron.core.models.gpt",
                          "megatron_zpp.megatron", "megatron_zpp.training.trainer"])

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
