"""The policy's ``pp`` and ``tp`` codecs on Megatron-Core's pipeline p2p and tensor-parallel collectives.

Pipeline (``pp``): ``p2p_communication._batched_p2p_ops`` / ``_p2p_ops`` (looked up by
``P2PCommunicator`` at call time) are wrapped: sends are encoded, receives post payload buffers
of the size the known shape implies (a variable-size codec sends its lengths first, one int64 per
direction, read from the container headers on the device: one host read per p2p call, for the
lengths sent and received together, and no device-wide synchronize), and the returned requests decode into Megatron's receive tensors in ``wait()``. This covers every schedule, interleaved and overlapped p2p included,
since they all wait on these requests before reading.

Tensor (``tp``): the collectives of ``tensor_parallel.mappings`` (``_reduce`` all-reduce, the
first/last-dim all-gathers and reduce-scatters through ``dist_all_gather_func`` /
``dist_reduce_scatter_func``) and of ``tensor_parallel.layers`` (sequence-parallel all-gather /
reduce-scatter, and the backward all-reduce of ``LinearWithGradAccumulationAndAsyncCommunication``)
go through compressed versions on the TP group. The vocabulary-parallel cross-entropy's
reductions are left exact (they are not routed). Only the tensor-parallel group's own floating-point
traffic is compressed: the same functions also carry MoE's exchanges over other groups (the allgather
token dispatcher's over TP x EP, the router's token counts over TP x CP and TP x DP x CP, integers), which
stay exact here; the token exchanges are the ``ep`` dimension's (``expert_parallel.py``).

With a ``none`` codec nothing is replaced, so training is bit-identical to Megatron's.
Traffic is recorded under the tags ``pp`` and ``tp``.
"""

from __future__ import annotations

import contextlib
import inspect
import os

import torch
import torch.distributed as dist

from megatron_zpp.comm import Topology, compressed_all_reduce, qgz_reduce_scatter, quantized_all_gather
from megatron_zpp.comm.p2p import SIZE_MESSAGE_BYTES, DecodingRequest, P2PCodec, record_p2p
from megatron_zpp.comm.stats import comm_timers
from megatron_zpp.comm.wire import FLOAT_DTYPES
from megatron_zpp.compression import get_codec
from megatron_zpp.compression.container import payload_lengths
from megatron_zpp.compression.host_read import HostRead

PP_TAG, TP_TAG = "pp", "tp"


