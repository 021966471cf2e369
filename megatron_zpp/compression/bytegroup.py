"""Byte grouping of float tensors, the transform in front of the byte-oriented lossless coders.

Each value's bits are rotated left by one (the sign moves to bit 0), so the high byte holds the
whole exponent for bfloat16 and float32 (fp16: its 5 exponent bits and the top 3 mantissa bits);
then byte ``b`` of every value goes to plane ``b`` (``[itemsize, numel]``, low byte first). The
exponent plane has about 2.6 bits of entropy per byte on Gaussian data, the mantissa planes
nearly 8: grouped, an order-0 coder sees each distribution apart (``lossless.md``). Pure torch
ops, so the same code runs on CPU and, for nvCOMP, on the GPU without leaving it.
"""

from __future__ import annotations

import torch

_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def group(x: torch.Tensor) -> torch.Tensor:
    """``uint8[itemsize, numel]`` planes of ``x`` (contiguous; any device)."""
    w = x.detach().contiguous().reshape(-1).view(_INT_OF[x.dtype])
    top = 8 * x.element_size() - 1
    # Arithmetic >> on signed ints: mask the sign copies away before or-ing in.
    rotated = (w << 1) | ((w >> top) & 1)
    return rotated.view(torch.uint8).view(-1, x.element_size()).t().contiguous()


def ungroup(planes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`group`: a flat tensor of ``dtype``."""
    int_dtype = _INT_OF[dtype]
    top = 8 * torch.empty((), dtype=dtype).element_size() - 1
    r = planes.t().contiguous().reshape(-1).view(int_dtype)
    low_mask = (1 << top) - 1  # all bits but the top one
    w = ((r >> 1) & low_mask) | (r << top)
    return w.view(dtype)
