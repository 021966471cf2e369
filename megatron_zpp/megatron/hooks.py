"""Install a compression policy into Megatron-Core: the hooks' shared core.

:class:`MegatronHooks` holds what every routed collective reads: the resolved policy and its dp.grad
schedule, the divergence guard's suspension of lossy codecs, one ``Topology`` per data-parallel group,
the error-feedback residuals (checkpointed with the model), and install / uninstall. The routing itself
lives beside it, one file per Megatron path:

- ``ddp.py``: Megatron DDP's bucket groups (``_ParamAndGradBucketGroup.start_grad_sync`` /
  ``start_param_sync``), with or without the distributed optimizer;
- ``fsdp.py``: Megatron-FSDP's pipelines (``AllGatherPipeline``, ``GradReducePipeline``) and hpZ;
- ``model_parallel.py``: pipeline p2p and tensor-parallel collectives (``pp`` / ``tp`` codecs).

This file wraps only ``parallel_state.initialize_model_parallel`` (to check the policy across ranks right
after it, when the hooks are installed before torch.distributed is up) and Megatron's own wait methods
(timed, behaviour unchanged). Invariants: every rank resolved the same policy before any routed
collective (``ensure_policy_agreed``), one instance is installed per process, and ``uninstall()``
restores every patched attribute exactly as it was stored.

With a ``none`` codec (and ``dp_uncompressed: megatron``, the default) the wrappers call Megatron's
original collectives unchanged and only record their bytes from sizes (no topology, no process group),
so the ``none`` policy trains bit-identically to Megatron without the plugin. With ``dp_uncompressed:
hierarchical`` (the ``fair`` preset) uncompressed collectives run on the project's algorithms instead.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Callable

import torch
import torch.distributed as dist

from megatron_zpp.comm import HeldShard, HpzShard, Topology, comm_timers, record_torch_collective, set_rounding_epoch
from megatron_zpp.compression import get_codec
from megatron_zpp.megatron.ddp import DdpRouting
from megatron_zpp.megatron.fsdp import FsdpRouting
from megatron_zpp.policy import Policy, check_policy_agreement, check_policy_devices

logger = logging.getLogger(__name__)

_ACTIVE: MegatronHooks | None = None  # the installed instance: one at a time per process


class MegatronHooks(DdpRouting, FsdpRouting):
    """The installed policy. ``install()`` before building Megatron's DDP; ``uninstall()`` restores.

    Args:
        policy: the resolved policy (``dp.grad``, ``dp.param`` here; ``tp`` and ``pp`` through
            ``model_parallel.ModelParallelHooks``).
        ranks_per_node: for the topology of each data-parallel group (default: the policy's, then
            ``LOCAL_WORLD_SIZE``).
        iteration_source: returns ``(iteration, train_iters)`` when called; read by
            :meth:`sync_iteration` before every routed collective (the dp.grad schedule, the
            rounding seeds). Without it, call :meth:`set_iteration` yourself.
        model_parallel_codecs: the ``tp`` / ``pp`` codecs to install (default: the policy's); a policy
            :meth:`switch_policy` takes runs each of them or none (``--zpp-policy auto`` installs the codec it
            may choose, off until it does).
    """

    def __init__(self, policy: Policy, ranks_per_node: int | None = None,
                 iteration_source: Callable[[], tuple[int, int]] | None = None,
                 model_parallel_codecs: dict[str, str] | None = None) -> None:
        self.policy = policy
        self.model_parallel_codecs = dict(model_parallel_codecs or {d: policy.codec(d) for d in ("tp", "pp")})
        # --zpp-policy auto: the running policy changes (switch_policy), a checkpoint may hold another one's state
        self.policy_switches = policy.name == "auto"
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
        self._hpz_buffer_of: dict[tuple, int] = {}  # hpZ copy's key -> id() of its Megatron-FSDP weight buffer
        self._held_shards: dict[tuple, HeldShard] = {}  # qWD: (bucket buffer ptr, numel, dtype) -> held shard
        # fp32 weights under a lossy dp.param codec: bucket key -> (the owner's shard view, its exact values), and
        # the keys gathered since the last optimizer step (ddp.py, "the optimizer's own shard")
        self._exact_shards: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._exact_pending: set[tuple] = set()
        self._saved_optimizer_step = None
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

    def can_switch_to(self, policy: Policy) -> bool:
        """Whether :meth:`switch_policy` can take ``policy``: its tp / pp codecs are the installed ones or none,
        and it splits the ranks into the same nodes."""
        return (all(policy.codec(d) in ("none", self.model_parallel_codecs[d]) for d in ("tp", "pp"))
                and (policy.ranks_per_node or self.ranks_per_node) == self.ranks_per_node)

    def switch_policy(self, policy: Policy) -> None:
        """Run ``policy`` from the next collective on (``--zpp-policy auto``). Like :meth:`suspend_lossy`, call it
        between iterations on every rank, with every rank's previous collectives issued (both sides of each
        collective must agree on its codec); the divergence guard's suspension stays as it is, applied to the new
        policy's lossy dimensions.

        Only what the change makes stale is dropped, so a switch that keeps the weight scheme costs no extra
        traffic. A new weight scheme (dp.param codec, qWD, hpZ size) drops qWD's held shards and hpZ's secondary
        copies and frees their memory (the next gather of every bucket is in full precision, so a later switch back
        to qWD starts exact, and every replica starts from the same weights); a new dp.grad codec zeroes the
        error-feedback residuals (they hold the old codec's error), a policy without error feedback drops them.
        The owners' exact fp32 shards kept at a lossy gather stay: the optimizer's next step still starts from them,
        whatever the new codec. A Megatron-FSDP gather prefetched by the last step keeps the codec it was issued
        with (decoded the same on every replica)."""
        if not self.can_switch_to(policy):
            raise ValueError(f"cannot switch to policy {policy.name!r}: tp {policy.codec('tp')!r} / pp "
                             f"{policy.codec('pp')!r} must be none or the installed {self.model_parallel_codecs}, and "
                             f"ranks per node {policy.ranks_per_node} must be {self.ranks_per_node}")
        check_policy_devices(policy, self.device_type)
        old = self.policy
        weights_change = old.weight_scheme != policy.weight_scheme
        self.policy = policy
        self._lossy_specs = frozenset(spec for spec in policy.codecs.values()
                                      if spec != "none" and not get_codec(spec).lossless)
        self._scheduled_grad_codec = policy.codec("dp.grad")
        if self._iteration is not None and policy.dp_grad_until < 1.0 and self.iteration_source is not None:
            self.set_iteration(*self.iteration_source())
        mp = getattr(self, "_model_parallel", None)
        if mp is not None:
            mp.off = {d for d in ("tp", "pp") if policy.codec(d) == "none"}
        if not policy.error_feedback:
            self._residuals = {}
            self._loaded_residuals = {}
        elif (old.codec("dp.grad"), old.dp_grad_intra) != (policy.codec("dp.grad"), policy.dp_grad_intra):
            self.reset_error_feedback()
        if weights_change:
            self._held_shards.clear()  # in-flight gathers keep theirs alive until they complete
            self._hpz_shards.clear()
            self._hpz_buffer_of.clear()

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
            interval = self.policy.param_resync_interval
            if interval and iteration and iteration % interval == 0:
                self.resync_weights()
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
        over the same ranks share their process groups.

        The hpZ partition is the group's own (``Policy.hpz_partition``): an MoE expert-data-parallel group, which
        often has fewer members per node than the dense one (one, once EP x expert-TP fills the node), gets one it
        can hold; a partition of 1, which ``hpz_partitioned`` reads as no secondary copy."""
        ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        hpz_size = 1
        if hpz and self.policy.hpz_size != 1:
            hpz_size = self.policy.hpz_partition(self.topology(group).node_size)
        topo = self._topologies.get((ranks, hpz_size))
        if topo is None:
            topo = Topology(group, ranks_per_node=self.ranks_per_node, hpz_partition_size=hpz_size)
            self._topologies[(ranks, hpz_size)] = topo
            # Both sides of every hop must use the same codec: without the world check (a launcher that
            # never called initialize_model_parallel), the members check each other on our own group.
            if topo.private_group is not None:
                self.ensure_policy_agreed(group=topo.private_group)
        return topo

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
        self._install_ddp(pgb)
        self._install_fsdp()
        from megatron_zpp.megatron.model_parallel import ModelParallelHooks

        # Kept before install(): install() rolls back its own patches on failure, and a later
        # failure here finds it through uninstall().
        self._model_parallel = ModelParallelHooks(self.model_parallel_codecs["pp"], self.model_parallel_codecs["tp"],
                                                  self.ranks_per_node)
        # Installed but not in the policy (auto's choices): off until switch_policy turns it on.
        self._model_parallel.off = {d for d in ("tp", "pp") if self.policy.codec(d) == "none"}
        self._model_parallel.install()
        from megatron_zpp.megatron.expert_parallel import ExpertParallelHooks

        # MoE: every token dispatch / combine reads its codec here when it starts (suspension and switches apply).
        self._expert_parallel = ExpertParallelHooks(self.codec, self.ranks_per_node)
        self._expert_parallel.install()

    def _time_waits(self, cls, names: tuple[str, ...]) -> None:
        """Add the host time of ``cls``'s methods ``names`` (Megatron's own waits on its data-parallel
        collectives) to ``comm_timers().wait_s``; behaviour unchanged. Restored by ``uninstall``."""
        for name in names:
            original = getattr(cls, name)
            self._timed_methods.append((cls, name, inspect.getattr_static(cls, name)))

            @functools.wraps(original)
            def timed(*args, _original=original, _site=name, **kwargs):
                with comm_timers().wait(_site):
                    return _original(*args, **kwargs)
            setattr(cls, name, timed)

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
        if residuals and not (self.policy.error_feedback or self.policy_switches):
            raise ValueError("the checkpoint holds error-feedback residuals but this run's policy has "
                             "error_feedback off; resume with --zpp-dp-grad-error-feedback or from another checkpoint")
        self._residuals = {}
        self._loaded_residuals = residuals

    # ------------------------------------------------------------------ Megatron's call or ours (both paths)
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
        self._uninstall_ddp()
        self._uninstall_fsdp()
        for cls, name, original in reversed(self._timed_methods):
            setattr(cls, name, original)
        self._timed_methods = []
        if getattr(self, "_model_parallel", None) is not None:
            self._model_parallel.uninstall()
            self._model_parallel = None
        if getattr(self, "_expert_parallel", None) is not None:
            self._expert_parallel.uninstall()
            self._expert_parallel = None
        self.installed = False
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
