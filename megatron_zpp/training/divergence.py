"""Divergence guard: a lossy policy that blows up falls back to uncompressed traffic for a while.

ZeRO++'s qgZ was reported to diverge to inf on two nodes; a week-long run with lossy codecs needs a
safety net that neither hides the event nor stops the run. After every iteration the guard looks at
the loss and the gradient norm, both reduced over the whole world first so every rank decides on the
same numbers:

* non-finite gradients (checked inside Megatron's own ``prepare_grads``, so Megatron's optimizer skips
  the step exactly as it does for an fp16 overflow), a non-finite loss or gradient norm, or
* a spike: the loss or the gradient norm above ``spike_factor`` x the median of the last ``window``
  accepted values,

switches every lossy dimension of the policy (``MegatronHooks.lossy_dimensions``) to uncompressed for
``fallback_iters`` iterations, zeroes the error-feedback residuals (a NaN would stay in them), logs the
event on every rank and to W&B, then resumes compression. The switch happens between iterations, on
every rank at the same iteration, so both ends of every collective agree on its codec; the ranks confirm
that each of them switched (``agreement.py``: a switch that fails on one rank is the same error on every
rank, before any collective runs with mismatched codecs).

Under ``--fp16`` an overflow is the loss scaler's routine business (Megatron skips the step and lowers
the scale); the guard then acts on the loss and on spikes only.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(kw_only=True)
class DivergenceGuardConfig:
    guard: bool = False
    """Watch the loss and the gradient norm; on a non-finite value or a spike, run the policy's lossy
    dimensions uncompressed for --zpp-divergence-fallback-iters iterations, then compress again."""
    window: int = 20
    """Accepted iterations whose median loss and gradient norm a new value is compared with."""
    min_history: int = 5
    """Accepted iterations needed before spikes are judged (non-finite values always are)."""
    spike_factor: float = 5.0
    """A loss or gradient norm above this multiple of the window's median is a spike."""
    fallback_iters: int = 50
    """Iterations run uncompressed after an event (a new event during them restarts the count)."""
    reload: bool = False
    """On an event, also reload the last complete checkpoint of --save (else --load) and rerun from it,
    uncompressed for --zpp-divergence-fallback-iters iterations (the data rewinds with it)."""


def add_divergence_args(parser) -> None:
    from megatron_zpp.policy import add_dataclass_args

    add_dataclass_args(parser, DivergenceGuardConfig, "zpp-divergence", "megatron_zpp divergence guard")


def divergence_config_from_args(args) -> DivergenceGuardConfig:
    from megatron_zpp.policy import dataclass_from_args

    config = dataclass_from_args(DivergenceGuardConfig, args, "zpp_divergence")
    for name in ("window", "min_history", "fallback_iters"):
        if getattr(config, name) < 1:
            raise ValueError(f"--zpp-divergence-{name.replace('_', '-')} {getattr(config, name)} must be >= 1")
    if not config.spike_factor > 1.0:
        raise ValueError(f"--zpp-divergence-spike-factor {config.spike_factor} must be > 1 (a multiple of the median)")
    if config.min_history > config.window:
        raise ValueError(f"--zpp-divergence-min-history {config.min_history} exceeds --zpp-divergence-window "
                         f"{config.window}")
    return config


