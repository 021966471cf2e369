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

``MoEAllGatherTokenDispatcher`` gathers every token of the tensor-and-expert-parallel (TP x EP) group to every
rank in ``token_dispatch`` (``gather_from_sequence_parallel_region``: the routing map, the probabilities, then the
hidden states) and sums the experts' outputs back in ``token_combine`` (``reduce_scatter_to_sequence_parallel_region``),
both looked up in ``token_dispatcher``'s globals. The same wrapping gives them their sites; the hidden states'
gather (the tensor ``token_dispatch`` was given) goes through :class:`_CodedGather` (forward: a compressed
all-gather, ``quantized_all_gather``; backward, Megatron's reduce-scatter of the gradients: ``qgz_reduce_scatter``
with the ``.grad`` codec, fp32 sums of decoded chunks), the combine's reduce-scatter through
:class:`_CodedReduceScatter` (the mirror image). The routing map and probabilities travel exactly and are counted
with the site. With both codecs of a site ``none``, Megatron's own functions run and only bytes are recorded
(ring all-gather / reduce-scatter: ``(size - 1)`` shards sent per rank).

Not hooked: the flex dispatcher (DeepEP / HybridEP kernels); ``ep`` codecs other than none are refused with it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch

from megatron_zpp.comm import Topology, qgz_reduce_scatter, quantized_all_gather
from megatron_zpp.comm.all_to_all import compressed_all_to_all
from megatron_zpp.comm.wire import FLOAT_DTYPES

# The dispatcher method running now on this thread: name "ep.dispatch" / "ep.combine"; tokens: the hidden states
# the allgather dispatcher's token_dispatch was given (its other gathers are the routing map and probabilities).
_SITE = threading.local()


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


class _CodedGather(torch.autograd.Function):
    """The allgather dispatcher's token gather over the TP x EP group (first dimension): forward with the site's
    codec, backward (the gradients reduce-scattered, summed) with its ``.grad`` codec."""

    @staticmethod
    def forward(ctx, input, topology, codecs, site):
        ctx.topology, ctx.codecs, ctx.site = topology, codecs, site
        return _all_gather(input, topology, codecs[0], site)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.topology, ctx.codecs[1], f"{ctx.site}.grad"), None, None, None


class _CodedReduceScatter(torch.autograd.Function):
    """The allgather dispatcher's combine: the experts' outputs summed over the TP x EP group and scattered
    (first dimension) with the site's codec; backward (the gradients all-gathered) with its ``.grad`` codec."""

    @staticmethod
    def forward(ctx, input, topology, codecs, site):
        ctx.topology, ctx.codecs, ctx.site = topology, codecs, site
        return _reduce_scatter(input, topology, codecs[0], site)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.topology, ctx.codecs[1], f"{ctx.site}.grad"), None, None, None


def _all_gather(input: torch.Tensor, topology: Topology, codec: str, tag: str) -> torch.Tensor:
    """Every member's ``input`` stacked along the first dimension, in group order (``none``: a plain all-gather)."""
    output = input.new_empty((topology.size * input.shape[0], *input.shape[1:]))
    quantized_all_gather(output, input.contiguous(), topology, codec=codec, tag=tag)
    return output


