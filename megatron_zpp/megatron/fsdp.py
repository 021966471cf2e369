"""The Megatron-FSDP (ZeRO-3) path: its pipelines' gathers and gradient reductions, and hpZ's secondary copies.

Megatron-FSDP calls ``torch.distributed`` directly, so the routing wraps ``AllGatherPipeline.async_bucket_gather``
(qwZ forward, hpZ backward from the secondary copy), ``AllGatherPipeline.wait_bucket_ready`` (decodes our
pending gather first), ``GradReducePipeline._bucket_group_gradient_reduce`` (qgZ, through the gradient
reduction of ``ddp.py``) and ``ParamAndGradBuffer.copy_main_weights_to_model_weights`` (invalidates that buffer's
hpZ copies after every weight install).

Invariants: the alignment padding a quantizer sees is zero (Megatron-FSDP never writes it, and garbage there
would set a block's scale); every DP replica decodes the same bytes, and a backward gather decodes the very
rows the forward gathered (hpZ keeps packed rows), never a stale copy (invalidated at every weight change; a
stale copy is refilled by a full gather, and ``hpz_all_gather`` refuses one); configurations whose reduction would bypass the routing are refused, not run
uncompressed. Part of :class:`~megatron_zpp.megatron.hooks.MegatronHooks` (a mixin).

qWD (``dp_param_difference``) here: every gather, forward and backward, is an intra-node gather of the hpZ
copy, held in the weights' dtype; after each weight install (invalidated) the first gather of a bucket
exchanges each shard's 4-bit difference across nodes to the ranks holding its copy
(``hpz_weight_difference_all_gather``: that exchange and the intra-node gather of the stale copy are both
issued at the call, as Megatron-FSDP issues a forward's gathers back to back, and combined at the bucket's wait);
the first gather ever, after a load or a resync, is full precision.

A group with one member per node (an MoE expert-data-parallel group once EP fills the node) has no hpZ copy
(``hpz_partitioned``): hpZ over one rank would hold every shard. Its buckets gather with qwZ, forward and
backward, and under qWD with zeropp's INT8 weights (there is no copy to take differences against).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_zpp.comm import (HeldShard, HpzShard, Topology, comm_timers, hpz_all_gather,
                               hpz_weight_difference_all_gather, quantized_all_gather)
from megatron_zpp.comm.wire import wire_format
from megatron_zpp.megatron.ddp import PARAM_TAG
from megatron_zpp.policy.policy import ZEROPP_WEIGHTS

PARAM_BWD_TAG = "dp.param.bwd"


class FsdpRouting:
    """``MegatronHooks``' routing of Megatron-FSDP's collectives and its hpZ state (module docstring)."""

    # ------------------------------------------------------------------ hpZ state
    @property
    def hpz_enabled(self) -> bool:
        return self.policy.hpz_size != 1

    @staticmethod
    def hpz_partitioned(topo: Topology) -> bool:
        """Whether ``topo`` (a gather topology from ``topology(group, hpz=True)``) has an hpZ secondary partition:
        more than one member per partition. A group with one member per node (an MoE expert-data-parallel group
        once EP fills the node) has none: its backward gathers are qwZ gathers again, and qWD falls back to them."""
        return topo.hpz_size > 1

    def invalidate_secondary(self, buffer=None) -> None:
        """Mark the hpZ secondary copies stale (the weights changed): those of one Megatron-FSDP
        ``ParamAndGradBuffer`` after its weight install, or with ``buffer=None`` every copy (a checkpoint load).

        Per buffer because each model chunk (virtual pipeline stages, chained optimizers) installs its own
        buffer: with ``--overlap-param-gather-with-optimizer-step`` one chunk's gathers may be in flight, or
        its copies refreshed, while the next chunk installs, and a global invalidation would mark those
        copies stale again (a repeated exchange or full gather, and under qWD a second, near-empty
        difference exchange). A copy of no known buffer is invalidated too: stale is safe, fresh is not."""
        for key, shard in self._hpz_shards.items():
            if buffer is None or self._hpz_buffer_of.get(key, id(buffer)) == id(buffer):
                shard.invalidate()

    def _keep_hpz_shard(self, key: tuple, pipeline, shard: HpzShard) -> HpzShard:
        """Register ``shard`` under ``key``, owned by ``pipeline``'s weight buffer (``invalidate_secondary``)."""
        self._hpz_shards[key] = shard
        self._hpz_buffer_of[key] = id(pipeline.buffer)
        return shard

    def _kept_hpz_shard(self, key: tuple, pipeline) -> HpzShard | None:
        """The copy kept under ``key`` if ``pipeline``'s buffer owns it (not one of a pipeline since freed whose
        ``id()`` the key reuses), else ``None``."""
        if self._hpz_buffer_of.get(key) != id(pipeline.buffer):
            return None
        return self._hpz_shards.get(key)

    def _drop_hpz_shard(self, key: tuple) -> None:
        self._hpz_shards.pop(key, None)
        self._hpz_buffer_of.pop(key, None)

    @property
    def hpz_bytes(self) -> int:
        """Memory held by this rank's hpZ secondary copies."""
        return sum(shard.nbytes for shard in self._hpz_shards.values())

    def _hpz_shard(self, pipeline, bucket_id: int, shard_input, topo: Topology, codec: str) -> HpzShard:
        key = (id(pipeline), bucket_id)
        shard = self._kept_hpz_shard(key, pipeline)
        if shard is None or shard.shard_numel != shard_input.numel() or shard.dtype != shard_input.dtype \
                or shard.format is not wire_format(topo, codec, "HpzShard"):  # the divergence guard switched codecs
            shard = self._keep_hpz_shard(key, pipeline, HpzShard(topo, shard_input.numel(), shard_input.dtype,
                                                                 codec, device=shard_input.device))
        return shard

    # ------------------------------------------------------------------ install
    def _install_fsdp(self) -> None:
        """Megatron-FSDP (ZeRO-3): its pipelines call torch.distributed directly, so the routing wraps
        ``AllGatherPipeline.async_bucket_gather`` (qwZ forward, hpZ backward) and
        ``GradReducePipeline._bucket_group_gradient_reduce`` (qgZ), and every weight install
        (after the optimizer step, after a checkpoint load) invalidates its own buffer's hpZ copies."""
        try:
            from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buf
        except ImportError:  # Megatron-FSDP needs einops and DTensor; without it there is nothing to hook
            return
        hooks = self
        gather_cls, reduce_cls, buffer_cls = fsdp_buf.AllGatherPipeline, fsdp_buf.GradReducePipeline, \
            fsdp_buf.ParamAndGradBuffer
        originals = {"async_bucket_gather": gather_cls.async_bucket_gather,
                     "wait_bucket_ready": gather_cls.wait_bucket_ready,
                     "_bucket_group_gradient_reduce": reduce_cls._bucket_group_gradient_reduce,
                     "copy_main_weights_to_model_weights": buffer_cls.copy_main_weights_to_model_weights}
        self._saved_fsdp = (gather_cls, reduce_cls, buffer_cls, originals)

        def async_bucket_gather(pipeline, bucket_id, bwd):
            hooks.sync_iteration()
            with comm_timers().wait(f"async_bucket_gather{'.bwd' if bwd else ''}"), \
                    hooks._route_fsdp_gather(pipeline, bucket_id, bwd):
                return originals["async_bucket_gather"](pipeline, bucket_id, bwd)

        def wait_bucket_ready(pipeline, bucket_id, bwd, *args, **kwargs):
            # all_gather_params replaces each bucket's event with its coalescing manager's, which
            # knows nothing of ours: decode here, before Megatron marks the bucket ready.
            with comm_timers().wait(f"wait_bucket_ready{'.bwd' if bwd else ''}"):
                handle = hooks._pending_gathers.pop((id(pipeline), pipeline.get_bucket_key(bucket_id, bwd)), None)
                if handle is not None:
                    handle.wait()
                return originals["wait_bucket_ready"](pipeline, bucket_id, bwd, *args, **kwargs)

        def bucket_group_gradient_reduce(pipeline, bucket_group, *args, **kwargs):
            hooks.sync_iteration()
            hooks._check_fsdp_supported(pipeline.buffer.ddp_config, kwargs.get("outer_fsdp_group_grad_reduce"))
            buffers = [(f"fsdp.bucket{b}", pipeline.get_fsdp_buffer(b)) for b in bucket_group]
            with comm_timers().wait("bucket_group_gradient_reduce"), hooks._route_fsdp_reduce(buffers, fsdp_buf):
                return originals["_bucket_group_gradient_reduce"](pipeline, bucket_group, *args, **kwargs)

        def copy_main_weights_to_model_weights(buffer, *args, **kwargs):
            # Reached by every sharding strategy after each optimizer step: the strategies whose
            # reduction bypasses the routed pipeline are refused here at the latest.
            hooks._check_fsdp_supported(buffer.ddp_config)
            result = originals["copy_main_weights_to_model_weights"](buffer, *args, **kwargs)
            hooks.invalidate_secondary(buffer)  # this buffer's copies only (invalidate_secondary)
            return result

        gather_cls.async_bucket_gather = async_bucket_gather
        gather_cls.wait_bucket_ready = wait_bucket_ready
        reduce_cls._bucket_group_gradient_reduce = bucket_group_gradient_reduce
        buffer_cls.copy_main_weights_to_model_weights = copy_main_weights_to_model_weights
        from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP

        self._time_waits(reduce_cls, ("wait_for_previous_grad_reduce",))
        self._time_waits(MegatronFSDP, ("synchronize_gradient_reduce", "synchronize_param_gather"))

    def _uninstall_fsdp(self) -> None:
        if getattr(self, "_saved_fsdp", None):
            gather_cls, reduce_cls, buffer_cls, originals = self._saved_fsdp
            gather_cls.async_bucket_gather = originals["async_bucket_gather"]
            gather_cls.wait_bucket_ready = originals["wait_bucket_ready"]
            reduce_cls._bucket_group_gradient_reduce = originals["_bucket_group_gradient_reduce"]
            buffer_cls.copy_main_weights_to_model_weights = originals["copy_main_weights_to_model_weights"]
            self._saved_fsdp = None

    # ------------------------------------------------------------------ routing
    def _difference_state(self, pipeline, bucket_id: int, shard_input, topo: Topology) -> tuple[HpzShard, HeldShard]:
        """qWD on Megatron-FSDP: the bucket's hpZ secondary copy in the weights' dtype, and this rank's held
        shard (what every replica holds of its own shard)."""
        key = ("qwd", id(pipeline), bucket_id)
        self._drop_hpz_shard((id(pipeline), bucket_id))  # the plain hpZ copy of a suspension (divergence guard)
        shard = self._kept_hpz_shard(key, pipeline)
        if shard is None or shard.shard_numel != shard_input.numel() or shard.dtype != shard_input.dtype:
            shard = self._keep_hpz_shard(key, pipeline, HpzShard(topo, shard_input.numel(), shard_input.dtype,
                                                                 "none", device=shard_input.device))
            self._held_shards.pop(key, None)  # a new copy is filled by a full-precision gather
        held = self._held_shards.get(key)
        if held is None:
            held = self._held_shards[key] = HeldShard(shard_input.numel(), shard_input.dtype, shard_input.device)
        return shard, held

    @contextlib.contextmanager
    def _route_fsdp_gather(self, pipeline, bucket_id: int, bwd: bool):
        hooks = self
        original = dist.all_gather_into_tensor
        codec = self.codec("dp.param")
        # qWD: every gather, forward and backward, comes from the hpZ copy, which a 4-bit difference exchange
        # refreshes once per weight update ("none": the divergence guard suspended it: plain gathers, and a
        # full-precision resync when it ends); a group without an hpZ copy gathers with qwZ INT8 (below).
        difference = self.policy.param_difference and codec != "none"

        def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
            if hooks._is_private(group):  # our own collectives' inner calls
                return original(output_tensor, input_tensor, group=group, async_op=async_op)
            tag = PARAM_BWD_TAG if bwd else PARAM_TAG
            if hooks.policy.param_difference and not difference:  # suspended: resync when qWD resumes
                hooks._held_shards.pop(("qwd", id(pipeline), bucket_id), None)
                hooks._drop_hpz_shard(("qwd", id(pipeline), bucket_id))
            gather_codec, differences = codec, difference
            if differences:
                topo = hooks.topology(group, hpz=True)
                if not (hooks.hpz_partitioned(topo) or topo.size == 1):
                    # No hpZ copy to take differences against (one member per node: an MoE expert group once
                    # EP fills the node): this bucket gathers its weights with ZeRO++'s INT8 (qwZ) instead of
                    # the 4-bit difference codec, which is too coarse for the weights themselves.
                    differences, gather_codec = False, ZEROPP_WEIGHTS
            if differences:
                wbuf = pipeline.get_fsdp_buffer(bucket_id, bwd)
                _zero_padding(input_tensor, wbuf, wbuf.shard_bucket_index.bucket_data_index)  # no garbage in a block
                shard, held = hooks._difference_state(pipeline, bucket_id, input_tensor, topo)
                handle = hpz_weight_difference_all_gather(output_tensor, input_tensor, shard, held, topo, codec=codec,
                                                          async_op=True, tag=tag)
                if not async_op:
                    handle.wait()
                    return None
                hooks._pending_gathers[(id(pipeline), pipeline.get_bucket_key(bucket_id, bwd))] = handle
                return handle
            if hooks._megatron_runs(gather_codec) and not hooks.hpz_enabled:
                hooks._record_torch(tag, "all_gather", group, input_tensor.numel() * input_tensor.element_size(),
                                    input_tensor.device)
                return original(output_tensor, input_tensor, group=group, async_op=async_op)
            topo = hooks.topology(group, hpz=hooks.hpz_enabled)
            hpz = hooks.hpz_enabled and hooks.hpz_partitioned(topo)
            shard = hooks._hpz_shard(pipeline, bucket_id, input_tensor, topo, gather_codec) if hpz else None
            key = (id(pipeline), pipeline.get_bucket_key(bucket_id, bwd))
            if bwd and shard is not None and shard.valid:
                handle = hpz_all_gather(output_tensor, shard, topo, async_op=True, tag=tag)
                if not async_op:
                    handle.wait()
                    return None
                hooks._pending_gathers[key] = handle
                return handle
            # Forward (or a backward gather with no fresh secondary copy): the full qwZ gather,
            # which also refreshes this bucket's hpZ rows.
            if gather_codec != "none":
                wbuf = pipeline.get_fsdp_buffer(bucket_id, bwd)
                _zero_padding(input_tensor, wbuf, wbuf.shard_bucket_index.bucket_data_index)
            handle = quantized_all_gather(output_tensor, input_tensor, topo, codec=gather_codec, async_op=True, tag=tag,
                                          hpz_shard=shard)
            if not async_op:
                handle.wait()
                return None
            hooks._pending_gathers[key] = handle
            return handle

        dist.all_gather_into_tensor = all_gather_into_tensor
        try:
            yield
        finally:
            dist.all_gather_into_tensor = original

    def _check_fsdp_supported(self, ddp_config, outer_group_reduce: bool = False) -> None:
        """Refuse the Megatron-FSDP configurations whose gradient reduction is not routed here, rather
        than run Megatron's collectives under a policy that promises ours."""
        if self._megatron_runs(self.grad_codec):
            return
        strategy = getattr(ddp_config, "data_parallel_sharding_strategy", "optim_grads_params")
        if strategy not in ("optim_grads", "optim_grads_params"):
            raise NotImplementedError(
                f"Megatron-FSDP data_parallel_sharding_strategy={strategy!r} reduces gradients outside the "
                f"pipeline megatron_zpp routes; with policy {self.policy.name!r} use optim_grads or "
                "optim_grads_params, or --zpp-dp-grad none with --zpp-dp-uncompressed megatron")
        if outer_group_reduce:
            raise NotImplementedError("Megatron-FSDP with an outer data-parallel group (hybrid FSDP, "
                                      "num_distributed_optimizer_instances > 1) is not supported by policy "
                                      f"{self.policy.name!r}; use 1 instance or --zpp-dp-grad none with "
                                      "--zpp-dp-uncompressed megatron")

    @contextlib.contextmanager
    def _route_fsdp_reduce(self, buffers, fsdp_buf=None):
        hooks = self
        original_rs, original_ar = dist.reduce_scatter_tensor, dist.all_reduce
        pending_buffers = list(buffers)  # Megatron-FSDP reduces the group's buckets in this order
        ours = not self._megatron_runs(self.grad_codec)
        original_pre = getattr(fsdp_buf, "gradient_reduce_preprocessing", None) if ours else None

        def preprocessing(grad_data, scaling_factor, ddp_config):
            # Megatron-FSDP fuses the 1/DP scaling into NCCL's PREMUL_SUM (gradient_reduce_div_fusion,
            # its default, for non-bf16 gradients): our collectives reduce with SUM, so scale first,
            # as Megatron's own unfused branch does. Same arithmetic, so fair stays comparable.
            if (scaling_factor is not None and not ddp_config.average_in_collective
                    and ddp_config.gradient_reduce_div_fusion and grad_data.dtype != torch.bfloat16):
                grad_data.mul_(scaling_factor)
                return dist.ReduceOp.SUM
            return original_pre(grad_data, scaling_factor, ddp_config)

        def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if hooks._is_private(group):
                return original_rs(output, input, op=op, group=group, async_op=async_op)
            name, gbuf = pending_buffers.pop(0) if pending_buffers else (None, None)
            ours = not hooks._megatron_runs(hooks.grad_codec)
            # Padding garbage only matters to a quantizer (it would set a block's scale).
            if hooks.grad_codec != "none" and gbuf is not None and gbuf.bucket_index.size == input.numel():
                _zero_padding(input, gbuf, 0)
            # Ours: synchronous, as Megatron-FSDP accumulates the shard right after its
            # coalescing block. Megatron's: its call exactly as it was made.
            sync = False if ours else async_op
            return hooks._reduce_scatter_grads(original_rs, output, input, op, group, async_op=sync, bucket=name)[0]

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if hooks._is_private(group):
                return original_ar(tensor, op=op, group=group, async_op=async_op)
            sync = async_op if hooks._megatron_runs(hooks.grad_codec) else False
            return hooks._all_reduce_grads(original_ar, tensor, op, group, async_op=sync)[0]

        dist.reduce_scatter_tensor, dist.all_reduce = reduce_scatter_tensor, all_reduce
        if original_pre is not None:
            fsdp_buf.gradient_reduce_preprocessing = preprocessing
        try:
            yield
        finally:
            dist.reduce_scatter_tensor, dist.all_reduce = original_rs, original_ar
            if original_pre is not None:
                fsdp_buf.gradient_reduce_preprocessing = original_pre


