"""Compiled kernels (C++ CPU; CUDA where present) equal the pure-PyTorch reference bit for bit,
and the qgZ slice reordering is ZeRO++ Algorithm 2."""

import itertools

import pytest
import torch

from megatron_zpp.compression import layout, ops

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SEED = 0x1234_5678_9ABC  # > 32 bits: both seed halves reach the hash


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def sample(numel: int, dtype, device, nonfinite=False):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g))
    if numel > 3:
        x[numel // 3] = 0.0
        x[: min(numel, 16)] = 0.0  # a zero (or partly zero) first block
    if nonfinite and numel > 40:
        x[20], x[-1] = float("nan"), float("inf")
    return x.to(dtype).to(device)


@pytest.mark.parametrize("bits,block", [(8, 8), (8, 256), (4, 64), (4, 128), (8, 24), (4, 40)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rows,length", [(1, 1), (1, 7), (1, 4099), (3, 255), (4, 512)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_dequantize_match_reference(bits, block, dtype, rows, length, stochastic, kernel_device):
    x = sample(rows * length, dtype, kernel_device, nonfinite=True)
    rb = layout.row_bytes(length, bits, block)
    got = torch.full((rows, rb), 0xAB, dtype=torch.uint8, device=kernel_device)  # padding must be overwritten
    want = torch.empty_like(got)
    ops.quantize_rows_(x, got, bits, block, stochastic, SEED, backend="kernel")
    ops.quantize_rows_(x, want, bits, block, stochastic, SEED, backend="reference")
    assert torch.equal(got, want)
    for out_dtype in FLOAT_DTYPES:
        y_got = torch.empty(rows * length, dtype=out_dtype, device=kernel_device)
        y_want = torch.empty_like(y_got)
        ops.dequantize_rows_(got, y_got, bits, block, backend="kernel")
        ops.dequantize_rows_(got, y_want, bits, block, backend="reference")
        nan = torch.isnan(y_want)
        assert torch.equal(torch.isnan(y_got), nan)  # NaN payload bits may differ; positions may not
        assert torch.equal(bits_of(y_got[~nan]), bits_of(y_want[~nan]))


@pytest.mark.parametrize("nodes,node_size,stages", [(2, 2, 1), (2, 4, 1), (3, 2, 1), (2, 2, 2), (4, 2, 3), (1, 4, 1)])
@pytest.mark.parametrize("bits,block", [(4, 64), (8, 128)])
def test_reorder_quantize_is_quantize_then_algorithm2(nodes, node_size, stages, bits, block, kernel_device):
    rows, length = nodes * node_size * stages, 200  # rows are not block multiples: partial blocks too
    x = sample(rows * length, torch.bfloat16, kernel_device)
    rb = layout.row_bytes(length, bits, block)
    got = torch.empty(rows, rb, dtype=torch.uint8, device=kernel_device)
    want = torch.empty_like(got)
    ops.reorder_quantize_(x, got, bits, block, nodes, node_size, stages, True, SEED, backend="kernel")
    ops.reorder_quantize_(x, want, bits, block, nodes, node_size, stages, True, SEED, backend="reference")
    assert torch.equal(got, want)
    plain = torch.empty_like(got)  # same counter (element index in x): reorder only moves rows
    ops.quantize_rows_(x, plain, bits, block, True, SEED, backend="kernel")
    for i in range(rows):
        assert torch.equal(got[layout.reorder_slot_of_input_row(i, stages, node_size, nodes)], plain[i])


def algorithm2_as_printed(partition_id, stages, node_size, nodes):
    """ZeRO++ Algorithm 2 line by line, with lines 2-3 labelled as the reading that is a permutation."""
    total_devices = node_size * nodes  # 1
    chunk_id = partition_id % total_devices  # 2 (text: stageID)
    stage_id = partition_id // total_devices  # 3 (text: chunkID)
    pipeline_offset = stage_id * total_devices  # 4
    chunk_offset = chunk_id // node_size  # 5
    chunk_base = (chunk_id % node_size) * nodes  # 6
    return pipeline_offset + chunk_base + chunk_offset  # 7


@pytest.mark.parametrize("nodes,node_size,stages", list(itertools.product([1, 2, 3, 4], [1, 2, 4, 8], [1, 2, 3])))
def test_algorithm2_formula_and_bijection(nodes, node_size, stages):
    total = nodes * node_size * stages
    mapped = [layout.alg2_mapped_partition(p, stages, node_size, nodes) for p in range(total)]
    assert mapped == [algorithm2_as_printed(p, stages, node_size, nodes) for p in range(total)]
    assert sorted(mapped) == list(range(total))
    # Eq. (2) of the paper for one stage: [0, X, 2X, ..., (Y-1)X, 1, X+1, ...] (X GPUs/node, Y nodes)
    eq2 = [n * node_size + d for d in range(node_size) for n in range(nodes)]
    first_stage = [None] * (nodes * node_size)
    for p in range(nodes * node_size):
        first_stage[mapped[p]] = p
    assert first_stage == eq2
    # qgZ correctness: after the intra-node all-to-all (slot block d*Y.. goes to local rank d), local
    # rank d holds exactly the partitions owned by rank d of every node, one per node, in node order.
    for d in range(node_size):
        held = first_stage[d * nodes : (d + 1) * nodes]
        assert held == [n * node_size + d for n in range(nodes)]


def test_paper_example_two_nodes_two_gpus():
    # Figure 9: swap slices 2 and 3 (1-indexed) before the intra-node all-to-all
    slots = [layout.alg2_mapped_partition(p, 1, 2, 2) for p in range(4)]
    assert slots == [0, 2, 1, 3]
    # DeepSpeed's swizzle comment, 2 nodes x 4 GPUs: |0|1|2|3|4|5|6|7| -> |0|4|1|5|2|6|3|7|
    order = [None] * 8
    for p in range(8):
        order[layout.alg2_mapped_partition(p, 1, 4, 2)] = p
    assert order == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("chunks,rows,length", [(2, 1, 256), (4, 2, 1000), (3, 3, 129), (8, 1, 64)])
@pytest.mark.parametrize("bits_in,block_in,bits_out,block_out", [(4, 128, 4, 128), (8, 64, 4, 128), (4, 32, 8, 256)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_dequant_reduce_quantize_matches_reference(chunks, rows, length, bits_in, block_in, bits_out, block_out,
                                                   stochastic, kernel_device):
    x = sample(chunks * rows * length, torch.float32, kernel_device, nonfinite=(chunks == 3))
    packed_in = ops.quantize(x, bits_in, block_in, rows=chunks * rows).view(chunks, rows, -1)
    rb_out = layout.row_bytes(length, bits_out, block_out)
    got = torch.full((rows, rb_out), 0xCD, dtype=torch.uint8, device=kernel_device)
    want = torch.empty_like(got)
    args = (length, bits_in, block_in, bits_out, block_out, stochastic, SEED)
    ops.dequant_reduce_quantize_(packed_in, got, *args, backend="kernel")
    ops.dequant_reduce_quantize_(packed_in, want, *args, backend="reference")
    assert torch.equal(got, want)


@pytest.mark.parametrize("chunks,rows,length", [(2, 1, 256), (4, 2, 1000), (3, 3, 129)])
@pytest.mark.parametrize("bits,block", [(4, 128), (8, 256)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("divisor", [1.0, 3.0, 8.0])
def test_dequant_reduce_matches_reference_and_is_the_mean(chunks, rows, length, bits, block, dtype, divisor,
                                                          kernel_device):
    x = sample(chunks * rows * length, torch.float32, kernel_device)
    packed = ops.quantize(x, bits, block, rows=chunks * rows)
    packed_in = packed.view(chunks, rows, -1)
    got = torch.empty(rows * length, dtype=dtype, device=kernel_device)
    want = torch.empty_like(got)
    ops.dequant_reduce_(packed_in, got, bits, block, divisor, backend="kernel")
    ops.dequant_reduce_(packed_in, want, bits, block, divisor, backend="reference")
    assert torch.equal(bits_of(got), bits_of(want))
    # semantics: (sum over chunks of the decoded chunks) / divisor, in fp32 then cast
    decoded = ops.dequantize(packed, (chunks, rows * length), torch.float32, bits, block)
    expect = (decoded.sum(0) / divisor).to(dtype)
    assert torch.allclose(got.float(), expect.float(), rtol=torch.finfo(dtype).eps * chunks, atol=1e-30)


def test_reduce_propagates_nan_from_one_chunk(kernel_device):
    chunks, length = 4, 512
    x = sample(chunks * length, torch.float32, kernel_device)
    x[2 * length + 300] = float("nan")  # chunk 2, block 1 (block=256)
    packed = ops.quantize(x, 4, 256, rows=chunks).view(chunks, 1, -1)
    out = torch.empty(length, device=kernel_device)
    ops.dequant_reduce_(packed, out, 4, 256, 4.0, backend="kernel")
    assert torch.isnan(out[256:]).all() and torch.isfinite(out[:256]).all()
    requant = torch.empty(1, layout.row_bytes(length, 4, 256), dtype=torch.uint8, device=kernel_device)
    ops.dequant_reduce_quantize_(packed, requant, length, 4, 256, 4, 256, backend="kernel")
    y = ops.dequantize(requant, (length,), torch.float32, 4, 256)
    assert torch.isnan(y[256:]).all() and torch.isfinite(y[:256]).all()


def test_ops_validate_arguments(kernel_device):
    x = torch.randn(100, device=kernel_device)
    packed = torch.empty(1, layout.row_bytes(100, 8, 64), dtype=torch.uint8, device=kernel_device)
    with pytest.raises(ValueError, match="bits=5 is not supported"):
        ops.quantize_rows_(x, packed, 5, 64)
    with pytest.raises(ValueError, match="block=12 must be a positive multiple of 8"):
        ops.quantize_rows_(x, packed, 8, 12)
    with pytest.raises(ValueError, match="104 bytes; rows of 100 elements at bits=8, block=64 need 108"):
        ops.quantize_rows_(x, packed[:, :-4].contiguous(), 8, 64)
    with pytest.raises(TypeError, match="torch.int32"):
        ops.quantize_rows_(x.int(), packed, 8, 64)
    with pytest.raises(ValueError, match="do not split into 3 equal rows"):
        ops.quantize_rows_(x, torch.empty(3, 8, dtype=torch.uint8, device=kernel_device), 8, 64)
    with pytest.raises(ValueError, match="stages\\*nodes\\*node_size = 4"):
        ops.reorder_quantize_(x, packed, 8, 64, 2, 2, 1)
    # the C++ op checks too, for callers that bypass the Python wrapper
    with pytest.raises(RuntimeError, match="bits=5 is not supported"):
        torch.ops.megatron_zpp.quantize_rows_(x, packed, 5, 64, False, 0)
