"""Error feedback's per-call arithmetic, shared by both qgZ paths (the fused blockwise kernels in
``reduce_scatter.py`` and the codec interface in ``any_codec.py``): check the residual, add it to
the input before hop 1 encodes, drop what a non-finite gradient left in it. Why and what is fed back:
``error_feedback.md``; the residuals themselves are kept by the caller (the Megatron hooks, per bucket)."""

from __future__ import annotations

import torch

from megatron_zpp.comm.scratch import Scratch
from megatron_zpp.comm.stats import comm_timers
from megatron_zpp.comm.wire import WireFormat


def check_residual(residual: torch.Tensor, input: torch.Tensor, fmt: WireFormat, what: str) -> None:
    if not fmt.compressed or fmt.codec.lossless:
        raise ValueError(f"{what}: error feedback (residual) needs a lossy codec; codec is {fmt.spec!r}")
    if (residual.dtype != torch.float32 or residual.numel() != input.numel() or residual.device != input.device
            or not residual.is_contiguous()):
        raise ValueError(f"{what}: residual must be a contiguous float32 tensor of {input.numel()} elements on "
                         f"{input.device}, got {residual.dtype} x {residual.numel()} on {residual.device}")


def drop_non_finite_(residual: torch.Tensor) -> None:
    """A non-finite gradient (an fp16 overflow the loss scaler will skip) must not stay in the residual:
    ``inf - decode(inf)`` is NaN and would poison every later step. Those entries restart from zero."""
    residual.masked_fill_(~torch.isfinite(residual), 0.0)


def compensate(input: torch.Tensor, residual: torch.Tensor, scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """Error feedback's first half: ``(x, target)``, ``target = input + residual`` in fp32 and ``x`` that in
    the input dtype (scratch: ``input`` may alias the output and is left as it is)."""
    with comm_timers().codec():
        target = scratch.take(input.numel() * 4).view(torch.float32)
        torch.add(input.view(-1), residual.view(-1), out=target)
        if input.dtype == torch.float32:
            return target, target
        x = scratch.take(input.numel() * input.element_size()).view(input.dtype)
        x.copy_(target)
        return x, target
