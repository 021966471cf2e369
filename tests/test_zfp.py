"""The zfp codec: bitstreams and decoded values equal to zfpy's, layout and padding, NaN rule, 16-bit
paths, error bounds, strict specs, every CPU kernel level, the zfpy reference, CUDA where built."""

import math

import numpy as np
import pytest
import torch
import zfpy

from megatron_zpp.compression import get_codec, zfp_reference
from megatron_zpp.compression.zfp_reference import bits_equal, zfpy_stream, zfpy_values
from megatron_zpp.compression.zfp import maxbits_for_rate, payload_bytes, zfp_decode_, zfp_encode_

RATES = [4, 8, 16, 32]
DIMS = [1, 2, 3]
# Multiples of the block and of a row/plane, and sizes with every kind of tail (partial row, plane, block).
SIZES = [1, 2, 3, 5, 15, 16, 17, 63, 64, 65, 100, 1000, 4099]


def payload_bytes_of(codec, x: torch.Tensor) -> bytes:
    return codec.encode(x).payload.cpu().numpy().tobytes()


def random_values(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)


SPECIAL = {
    # zfp's cast scale 2^(30 - emax) overflows float below 2^-97: zfp turns such blocks into INT32_MIN
    # (zfp.md); we reproduce it bit for bit
    "tiny": lambda rng: (rng.standard_normal(640) * 1e-31).astype(np.float32),
    "tiny_edge": lambda rng: np.tile(np.array([2.0**-98, -(2.0**-98), 0.99 * 2.0**-97, 2.0**-97], np.float32), 160),
    "subnormal": lambda rng: (rng.standard_normal(640) * 1e-40).astype(np.float32),
    "huge": lambda rng: (rng.standard_normal(640) * 1e38).astype(np.float32),
    "float_max": lambda rng: np.tile(np.array([3.4028235e38, -3.4028235e38, 1.0, 0.0], np.float32), 160),
    "zeros": lambda rng: np.zeros(640, np.float32),
    "negative_zeros": lambda rng: -np.zeros(640, np.float32),
    "sparse_mixed_scale": lambda rng: np.where(rng.random(640) < 0.5, 0, rng.standard_normal(640) * 1e20).astype(np.float32),
    "constant": lambda rng: np.full(640, 3.0, np.float32),
    "powers_of_two": lambda rng: (2.0 ** rng.integers(-140, 127, 640) * rng.choice([-1, 1], 640)).astype(np.float32),
}


# ------------------------------------------------------ zfpy equality ------
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("rate", RATES)
def test_bitstream_and_values_equal_zfpy(rate, dims):
    codec = get_codec(f"zfp:rate={rate},dims={dims}")
    for i, n in enumerate(SIZES):
        x = random_values(n, seed=1000 * rate + 10 * dims + i)
        stream = zfpy_stream(x, rate, dims)
        ours = codec.encode(torch.from_numpy(x))
        assert ours.payload.numpy().tobytes() == stream, f"numel={n}"
        assert codec.wire_bytes(n) == len(stream)
        y = codec.decode(ours)
        assert bits_equal(y.numpy(), zfpy_values(stream, n, rate, dims)), f"numel={n}"


@pytest.mark.parametrize("dims", DIMS)
def test_whole_rows_are_the_plain_reshape(dims):
    """Without a tail the layout is just x.reshape(-1), (-1, 4) or (-1, 4, 4): no helper involved."""
    x = random_values(4096, seed=7)
    array = x.reshape({1: (-1,), 2: (-1, 4), 3: (-1, 4, 4)}[dims])
    for rate in RATES:
        expected = zfpy.compress_numpy(array, rate=rate, write_header=False)
        assert payload_bytes_of(get_codec(f"zfp:rate={rate},dims={dims}"), torch.from_numpy(x)) == expected


def test_tail_padding_is_zfps_rule():
    """A tail of w values in the last 4x4 plane is completed as zfp completes a partial block: the
    partial row a/ab/abc -> aaaa/abba/abca, then missing rows copied the same way along y."""
    x = np.arange(1, 7, dtype=np.float32)  # 6 values: one full row, a row of 2
    plane = zfp_reference.zfp_array(x, 3)[0]
    assert plane.tolist() == [[1, 2, 3, 4], [5, 6, 6, 5], [5, 6, 6, 5], [1, 2, 3, 4]]
    assert zfp_reference.zfp_array(x[:5], 2).tolist() == [[1, 2, 3, 4], [5, 5, 5, 5]]