def _padding_ranges(buf) -> list[tuple[int, int]]:
    """Bucket-relative ranges of a Megatron-FSDP buffer that belong to no parameter (alignment padding),
    cached on the buffer itself (an id-keyed cache could hand a later run's buffer a freed one's ranges)."""
    ranges = getattr(buf, "_zpp_padding_ranges", None)
    if ranges is None:
        base, size = buf.bucket_index.global_data_index, buf.bucket_index.size
        covered = sorted((it.global_data_index - base, it.global_data_index - base + it.size)
                         for it in buf.item_index_map.values())
        ranges, cursor = [], 0
        for start, end in covered:
            if start > cursor:
                ranges.append((cursor, start))
            cursor = max(cursor, end)
        if cursor < size:
            ranges.append((cursor, size))
        buf._zpp_padding_ranges = ranges
    return ranges


def _zero_padding(tensor: torch.Tensor, buf, offset: int) -> None:
    """Zero the alignment padding inside ``tensor`` (bucket coordinates start at ``offset``).

    Megatron-FSDP allocates its buffers with ``torch.empty`` and never writes the padding between
    parameters: garbage there (1e38 was observed) is harmless to an uncompressed collective, but it
    would set the scale of its whole quantization block and wipe out the real values beside it.
    """
    end = offset + tensor.numel()
    flat = tensor.view(-1)
    for start, stop in _padding_ranges(buf):
        lo, hi = max(start, offset), min(stop, end)
        if lo < hi:
            flat[lo - offset:hi - offset].zero_()
