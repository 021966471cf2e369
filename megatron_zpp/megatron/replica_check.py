"""Check, at the point of use, that every data-parallel replica computes with the same weights.

Compressed weight gathers (qwZ, hpZ) and overlapped parameter syncs can go wrong in ways a
final comparison cannot see: a module that runs its forward on undecoded or stale rows on one
replica and on fresh ones on another still ends with identical weights after a forced sync.
``ReplicaWeightCheck`` digests each module's own parameters (``recurse=False``) when the module
is used, in its forward (a pre-hook registered after Megatron's, so after its parameter-sync
hooks) and in its backward (a hook on the module's output gradient, which fires before the
module's backward runs), and compares the digests across the data-parallel group once per
iteration.

It is a debugging aid (``--check-replica-weights``): hashing every parameter on every use
copies it to the host, which is cheap for test models and slow for real ones.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class ReplicaCheckResult:
    """What the check saw: how many uses were compared, and the first mismatches."""

    uses_compared: int = 0
    expert_uses_compared: int = 0  # of which expert modules, compared over the expert-data-parallel group
    iterations: int = 0
    mismatch_count: int = 0
    mismatches: list[str] = field(default_factory=list)  # the first ``max_reported``


def _digest(params: list[torch.Tensor]) -> str:
    h = hashlib.sha1()
    for p in params:
        # A copy: exporting a Megatron-FSDP bucket itself to numpy would pin its (resizable) storage.
        raw = p.detach().reshape(-1).view(torch.uint8).to("cpu", copy=True)
        h.update(str(tuple(p.shape)).encode())
        h.update(raw.numpy().tobytes())
    return h.hexdigest()[:16]


def is_expert_parameter(p: torch.Tensor) -> bool:
    """Whether Megatron-Core marked ``p`` an MoE expert weight (``allreduce=False``): it is reduced and gathered over
    the expert-data-parallel group, not the dense one. The one test of it that the hooks, the replica checks and the
    run log share."""
    return not getattr(p, "allreduce", True)


def is_expert_module(name: str, params: list[torch.Tensor]) -> bool:
    """Whether a module holds MoE expert weights: Megatron-Core's DDP marks them ``allreduce=False``; Megatron-FSDP's
    parameters lose that attribute, and it goes by the name (``.experts.``), as here."""
    return any(is_expert_parameter(p) for p in params) or ".experts." in f".{name}."


class ReplicaWeightCheck:
    """Digest every module's weights at each use and compare them across ``group`` per iteration.

    Args:
        models: the model chunks, already wrapped by Megatron (DDP or Megatron-FSDP), so that
            these hooks run after Megatron's own.
        group: the data-parallel group whose replicas must agree.
        expert_group: MoE: the expert-data-parallel group, over which the expert modules' replicas must agree
            (``is_expert_module``; across expert-parallel ranks they are different experts). Without it no module may hold expert parameters.
        max_reported: mismatches kept in the result (all are counted).
    """

    def __init__(self, models: list[torch.nn.Module], group, max_reported: int = 20, expert_group=None) -> None:
        self.group = group
        self.expert_group = expert_group
        self.max_reported = max_reported
        self.result = ReplicaCheckResult()
        # (module, phase, digest) in order of use, dense modules and expert modules apart
        self._uses: dict[bool, list[tuple[str, str, str]]] = {False: [], True: []}
        self._handles = []
        for c, model in enumerate(models):
            for name, module in model.named_modules():
                params = list(module.parameters(recurse=False))
                if params:
                    expert = is_expert_module(name, params)
                    if expert and expert_group is None:
                        raise ValueError(f"chunk{c}.{name} holds expert parameters: pass expert_group (the "
                                         "expert-data-parallel group) to compare them over their own replicas")
                    self._attach(f"chunk{c}.{name}", module, expert)

    def _attach(self, name: str, module: torch.nn.Module, expert: bool = False) -> None:
        # The forward use is digested after the module's forward, not in a pre-hook: the weights cannot change
        # during it, and Megatron's own pre-hook (which waits for the module's parameter gather) has run by then
        # whatever the hook order. A pre-hook of ours would run *before* Megatron's once Megatron re-registers
        # its hooks (disable_forward_pre_hook / enable_forward_pre_hook around a checkpoint save), and digest
        # weights whose gather is still in flight: a false mismatch (seen with --overlap-param-gather and a save,
        # Megatron alone included). With full activation recomputation the first forward runs without grad (not
        # recorded) and the recomputed one, during the backward, is the recorded "forward" use: the same on every
        # rank, so still compared like for like.
        def post_forward(mod, _inputs, output):
            if not torch.is_grad_enabled():  # training uses; evaluation is not compared
                return
            self._uses[expert].append((name, "forward", _digest(list(mod.parameters(recurse=False)))))
            tensors = [output] if isinstance(output, torch.Tensor) else \
                [t for t in (output if isinstance(output, (tuple, list)) else ()) if isinstance(t, torch.Tensor)]
            for t in tensors:
                if t.requires_grad:
                    # The gradient of the module's output is ready just before its backward runs.
                    t.register_hook(lambda grad, mod=mod: self._on_backward(name, mod, expert))
                    break

        self._handles.append(module.register_forward_hook(post_forward))

    def _on_backward(self, name: str, module: torch.nn.Module, expert: bool) -> None:
        self._uses[expert].append((name, "backward", _digest(list(module.parameters(recurse=False)))))

    def end_iteration(self, iteration: int) -> None:
        """Compare this iteration's uses across the group, the expert modules' across the expert-data-parallel
        group (collectives: call on every rank)."""
        uses, self._uses = self._uses, {False: [], True: []}
        self.result.iterations += 1
        self._compare(iteration, uses[False], self.group, "")
        if self.expert_group is not None:
            self._compare(iteration, uses[True], self.expert_group, "expert-data-parallel ")
            self.result.expert_uses_compared += len(uses[True])

    def _compare(self, iteration: int, uses: list, group, kind: str) -> None:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, uses, group=group)
        self.result.uses_compared += len(uses)
        for replica, theirs in enumerate(everyone):
            if len(theirs) != len(uses):
                self._report(f"iteration {iteration}: {kind}replica {replica} used {len(theirs)} module weights, "
                             f"this rank {len(uses)}")
                continue
            for (name, phase, mine), (_, _, other) in zip(uses, theirs):
                if mine != other:
                    self._report(f"iteration {iteration}: {name} {phase}: {kind}replica {replica} computed with "
                                 f"different weights")

    def _report(self, message: str) -> None:
        self.result.mismatch_count += 1
        if len(self.result.mismatches) < self.max_reported:
            self.result.mismatches.append(message)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
