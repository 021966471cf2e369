"""Sizes and index math of the blocked-quantization wire format.

Mirrors ``csrc/include/zpp/quant_math.h`` line for line; the format itself is
documented in ``blockwise.md`` beside this file. A *row* is the packed form of
``L`` consecutive elements::

    [ float32 scales x num_blocks(L) | data bytes, zero-padded to a multiple of 4 ]

Rows of equal ``L`` stack as ``uint8[R, row_bytes(L)]``.
"""

from __future__ import annotations

SUPPORTED_BITS = (4, 8)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align4(n: int) -> int:
    return (n + 3) & ~3


def qmax_for_bits(bits: int) -> int:
    """Largest quantized magnitude: symmetric [-qmax, qmax], so -128 / -8 are never used."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; valid: {SUPPORTED_BITS}")
    return 127 if bits == 8 else 7


def check_bits_block(bits: int, block: int) -> None:
    qmax_for_bits(bits)
    if block <= 0 or block % 8:
        raise ValueError(f"block={block} must be a positive multiple of 8")


MAX_HADAMARD = 1 << 12  # the kernels keep one run in registers / shared memory


def check_hadamard(hadamard: int, block: int) -> None:
    """``hadamard``: 0 (off) or the run length of the Walsh-Hadamard smoothing (quant_math.h), a power of two in
    [2, MAX_HADAMARD] dividing ``block``, so that every run lies inside one quantization block."""
    if hadamard == 0:
        return
    if not (2 <= hadamard <= MAX_HADAMARD and hadamard & (hadamard - 1) == 0 and block % hadamard == 0):
        raise ValueError(f"hadamard={hadamard} is not valid with block={block}; valid: 0 (off) or a power of two "
                         f"in [2, {MAX_HADAMARD}] that divides the block")


def hadamard_scale(hadamard: int) -> float:
    """fp32(1 / sqrt(hadamard)) as quant_math.h's ``hadamard_scale``: fp32(1/sqrt(2)) times an exact power of two
    (the product is exact), or the power of two alone when log2(hadamard) is even."""
    log2h = hadamard.bit_length() - 1
    root_half = 0.7071067690849304  # fp32(0.70710678118654752), 0x3F3504F3
    return (root_half if log2h & 1 else 1.0) * 2.0 ** -(log2h >> 1)


def num_blocks(numel: int, block: int) -> int:
    return ceil_div(numel, block)


def data_bytes(numel: int, bits: int) -> int:
    return align4(ceil_div(numel * bits, 8))


def row_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes of one packed row of ``numel`` elements (scales + padded data)."""
    return 4 * num_blocks(numel, block) + data_bytes(numel, bits)


def alg2_mapped_partition(partition_id: int, stages: int, node_size: int, nodes: int) -> int:
    """ZeRO++ Algorithm 2: the slot of slice ``partition_id = stage * W + dest``.

    ``W = node_size * nodes`` and ``dest = node * node_size + local``. The slot is
    ``stage * W + local * nodes + node``: the intra-node all-to-all then gives
    local rank ``local`` the slices that every node's rank ``local`` will own.
    The paper's extracted text swaps the labels of its lines 2-3; this reading is
    the one that is a permutation and reproduces Eq. (2) and Figure 9.
    """
    total_devices = node_size * nodes
    stage_id = partition_id // total_devices
    chunk_id = partition_id % total_devices
    pipeline_offset = stage_id * total_devices
    chunk_offset = chunk_id // node_size
    chunk_base = (chunk_id % node_size) * nodes
    return pipeline_offset + chunk_base + chunk_offset


def reorder_slot_of_input_row(input_row: int, stages: int, node_size: int, nodes: int) -> int:
    """Slot of input row ``dest * stages + stage`` (each destination's slices are contiguous)."""
    total_devices = node_size * nodes
    dest, stage = divmod(input_row, stages)
    return alg2_mapped_partition(stage * total_devices + dest, stages, node_size, nodes)
