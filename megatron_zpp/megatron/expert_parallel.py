"""The policy's ``ep`` codecs on Megatron-Core's MoE token dispatch and combine (the alltoall dispatcher).

``MoEAlltoAllTokenDispatcher`` moves tokens with ``tensor_parallel.mappings.all_to_all`` (an autograd function
over the expert-parallel group), looked up at call time in ``token_dispatcher``'s module globals: twice in
``token_dispatch`` (the hidden states, then their routing probabilities) and once in ``token_combine`` (the
experts' outputs). ``install()`` wraps the two methods, so each all-to-all knows its site, and replaces that global
with :class:`_CodedAllToAll`: forward with the site's codec, backward (the gradients, with the split sizes swapped)
with its ``.grad`` codec, each through :func:`megatron_zpp.comm.compressed_all_to_all`. The probabilities (one
value per token) travel exactly whatever the codec, as a lossy code of the routing weights would change which
expert output counts how much; their bytes are counted with the site's.

Every call reads its codec when it starts (``codec_of``: the policy's, or none while the divergence guard suspends
lossy codecs), the same on every rank. A site whose forward and backward codecs are both ``none`` calls
Megatron's own ``all_to_all`` (with its ``use_nccl_stream``: under shared-expert overlap it runs on NCCL's stream
as without the plugin), bit-identical, and only its bytes are recorded (the backward's from a hook on the output
gradient); its bytes are counted under ``ep.dispatch``, ``ep.dispatch.grad``, ``ep.combine``, ``ep.combine.grad``
(the routing weights' exchange adds bytes, not calls).

A compressed site runs synchronously on the current stream (encode, exchange, decode), forward and backward:
it does not overlap the shared experts as Megatron's NCCL-stream all-to-all can, and variable-size codecs read
two small tensors back to the host per call (``comm/all_to_all.py``). Refused with CUDA graphs and with
``--overlap-moe-expert-parallel-comm`` (``check_expert_parallel_codecs``).

Not hooked: the allgather dispatcher (its gathers and reduce-scatters over the tensor-and-expert-parallel group)
and the flex dispatcher (DeepEP / HybridEP kernels); ``ep`` codecs other than none are refused with them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch

from megatron_zpp.comm.all_to_all import compressed_all_to_all

_SITE = threading.local()  # the dispatcher method running now on this thread: "ep.dispatch" / "ep.combine"


class _CodedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input, output_splits, input_splits, site, codecs, ranks_per_node):
        ctx.group, ctx.splits, ctx.site, ctx.codecs, ctx.ranks_per_node = (
            group, (output_splits, input_splits), site, codecs, ranks_per_node)
        return compressed_all_to_all(input, output_splits, input_splits, group, codecs[0], site, ranks_per_node,
                                     calls=_calls(input))

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        # The gradients go back the way the rows came: split sizes swapped.
        return (None, compressed_all_to_all(grad, input_splits, output_splits, ctx.group, ctx.codecs[1],
                                            f"{ctx.site}.grad", ctx.ranks_per_node, calls=_calls(grad)),
                None, None, None, None, None)


def _calls(t: torch.Tensor) -> int:
    """The hidden states' exchange is the site's call; the routing weights' (one value per row) adds bytes only."""
    return 1 if t.dim() > 1 else 0