@pytest.mark.parametrize("case", sorted(SPECIAL))
def test_special_values_equal_zfpy(case):
    x = SPECIAL[case](np.random.default_rng(3))
    for dims in DIMS:
        for rate in RATES:
            codec = get_codec(f"zfp:rate={rate},dims={dims}")
            stream = zfpy_stream(x, rate, dims)
            ours = codec.encode(torch.from_numpy(x))
            assert ours.payload.numpy().tobytes() == stream, (dims, rate)
            assert bits_equal(codec.decode(ours).numpy(), zfpy_values(stream, x.size, rate, dims)), (dims, rate)


def test_tiny_blocks_stay_tiny():
    """Blocks below 2^-97 are zfp's INT32_MIN garbage (matched above), but never larger than 2^-97."""
    x = torch.from_numpy(SPECIAL["tiny"](np.random.default_rng(4)))
    for dims in DIMS:
        for rate in RATES:
            codec = get_codec(f"zfp:rate={rate},dims={dims}")
            y = codec.decode(codec.encode(x))
            assert y.abs().max() <= 2.0**-97 and (y - x).abs().max() < 2.0**-96


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("rate", RATES)
def test_decoding_arbitrary_bytes_equals_zfpys_decoder(rate, dims):
    """Random payloads exercise every way a block's budget can end (inside a verbatim run, a group test,
    a scan); our decoder must guess exactly as zfp's does. Blocks that happen to start with our
    non-finite marker (flag 1, exponent 0) are NaN for us and zeros for zfp."""
    n = 4**dims * 300
    maxbits = maxbits_for_rate(rate, dims)
    raw = np.random.default_rng(rate * dims).integers(0, 256, payload_bytes(n, dims, maxbits), dtype=np.uint8)
    out = torch.empty(n)
    zfp_decode_(torch.from_numpy(raw.copy()), out, dims, maxbits)
    ref = zfpy_values(raw.tobytes(), n, rate, dims)
    ours = out.numpy()
    marked = np.isnan(ours)
    assert np.array_equal(ours[~marked].view(np.uint32), ref[~marked].view(np.uint32))
    assert np.all(ref[marked] == 0)


# ----------------------------------------------------- sizes and dtypes -----
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("numel", [0, 1, 4, 5, 63, 64, 65, 1001])
def test_wire_bytes_exact(dims, numel):
    for rate in (4, 8, 2.5 if dims > 1 else 2.25):
        codec = get_codec(f"zfp:rate={rate},dims={dims}")
        maxbits = math.floor(4**dims * rate + 0.5)
        expected = 8 * math.ceil(math.ceil(numel / 4**dims) * maxbits / 64)  # whole 64-bit words
        assert codec.wire_bytes(numel) == codec.wire_bytes(numel, torch.bfloat16) == expected
        assert codec.encode(torch.randn(numel)).payload.numel() == expected


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_empty_tensors(shape, dtype):
    codec = get_codec("zfp:rate=8")
    packed = codec.encode(torch.empty(shape, dtype=dtype))
    assert packed.payload.numel() == 0 and packed.payload.dtype == torch.uint8
    y = codec.decode(packed)
    assert y.shape == shape and y.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", DIMS)
def test_16_bit_inputs_go_through_fp32(dtype, dims):
    """bf16/fp16 are widened to fp32 (exact), coded, decoded in fp32 and rounded to nearest-even."""
    codec = get_codec(f"zfp:rate=16,dims={dims}")
    x = torch.randn(2, 3, 333).to(dtype)
    packed = codec.encode(x)
    assert torch.equal(packed.payload, codec.encode(x.float()).payload)
    y = codec.decode(packed)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, codec.decode(codec.encode(x.float())).to(dtype))
    assert packed.payload.numel() == codec.wire_bytes(x.numel(), dtype)


def test_shapes_are_read_flat():
    codec = get_codec("zfp:rate=8")
    x = torch.randn(5, 7, 11)
    assert torch.equal(codec.encode(x).payload, codec.encode(x.reshape(-1)).payload)
    assert torch.equal(codec.encode(x[0].t()).payload, codec.encode(x[0].t().contiguous()).payload)
    assert codec.decode(codec.encode(x)).shape == x.shape


# ------------------------------------------------------------ errors -------
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("rate", RATES)
def test_error_within_what_the_rate_gives(rate, dims):
    """Per block, |error| <= 2^(emax + max(6 - rate, -24)) with emax the frexp exponent of the block's
    largest magnitude: a block keeps about rate - 6 bits below its top bit (zfp's 9-bit header and
    transform cost the rest), capped by fp32's 24-bit significand at rate 32. Conservative, measured
    margins in zfp.md; the exact values are zfpy's (tests above)."""
    codec = get_codec(f"zfp:rate={rate},dims={dims}")
    torch.manual_seed(rate + dims)
    x = torch.randn(1 << 14) * torch.logspace(-3, 3, 1 << 14)[torch.randperm(1 << 14)]
    y = codec.decode(codec.encode(x))
    block = 4**dims
    emax = torch.frexp(x.view(-1, block).abs().amax(1, keepdim=True))[1].float()
    bound = torch.exp2(emax + max(6 - rate, -24))
    assert torch.all((y - x).view(-1, block).abs() <= bound)


