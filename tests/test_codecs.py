"""The codec interface: specs, shapes/dtypes/sizes, error bounds, NaN/Inf, stochastic rounding."""

import math

import pytest
import torch

from megatron_zpp.compression import available_codecs, get_codec, layout, ops

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def device(device):
    """conftest's devices; a GPU only where the CUDA kernels are built (without them, encoding a CUDA
    tensor raises instead of silently running the slow reference: see tests/test_kernels.py)."""
    if device.type == "cuda" and not ops.kernels_available(device):
        pytest.skip("the extension was built without CUDA kernels (ZPP_BUILD_CUDA=1 builds them)")
    return device
QUANT_SPECS = ["int8:block=256", "int4:block=128", "int8:block=64", "int4:block=32,rounding=stochastic"]


def eps(dtype):
    return torch.finfo(dtype).eps


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-element absmax of its block (the last partial block padded with zeros)."""
    xf = x.detach().float().reshape(-1)
    n = xf.numel()
    nb = layout.num_blocks(n, block)
    padded = torch.nn.functional.pad(xf, (0, nb * block - n)).view(nb, block)
    return padded.abs().amax(1).repeat_interleave(block)[:n]


def error_bound(x: torch.Tensor, codec) -> torch.Tensor:
    """Per-element bound derived from the codec: |x - y| <= absmax/(2 qmax) for round-to-nearest
    (absmax/qmax for stochastic: floor(v+u) is within one step), plus fp32 rounding of the
    scale, of x/scale and of q*scale (each <= 2^-24 relative, O(qmax) of them in units of the scale),
    plus the final rounding to the output dtype."""
    absmax = block_absmax(x, codec.block)
    step = absmax / codec.qmax
    quant = step if codec.stochastic else step / 2
    fp32_ops = absmax * 4 * 2.0**-24
    out_rounding = absmax * (1 + 1 / codec.qmax) * eps(x.dtype) / 2
    return quant + fp32_ops + out_rounding


@pytest.mark.parametrize("spec", QUANT_SPECS + ["none"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5), (1000,), (2, 3, 129)])
def test_roundtrip_shape_dtype_size(spec, dtype, shape, device):
    codec = get_codec(spec)
    x = (torch.randn(shape, device=device) * 3).to(dtype)
    packed = codec.encode(x)
    assert packed.payload.dtype == torch.uint8
    assert packed.payload.numel() == codec.wire_bytes(x.numel(), dtype)
    y = codec.decode(packed)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    if codec.lossless:
        assert torch.equal(y.reshape(-1).view(torch.uint8), x.reshape(-1).view(torch.uint8))
    else:
        err = (y.float() - x.float()).abs().reshape(-1)
        assert torch.all(err <= error_bound(x, codec)), f"max excess {(err - error_bound(x, codec)).max()}"


@pytest.mark.parametrize("spec,bits,block", [("int8:block=256", 8, 256), ("int4:block=128", 4, 128)])
@pytest.mark.parametrize("numel", [0, 1, 2, 255, 256, 257, 1001])
def test_wire_bytes_exact(spec, bits, block, numel):
    codec = get_codec(spec)
    data = math.ceil(numel * bits / 8)
    expected = 4 * math.ceil(numel / block) + 4 * math.ceil(data / 4)  # scales + data padded to 4 bytes
    assert codec.wire_bytes(numel) == expected
    assert codec.encode(torch.randn(numel)).payload.numel() == expected


def test_compression_ratios_on_a_large_bucket():
    n = 1 << 20
    assert get_codec("none").wire_bytes(n, torch.bfloat16) == 2 * n
    # bf16 -> INT8 with one fp32 scale per 256: (1 + 4/256) / 2 of the bf16 bytes
    assert get_codec("int8:block=256").wire_bytes(n) / (2 * n) == pytest.approx((1 + 4 / 256) / 2)
    assert get_codec("int4:block=128").wire_bytes(n) / (2 * n) == pytest.approx((0.5 + 4 / 128) / 2)


@pytest.mark.parametrize("spec", ["int8:block=256", "int4:block=128"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_error_at_most_half_a_step_for_nearest(spec, dtype, device):
    codec = get_codec(spec)
    g = torch.Generator().manual_seed(1)
    # heavy-tailed, several magnitudes, partial last block
    x = (torch.randn(10_007, generator=g) * torch.exp(torch.randn(10_007, generator=g) * 2)).to(dtype).to(device)
    y = codec.decode(codec.encode(x))
    err = (y.float() - x.float()).abs()
    absmax = block_absmax(x, codec.block)
    # the acceptance bound itself, up to fp32/out-dtype rounding terms
    assert torch.all(err <= absmax / (2 * codec.qmax) + absmax * (2.0**-21 + eps(dtype)))
    # and it is tight: some element gets close to half a step
    assert (err / (absmax / (2 * codec.qmax))).max() > 0.9


def test_zero_blocks_are_exact_and_absmax_is_exact(device):
    x = torch.zeros(1000, device=device)
    x[300:310] = torch.linspace(-1, 1, 10)
    for spec in ("int8:block=256", "int4:block=128"):
        codec = get_codec(spec)
        y = codec.decode(codec.encode(x))
        assert torch.equal(y[:256], x[:256]) and torch.equal(y[512:], x[512:])
        assert y[300].item() == -1.0 and y[309].item() == 1.0  # +-absmax decode exactly to +-qmax*scale


@pytest.mark.parametrize("spec", QUANT_SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nonfinite_propagates_to_its_block_only(spec, bad, dtype, device):
    codec = get_codec(spec)
    x = torch.randn(3 * codec.block + 5, device=device).to(dtype)
    x[codec.block + 3] = bad
    y = codec.decode(codec.encode(x))
    finite = torch.isfinite(y)
    assert not finite[codec.block : 2 * codec.block].any()  # the whole block reads non-finite
    assert finite[: codec.block].all() and finite[2 * codec.block :].all()  # neighbours untouched


def test_stochastic_rounding_is_unbiased():
    n, trials, block = 4096, 400, 128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    codec = get_codec(f"int4:block={block},rounding=stochastic,seed=7")
    errs = torch.stack([codec.decode(codec.encode(x)) - x for _ in range(trials)])  # each call: new stream
    step = block_absmax(x, block) / 7
    # per element, each draw's error is in (-step, step) with variance <= step^2/4
    mean_err = errs.mean(0)
    assert torch.all(mean_err.abs() <= 5 * step / (2 * trials**0.5))
    # the average over all elements shrinks like 1/sqrt(n * trials): bias would show here
    assert (mean_err / step).mean().abs() < 5 * 0.5 / (n * trials) ** 0.5
    # and nearest rounding is biased on the same data (so the test can fail)
    near = get_codec(f"int4:block={block}")
    assert not torch.all((near.decode(near.encode(x)) - x).abs() <= 5 * step / (2 * trials**0.5))


def test_stochastic_is_reproducible_per_seed_and_differs_across_calls():
    x = torch.randn(1000)
    a, b = get_codec("int8:rounding=stochastic,seed=3"), get_codec("int8:rounding=stochastic,seed=3")
    pa1, pb1 = a.encode(x).payload, b.encode(x).payload
    assert torch.equal(pa1, pb1)  # same seed, same call index: same bits (ranks stay in sync)
    assert not torch.equal(pa1, a.encode(x).payload)  # next call: fresh randomness
    assert not torch.equal(pa1, get_codec("int8:rounding=stochastic,seed=4").encode(x).payload)


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("int3:block=4", "unknown codec 'int3'"),
        ("bogus:rate=8", "valid codecs: int4, int8, mpc, none, nvcomp, zfp, zstd"),
        ("int8:blk=256", "unknown parameter 'blk'"),
        ("int8:blk=256", "valid: block, rounding, seed"),
        ("int8:block=100", "block=100 is not valid"),
        ("int8:block=0", "multiple of 8"),
        ("int8:block=abc", "'abc' is not an integer"),
        ("int4:rounding=up", "valid: nearest, stochastic"),
        ("int8:block=256,block=128", "given twice"),
        ("int8:block", "expected key=value"),
        ("none:block=8", "unknown parameter 'block' for codec 'none'"),
        ("", "non-empty"),
    ],
)
def test_bad_specs_raise_clear_errors(spec, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        get_codec(spec)


def test_registry_lists_codecs_and_canonical_specs():
    assert {"none", "int8", "int4"} <= set(available_codecs())
    assert get_codec("int8").spec == "int8:block=256,rounding=nearest,seed=0"
    assert get_codec(" int4 : block=64 ").spec == "int4:block=64,rounding=nearest,seed=0"
    assert get_codec("none").lossless and not get_codec("int8").lossless


def test_decode_rejects_a_payload_of_the_wrong_size():
    codec = get_codec("int8:block=256")
    packed = codec.encode(torch.randn(1000))
    bad = type(packed)(payload=packed.payload[:-4], shape=packed.shape, dtype=packed.dtype)
    with pytest.raises(ValueError, match="1000 values need 1016 uint8 bytes"):
        codec.decode(bad)