def _is_tensor_parallel_group(group) -> bool:
    """Whether ``group`` is Megatron's tensor-parallel group (the object: MoE's TP x EP group may have its ranks).
    Megatron names the group of every TP collective; ``None`` would be torch's world, not TP."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    return group is not None and group is tp


class ModelParallelHooks:
    """Installs the ``pp`` / ``tp`` codecs; ``uninstall()`` restores Megatron's functions."""

    def __init__(self, pp_codec: str, tp_codec: str, ranks_per_node: int | None) -> None:
        self.pp = P2PCodec(pp_codec) if pp_codec != "none" else None
        self.tp_codec = tp_codec
        self.ranks_per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or None
        # Set by the divergence guard (MegatronHooks.suspend_lossy) between iterations: lossy codecs step aside.
        self.suspended = False
        # Dimensions whose installed codec is off (``--zpp-policy auto`` has not chosen it): their traffic runs as
        # with ``none``, switched between iterations like ``suspended``.
        self.off: set[str] = set()
        self._pp_lossy = pp_codec != "none" and not get_codec(pp_codec).lossless
        self._tp_lossy = tp_codec != "none" and not get_codec(tp_codec).lossless
        self._restore: list[tuple[object, str, object]] = []
        self._topologies: dict[tuple[int, ...], Topology] = {}

    def _patch(self, owner, name: str, value) -> None:
        # The attribute as stored (a staticmethod stays a staticmethod), so uninstall restores it exactly.
        self._restore.append((owner, name, inspect.getattr_static(owner, name)))
        setattr(owner, name, value)

    def install(self) -> ModelParallelHooks:
        try:
            if self.pp is not None:
                self._install_pp()
            if self.tp_codec != "none":
                self._install_tp()
        except BaseException:
            self.uninstall()  # whatever was patched before the failure
            raise
        return self

    def uninstall(self) -> None:
        for owner, name, value in reversed(self._restore):
            setattr(owner, name, value)
        self._restore = []

    # ------------------------------------------------------------------ pipeline
    def _install_pp(self) -> None:
        from megatron.core.pipeline_parallel import p2p_communication as p2p

        codec, hooks = self.pp, self
        originals = {"_batched_p2p_ops": p2p._batched_p2p_ops, "_p2p_ops": p2p._p2p_ops}

        def encoded_call(name, *, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                         group, prev_pipeline_rank, next_pipeline_rank):
            if (hooks.suspended and hooks._pp_lossy) or "pp" in hooks.off:  # Megatron's own p2p (still counted)
                me, rpn = dist.get_rank(), hooks.ranks_per_node or dist.get_world_size()
                for t, peer in ((tensor_send_prev, prev_pipeline_rank), (tensor_send_next, next_pipeline_rank)):
                    if t is not None:
                        record_p2p(PP_TAG, peer, me, rpn, t.numel() * t.element_size(), t.numel() * t.element_size())
                return originals[name](
                    tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,
                    tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next, group=group,
                    prev_pipeline_rank=prev_pipeline_rank, next_pipeline_rank=next_pipeline_rank)
            me, rpn = dist.get_rank(), hooks.ranks_per_node or dist.get_world_size()  # at the call: installs before init
            sends, raw = {}, {}
            peers = {"send_prev": prev_pipeline_rank, "send_next": next_pipeline_rank}
            for key, t in (("send_prev", tensor_send_prev), ("send_next", tensor_send_next)):
                if t is not None:
                    raw[key] = t.numel() * t.element_size()
                    # variable size: the whole encoded buffer; cut to its true length after the size read
                    sends[key] = codec.encode(t, site=f"{PP_TAG}.{key}", rank=me) if codec.fixed_size \
                        else encode_whole(t)
            recv_like = {key: t for key, t in (("recv_prev", tensor_recv_prev), ("recv_next", tensor_recv_next))
                         if t is not None}
            sizes = {} if codec.fixed_size else exchange_sizes(
                originals[name], sends, recv_like, group=group, prev_pipeline_rank=prev_pipeline_rank,
                next_pipeline_rank=next_pipeline_rank)
            for key, payload in sends.items():
                if not codec.fixed_size:
                    sends[key] = payload = payload[:sizes[key]]
                size_message = 0 if codec.fixed_size else SIZE_MESSAGE_BYTES
                record_p2p(PP_TAG, peers[key], me, rpn, payload.numel() + size_message, raw[key])
            recvs = {key: codec.empty_payload(t, sizes.get(key)) for key, t in recv_like.items()}
            reqs = originals[name](
                tensor_send_prev=sends.get("send_prev"), tensor_recv_prev=recvs.get("recv_prev"),
                tensor_send_next=sends.get("send_next"), tensor_recv_next=recvs.get("recv_next"),
                group=group, prev_pipeline_rank=prev_pipeline_rank, next_pipeline_rank=next_pipeline_rank)
            outs = {"recv_prev": tensor_recv_prev, "recv_next": tensor_recv_next}
            if isinstance(reqs, dict):  # _p2p_ops: one request per direction
                return {key: DecodingRequest([req], [(codec, recvs[key], outs[key])] if key in recvs else [],
                                             keep=sends.get(key)) for key, req in reqs.items()}
            decodes = [(codec, recvs[key], outs[key]) for key in recvs]
            return [DecodingRequest(reqs, decodes, keep=sends)] if reqs else []

        def encode_whole(t: torch.Tensor) -> torch.Tensor:
            """A variable-size codec's encoding of ``t``, the whole buffer (its length is in the header)."""
            if t.dtype not in FLOAT_DTYPES:
                raise TypeError(f"pipeline p2p compression takes {FLOAT_DTYPES}, got {t.dtype}")
            with comm_timers().codec():
                return codec.codec.encode(t.detach().contiguous()).payload.view(-1)

        def exchange_sizes(p2p_ops, sends, recv_like, **where) -> dict[str, int]:
            """Variable-size payloads: send each payload's length (one int64, read from its container header
            on the device) the way the payload will go, and return the lengths of what this rank sends
            (``send_*``) and receives (``recv_*``): the one host read of the p2p call.

            It waits for the size messages only (their requests, then the current stream), not for the
            whole device: no torch.cuda.synchronize(). Megatron's own synchronize "against a race" in
            batch_isend_irecv runs in _communicate_shapes (variable_seq_lengths only) and after each p2p
            call when config.batch_p2p_sync is set (its default); here the payload ops are issued after the
            size ops completed on this rank (the read), so no two of our batches are in flight at once."""
            size_sends = {key: payload_lengths([p]) for key, p in sends.items()}
            size_recvs = {key: torch.empty(1, dtype=torch.int64, device=t.device) for key, t in recv_like.items()}
            reqs = p2p_ops(tensor_send_prev=size_sends.get("send_prev"), tensor_recv_prev=size_recvs.get("recv_prev"),
                           tensor_send_next=size_sends.get("send_next"), tensor_recv_next=size_recvs.get("recv_next"),
                           **where)
            works = list(reqs.values() if isinstance(reqs, dict) else reqs)
            both = {**size_sends, **size_recvs}
            # Earlier received payloads' container checks come along in the same read.
            checks, codec.pending_checks = codec.pending_checks, []
            # The tensors go in as they are (computing on them before the wait would read them early).
            values = HostRead(list(both.values()) + [c.record for c in checks], works).values()
            for check, record in zip(checks, values[len(both):]):
                check.raise_if_invalid(record)
            return {key: int(v[0]) for key, v in zip(both, values)}

        def batched(**kwargs):
            return encoded_call("_batched_p2p_ops", **kwargs)

        def single(**kwargs):
            return encoded_call("_p2p_ops", **kwargs)

        self._patch(p2p, "_batched_p2p_ops", batched)
        self._patch(p2p, "_p2p_ops", single)

    # ------------------------------------------------------------------ tensor
    def _topology(self, group) -> Topology:
        ranks = tuple(dist.get_process_group_ranks(group))
        topo = self._topologies.get(ranks)
        if topo is None:
            topo = Topology(group, ranks_per_node=self.ranks_per_node or dist.get_world_size(),
                            hpz_partition_size=1)
            self._topologies[ranks] = topo
        return topo

    def _install_tp(self) -> None:
        from megatron.core.tensor_parallel import layers, mappings

        hooks = self

        def codec() -> str:  # read at each call: the divergence guard may have suspended a lossy codec
            return "none" if hooks.suspended and hooks._tp_lossy else hooks.tp_codec

        original_reduce = mappings._reduce

        def exact(t: torch.Tensor, group) -> bool:
            # Megatron's own call: "tp" not chosen (installed for --zpp-policy auto), not the tensor-parallel
            # group (MoE's TP x EP, TP x CP groups), or not floating point (token counts, routing masks).
            return "tp" in hooks.off or not t.is_floating_point() or not _is_tensor_parallel_group(group)

        def patched(module):
            original_ag, original_rs = module.dist_all_gather_func, module.dist_reduce_scatter_func

            def all_gather(output, input, group=None, async_op=False):
                if exact(input, group):
                    return original_ag(output, input, group=group, async_op=async_op)
                return quantized_all_gather(output, input.contiguous(), hooks._topology(group), codec=codec(),
                                            async_op=async_op, tag=TP_TAG)

            def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
                if exact(input, group):
                    return original_rs(output, input, op=op, group=group, async_op=async_op)
                return qgz_reduce_scatter(output, input.contiguous(), hooks._topology(group), codec=codec(),
                                          op="sum" if op == dist.ReduceOp.SUM else "mean", async_op=async_op,
                                          tag=TP_TAG)
            return all_gather, reduce_scatter

        def reduce(input_, group):  # mappings._reduce: all-reduce in the TP region
            if exact(input_, group):
                return original_reduce(input_, group)
            if group.size() == 1:
                return input_
            out = input_.contiguous()
            compressed_all_reduce(out, hooks._topology(group), codec=codec(), op="sum", tag=TP_TAG)
            return out

        for module in (mappings, layers):
            all_gather, reduce_scatter = patched(module)
            self._patch(module, "dist_all_gather_func", all_gather)
            self._patch(module, "dist_reduce_scatter_func", reduce_scatter)
        self._patch(mappings, "_reduce", reduce)

        linear = layers.LinearWithGradAccumulationAndAsyncCommunication
        original_backward = linear.backward

        @contextlib.contextmanager
        def route_tp_all_reduce():
            original = dist.all_reduce

            def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
                if op != dist.ReduceOp.SUM or exact(tensor, group) or group.size() == 1:
                    return original(tensor, op=op, group=group, async_op=async_op)
                return compressed_all_reduce(tensor, hooks._topology(group), codec=codec(), op="sum",
                                             async_op=async_op, tag=TP_TAG)

            dist.all_reduce = all_reduce
            try:
                yield
            finally:
                dist.all_reduce = original

        def backward(ctx, *grads):
            if "tp" in hooks.off:
                return original_backward(ctx, *grads)
            with route_tp_all_reduce():
                return original_backward(ctx, *grads)

        self._patch(linear, "backward", staticmethod(backward))
