"""Install a compression policy into Megatron-Core's data-parallel gradient and parameter collectives.

Megatron's ``_ParamAndGradBucketGroup`` issues one collective per bucket from ``start_grad_sync``
(reduce-scatter with the distributed optimizer through the module global
``dist_reduce_scatter_func``, else ``torch.distributed.all_reduce``) and ``start_param_sync``
(in-place all-gather through ``dist_all_gather_func``). We wrap those two methods. While one
runs, the collective it looks up is routed to ours (qgZ, the compressed all-reduce, qwZ) for
that bucket group only; the handles ours return are chained behind Megatron's own in
``grad_reduce_handle`` / ``param_gather_handle``, so Megatron waits them wherever it waits its
collectives (``finish_grad_sync``, ``finish_param_sync``, a forced sync). Megatron's code, its
bucketing, overlap and ``_coalescing_manager`` blocks stay as they are.

With a ``none`` codec (and ``dp_uncompressed: megatron``, the default) the wrapper calls
Megatron's original collective unchanged and only records its bytes from sizes (no topology, no
process group), so the ``none`` policy trains bit-identically to Megatron without the plugin. With ``dp_uncompressed: hierarchical`` (the
``fair`` preset) uncompressed collectives run on the project's algorithms instead.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Callable

import torch
import torch.distributed as dist

from megatron_zpp.comm import (HpzShard, Topology, comm_timers, compressed_all_reduce, hpz_all_gather,
                               qgz_reduce_scatter, quantized_all_gather, record_torch_collective, set_rounding_epoch)
from megatron_zpp.comm.wire import wire_format
from megatron_zpp.compression import get_codec
from megatron_zpp.policy import Policy, check_policy_agreement, check_policy_devices

logger = logging.getLogger(__name__)

GRAD_TAG, PARAM_TAG, PARAM_BWD_TAG = "dp.grad", "dp.param", "dp.param.bwd"
_ACTIVE: MegatronHooks | None = None  # the installed instance: one at a time per process


class MegatronHooks:
    """The installed policy. ``install()`` before building Megatron's DDP; ``uninstall()`` restores.

    Args:
        policy: the resolved policy (``dp.grad``, ``dp.param`` here; ``tp`` and ``pp`` through
            ``model_parallel.ModelParallelHooks``).
        ranks_per_node: for the topology of each data-parallel group (default: the policy's, then
            ``LOCAL_WORLD_SIZE``).
        iteration_source: returns ``(iteration, train_iters)`` when called; read by
            :meth:`sync_iteration` before every routed collective (the dp.grad schedule, the
            rounding seeds). Without it, call :meth:`set_iteration` yourself.
    """

    def __init__(self, policy: Policy, ranks_per_node: int | None = None,
                 iteration_source: Callable[[], tuple[int, int]] | None = None) -> None:
        self.policy = policy
        self.iteration_source = iteration_source
        self._iteration: int | None = None
        self._policy_agreed = False
        self.ranks_per_node = ranks_per_node or policy.ranks_per_node
        self._scheduled_grad_codec = policy.codec("dp.grad")
        # Divergence guard (megatron_zpp/training/divergence.py): while set, every lossy dimension runs
        # uncompressed; flipped only between iterations, at the same point on every rank.
        self.lossy_suspended = False
        # Decided once: the codec lookups on the comm path only test membership.
        self._lossy_specs = frozenset(spec for spec in policy.codecs.values()
                                      if spec != "none" and not get_codec(spec).lossless)
        self._topologies: dict[tuple, Topology] = {}
        self._hpz_shards: dict[tuple[int, int], HpzShard] = {}
        self._pending_gathers: dict[tuple, object] = {}  # (pipeline, bucket key) -> our gather handle
        # Error feedback: one fp32 residual per gradient bucket, keyed by a name that is the same in every run
        # of the same model and layout ("ddp.bucket3.n500000", "fsdp.bucket2"): not by storage, which
        # Megatron-FSDP allocates afresh for every reduction.
        self._residuals: dict[str, torch.Tensor] = {}
        self._loaded_residuals: dict[str, torch.Tensor] = {}
        self._saved: dict[str, object] = {}
        self._timed_methods: list[tuple[object, str, object]] = []  # (class or module, name, original)
        self.installed = False
        # Where the tensors the policy's codecs see live: the trainer sets it from its device; Megatron-LM's
        # script trains on CUDA whenever there is one.
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"

    # ------------------------------------------------------------------ schedule
    def set_iteration(self, iteration: int, train_iters: int) -> None:
        """Apply the dp.grad schedule: compress for the first ``dp_grad_until`` of the iterations."""
        compress = iteration < self.policy.dp_grad_until * train_iters
        self._scheduled_grad_codec = self.policy.codec("dp.grad") if compress else "none"

    @property
    def grad_codec(self) -> str:
        """The dp.grad codec of the current reduction: the schedule's, or none while lossy ones are suspended."""
        return self._unless_suspended(self._scheduled_grad_codec)

    def _intra_codec(self) -> str | None:
        """qgZ's intra-node hop codec; none with the reduction itself uncompressed (schedule or guard)."""
        return None if self.grad_codec == "none" else self.policy.dp_grad_intra

    def codec(self, dimension: str) -> str:
        """The codec ``dimension`` runs now (``dp.grad`` follows the schedule too)."""
        if dimension == "dp.grad":
            return self.grad_codec
        return self._unless_suspended(self.policy.codec(dimension))

    @property
    def lossy_dimensions(self) -> list[str]:
        """The dimensions whose codec loses information (what the divergence guard switches off)."""
        return [d for d, spec in self.policy.codecs.items() if spec in self._lossy_specs]

    def suspend_lossy(self, suspended: bool) -> None:
        """Run every lossy dimension uncompressed (``True``) or with its codec again. Call between
        iterations on every rank (both sides of each collective must agree on its codec)."""
        self.lossy_suspended = suspended
        if getattr(self, "_model_parallel", None) is not None:
            self._model_parallel.suspended = suspended
        if suspended:
            self.reset_error_feedback()

    def _unless_suspended(self, spec: str) -> str:
        if self.lossy_suspended and spec in self._lossy_specs:
            return "none"
        return spec

    def ensure_policy_agreed(self, group=None) -> None:
        """Check, once, that the ranks of ``group`` (default: the world) resolved the same policy.

        A collective over ``group``: call it only where all its ranks are at the same point. The world
        check runs at ``install()`` when torch.distributed is up, else right after Megatron's
        ``initialize_model_parallel`` (Megatron-LM installs the hooks before it initializes), and at
        ``pretrain_gpt.py``'s first iteration; never from a routed collective, which pipeline stages
        reach at different times (with an interleaved schedule stage 0 syncs gradients before sending
        to the last stage, so a world collective there deadlocks). A topology that finds no world check
        done checks its own members, who are all at its first collective (``topology``)."""
        if self._policy_agreed or not dist.is_initialized():
            return
        check_policy_agreement(self.policy, group=group)
        if group is None:
            self._policy_agreed = True

    def sync_iteration(self) -> None:
        """Read the iteration from ``iteration_source``; on a new one, apply the dp.grad schedule and
        restart the stochastic-rounding seed streams at it (reproducible across reruns and resumes).
        Called before every routed collective and, by ``pretrain_gpt.py``, at the start of every
        iteration. Communicates nothing."""
        if self.iteration_source is None:
            return
        iteration, train_iters = self.iteration_source()
        if iteration != self._iteration:
            self._iteration = iteration
            set_rounding_epoch(iteration)
            if self.policy.dp_grad_until < 1.0:
                if not train_iters:
                    raise ValueError(f"--zpp-dp-grad-until {self.policy.dp_grad_until} needs the number of "
                                     f"training iterations; it is {train_iters!r}")
                self.set_iteration(iteration, train_iters)

    # ------------------------------------------------------------------ topology
    def topology(self, group, hpz: bool = False) -> Topology:
        """The topology of a data-parallel group (with the policy's hpZ partition when ``hpz``).

        Built at the first routed collective on ``group``: its construction is a collective over
        ``group``'s members only (topology.py), who are all at that collective, so it is safe
        however the pipeline stages are timed. Megatron-FSDP's gather (hpZ) and reduce topologies
        over the same ranks share their process groups."""
        ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        hpz_size = self.policy.hpz_size if hpz else 1
        topo = self._topologies.get((ranks, hpz_size))
        if topo is None:
            topo = Topology(group, ranks_per_node=self.ranks_per_node, hpz_partition_size=hpz_size)
            self._topologies[(ranks, hpz_size)] = topo
            # Both sides of every hop must use the same codec: without the world check (a launcher that
            # never called initialize_model_parallel), the members check each other on our own group.
            if topo.private_group is not None:
                self.ensure_policy_agreed(group=topo.private_group)
        return topo

    # ------------------------------------------------------------------ hpZ state
    @property
    def hpz_enabled(self) -> bool:
        return self.policy.hpz_size != 1

    def invalidate_secondary(self) -> None:
        """Mark every hpZ secondary copy stale (the weights changed: optimizer step, checkpoint load)."""
        for shard in self._hpz_shards.values():
            shard.invalidate()

    @property
    def hpz_bytes(self) -> int:
        """Memory held by this rank's hpZ secondary copies."""
        return sum(shard.nbytes for shard in self._hpz_shards.values())

    def _hpz_shard(self, pipeline, bucket_id: int, shard_input, topo: Topology, codec: str) -> HpzShard:
        key = (id(pipeline), bucket_id)
        shard = self._hpz_shards.get(key)
        if shard is None or shard.shard_numel != shard_input.numel() or shard.dtype != shard_input.dtype \
                or shard.format is not wire_format(topo, codec, "HpzShard"):  # the divergence guard switched codecs
            shard = HpzShard(topo, shard_input.numel(), shard_input.dtype, codec, device=shard_input.device)
            self._hpz_shards[key] = shard
        return shard

    # ------------------------------------------------------------------ install
    def install(self) -> MegatronHooks:
        from megatron.core.distributed import param_and_grad_buffer as pgb

        global _ACTIVE
        if self.installed:
            return self
        if _ACTIVE is not None:
            raise RuntimeError("another MegatronHooks is installed in this process (policy "
                               f"{_ACTIVE.policy.name!r}); uninstall() it first: two would wrap each other")
        check_policy_devices(self.policy, self.device_type)  # before anything is patched
        try:
            self._install(pgb)
            self._check_policy_when_initialized()
        except BaseException:
            self.uninstall()  # restores whatever was patched before the failure
            raise
        self.installed = True
        _ACTIVE = self
        return self

    def _check_policy_when_initialized(self) -> None:
        """The world-wide policy check at a point every rank reaches together: now when torch.distributed
        is up (install is SPMD), else right after Megatron's ``initialize_model_parallel``."""
        if dist.is_initialized():
            self.ensure_policy_agreed()
            return
        from megatron.core import parallel_state

        original = parallel_state.initialize_model_parallel
        hooks = self

        def initialize_model_parallel(*args, **kwargs):
            result = original(*args, **kwargs)
            hooks.ensure_policy_agreed()
            return result

        parallel_state.initialize_model_parallel = initialize_model_parallel
        self._timed_methods.append((parallel_state, "initialize_model_parallel", original))

    def _install(self, pgb) -> None:
        cls = pgb._ParamAndGradBucketGroup
        hooks = self
        originals = {name: getattr(cls, name) for name in ("start_grad_sync", "start_param_sync")}
        self._saved = dict(originals)

        def start_grad_sync(bucket_group, force_all_reduce=False):
            hooks._check_supported(bucket_group)
            hooks.sync_iteration()
            with comm_timers().wait(), hooks._route_grad_collectives(pgb, bucket_group) as ours:
                result = originals["start_grad_sync"](bucket_group, force_all_reduce)
            # Megatron waits grad_reduce_handle in finish_grad_sync before it reads the bucket
            # (and, in 0.19, before _copy_back_extra_main_grads): ours join it there.
            bucket_group.grad_reduce_handle = _chain(bucket_group.grad_reduce_handle, ours)
            return result

        def start_param_sync(bucket_group, force_sync=False):
            hooks.sync_iteration()
            with comm_timers().wait(), hooks._route_param_gather(pgb, bucket_group) as ours:
                result = originals["start_param_sync"](bucket_group, force_sync)
            # finish_param_sync (and a forced sync) wait param_gather_handle before the forward
            # that needs the weights, including a gather that finish_param_sync itself dispatches.
            bucket_group.param_gather_handle = _chain(bucket_group.param_gather_handle, ours)
            return result

        cls.start_grad_sync = start_grad_sync
        cls.start_param_sync = start_param_sync
        self._time_waits(cls, ("finish_grad_sync", "finish_param_sync"))
        self._install_fsdp()
        from megatron_zpp.megatron.model_parallel import ModelParallelHooks

        # Kept before install(): install() rolls back its own patches on failure, and a later
        # failure here finds it through uninstall().
        self._model_parallel = ModelParallelHooks(self.policy.codec("pp"), self.policy.codec("tp"),
                                                  self.ranks_per_node)
        self._model_parallel.install()

    def _install_fsdp(self) -> None:
        """Megatron-FSDP (ZeRO-3): its pipelines call torch.distributed directly, so the routing wraps
        ``AllGatherPipeline.async_bucket_gather`` (qwZ forward, hpZ backward) and
        ``GradReducePipeline._bucket_group_gradient_reduce`` (qgZ), and every weight install
        (after the optimizer step, after a checkpoint load) invalidates the hpZ copies."""
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
            with comm_timers().wait(), hooks._route_fsdp_gather(pipeline, bucket_id, bwd):
                return originals["async_bucket_gather"](pipeline, bucket_id, bwd)

        def wait_bucket_ready(pipeline, bucket_id, bwd, *args, **kwargs):
            # all_gather_params replaces each bucket's event with its coalescing manager's, which
            # knows nothing of ours: decode here, before Megatron marks the bucket ready.
            with comm_timers().wait():
                handle = hooks._pending_gathers.pop((id(pipeline), pipeline.get_bucket_key(bucket_id, bwd)), None)
                if handle is not None:
                    handle.wait()
                return originals["wait_bucket_ready"](pipeline, bucket_id, bwd, *args, **kwargs)

        def bucket_group_gradient_reduce(pipeline, bucket_group, *args, **kwargs):
            hooks.sync_iteration()
            hooks._check_fsdp_supported(pipeline.buffer.ddp_config, kwargs.get("outer_fsdp_group_grad_reduce"))
            buffers = [(f"fsdp.bucket{b}", pipeline.get_fsdp_buffer(b)) for b in bucket_group]
            with comm_timers().wait(), hooks._route_fsdp_reduce(buffers, fsdp_buf):
                return originals["_bucket_group_gradient_reduce"](pipeline, bucket_group, *args, **kwargs)

        def copy_main_weights_to_model_weights(buffer, *args, **kwargs):
            # Reached by every sharding strategy after each optimizer step: the strategies whose
            # reduction bypasses the routed pipeline are refused here at the latest.
            hooks._check_fsdp_supported(buffer.ddp_config)
            result = originals["copy_main_weights_to_model_weights"](buffer, *args, **kwargs)
            hooks.invalidate_secondary()
            return result

        gather_cls.async_bucket_gather = async_bucket_gather
        gather_cls.wait_bucket_ready = wait_bucket_ready
        reduce_cls._bucket_group_gradient_reduce = bucket_group_gradient_reduce
        buffer_cls.copy_main_weights_to_model_weights = copy_main_weights_to_model_weights
        from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP

        self._time_waits(reduce_cls, ("wait_for_previous_grad_reduce",))
        self._time_waits(MegatronFSDP, ("synchronize_gradient_reduce", "synchronize_param_gather"))

    def _time_waits(self, cls, names: tuple[str, ...]) -> None:
        """Add the host time of ``cls``'s methods ``names`` (Megatron's own waits on its data-parallel
        collectives) to ``comm_timers().wait_s``; behaviour unchanged. Restored by ``uninstall``."""
        for name in names:
            original = getattr(cls, name)
            self._timed_methods.append((cls, name, inspect.getattr_static(cls, name)))

            @functools.wraps(original)
            def timed(*args, _original=original, **kwargs):
                with comm_timers().wait():
                    return _original(*args, **kwargs)
            setattr(cls, name, timed)

    @contextlib.contextmanager
    def _route_fsdp_gather(self, pipeline, bucket_id: int, bwd: bool):
        hooks = self
        original = dist.all_gather_into_tensor
        codec = self.codec("dp.param")

        def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
            if hooks._is_private(group):  # our own collectives' inner calls
                return original(output_tensor, input_tensor, group=group, async_op=async_op)
            tag = PARAM_BWD_TAG if bwd else PARAM_TAG
            if hooks._megatron_runs(codec) and not hooks.hpz_enabled:
                hooks._record_torch(tag, "all_gather", group, input_tensor.numel() * input_tensor.element_size(),
                                    input_tensor.device)
                return original(output_tensor, input_tensor, group=group, async_op=async_op)
            topo = hooks.topology(group, hpz=hooks.hpz_enabled)
            shard = hooks._hpz_shard(pipeline, bucket_id, input_tensor, topo, codec) if hooks.hpz_enabled else None
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
            if codec != "none":
                wbuf = pipeline.get_fsdp_buffer(bucket_id, bwd)
                _zero_padding(input_tensor, wbuf, wbuf.shard_bucket_index.bucket_data_index)
            handle = quantized_all_gather(output_tensor, input_tensor, topo, codec=codec, async_op=True, tag=tag,
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

    # ------------------------------------------------------------------ error feedback
    def _residual(self, grads: torch.Tensor, bucket: str | None) -> torch.Tensor | None:
        """The error-feedback residual of ``bucket`` (None: feedback off, or this reduction uncompressed by
        the dp_grad_until schedule: the residual is then kept, unused)."""
        if not self.policy.error_feedback or self.grad_codec == "none":
            return None
        if bucket is None:
            raise RuntimeError("error feedback: a gradient reduction without a bucket name (a routing path "
                               "this version does not know); turn --zpp-dp-grad-error-feedback off")
        residual = self._residuals.get(bucket)
        if residual is None:
            loaded = self._loaded_residuals.pop(bucket, None)
            if loaded is not None and loaded.numel() != grads.numel():
                raise ValueError(f"checkpoint error-feedback residual {bucket!r} has {loaded.numel()} elements; "
                                 f"this run's bucket has {grads.numel()} (another model or layout)")
            residual = (loaded.to(device=grads.device, dtype=torch.float32).contiguous() if loaded is not None
                        else torch.zeros(grads.numel(), dtype=torch.float32, device=grads.device))
            self._residuals[bucket] = residual
        elif residual.numel() != grads.numel():
            raise RuntimeError(f"error feedback: bucket {bucket!r} changed size ({residual.numel()} -> {grads.numel()})")
        return residual

    def reset_error_feedback(self) -> None:
        """Zero every error-feedback residual: after a step with non-finite gradients (a NaN would stay in the
        residual and poison every later reduction) and when lossy codecs are suspended."""
        for residual in self._residuals.values():
            residual.zero_()
        self._loaded_residuals = {}

    def state_dict(self) -> dict:
        """Compression state a checkpoint keeps: the error-feedback residuals, by bucket name."""
        return {"error_feedback_residuals": {k: r.detach().cpu().clone() for k, r in self._residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s residuals; each attaches to the bucket of its name when it is reduced."""
        residuals = dict(state.get("error_feedback_residuals", {}))
        if residuals and not self.policy.error_feedback:
            raise ValueError("the checkpoint holds error-feedback residuals but this run's policy has "
                             "error_feedback off; resume with --zpp-dp-grad-error-feedback or from another checkpoint")
        self._residuals = {}
        self._loaded_residuals = residuals

    def _megatron_runs(self, codec: str) -> bool:
        """Whether a collective with ``codec`` stays Megatron's own call (only recorded)."""
        return codec == "none" and self.policy.dp_uncompressed == "megatron"

    def _record_torch(self, tag: str, kind: str, group, chunk_bytes: int, device) -> None:
        """Bytes of one of Megatron's own collectives, from sizes only: no topology, no process group."""
        record_torch_collective(tag, kind, group, chunk_bytes, self.ranks_per_node, device)

    def _is_private(self, group) -> bool:
        """Whether ``group`` is one of our topologies' own groups (never routed again)."""
        if group is None:
            return False
        return any(topo.owns(group) for topo in self._topologies.values())

    def uninstall(self) -> None:
        from megatron.core.distributed import param_and_grad_buffer as pgb

        for name, fn in self._saved.items():
            setattr(pgb._ParamAndGradBucketGroup, name, fn)
        self._saved = {}
        if getattr(self, "_saved_fsdp", None):
            gather_cls, reduce_cls, buffer_cls, originals = self._saved_fsdp
            gather_cls.async_bucket_gather = originals["async_bucket_gather"]
            gather_cls.wait_bucket_ready = originals["wait_bucket_ready"]
            reduce_cls._bucket_group_gradient_reduce = originals["_bucket_group_gradient_reduce"]
            buffer_cls.copy_main_weights_to_model_weights = originals["copy_main_weights_to_model_weights"]
            self._saved_fsdp = None
        for cls, name, original in reversed(self._timed_methods):
            setattr(cls, name, original)
        self._timed_methods = []
        if getattr(self, "_model_parallel", None) is not None:
            self._model_parallel.uninstall()
            self._model_parallel = None
        self.installed = False
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None

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
        names = {b.grad_data.data_ptr(): f"ddp.bucket{b.bucket_id}.n{b.grad_data.numel()}"
                 for b in bucket_group.buckets}
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
        handles: list = []

        def all_gather(output, input, group=None, async_op=False):
            if hooks._megatron_runs(codec):
                hooks._record_torch(PARAM_TAG, "all_gather", group, input.numel() * input.element_size(), input.device)
                return original_ag(output, input, group=group, async_op=async_op)
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


def _op_name(op) -> str:
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "mean"
    raise ValueError(f"Megatron asked for reduce op {op}; megatron_zpp's gradient reduction supports SUM and AVG "
                     "(with Megatron-FSDP, PREMUL_SUM is replaced by scaling then SUM)")