def _reduce_scatter(input: torch.Tensor, topology: Topology, codec: str, tag: str) -> torch.Tensor:
    """Sum ``input`` over the group, this rank's ``1 / size`` of the first dimension. ``none``: the plain
    reduce-scatter Megatron's own function runs (bit-identical to it), bytes recorded as a ring."""
    if input.shape[0] % topology.size:
        raise ValueError(f"{tag}: {input.shape[0]} rows do not split over the {topology.size} ranks of the group")
    if codec == "none":
        from megatron.core.tensor_parallel import mappings

        output = mappings._reduce_scatter_along_first_dim(input, topology.group)
        _record_ring(tag, _nbytes(output), topology.group, topology.ranks_per_node)
        return output
    output = input.new_empty((input.shape[0] // topology.size, *input.shape[1:]))
    qgz_reduce_scatter(output, input.contiguous(), topology, codec=codec, op="sum", tag=tag)
    return output


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _record_ring(tag: str, shard_bytes: int, group, ranks_per_node, calls: int = 1) -> None:
    """Bytes of a ring all-gather or reduce-scatter whose per-rank shard has ``shard_bytes``: ``size - 1`` shards
    sent to the ring's next member (as quantized_all_gather's ``none`` counts them)."""
    from megatron_zpp.comm.stats import comm_stats
    from megatron_zpp.comm.topology import group_layout

    layout = group_layout(group, ranks_per_node)
    comm_stats().record(tag, *layout.split_ring((layout.size - 1) * shard_bytes), calls=calls)


NONE = ("none", "none")


def _codable(t: torch.Tensor, tokens: bool) -> bool:
    """Whether an allgather-dispatcher exchange takes the site's codecs: the hidden states, in a dtype the codecs
    take (``--moe-router-dtype fp64`` makes the combine's input fp64: Megatron's exact exchange, counted)."""
    return tokens and t.dtype in FLOAT_DTYPES


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
    """Installs the ``ep`` codecs on the alltoall and allgather token dispatchers; ``uninstall()`` restores Megatron-Core's.

    Args:
        codec_of: the codec a dimension runs now (``MegatronHooks.codec``), read at every all-to-all.
        ranks_per_node: for the intra- / inter-node byte split and the compressed collectives' hops (default
            ``LOCAL_WORLD_SIZE``, else every rank counts as its own node, as ``comm.topology.group_layout``).

    """

    def __init__(self, codec_of, ranks_per_node: int | None) -> None:
        from megatron_zpp.comm.topology import ranks_per_node_from_env

        self.codec_of = codec_of
        # one value for the counted and the compressed paths (unknown: every rank its own node, an upper bound)
        self.ranks_per_node = ranks_per_node or ranks_per_node_from_env() or 1
        self._restore: list[tuple[object, str, object]] = []
        self._topologies: dict[tuple[int, ...], Topology] = {}

    def _topology(self, group) -> Topology:
        """The compressed collectives' topology of a TP x EP group, made once per group (by its members only)."""
        import torch.distributed as dist

        ranks = tuple(dist.get_process_group_ranks(group))
        topo = self._topologies.get(ranks)
        if topo is None:
            topo = self._topologies[ranks] = Topology(group, ranks_per_node=self.ranks_per_node, hpz_partition_size=1)
        return topo

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
            # Only the tensor token_dispatch / token_combine was given is coded (megatron-core 0.19 passes it
            # through unchanged); the routing weights travel exactly: a lossy code would reweigh expert outputs.
            tokens = input_ is getattr(_SITE, "tokens", None)
            codecs = (hooks.codec_of(site), hooks.codec_of(f"{site}.grad")) if tokens else NONE
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

        original_gather = token_dispatcher.gather_from_sequence_parallel_region
        original_reduce_scatter = token_dispatcher.reduce_scatter_to_sequence_parallel_region

        def gather(input_, tensor_parallel_output_grad=True, group=None, output_split_sizes=None,
                   use_global_buffer=False):
            site = getattr(_SITE, "name", None)
            megatron = functools.partial(original_gather, input_, tensor_parallel_output_grad, group,
                                         output_split_sizes, use_global_buffer)
            if site is None or group is None or group.size() == 1:
                return megatron()
            tokens = input_ is getattr(_SITE, "tokens", None)
            codecs = (hooks.codec_of(site), hooks.codec_of(f"{site}.grad")) if _codable(input_, tokens) else NONE
            if codecs != ("none", "none"):
                if output_split_sizes is not None or not tensor_parallel_output_grad:
                    raise NotImplementedError(f"{site}: the ep codecs gather equal shards whose gradients are "
                                              "reduce-scattered (megatron-core 0.19's allgather dispatcher); this "
                                              "call passes output_split_sizes or tensor_parallel_output_grad=False")
                return _CodedGather.apply(input_, hooks._topology(group), codecs, site)
            output = megatron()
            # the routing map (no gradient) and probabilities add bytes, not calls; the hook keeps a byte count,
            # not the tensor (which recompute or offloading may free)
            rpn, calls, nbytes = hooks.ranks_per_node, int(tokens), _nbytes(input_)
            _record_ring(site, nbytes, group, rpn, calls)
            if output.requires_grad and tensor_parallel_output_grad:
                output.register_hook(lambda grad: _record_ring(f"{site}.grad", nbytes, group, rpn, calls))
            return output

        def reduce_scatter(input_, group=None, input_split_sizes=None, use_global_buffer=False):
            site = getattr(_SITE, "name", None)
            if site is None or group is None or group.size() == 1:
                return original_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
            codecs = (hooks.codec_of(site), hooks.codec_of(f"{site}.grad")) if _codable(input_, True) else NONE
            if codecs != ("none", "none"):
                if input_split_sizes is not None:
                    raise NotImplementedError(f"{site}: the ep codecs reduce-scatter equal shards (megatron-core "
                                              "0.19's allgather dispatcher); this call passes input_split_sizes")
                return _CodedReduceScatter.apply(input_, hooks._topology(group), codecs, site)
            output = original_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
            rpn, nbytes = hooks.ranks_per_node, _nbytes(output)
            _record_ring(site, nbytes, group, rpn)
            if output.requires_grad:
                output.register_hook(lambda grad: _record_ring(f"{site}.grad", nbytes, group, rpn))
            return output

        sites = (("token_dispatch", "ep.dispatch"), ("token_combine", "ep.combine"))
        for cls in (token_dispatcher.MoEAlltoAllTokenDispatcher, token_dispatcher.MoEAllGatherTokenDispatcher):
            for method, site in sites:
                original = getattr(cls, method)

                @functools.wraps(original)
                def at_site(self, hidden_states, *args, _original=original, _site=site, **kwargs):
                    with _at(_site, hidden_states):
                        return _original(self, hidden_states, *args, **kwargs)

                self._patch(cls, method, at_site)
        self._patch(token_dispatcher, "all_to_all", all_to_all)
        self._patch(token_dispatcher, "gather_from_sequence_parallel_region", gather)
        self._patch(token_dispatcher, "reduce_scatter_to_sequence_parallel_region", reduce_scatter)
        return self

    def uninstall(self) -> None:
        for owner, name, value in reversed(self._restore):
            setattr(owner, name, value)
        self._restore = []


@contextlib.contextmanager
def _at(site: str, tokens: torch.Tensor):
    previous = getattr(_SITE, "name", None), getattr(_SITE, "tokens", None)
    _SITE.name, _SITE.tokens = site, tokens
    try:
        yield
    finally:
        _SITE.name, _SITE.tokens = previous


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