def _record(tag: str, t: torch.Tensor, output_splits, input_splits, group, ranks_per_node) -> None:
    """Bytes of Megatron's own exchange of ``t`` (the rows this rank sends to each other member)."""
    from megatron_zpp.comm.any_codec import _a2a_bytes
    from megatron_zpp.comm.stats import comm_stats
    from megatron_zpp.comm.topology import group_layout

    layout = group_layout(group, ranks_per_node)
    rows = [int(n) for n in input_splits] if input_splits is not None else [t.shape[0] // layout.size] * layout.size
    row_bytes = t[:1].numel() * t.element_size() if t.shape[0] else 0
    comm_stats().record(tag, *_a2a_bytes(layout, [n * row_bytes for n in rows]),
                        calls=_calls(t))


class ExpertParallelHooks:
    """Installs the ``ep`` codecs on the alltoall token dispatcher; ``uninstall()`` restores Megatron-Core's.

    Args:
        codec_of: the codec a dimension runs now (``MegatronHooks.codec``), read at every all-to-all.
        ranks_per_node: for the intra- / inter-node byte split (default ``LOCAL_WORLD_SIZE``).
    """

    def __init__(self, codec_of, ranks_per_node: int | None) -> None:
        self.codec_of = codec_of
        self.ranks_per_node = ranks_per_node
        self._restore: list[tuple[object, str, object]] = []

    def _patch(self, owner, name: str, value) -> None:
        self._restore.append((owner, name, inspect.getattr_static(owner, name)))
        setattr(owner, name, value)

    def install(self) -> ExpertParallelHooks:
        from megatron.core.transformer.moe import token_dispatcher

        hooks = self
        original_all_to_all = token_dispatcher.all_to_all

        def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None, use_nccl_stream=False):
            site = getattr(_SITE, "name", None)
            if site is None:  # a dispatcher method we do not know: Megatron's own exchange
                return original_all_to_all(group, input_, output_split_sizes_, input_split_sizes,
                                           use_nccl_stream=use_nccl_stream)
            if group.size() == 1:
                return input_  # as Megatron-Core: nothing to exchange
            # the routing weights (one value per row) travel exactly: a lossy code would reweigh expert outputs
            codecs = (hooks.codec_of(site), hooks.codec_of(f"{site}.grad")) if input_.dim() > 1 else ("none", "none")
            if codecs != ("none", "none"):
                return _CodedAllToAll.apply(group, input_, _host(output_split_sizes_), _host(input_split_sizes), site,
                                            codecs, hooks.ranks_per_node)
            output = original_all_to_all(group, input_, output_split_sizes_, input_split_sizes,
                                         use_nccl_stream=use_nccl_stream)
            if _on_host(input_split_sizes) and _on_host(output_split_sizes_):  # else not counted: no reads added
                rpn, out_splits, in_splits = hooks.ranks_per_node, output_split_sizes_, input_split_sizes
                _record(site, input_, out_splits, in_splits, group, rpn)
                if output.requires_grad:  # Megatron's backward exchange sends the output's rows back
                    output.register_hook(lambda grad: _record(f"{site}.grad", grad, in_splits, out_splits, group, rpn))
            return output

        cls = token_dispatcher.MoEAlltoAllTokenDispatcher
        for method, site in (("token_dispatch", "ep.dispatch"), ("token_combine", "ep.combine")):
            original = getattr(cls, method)

            @functools.wraps(original)
            def at_site(self, *args, _original=original, _site=site, **kwargs):
                with _at(_site):
                    return _original(self, *args, **kwargs)

            self._patch(cls, method, at_site)
        self._patch(token_dispatcher, "all_to_all", all_to_all)
        return self

    def uninstall(self) -> None:
        for owner, name, value in reversed(self._restore):
            setattr(owner, name, value)
        self._restore = []


@contextlib.contextmanager
def _at(site: str):
    previous = getattr(_SITE, "name", None)
    _SITE.name = site
    try:
        yield
    finally:
        _SITE.name = previous


def _on_host(splits) -> bool:
    return not (isinstance(splits, torch.Tensor) and splits.device.type != "cpu")


def _host(splits):
    """Split sizes as a host list. Megatron-Core 0.19's dispatcher passes numpy arrays it has already brought to
    the host (``_maybe_dtoh_and_synchronize`` at ``before_ep_alltoall``), or ``None`` (equal splits); a tensor
    here would mean a device-to-host read this hook adds, which a newer dispatcher should not get silently."""
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor) and splits.device.type != "cpu":
        raise TypeError("ep codecs: the token dispatcher passed its split sizes as a device tensor; this hook "
                        "expects them on the host (megatron-core 0.19's behaviour)")
    return [int(s) for s in splits]
