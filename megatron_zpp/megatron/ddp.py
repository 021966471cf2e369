"""The Megatron DDP path: ``_ParamAndGradBucketGroup``'s bucket collectives, with or without the
distributed optimizer, and the gradient reduction Megatron-FSDP's path reuses.

Wraps ``start_grad_sync`` (reduce-scatter through the module global ``dist_reduce_scatter_func`` with the
distributed optimizer, else ``torch.distributed.all_reduce`` of the bucket) and ``start_param_sync``
(all-gather through ``dist_all_gather_func``). While one runs, the collective it looks up is routed to
ours (qgZ, the compressed all-reduce, qwZ) for that bucket group only; the handles ours return are
chained behind Megatron's own in ``grad_reduce_handle`` / ``param_gather_handle``.

Invariants: Megatron waits our collectives exactly where it waits its own (``finish_grad_sync``,
``finish_param_sync``, a forced sync), so nothing reads a bucket before ours is decoded; our collectives
run on the topology's private groups, never inside Megatron's ``_coalescing_manager`` on its group
(``comm/topology.py``); with ``none`` and ``dp_uncompressed: megatron`` Megatron's call runs unchanged,
only recorded. Part of :class:`~megatron_zpp.megatron.hooks.MegatronHooks` (a mixin: it uses the hooks'
policy, ``topology()``, ``sync_iteration()`` and error-feedback residuals).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_zpp.compression import get_codec
from megatron_zpp.comm import (HeldShard, comm_timers, compressed_all_reduce, qgz_reduce_scatter, quantized_all_gather,
                               weight_difference_all_gather)
from megatron_zpp.megatron.replica_check import is_expert_parameter

GRAD_TAG, PARAM_TAG = "dp.grad", "dp.param"


class DdpRouting:
    """``MegatronHooks``' routing of Megatron DDP's bucket collectives (module docstring)."""

    # ------------------------------------------------------------------ install
    def _install_ddp(self, pgb) -> None:
        """Wrap ``_ParamAndGradBucketGroup.start_grad_sync`` / ``start_param_sync``; restored by ``_uninstall_ddp``."""
        cls = pgb._ParamAndGradBucketGroup
        hooks = self
        originals = {name: getattr(cls, name) for name in ("start_grad_sync", "start_param_sync")}
        self._saved = dict(originals)

        def start_grad_sync(bucket_group, force_all_reduce=False):
            hooks._check_supported(bucket_group)
            hooks.sync_iteration()
            with comm_timers().wait("start_grad_sync"), hooks._route_grad_collectives(pgb, bucket_group) as ours:
                result = originals["start_grad_sync"](bucket_group, force_all_reduce)
            # Megatron waits grad_reduce_handle in finish_grad_sync before it reads the bucket
            # (and, in 0.19, before _copy_back_extra_main_grads): ours join it there.
            bucket_group.grad_reduce_handle = _chain(bucket_group.grad_reduce_handle, ours)
            return result

        def start_param_sync(bucket_group, force_sync=False):
            hooks.sync_iteration()
            with comm_timers().wait("start_param_sync"), hooks._route_param_gather(pgb, bucket_group) as ours:
                result = originals["start_param_sync"](bucket_group, force_sync)
            # finish_param_sync (and a forced sync) wait param_gather_handle before the forward
            # that needs the weights, including a gather that finish_param_sync itself dispatches.
            bucket_group.param_gather_handle = _chain(bucket_group.param_gather_handle, ours)
            return result

        cls.start_grad_sync = start_grad_sync
        cls.start_param_sync = start_param_sync
        self._install_exact_weights()
        self._time_waits(cls, ("finish_grad_sync", "finish_param_sync"))

    def _uninstall_ddp(self) -> None:
        from megatron.core.distributed import param_and_grad_buffer as pgb

        for name, fn in self._saved.items():
            setattr(pgb._ParamAndGradBucketGroup, name, fn)
        self._saved = {}
        if self._saved_optimizer_step is not None:
            from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

            DistributedOptimizer.step_with_ready_grads = self._saved_optimizer_step
            self._saved_optimizer_step = None

    # ------------------------------------------------------------------ routing
    def _check_supported(self, bucket_group) -> None:
        cfg = bucket_group.ddp_config
        ours = not self._megatron_runs(self.policy.codec("dp.grad"))
        if cfg.num_distributed_optimizer_instances > 1 and ours:
            raise NotImplementedError("dp.grad compression with num_distributed_optimizer_instances > 1 is not "
                                      "supported; use 1 instance, or --zpp-dp-grad none with --zpp-dp-uncompressed megatron")
        if cfg.reduce_scatter_with_fp32_accumulation and ours:
            raise ValueError("--ddp-reduce-scatter-with-fp32-accumulation replaces the reduce-scatter that "
                             "dp.grad compression (or the hierarchical baseline) replaces; use one or the other")

    @contextlib.contextmanager
    def _route_grad_collectives(self, pgb, bucket_group):
        """While Megatron's start_grad_sync runs: its bucket reduce-scatters / all-reduces go to ours.
        Yields the list our async handles are appended to."""
        hooks = self
        original_rs = pgb.dist_reduce_scatter_func
        original_ar = dist.all_reduce
        grad_buffers = {id(b.grad_data) for b in bucket_group.buckets}
        # Stable names for error feedback: the bucket whose gradients a collective reduces.
        # MoE: expert buckets (Megatron-Core marks their parameters allreduce=False) count their ids from 0 too.
        names = {b.grad_data.data_ptr(): f"ddp.{'expert.' if _is_expert_bucket(b) else ''}bucket{b.bucket_id}"
                                         f".n{b.grad_data.numel()}" for b in bucket_group.buckets}
        handles: list = []

        def keep(result_and_handle):
            result, handle = result_and_handle
            if handle is not None:
                handles.append(handle)
            return result  # ours: None, nothing for Megatron's _coalescing_manager to track

        def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            return keep(hooks._reduce_scatter_grads(original_rs, output, input, op, group, async_op,
                                                    bucket=names.get(input.data_ptr())))

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if id(tensor) not in grad_buffers:  # not a bucket's gradient: leave it alone
                return original_ar(tensor, op=op, group=group, async_op=async_op)
            return keep(hooks._all_reduce_grads(original_ar, tensor, op, group, async_op,
                                                bucket=names.get(tensor.data_ptr())))

        pgb.dist_reduce_scatter_func = reduce_scatter
        dist.all_reduce = all_reduce
        try:
            yield handles
        finally:
            pgb.dist_reduce_scatter_func = original_rs
            dist.all_reduce = original_ar

    @contextlib.contextmanager
    def _route_param_gather(self, pgb, bucket_group):
        """While Megatron's start_param_sync runs: its bucket all-gathers go to qwZ (or are only
        recorded with ``none``). Yields the list our async handles are appended to."""
        hooks = self
        original_ag = pgb.dist_all_gather_func
        codec = self.codec("dp.param")
        difference = self.policy.param_difference and codec != "none"  # "none": suspended by the divergence guard
        lossy = codec != "none" and not get_codec(codec).lossless
        handles: list = []

        def all_gather(output, input, group=None, async_op=False):
            if hooks.policy.param_difference and not difference:
                hooks._held_shards.pop(hooks._bucket_key(output), None)  # replicas get exact weights: resync after
            if hooks._megatron_runs(codec):
                hooks._record_torch(PARAM_TAG, "all_gather", group, input.numel() * input.element_size(), input.device)
                return original_ag(output, input, group=group, async_op=async_op)
            if difference:
                if output.dtype == torch.float32:
                    # fp32: the owner's slice is the optimizer's master shard, which the decoded weights replace
                    # at the gather: kept aside and put back before its next step, as for a lossy qwZ (below).
                    hooks._keep_exact(output, input)
                handle = weight_difference_all_gather(output, input, hooks._held_shard(output, input),
                                                      hooks.topology(group), codec=codec, async_op=async_op,
                                                      tag=PARAM_TAG)
            else:
                if output.dtype == torch.float32 and lossy:
                    hooks._keep_exact(output, input)
                handle = quantized_all_gather(output, input, hooks.topology(group), codec=codec, async_op=async_op,
                                              tag=PARAM_TAG)
            if handle is not None:
                handles.append(handle)
            return None

        pgb.dist_all_gather_func = all_gather
        try:
            yield handles
        finally:
            pgb.dist_all_gather_func = original_ag

    # ------------------------------------------------------------------ qWD's held shards
    @staticmethod
    def _bucket_key(output) -> tuple:
        """A bucket, by its gathered parameter buffer (qWD's held shards and the fp32 exact shards are kept per
        bucket)."""
        return output.data_ptr(), output.numel(), output.dtype

    def _held_shard(self, output, input) -> HeldShard:
        """This rank's :class:`HeldShard` of the bucket whose gathered weights are ``output``: empty (a
        full-precision gather first) when new or after :meth:`resync_weights`."""
        held = self._held_shards.get(self._bucket_key(output))
        if held is None:
            held = self._held_shards[self._bucket_key(output)] = HeldShard(input.numel(), input.dtype, input.device)
        return held

    def resync_weights(self, loaded: bool = False) -> None:
        """The next weight gather of every bucket is in full precision (qWD): call on every rank with
        ``loaded=True`` after the weights changed other than by an optimizer step (a checkpoint load); the hooks
        call it every ``param_resync_interval`` iterations (``sync_iteration``). Without qWD there is nothing to
        do. Only a load drops the owners' exact fp32 shards kept at the last gather: the loaded weights replace
        them; a periodic resync lands between a gather and the step that must start from them."""
        for held in self._held_shards.values():
            held.invalidate()
        if loaded:
            self._exact_pending.clear()

    # ------------------------------------------------------------------ fp32 weights: the optimizer's own shard
    # With fp32 weights Megatron's distributed optimizer keeps no separate master copy: its main parameters are
    # views of its shard of the gathered buffer (distrib_optimizer.py, "fp32 params"). A lossy gather decodes
    # every row into that buffer, the owner's too, so the owner's exact weights are kept aside at the gather and
    # put back before the optimizer's next step (and while a checkpoint is saved): the optimizer always steps
    # from its own weights, every replica computes with the decoded ones.
    def _keep_exact(self, output, input) -> None:
        key = self._bucket_key(output)
        if key in self._exact_pending:
            # A second gather before the next step (a forced sync for a save or an evaluation, then the next
            # forward's): the shard holds the decoded weights by now; the exact ones are already kept.
            return
        exact = self._exact_shards.get(key, (None, None))[1]
        if exact is None or exact.numel() != input.numel():
            exact = torch.empty_like(input)
        exact.copy_(input)  # before the gather is launched: its decode overwrites ``input``
        self._exact_shards[key] = (input, exact)
        self._exact_pending.add(key)

    def restore_exact_weights(self, optimizer=None) -> None:
        """Put the owner's exact fp32 shards back where the optimizer reads them (the wrapped
        ``DistributedOptimizer.step_with_ready_grads`` calls this first); each gather's are used once. With an
        ``optimizer``, only the shards of its own parameter buffers: under a ChainedOptimizer (MoE: dense and
        expert optimizers) the first optimizer's step gathers its buffers before the second one steps."""
        owned = _buffer_ranges(optimizer)
        for key in [k for k in self._exact_pending if owned is None or any(lo <= k[0] < hi for lo, hi in owned)]:
            view, exact = self._exact_shards[key]
            view.copy_(exact)
            self._exact_pending.discard(key)

    @contextlib.contextmanager
    def exact_weights(self):
        """While active (a checkpoint save), the owners' shards hold the optimizer's exact fp32 weights, which a
        save writes as the master copy; afterwards the decoded weights the replicas share again."""
        swapped = []
        for key in self._exact_pending:
            view, exact = self._exact_shards[key]
            swapped.append((view, view.clone()))
            view.copy_(exact)
        try:
            yield
        finally:
            for view, decoded in swapped:
                view.copy_(decoded)

    def _install_exact_weights(self) -> None:
        """Wrap ``DistributedOptimizer.step_with_ready_grads``: the exact shards first (restored by
        ``_uninstall_ddp``)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        hooks = self
        original = DistributedOptimizer.step_with_ready_grads

        def step_with_ready_grads(optimizer, *args, **kwargs):
            hooks.restore_exact_weights(optimizer)
            return original(optimizer, *args, **kwargs)

        DistributedOptimizer.step_with_ready_grads = step_with_ready_grads
        self._saved_optimizer_step = original

    # ------------------------------------------------------------------ the gradient reduction (fsdp.py's too)
    def _reduce_scatter_grads(self, original, output, input, op, group, async_op, bucket: str | None = None):
        """``(result, handle)``: Megatron's own reduce-scatter, recorded; or ours (qgZ, or its
        uncompressed 2-hop form for the fair baseline)."""
        if self._megatron_runs(self.grad_codec):
            self._record_torch(GRAD_TAG, "reduce_scatter", group, output.numel() * output.element_size(),
                               output.device)
            return original(output, input, op=op, group=group, async_op=async_op), None
        return None, qgz_reduce_scatter(output, input, self.topology(group), codec=self.grad_codec, op=_op_name(op),
                                        async_op=async_op, tag=GRAD_TAG, intra_codec=self._intra_codec(),
                                        stages=self.policy.qgz_stages, residual=self._residual(input, bucket))

    def _all_reduce_grads(self, original, tensor, op, group, async_op, bucket: str | None = None):
        """``(result, handle)``: Megatron's own all-reduce, recorded; or ours (compressed or the
        uncompressed hierarchical one)."""
        if self._megatron_runs(self.grad_codec):
            size = dist.get_world_size(group)
            self._record_torch(GRAD_TAG, "all_reduce", group, tensor.numel() * tensor.element_size() // size,
                               tensor.device)
            return original(tensor, op=op, group=group, async_op=async_op), None
        return None, compressed_all_reduce(tensor, self.topology(group), codec=self.grad_codec, op=_op_name(op), async_op=async_op,
                                           tag=GRAD_TAG, intra_codec=self._intra_codec(),
                                           stages=self.policy.qgz_stages, residual=self._residual(tensor, bucket))


def _is_expert_bucket(bucket) -> bool:
    return any(is_expert_parameter(p) for p in bucket.params_list)


def _buffer_ranges(optimizer) -> list[tuple[int, int]] | None:
    """The address ranges of a DistributedOptimizer's parameter buffers (None: not known, restore all)."""
    buffers = list(getattr(optimizer, "buffers", None) or []) + list(getattr(optimizer, "expert_parallel_buffers",
                                                                             None) or [])
    data = [b.param_data for b in buffers if getattr(b, "param_data", None) is not None]
    if not data:
        return None
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in data]


class _ChainedHandle:
    """Megatron's handle of a bucket group's collectives (its coalescing manager), then ours.

    Stored where Megatron keeps its own handle, so Megatron waits ours exactly where it waits its
    collectives: before any code reads the gathered weights or the reduced gradients."""

    def __init__(self, megatron_handle, ours: list) -> None:
        self._megatron, self._ours = megatron_handle, list(ours)

    def wait(self) -> bool:
        if self._megatron is not None:
            self._megatron.wait()
            self._megatron = None
        while self._ours:
            self._ours.pop(0).wait()
        return True

    def is_completed(self) -> bool:
        return self._megatron is None and not self._ours


def _chain(megatron_handle, ours: list):
    if not ours:
        return megatron_handle
    if megatron_handle is None:
        # Megatron issued synchronously (it keeps no handle): so must we be finished now.
        for h in ours:
            h.wait()
        return None
    return _ChainedHandle(megatron_handle, ours)


def _op_name(op) -> str:
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "mean"
    raise ValueError(f"Megatron asked for reduce op {op}; megatron_zpp's gradient reduction supports SUM and AVG "
                     "(with Megatron-FSDP, PREMUL_SUM is replaced by scaling then SUM)")
