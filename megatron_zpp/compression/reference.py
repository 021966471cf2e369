"""Pure-PyTorch reference of every blocked-quantization op.

The test oracle for the C++ and CUDA kernels (which must match it bit for bit)
and the fallback when the extension is not built. Written for clarity, not
speed: it materialises several full-size temporaries. Each function has the same
signature and out-variant contract as the ``torch.ops.megatron_zpp`` op of the
same name; the numerics are the contract at the top of
``csrc/include/zpp/quant_math.h``.

Device-independent arithmetic: the reference runs on CPU and CUDA tensors and
must give the same bits on both. Every fp32 division here divides a tensor by a
tensor of the same device (IEEE correctly rounded on every device), never by a
Python number: PyTorch's CUDA kernel computes ``tensor / number`` as
``tensor * fp32(1 / number)``, which differs in the last bit for some inputs
(3-5% of INT8 and over half of INT4 block scales). The only fp32 arithmetic
with a Python-number operand is the multiply by 2^-24 in
:func:`stochastic_uniform`, which is exact. ``tests/test_kernels.py`` replays
the reference with CUDA's scalar-division rule on CPU and checks this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_zpp.compression import layout

_MASK32 = 0xFFFFFFFF


# ------------------------------------------------------------- hashing ------
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow."""
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def mix32_int(x: int) -> int:
    return int(_mix32(torch.tensor([x & _MASK32], dtype=torch.int64)).item())


