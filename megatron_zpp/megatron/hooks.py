"""Install a compression policy into Megatron-Core's data-parallel gradient and parameter collectives.

Megatron's ``_ParamAndGradBucketGroup`` issues one collective per bucket from four methods:
``start_grad_sync`` (reduce-scatter with the distributed optimizer through the module global
``dist_reduce_scatter_func``, else ``torch.distributed.all_reduce``), ``finish_grad_sync``,
``start_param_sync`` (in-place all-gather through ``dist_all_gather_func``) and
``finish_param_sync``. We wrap those four methods. While a ``start_*`` method runs, the
collective it looks up is routed to ours (qgZ, the compressed all-reduce, qwZ) for this
bucket group only; the handles ours return are kept on the bucket group and waited in the
matching ``finish_*`` (Megatron itself keeps the coalescing manager's handle, which knows
nothing of ours). Megatron's code, its bucketing, overlap and ``_coalescing_manager`` blocks
stay as they are.

With a ``none`` codec the wrapper calls Megatron's original collective unchanged and only
records its bytes, so the ``none`` policy trains bit-identically to Megatron without the plugin.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from megatron_zpp.comm import (Topology, compressed_all_reduce, qgz_reduce_scatter, quantized_all_gather,
                               record_torch_collective)
from megatron_zpp.policy import Policy

logger = logging.getLogger(__name__)

GRAD_TAG, PARAM_TAG = "dp.grad", "dp.param"


class MegatronHooks:
    """The installed policy. ``install()`` before building Megatron's DDP; ``uninstall()`` restores.

    Args:
        policy: the resolved policy (``dp.grad`` and ``dp.param`` are used here; ``tp``/``pp``
            arrive with issue [4] and must be ``none``).
        ranks_per_node: for the topology of each data-parallel group (default: the policy's, then
            ``LOCAL_WORLD_SIZE``).
    """

    def __init__(self, policy: Policy, ranks_per_node: int | None = None) -> None:
        for dim in ("tp", "pp"):
            if policy.compresses(dim):
                raise NotImplementedError(f"policy {policy.name!r} compresses {dim} ({policy.codec(dim)}); "
                                          f"tensor/pipeline-parallel compression arrives in issue [4]; "
                                          f"set --zpp-{dim} none")
        self.policy = policy
        self.ranks_per_node = ranks_per_node or policy.ranks_per_node
        self.grad_codec = policy.codec("dp.grad")
        self._topologies: dict[tuple[int, ...], Topology] = {}
        self._saved: dict[str, object] = {}
        self.installed = False

    # ------------------------------------------------------------------ schedule
    def set_iteration(self, iteration: int, train_iters: int) -> None:
        """Apply the dp.grad schedule: compress for the first ``dp_grad_until`` of the iterations."""
        compress = iteration < self.policy.dp_grad_until * train_iters
        self.grad_codec = self.policy.codec("dp.grad") if compress else "none"

    # ------------------------------------------------------------------ topology
    def topology(self, group) -> Topology:
        ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        topo = self._topologies.get(ranks)
        if topo is None:
            topo = Topology(group, ranks_per_node=self.ranks_per_node, hpz_partition_size=1)
            self._topologies[ranks] = topo
        return topo

    # ------------------------------------------------------------------ install
    def install(self) -> MegatronHooks:
        from megatron.core.distributed import param_and_grad_buffer as pgb

        if self.installed:
            return self
        cls = pgb._ParamAndGradBucketGroup
        hooks = self
        originals = {name: getattr(cls, name) for name in
                     ("start_grad_sync", "finish_grad_sync", "start_param_sync", "finish_param_sync")}
        self._saved = dict(originals)

        def start_grad_sync(bucket_group, force_all_reduce=False):
            hooks._check_supported(bucket_group)
            with hooks._route_grad_collectives(pgb, bucket_group):
                return originals["start_grad_sync"](bucket_group, force_all_reduce)

        def finish_grad_sync(bucket_group, force_all_reduce=False):
            result = originals["finish_grad_sync"](bucket_group, force_all_reduce)
            _wait_all(bucket_group, "_zpp_grad_handles")
            return result

        def start_param_sync(bucket_group, force_sync=False):
            if force_sync:
                _wait_all(bucket_group, "_zpp_param_handles")
            with hooks._route_param_gather(pgb, bucket_group):
                return originals["start_param_sync"](bucket_group, force_sync)

        def finish_param_sync(bucket_group, *args, **kwargs):
            _wait_all(bucket_group, "_zpp_param_handles")
            return originals["finish_param_sync"](bucket_group, *args, **kwargs)

        cls.start_grad_sync = start_grad_sync
        cls.finish_grad_sync = finish_grad_sync
        cls.start_param_sync = start_param_sync
        cls.finish_param_sync = finish_param_sync
        self.installed = True
        return self

    def uninstall(self) -> None:
        from megatron.core.distributed import param_and_grad_buffer as pgb

        for name, fn in self._saved.items():
            setattr(pgb._ParamAndGradBucketGroup, name, fn)
        self._saved = {}
        self.installed = False

    # ------------------------------------------------------------------ routing
    def _check_supported(self, bucket_group) -> None:
        cfg = bucket_group.ddp_config
        if cfg.num_distributed_optimizer_instances > 1 and self.policy.compresses("dp.grad"):
            raise NotImplementedError("dp.grad compression with num_distributed_optimizer_instances > 1 is not "
                                      "supported; use 1 instance or --zpp-dp-grad none")
        if cfg.reduce_scatter_with_fp32_accumulation and self.policy.compresses("dp.grad"):
            raise ValueError("--ddp-reduce-scatter-with-fp32-accumulation replaces the reduce-scatter that "
                             "dp.grad compression replaces; use one or the other")

    @contextlib.contextmanager
    def _route_grad_collectives(self, pgb, bucket_group):
        hooks = self
        original_rs = pgb.dist_reduce_scatter_func
        original_ar = dist.all_reduce
        grad_buffers = {id(b.grad_data) for b in bucket_group.buckets}
        handles = bucket_group.__dict__.setdefault("_zpp_grad_handles", [])

        def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            topo = hooks.topology(group)
            if hooks.grad_codec == "none":
                record_torch_collective(GRAD_TAG, "reduce_scatter", topo, output.numel() * output.element_size())
                return original_rs(output, input, op=op, group=group, async_op=async_op)
            handle = qgz_reduce_scatter(output, input, topo, codec=hooks.grad_codec, op=_op_name(op),
                                        async_op=async_op, tag=GRAD_TAG, intra_codec=hooks.policy.dp_grad_intra,
                                        stages=hooks.policy.qgz_stages)
            if handle is not None:
                handles.append(handle)
            return None  # inside Megatron's _coalescing_manager: nothing for it to track

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if id(tensor) not in grad_buffers:  # not a bucket's gradient: leave it alone
                return original_ar(tensor, op=op, group=group, async_op=async_op)
            topo = hooks.topology(group)
            if hooks.grad_codec == "none":
                record_torch_collective(GRAD_TAG, "all_reduce", topo,
                                        tensor.numel() * tensor.element_size() // max(topo.size, 1))
                return original_ar(tensor, op=op, group=group, async_op=async_op)
            handle = compressed_all_reduce(tensor, topo, codec=hooks.grad_codec, op=_op_name(op),
                                           async_op=async_op, tag=GRAD_TAG, intra_codec=hooks.policy.dp_grad_intra,
                                           stages=hooks.policy.qgz_stages)
            if handle is not None:
                handles.append(handle)
            return None

        pgb.dist_reduce_scatter_func = reduce_scatter
        dist.all_reduce = all_reduce
        try:
            yield
        finally:
            pgb.dist_reduce_scatter_func = original_rs
            dist.all_reduce = original_ar

    @contextlib.contextmanager
    def _route_param_gather(self, pgb, bucket_group):
        hooks = self
        original_ag = pgb.dist_all_gather_func
        codec = self.policy.codec("dp.param")
        handles = bucket_group.__dict__.setdefault("_zpp_param_handles", [])

        def all_gather(output, input, group=None, async_op=False):
            topo = hooks.topology(group)
            if codec == "none":
                record_torch_collective(PARAM_TAG, "all_gather", topo, input.numel() * input.element_size())
                return original_ag(output, input, group=group, async_op=async_op)
            handle = quantized_all_gather(output, input, topo, codec=codec, async_op=async_op, tag=PARAM_TAG)
            if handle is not None:
                handles.append(handle)
            return None

        pgb.dist_all_gather_func = all_gather
        try:
            yield
        finally:
            pgb.dist_all_gather_func = original_ag


def _wait_all(bucket_group, attr: str) -> None:
    handles = bucket_group.__dict__.get(attr)
    while handles:
        handles.pop(0).wait()


def _op_name(op) -> str:
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "mean"
    raise ValueError(f"Megatron asked for reduce op {op}; compressed gradient reduction supports SUM and AVG")
