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
lossy codecs or after ``--zpp-policy auto`` switched), between iterations on every rank alike. With every ``ep``
codec ``none`` the exchange is Megatron's own call (``all_to_all_single`` on the same tensors and split sizes),
bit-identical to training without the plugin, and its bytes are recorded under ``ep.dispatch``,
``ep.dispatch.grad``, ``ep.combine``, ``ep.combine.grad``.

Not hooked: the allgather dispatcher (its gathers and reduce-scatters over the tensor-and-expert-parallel group)
and the flex dispatcher (DeepEP / HybridEP kernels); ``ep`` codecs other than none are refused with them.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import torch

from megatron_zpp.comm.all_to_all import compressed_all_to_all

_SITE = threading.local()  # the dispatcher method running now on this thread: "ep.dispatch" / "ep.combine"


class _CodedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input, output_splits, input_splits, site, codec_of, ranks_per_node):
        ctx.group, ctx.splits, ctx.site = group, (output_splits, input_splits), site
        ctx.codec_of, ctx.ranks_per_node = codec_of, ranks_per_node
        codec = codec_of(site) if input.dim() > 1 else "none"  # the routing probabilities travel exactly
        return compressed_all_to_all(input, output_splits, input_splits, group, codec, site, ranks_per_node)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        site = f"{ctx.site}.grad"
        codec = ctx.codec_of(site) if grad.dim() > 1 else "none"
        # The gradients go back the way the rows came: split sizes swapped.
        return (None, compressed_all_to_all(grad, input_splits, output_splits, ctx.group, codec, site,
                                            ctx.ranks_per_node), None, None, None, None, None)


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
            return _CodedAllToAll.apply(group, input_, _host(output_split_sizes_), _host(input_split_sizes), site,
                                        hooks.codec_of, hooks.ranks_per_node)

        cls = token_dispatcher.MoEAlltoAllTokenDispatcher
        for method, site in (("token_dispatch", "ep.dispatch"), ("token_combine", "ep.combine")):
            original = getattr(cls, method)

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


def _host(splits):
    """Split sizes as a host list (the dispatcher passes numpy arrays, or tensors before its device-to-host copy)."""
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return splits.tolist()
    return [int(s) for s in splits]