def test_error_falls_with_the_rate():
    x = torch.randn(1 << 14)
    for dims in DIMS:
        errs = [(get_codec(f"zfp:rate={r},dims={dims}").decode(get_codec(f"zfp:rate={r},dims={dims}").encode(x)) - x)
                .norm().item() for r in RATES]
        assert errs == sorted(errs, reverse=True) and errs[-1] < 1e-6 * x.norm().item(), (dims, errs)


# ---------------------------------------------------------- NaN / Inf ------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dims", DIMS)
def test_nonfinite_makes_its_block_nan_and_leaves_the_rest_as_zfp(bad, dims):
    block = 4**dims
    codec = get_codec(f"zfp:rate=8,dims={dims}")
    x = random_values(10 * block + 3, seed=11)
    x[3 * block + 1] = bad
    x[10 * block + 2] = bad  # in the partial last block
    packed = codec.encode(torch.from_numpy(x))
    y = codec.decode(packed).numpy()
    nan_blocks = {3, 10}
    for b in range(11):
        values = y[b * block:(b + 1) * block]
        assert np.all(np.isnan(values)) == (b in nan_blocks), b
    # every other block is zfp's, bit for bit; the marked blocks are "flag 1, exponent 0, zeros"
    maxbits = codec.maxbits
    ours = np.unpackbits(packed.payload.numpy(), bitorder="little")
    zfp_bits = np.unpackbits(np.frombuffer(zfpy_stream(x, 8, dims), np.uint8), bitorder="little")
    for b in range(11):
        span = slice(b * maxbits, (b + 1) * maxbits)
        if b in nan_blocks:
            assert ours[span].tolist() == [1] + [0] * (maxbits - 1)
        else:
            assert np.array_equal(ours[span], zfp_bits[span]), b
    # a stock zfp decoder reads the marker as a block of zeros
    stock = zfpy_values(packed.payload.numpy().tobytes(), x.size, 8, dims)
    assert np.all(stock[3 * block:4 * block] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nonfinite_propagates_in_16_bit(dtype):
    x = torch.randn(200).to(dtype)
    x[70] = float("inf")
    y = get_codec("zfp:rate=8").decode(get_codec("zfp:rate=8").encode(x))
    assert torch.isnan(y[64:128]).all() and torch.isfinite(y[:64]).all() and torch.isfinite(y[128:]).all()


# -------------------------------------------------- kernels, reference -----
def cpu_levels():
    from megatron_zpp.compression import ops

    if not ops.kernels_available("cpu"):
        return []
    return list(torch.ops.megatron_zpp._cpu_isas())


@pytest.mark.parametrize("level", cpu_levels())
def test_every_cpu_level_writes_the_same_bits(level):
    previous = torch.ops.megatron_zpp._set_cpu_isa(level)
    try:
        x = np.concatenate([random_values(3001, seed=5), SPECIAL["tiny"](np.random.default_rng(1))])
        x[17] = np.nan
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            xt = torch.from_numpy(x).to(dtype)
            for dims in DIMS:
                for rate in RATES:
                    codec = get_codec(f"zfp:rate={rate},dims={dims}")
                    packed = codec.encode(xt)
                    ref = zfp_reference.encode(xt, dims, codec.maxbits)
                    assert torch.equal(packed.payload, ref), (level, dtype, dims, rate)
                    y = codec.decode(packed)
                    y_ref = zfp_reference.decode(ref, xt.shape, dtype, dims, codec.maxbits)
                    assert bits_equal(y.float().numpy(), y_ref.float().numpy()), (level, dtype, dims, rate)
    finally:
        torch.ops.megatron_zpp._set_cpu_isa(previous)


def test_reference_backend_equals_the_kernels():
    x = torch.randn(1234)
    x[100] = float("nan")
    for dims in DIMS:
        maxbits = maxbits_for_rate(8, dims)
        a = torch.empty(payload_bytes(x.numel(), dims, maxbits), dtype=torch.uint8)
        b = torch.empty_like(a)
        zfp_encode_(x, a, dims, maxbits, backend="kernel")
        zfp_encode_(x, b, dims, maxbits, backend="reference")
        assert torch.equal(a, b)
        ya, yb = torch.empty_like(x), torch.empty_like(x)
        zfp_decode_(a, ya, dims, maxbits, backend="kernel")
        zfp_decode_(a, yb, dims, maxbits, backend="reference")
        assert bits_equal(ya.numpy(), yb.numpy())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: the CUDA kernels are compile-checked only "
                    "(tests/test_cuda_build.py)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernels_write_the_cpu_bits(dtype):
    from megatron_zpp.compression.zfp import _has_zfp_kernels

    if not _has_zfp_kernels(torch.device("cuda")):
        pytest.skip("the extension was built without CUDA kernels (ZPP_BUILD_CUDA=1 builds them)")
    x = torch.from_numpy(np.concatenate([random_values(100003, seed=9), SPECIAL["tiny"](np.random.default_rng(2))]))
    x[5] = float("inf")
    x = x.to(dtype)
    for dims in DIMS:
        for rate in RATES:
            codec = get_codec(f"zfp:rate={rate},dims={dims}")
            packed = codec.encode(x.cuda())
            assert packed.payload.is_cuda
            assert torch.equal(packed.payload.cpu(), codec.encode(x).payload), (dims, rate)
            assert bits_equal(codec.decode(packed).cpu().float().numpy(), codec.decode(codec.encode(x)).float().numpy())


def test_ops_validate_arguments():
    x = torch.randn(100)
    good = torch.empty(payload_bytes(100, 3, 512), dtype=torch.uint8)
    with pytest.raises(ValueError, match="need 128"):
        zfp_encode_(x, torch.empty(55, dtype=torch.uint8), 3, 512)
    with pytest.raises(ValueError, match="dims=4 is not valid"):
        zfp_encode_(x, good, 4, 512)
    with pytest.raises(ValueError, match="maxbits=8 is not valid"):
        zfp_encode_(x, good, 3, 8)
    with pytest.raises(TypeError, match="valid: torch.float32"):
        zfp_encode_(x.double(), good, 3, 512)
    with pytest.raises(ValueError, match="1-D uint8"):
        zfp_decode_(good.view(2, -1), x, 3, 512)
    with pytest.raises(ValueError, match="backend="):
        zfp_encode_(x, good, 3, 512, backend="fast")
    # the C++ checks stand on their own too
    with pytest.raises(RuntimeError, match="need 128"):
        torch.ops.megatron_zpp.zfp_encode_(x, torch.empty(55, dtype=torch.uint8), 3, 512)
    with pytest.raises(RuntimeError, match="dims=0 is not supported"):
        torch.ops.megatron_zpp.zfp_decode_(good, x, 0, 512)


def test_decode_rejects_a_payload_of_the_wrong_size():
    codec = get_codec("zfp:rate=8")
    packed = codec.encode(torch.randn(1000))
    bad = type(packed)(payload=packed.payload[:-8], shape=packed.shape, dtype=packed.dtype)
    with pytest.raises(ValueError, match="1000 values need 1024 uint8 bytes"):
        codec.decode(bad)


# ------------------------------------------------------------- specs -------
def test_specs_are_canonical():
    assert get_codec("zfp").spec == "zfp:rate=8,dims=3"
    assert get_codec("zfp:rate=8.0").spec == "zfp:rate=8,dims=3"
    assert get_codec(" zfp : dims=1 , rate=16 ").spec == "zfp:rate=16,dims=1"
    assert get_codec("zfp:rate=2.5").spec == "zfp:rate=2.5,dims=3"
    assert get_codec("zfp:rate=8,dims=2").maxbits == 128 and not get_codec("zfp").lossless


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("zfp:rate=0", "rate=0.0 is not valid; valid: a number in (0, 32]"),
        ("zfp:rate=-4", "rate=-4.0 is not valid"),
        ("zfp:rate=33", "rate=33.0 is not valid; valid: a number in (0, 32]"),
        ("zfp:rate=nan", "rate=nan is not valid"),
        ("zfp:rate=inf", "rate=inf is not valid"),
        ("zfp:rate=eight", "rate='eight' is not a number"),
        ("zfp:rate=2,dims=1", "leaves 8 bits per block of 4 values and zfp needs at least 9; valid: rate >= 2.125"),
        ("zfp:dims=4", "dims=4 is not valid; valid: 1, 2, 3"),
        ("zfp:dims=0", "dims=0 is not valid; valid: 1, 2, 3"),
        ("zfp:dims=3d", "dims='3d' is not an integer"),
        ("zfp:precision=16", "unknown parameter 'precision' for codec 'zfp' in spec 'zfp:precision=16'; valid: rate, dims"),
        ("zfp:rate=8,rate=4", "given twice"),
        ("zfp:rate", "expected key=value"),
    ],
)
def test_bad_specs_raise_clear_errors(spec, needle):
    with pytest.raises(ValueError, match=re_escape(needle)):
        get_codec(spec)


def re_escape(s: str) -> str:
    import re

    return re.escape(s)