def stochastic_uniform(seed: int, index: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in [0, 1) (24 bits) for int64 element indices; see quant_math.h."""
    seed &= (1 << 64) - 1
    key = (seed & _MASK32) ^ mix32_int(seed >> 32)
    h = _mix32(torch.full_like(index, mix32_int(key)) ^ (index & _MASK32))
    h = _mix32(h ^ (index >> 32))
    # A 24-bit integer times 2^-24: exact, so no device can round it differently.
    return (h >> 8).to(torch.float32) * (1.0 / 16777216.0)


# ---------------------------------------------------- Hadamard smoothing ----
def hadamard_rows(x2: torch.Tensor, hadamard: int) -> torch.Tensor:
    """The normalized Walsh-Hadamard transform of every run of ``hadamard`` values of each row of fp32 ``[R, L]``
    (runs from the row start; a last run shorter than ``hadamard`` unchanged): quant_math.h's ``hadamard_run``,
    butterfly for butterfly. Its own inverse up to fp32 rounding. Returns a new tensor."""
    rows, length = x2.shape
    full = length // hadamard * hadamard
    out = x2.clone()
    if full == 0:
        return out
    v = x2[:, :full]
    d = 1
    while d < hadamard:
        pairs = v.reshape(rows, -1, 2, d)  # element g*2d + t*d + r: t=0 and t=1 are the butterfly's a and b
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        v = torch.stack((a + b, a - b), dim=2).reshape(rows, full)
        d *= 2
    # tensor * tensor: the same fp32 multiply on every device (see the module docstring)
    out[:, :full] = v * torch.full_like(v, layout.hadamard_scale(hadamard))
    return out


# ----------------------------------------------------------- quantizing -----
def _quantize_matrix(x2: torch.Tensor, bits: int, block: int, stochastic: bool, seed: int) -> torch.Tensor:
    """Quantize each row of an fp32 ``[R, L]`` matrix; returns packed ``uint8[R, row_bytes]``.

    The stochastic-rounding counter is the flat element index ``r * L + e``.
    """
    rows, length = x2.shape
    qmax = layout.qmax_for_bits(bits)
    nb = layout.num_blocks(length, block)
    xp = F.pad(x2, (0, nb * block - length)).view(rows, nb, block)

    nonfinite = ~torch.isfinite(xp).all(dim=-1)
    absmax = xp.abs().amax(dim=-1)
    # The one definition of a block scale: IEEE fp32 absmax / qmax (quant_math.h's block_scale).
    # Tensor / tensor, not `absmax / qmax`: see the module docstring.
    scale = absmax / torch.full_like(absmax, float(qmax))
    scale = torch.where(nonfinite, torch.full_like(scale, float("nan")), scale)

    v = (xp / scale.unsqueeze(-1)).clamp(-qmax, qmax)
    if stochastic:
        col = torch.arange(nb * block, device=x2.device, dtype=torch.int64)
        index = torch.arange(rows, device=x2.device, dtype=torch.int64).unsqueeze(1) * length + col
        u = stochastic_uniform(seed, index).view(rows, nb, block)
        q = torch.floor(v + u).clamp(max=qmax)
    else:
        q = torch.round(v)  # half to even
    q = torch.where((scale > 0).unsqueeze(-1), q, torch.zeros_like(q))
    q = q.view(rows, nb * block)[:, :length].to(torch.int16)

    if bits == 8:
        data = q.to(torch.int8).view(torch.uint8)
    else:
        if length % 2:
            q = F.pad(q, (0, 1))
        data = ((q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)).to(torch.uint8)

    out = torch.zeros(rows, layout.row_bytes(length, bits, block), dtype=torch.uint8, device=x2.device)
    out[:, : 4 * nb] = scale.contiguous().view(torch.uint8).view(rows, 4 * nb)
    out[:, 4 * nb : 4 * nb + data.shape[1]] = data
    return out


def _dequantize_matrix(packed: torch.Tensor, length: int, bits: int, block: int) -> torch.Tensor:
    """Decode packed ``uint8[R, row_bytes]`` rows of ``length`` elements to fp32 ``[R, length]``."""
    rows = packed.shape[0]
    if length == 0:  # an empty slice of a larger tensor may start at any byte: nothing to view as fp32
        return torch.zeros(rows, 0, dtype=torch.float32, device=packed.device)
    nb = layout.num_blocks(length, block)
    scale = packed[:, : 4 * nb].reshape(-1).view(torch.float32).view(rows, nb)
    nbytes = layout.ceil_div(length * bits, 8)
    data = packed[:, 4 * nb : 4 * nb + nbytes]
    if bits == 8:
        q = data.reshape(-1).view(torch.int8).view(rows, nbytes).to(torch.float32)
    else:
        d = data.to(torch.int16)
        lo = ((d & 0xF) ^ 8) - 8  # sign-extend a 4-bit two's complement nibble
        hi = ((d >> 4) ^ 8) - 8
        q = torch.stack((lo, hi), dim=-1).view(rows, 2 * nbytes)[:, :length].to(torch.float32)
    s = scale.repeat_interleave(block, dim=1)[:, :length]
    return q * s


# ---------------------------------------------------- the op contracts ------
def _rotated(x2: torch.Tensor, hadamard: int) -> torch.Tensor:
    return hadamard_rows(x2, hadamard) if hadamard else x2


def quantize_rows_(x: torch.Tensor, packed: torch.Tensor, bits: int, block: int,
                   stochastic: bool = False, seed: int = 0, hadamard: int = 0) -> None:
    """Quantize ``x`` (R*L elements) into ``packed`` (uint8 ``[R, row_bytes(L)]``); ``hadamard`` > 0 rotates
    each row's fp32 values first (:func:`hadamard_rows`)."""
    layout.check_bits_block(bits, block)
    layout.check_hadamard(hadamard, block)
    rows = packed.shape[0]
    x2 = _rotated(x.reshape(rows, -1).to(torch.float32), hadamard)
    packed.copy_(_quantize_matrix(x2, bits, block, stochastic, seed).view_as(packed))


def reorder_quantize_(x: torch.Tensor, packed: torch.Tensor, bits: int, block: int,
                      nodes: int, node_size: int, stages: int,
                      stochastic: bool = False, seed: int = 0, hadamard: int = 0) -> None:
    """Fused qgZ slice reorder + quantize: input row ``i`` lands in row ``reorder_slot_of_input_row(i)``.

    ``x`` has ``P = stages * nodes * node_size`` equal rows; the stochastic counter is
    the element's index in ``x`` (so the result equals quantize-then-permute).
    """
    layout.check_bits_block(bits, block)
    layout.check_hadamard(hadamard, block)
    num_rows = stages * nodes * node_size
    x2 = _rotated(x.reshape(num_rows, -1).to(torch.float32), hadamard)
    q = _quantize_matrix(x2, bits, block, stochastic, seed)
    slots = torch.tensor([layout.reorder_slot_of_input_row(i, stages, node_size, nodes)
                          for i in range(num_rows)], device=x.device)
    out = torch.empty_like(q)
    out[slots] = q
    packed.copy_(out.view_as(packed))


def dequantize_rows_(packed: torch.Tensor, out: torch.Tensor, bits: int, block: int, hadamard: int = 0) -> None:
    """Decode ``packed`` (``[R, row_bytes(L)]``) into ``out`` (R*L elements, any float dtype); ``hadamard`` > 0
    rotates the fp32 decode back before the cast."""
    layout.check_bits_block(bits, block)
    layout.check_hadamard(hadamard, block)
    rows = packed.shape[0]
    length = out.numel() // rows if rows else 0
    y = _rotated(_dequantize_matrix(packed.reshape(rows, -1), length, bits, block), hadamard)
    out.copy_(y.reshape(out.shape))


def dequantize_add_rows_(packed: torch.Tensor, out: torch.Tensor, bits: int, block: int, hadamard: int = 0) -> None:
    """``out = cast(decoded + fp32(out))``: :func:`dequantize_rows_`'s fp32 decode (rotated back when ``hadamard``)
    plus the values ``out`` holds, rounded once to its dtype (qWD adds weight differences to held weights)."""
    layout.check_bits_block(bits, block)
    layout.check_hadamard(hadamard, block)
    rows = packed.shape[0]
    length = out.numel() // rows if rows else 0
    y = _rotated(_dequantize_matrix(packed.reshape(rows, -1), length, bits, block), hadamard)
    out.copy_((y + out.reshape(rows, length).to(torch.float32)).reshape(out.shape))


def _reduce_chunks(packed_in: torch.Tensor, length: int, bits: int, block: int) -> torch.Tensor:
    num_chunks, rows = packed_in.shape[0], packed_in.shape[1]
    acc = torch.zeros(rows, length, dtype=torch.float32, device=packed_in.device)
    for c in range(num_chunks):  # fixed order: the kernels add chunk 0 first, then 1, ...
        acc = acc + _dequantize_matrix(packed_in[c], length, bits, block)
    return acc


def dequant_reduce_quantize_(packed_in: torch.Tensor, packed_out: torch.Tensor, row_numel: int,
                             bits_in: int, block_in: int, bits_out: int, block_out: int,
                             stochastic: bool = False, seed: int = 0, hadamard_in: int = 0,
                             hadamard_out: int = 0) -> None:
    """Sum ``packed_in`` (uint8 ``[C, K, row_bytes_in]``) over C in fp32, re-quantize into ``[K, row_bytes_out]``.

    The stochastic counter is the output element index ``k * row_numel + e``. ``hadamard_in`` > 0: the input rows
    were rotated, the sum is rotated back; ``hadamard_out`` > 0: the sum is rotated before quantizing. Equal
    (both on): the sum stays in the rotated domain, neither is applied (linearity; the transform is its own
    inverse).
    """
    layout.check_bits_block(bits_in, block_in)
    layout.check_bits_block(bits_out, block_out)
    layout.check_hadamard(hadamard_in, block_in)
    layout.check_hadamard(hadamard_in, block_out)
    layout.check_hadamard(hadamard_out, block_out)
    acc = _reduce_chunks(packed_in, row_numel, bits_in, block_in)
    if hadamard_in != hadamard_out:
        acc = _rotated(_rotated(acc, hadamard_in), hadamard_out)
    packed_out.copy_(_quantize_matrix(acc, bits_out, block_out, stochastic, seed).view_as(packed_out))


def dequant_reduce_(packed_in: torch.Tensor, out: torch.Tensor, bits: int, block: int,
                    divisor: float = 1.0, hadamard: int = 0) -> None:
    """Sum ``packed_in`` (uint8 ``[C, K, row_bytes]``) over C in fp32, divide, write ``out`` (K*L, any float dtype).
    ``hadamard`` > 0: the rows were rotated; the sum is rotated back before the division."""
    layout.check_bits_block(bits, block)
    layout.check_hadamard(hadamard, block)
    rows = packed_in.shape[1]
    length = out.numel() // rows if rows else 0
    acc = _rotated(_reduce_chunks(packed_in, length, bits, block), hadamard)
    # fp32(divisor) as a tensor: true division on every device (see the module docstring).
    out.copy_((acc / torch.full_like(acc, divisor)).reshape(out.shape))
