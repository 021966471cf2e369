"""The Walsh-Hadamard smoothing of SDP4Bit's inter-node gradients (issue 23, item 2): the reference's
definition (quant_math.h ``hadamard_run``), its inverse, and what it buys a 4-bit quantizer on outliers."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_zpp.compression import layout
from megatron_zpp.compression.reference import _dequantize_matrix, _quantize_matrix, hadamard_rows


def _sylvester(h: int) -> torch.Tensor:
    m = torch.ones(1, 1, dtype=torch.float64)
    while m.shape[0] < h:
        m = torch.cat((torch.cat((m, m), 1), torch.cat((m, -m), 1)), 0)
    return m


@pytest.mark.parametrize("h", [2, 4, 32, 128])
def test_hadamard_is_the_normalized_sylvester_transform_and_its_own_inverse(h):
    g = torch.Generator().manual_seed(h)
    x = torch.randn(3, 5 * h + h // 2 + 1, generator=g)  # a partial last run
    y = hadamard_rows(x, h)
    full = (x.shape[1] // h) * h
    dense = (x[:, :full].double().reshape(3, -1, h) @ _sylvester(h) / math.sqrt(h)).reshape(3, full)
    # fp32 butterflies: log2(h) additions, each within half an ulp of its partial sum, plus the scale
    tolerance = (math.log2(h) + 1) * 2.0**-23 * x.abs().max().item() * math.sqrt(h)
    assert (y[:, :full].double() - dense).abs().max().item() <= tolerance
    assert torch.equal(y[:, full:], x[:, full:])  # the partial run is left as it is
    back = hadamard_rows(y, h)
    assert (back - x).abs().max().item() <= 2 * tolerance
    # orthogonal: the norm of each full run is kept (up to rounding)
    norms = y[:, :full].reshape(3, -1, h).double().norm(dim=-1) / x[:, :full].reshape(3, -1, h).double().norm(dim=-1)
    assert (norms - 1).abs().max().item() < 1e-5


def test_hadamard_scale_is_fp32_one_over_root_h():
    for log2h in range(1, 13):
        h = 1 << log2h
        scale = layout.hadamard_scale(h)
        assert scale == torch.tensor(1 / math.sqrt(h), dtype=torch.float32).item(), h
    for bad, block in ((3, 128), (256, 128), (0.5, 128), (1, 8), (8192, 8192)):
        if bad == 0:
            continue
        with pytest.raises(ValueError, match="hadamard="):
            layout.check_hadamard(bad, block)
    layout.check_hadamard(0, 128)
    layout.check_hadamard(32, 128)


def _int4_error(x: torch.Tensor, hadamard: int) -> float:
    """Relative L2 error of an INT4/128 round trip, with the rotation before and after when ``hadamard``."""
    n = x.shape[1]
    rotate = (lambda v: hadamard_rows(v, hadamard)) if hadamard else (lambda v: v)
    y = rotate(_dequantize_matrix(_quantize_matrix(rotate(x), 4, 128, False, 0), n, 4, 128))
    return ((y - x).norm() / x.norm()).item()


def test_hadamard_makes_int4_error_independent_of_the_tails():
    """Heavy tails (a Student-t with 3 degrees of freedom, gradient-like normal x log-uniform magnitudes, rare
    large channels) set the block scale from a few large values and round the rest coarsely; the rotation
    spreads them over their run, so INT4's error falls to about a Gaussian's, which it leaves as it is."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 15
    normal = torch.randn(1, n, generator=g)
    tails = {
        "student-t3": normal / torch.sqrt(torch.randn(3, n, generator=g).pow(2).mean(0, keepdim=True)),
        "log-uniform magnitudes": torch.randn(1, n, generator=g) * torch.exp(4 * torch.rand(1, n, generator=g) - 2),
        "outlier channels": torch.randn(1, n, generator=g) * torch.where(torch.arange(n) % 97 == 0, 20.0, 1.0),
    }
    gaussian = (_int4_error(normal, 0), _int4_error(normal, 32))
    print(f"\nINT4/128 relative L2 error, plain vs Hadamard 32: normal {gaussian[0]:.4f} vs {gaussian[1]:.4f}")
    assert gaussian[1] <= 1.02 * gaussian[0]
    for name, x in tails.items():
        plain, rotated = _int4_error(x, 0), _int4_error(x, 32)
        print(f"  {name}: {plain:.4f} vs {rotated:.4f}")
        assert rotated < 0.75 * plain, name
        assert rotated < 1.1 * gaussian[0], name