class DivergenceGuard:
    """One per rank; ``install`` once the optimizer exists, then ``begin``/``end`` around each iteration.

    ``events`` lists what happened (iteration, reason, action), identical on every rank.
    """

    def __init__(self, config: DivergenceGuardConfig, hooks, *, device: torch.device, fp16: bool,
                 log=print, wandb_log=None, agreement=None) -> None:
        from megatron_zpp.training.agreement import Agreement

        self.config = config
        self.agreement = agreement or Agreement(device=device)
        self.hooks = hooks
        self.device = device
        self.fp16 = fp16
        self.log = log
        self.wandb_log = wandb_log
        self.rank = dist.get_rank()
        self.events: list[dict] = []
        self.suspended_until: int | None = None  # first iteration (1-based) compressed again
        self.uncompressed_iterations: list[int] = []
        self._losses: list[float] = []
        self._grad_norms: list[float] = []
        self._nonfinite_grads = False
        self.reloaded: set[int] = set()  # checkpoint iterations reloaded (--zpp-divergence-reload), once each

    # ------------------------------------------------------------------ Megatron's found-inf check
    def install(self, optimizer) -> None:
        """Fold a finite check of the main gradients into ``optimizer.prepare_grads``, whose found-inf
        result makes Megatron skip the step (its fp16 path); every rank joins one MAX all-reduce of the
        flag, so they skip together. Installed with the guard, and with error feedback (a non-finite step
        must not leave NaN in a residual), also without the guard."""
        if not (self.config.guard or self.hooks.policy.error_feedback):
            return
        original = optimizer.prepare_grads

        def prepare_grads() -> bool:
            found = bool(original())
            grads = main_grads(optimizer)
            local = torch.tensor(found, device=self.device)
            if grads and not found:
                # One reduction over all gradients, read once below: no host sync per parameter.
                local = torch.stack([torch.isfinite(g).all() for g in grads]).all().logical_not()
            flag = local.to(device=self.device, dtype=torch.float32).reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank skips together
            self._nonfinite_grads = bool(flag.item() > 0)  # one host sync, as Megatron's own fp16 check has
            if self._nonfinite_grads:
                self.hooks.reset_error_feedback()
            return self._nonfinite_grads

        optimizer.prepare_grads = prepare_grads

    # ------------------------------------------------------------------ per iteration
    def begin(self, iteration: int) -> None:
        """Before 1-based ``iteration``: resume compression when the fallback is over."""
        if self.suspended_until is not None and iteration >= self.suspended_until:
            self.suspended_until = None
            self._switch(False)
            self._event(iteration, "fallback over", "compressing again")
        if self.suspended_until is not None:
            self.uncompressed_iterations.append(iteration)

    def end(self, iteration: int, loss: float, grad_norm: float | None, update_ok: bool) -> str | None:
        """After 1-based ``iteration``: judge it; returns the reason when it triggered a fallback."""
        if not self.config.guard:
            self._nonfinite_grads = False
            return None
        # Reduced over the world first, so the decision below is the same on every rank by construction.
        # Non-finite values travel as flags: a MAX reduction may drop a NaN (NaN comparisons are false).
        norm = float("nan") if grad_norm is None else float(grad_norm)
        finite_or_zero = [v if math.isfinite(v) else 0.0 for v in (loss, norm)]
        values = torch.tensor([float(not math.isfinite(loss)), float(not math.isfinite(norm)),
                               float(self._nonfinite_grads and not self.fp16), *finite_or_zero],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        loss_bad, norm_bad, nonfinite, loss, norm = (float(v) for v in values.cpu())
        loss = float("nan") if loss_bad else loss
        norm = float("nan") if norm_bad else norm
        self._nonfinite_grads = False
        reason = None
        if nonfinite > 0:
            reason = "non-finite gradients (Megatron's optimizer skipped the step)"
        elif not math.isfinite(loss):
            reason = f"non-finite loss {loss}"
        elif update_ok and not math.isfinite(norm):
            reason = f"non-finite gradient norm {norm}"
        else:
            reason = (self._spike("loss", loss, self._losses) or
                      (self._spike("gradient norm", norm, self._grad_norms) if update_ok else None))
        if reason is None:
            self._push(self._losses, loss)
            if update_ok:
                self._push(self._grad_norms, norm)
            return None
        self._trigger(iteration, reason)
        return reason

    def rewound(self, iteration: int) -> None:
        """The trainer reloaded the checkpoint of ``iteration``: run uncompressed from the next one on."""
        self.suspended_until = iteration + 1 + self.config.fallback_iters
        if self.hooks.lossy_dimensions:
            self._switch(True)
        self._event(iteration + 1, f"reloaded the checkpoint of iteration {iteration}",
                    f"rerunning from iteration {iteration + 1}, uncompressed through iteration "
                    f"{self.suspended_until - 1}")

    def _switch(self, suspended: bool) -> None:
        """Switch the lossy dimensions off (``True``) or on, and confirm that every rank did (one all-reduce,
        at a switch only: every rank switches at the same iteration, decided on world-reduced values)."""
        with self.agreement.step("policy switch", local=True):
            self.hooks.suspend_lossy(suspended)

    def _spike(self, what: str, value: float, history: list[float]) -> str | None:
        if len(history) < self.config.min_history:
            return None
        median = statistics.median(history)
        if median > 0 and value > self.config.spike_factor * median:
            return (f"{what} spike {value:.4g} > {self.config.spike_factor:g} x median {median:.4g} of the last "
                    f"{len(history)} iterations")
        return None

    def _push(self, history: list[float], value: float) -> None:
        history.append(value)
        del history[:-self.config.window]

    def _trigger(self, iteration: int, reason: str) -> None:
        dims = self.hooks.lossy_dimensions
        self.suspended_until = iteration + 1 + self.config.fallback_iters
        if dims:
            self._switch(True)
            action = (f"lossy dimensions {', '.join(dims)} uncompressed for {self.config.fallback_iters} "
                      f"iterations (iterations {iteration + 1}-{self.suspended_until - 1})")
        else:
            action = "no lossy dimension in this policy to switch off"
            self.hooks.reset_error_feedback()
        self._event(iteration, reason, action)

    def _event(self, iteration: int, reason: str, action: str) -> None:
        self.events.append({"iteration": iteration, "reason": reason, "action": action})
        self.log(f"[divergence guard] rank {self.rank} iteration {iteration}: {reason}; {action}")
        if self.wandb_log is not None:
            self.wandb_log({"zpp/divergence_fallback": 0 if action == "compressing again" else 1}, iteration)

    def summary(self) -> dict:
        return {"events": self.events, "uncompressed_iterations": self.uncompressed_iterations}


def main_grads(optimizer) -> list[torch.Tensor]:
    """The gradients the optimizer is about to apply, local shards (after ``prepare_grads``). Megatron-FSDP puts
    them on the DTensor main parameters (``.grad``, or ``decoupled_grad`` with TE's FusedAdam), not on their
    local views."""
    from megatron_zpp.training.checkpoint import _inner_optimizers

    out = []
    for opt in _inner_optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                g = p.grad if p.grad is not None else getattr(p, "decoupled_grad", None)
                if g is not None:
                    out.append(g.to_local() if hasattr(g, "to_local") else g)
    return out
