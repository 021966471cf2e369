"""Megatron-style iteration lines with per-dimension traffic, optional W&B, and the run summary.

Traffic comes from ``comm_stats`` summed over all ranks at each log interval (one small
collective per interval, off the training path): MB sent intra- and inter-node per tag and
the inter-node ratio to what the same collectives would have sent uncompressed.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import statistics

import torch
import torch.distributed as dist

from megatron_zpp.comm import TagStats, comm_stats, comm_timers
from megatron_zpp.training.nic import NicWindow
from megatron_zpp.training.soak_stats import ResourceSampler, interval_record

MB = 1e6


def gpu_peak_memory_bytes(device: torch.device) -> int | None:
    """``torch.cuda.max_memory_allocated`` since the process started, the maximum over ranks (one small
    collective, at the end); ``None`` off the GPU."""
    if device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(device)], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def _delta(now: dict[str, TagStats], before: dict[str, TagStats]) -> dict[str, TagStats]:
    out = {}
    for tag, s in now.items():
        b = before.get(tag, TagStats())
        out[tag] = TagStats(s.intra_bytes - b.intra_bytes, s.inter_bytes - b.inter_bytes, s.calls - b.calls,
                            s.uncompressed_intra_bytes - b.uncompressed_intra_bytes,
                            s.uncompressed_inter_bytes - b.uncompressed_inter_bytes)
    return out


def traffic_text(stats: dict[str, TagStats], iterations: int) -> str:
    parts = []
    for tag in sorted(stats):
        s = stats[tag]
        parts.append(f"{tag} MB intra/inter: {s.intra_bytes / MB / iterations:.2f}/{s.inter_bytes / MB / iterations:.2f}"
                     f" (x{s.inter_ratio:.3f})")
    return " | ".join(parts)


REPLICA_CHECK_MAX_NUMEL = 200_000_000


def dp_replicas_identical(models) -> bool | None:
    """Whether every data-parallel replica holds bit-identical parameters (a digest per rank, compared over the DP
    group; MoE expert parameters, marked ``allreduce=False`` by Megatron-Core, over the expert-data-parallel group).
    ``None`` for models too large to digest at the end of a run."""
    from megatron.core import parallel_state

    from megatron_zpp.megatron.replica_check import is_expert_parameter

    params = [p for m in models for p in m.parameters()]
    if any(hasattr(p, "to_local") for p in params):
        return None  # ZeRO-3 (Megatron-FSDP): parameters are DTensor shards, there are no replicas
    if sum(p.numel() for p in params) > REPLICA_CHECK_MAX_NUMEL:
        return None
    expert = [p for p in params if is_expert_parameter(p)]
    dense = [p for p in params if not is_expert_parameter(p)]
    same = _identical_over(dense, parallel_state.get_data_parallel_group())
    if expert:
        same = _identical_over(expert, parallel_state.get_expert_data_parallel_group()) and same
    return same


def _identical_over(params: list[torch.Tensor], group) -> bool:
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, digest.hexdigest(), group=group)
    return all(d == everyone[0] for d in everyone)


class IterationLogger:
    def __init__(self, args, policy, log=print, device: torch.device | str = "cpu") -> None:
        self.args, self.policy, self._log = args, policy, log
        self.device = torch.device(device)  # where the model runs: decides whether host timers see its work
        self.grad_norms: list[float] = []
        self.moe_aux_losses: dict[str, list[float]] = {}  # per iteration, by Megatron-Core's name (MoE only)
        self.rank = dist.get_rank()
        self.times: list[float] = []
        self._last_stats: dict[str, TagStats] = {}
        self._last_logged = 0
        self.wandb = None
        self.comm_seconds: list[tuple[float, float]] = []  # per iteration: (codec, exposed wait)
        self._last_timers = (0.0, 0.0)
        # exposed wait by site (CommTimers) at the end of the first iteration and of the latest: their difference is
        # the steady iterations' (O(1) memory over a long run)
        self._first_sites: dict[str, float] = {}
        self._last_sites: dict[str, float] = {}
        self.nic = NicWindow()
        self._window: tuple | None = None  # (NIC bytes, comm_stats) over the training loop
        # Long-run health (soak): resident memory and scratch pools per log interval, and each
        # interval's byte counters, so a run can show both flat and adding up to its totals.
        self.resources = ResourceSampler()
        self.traffic_intervals: list[dict] = []
        self._last_iteration = 0

    def log(self, text: str) -> None:
        if self.rank == 0:
            self._log(text, flush=True) if self._log is print else self._log(text)

    def start(self, data: str, world: int) -> None:
        """``data``: one line saying what the run trains on."""
        a = self.args
        self.log(f"> megatron_zpp: world {world} = TP {a.tensor_model_parallel_size} x PP "
                 f"{a.pipeline_model_parallel_size} x DP {a.data_parallel_size}; policy {self.policy.name}: "
                 + self.policy.summary())
        self.log(f"> data: {data}; tokenizer {a.tokenizer_type} (vocabulary padded to {a.padded_vocab_size}); "
                 f"global batch {a.global_batch_size} ({a.num_microbatches} micro-batches of {a.micro_batch_size})")
        comm_stats().reset()
        comm_timers().reset()
        self.nic.start()
        if a.wandb_project and self.rank == dist.get_world_size() - 1:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("--wandb-project needs wandb: pip install wandb") from e
            # WANDB_MODE, when set, decides (offline sweeps); otherwise online only with credentials
            # or under a sweep agent (which has logged in), so a bare run never blocks on a login.
            mode = None if os.environ.get("WANDB_MODE") else (
                "online" if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_SWEEP_ID") else "offline")
            config = {k: v for k, v in vars(a).items() if k != "wandb_config"}
            self.wandb = wandb.init(project=a.wandb_project, name=a.wandb_exp_name, mode=mode,
                                    group=a.wandb_group, job_type=a.wandb_job_type,
                                    dir=a.wandb_save_dir or a.save or None,
                                    config={**config, "zpp_policy_resolved": self.policy.to_dict(),
                                            **a.wandb_config})

    def iteration(self, iteration: int, loss: float, lr: float, grad_norm, seconds: float, update_ok: bool,
                  hpz_bytes: int = 0, aux_losses: dict[str, float] | None = None) -> None:
        if not self.times:  # the first iteration of this run (a resumed run starts past 1)
            self._last_logged = iteration - 1
        self.times.append(seconds)
        for name, value in (aux_losses or {}).items():
            self.moe_aux_losses.setdefault(name, []).append(value)
        self.grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
        timers = comm_timers().snapshot()
        self.comm_seconds.append((timers[0] - self._last_timers[0], timers[1] - self._last_timers[1]))
        self._last_timers = timers
        self._last_sites = comm_timers().sites()
        if len(self.times) == 1:
            self._first_sites = self._last_sites
        self._last_iteration = iteration
        a = self.args
        if iteration % a.log_interval and iteration != a.train_iters:
            return
        stats = comm_stats().summed_over_ranks()
        interval = _delta(stats, self._last_stats)
        n = iteration - self._last_logged
        self._last_stats, self._last_logged = stats, iteration
        self.traffic_intervals.append(interval_record(iteration, n, interval))
        self.resources.sample(iteration, hpz_bytes)
        recent = self.times[-n:]
        mean_s = sum(recent) / len(recent)
        tokens_per_s = a.global_batch_size * a.seq_length / mean_s
        eta = datetime.timedelta(seconds=round(mean_s * (a.train_iters - iteration)))
        norm = float(grad_norm) if grad_norm is not None else float("nan")
        # As Megatron-LM: each MoE aux loss averaged over the interval's iterations, after the lm loss.
        aux = {name: sum(v[-n:]) / len(v[-n:]) for name, v in self.moe_aux_losses.items() if v}
        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        self.log(f" [{now}] iteration {iteration:8d}/{a.train_iters:8d} | consumed samples: "
                 f"{iteration * a.global_batch_size:12d} | elapsed time per iteration (ms): {mean_s * 1e3:.1f} | "
                 f"learning rate: {lr:.6E} | global batch size: {a.global_batch_size:5d} | lm loss: {loss:.6E} | "
                 + "".join(f"{name}: {value:.6E} | " for name, value in aux.items()) + f"grad norm: {norm:.3f} | tokens/s: {tokens_per_s:.0f} | ETA {eta} | "
                 + traffic_text(interval, n) + (f" | hpZ secondary MB/rank: {hpz_bytes / MB:.2f}" if hpz_bytes else "")
                 + ("" if update_ok else " | update skipped"))
        if self.wandb is not None:
            record = {"lm loss": loss, "learning-rate": lr, "grad-norm": norm, "tokens-per-sec": tokens_per_s,
                      "iteration-time": mean_s, **aux}
            for tag, s in interval.items():
                record.update({f"comm/{tag}/intra_MB": s.intra_bytes / MB / n, f"comm/{tag}/inter_MB":
                               s.inter_bytes / MB / n, f"comm/{tag}/inter_ratio": s.inter_ratio})
            self.wandb.log(record, step=iteration)

    def end_training(self) -> None:
        """Close the measurement window at the end of the training loop (a collective): the bytes
        and NIC counters reported per iteration then exclude the final parameter sync and the
        evaluation that run before :meth:`finish`."""
        self._window = (self.nic.stop(), comm_stats().summed_over_ranks())
        if self._last_iteration > self._last_logged:  # stopped between log intervals (--exit-interval)
            stats = self._window[1]
            self.traffic_intervals.append(interval_record(self._last_iteration,
                                                          self._last_iteration - self._last_logged,
                                                          _delta(stats, self._last_stats)))
            self._last_stats, self._last_logged = stats, self._last_iteration

    def _breakdown(self) -> dict:
        """Mean seconds per iteration after the first, averaged over ranks: codec, exposed
        communication (see ``CommTimers``), and the rest (compute, optimizer, framework)."""
        steady = list(zip(self.times, self.comm_seconds))[1:] or list(zip(self.times, self.comm_seconds))
        n = max(len(steady), 1)
        mine = torch.tensor([sum(t for t, _ in steady) / n, sum(c for _, (c, _) in steady) / n,
                             sum(w for _, (_, w) in steady) / n], dtype=torch.float64)
        on_cuda = self.device.type == "cuda"
        if on_cuda and "nccl" in str(dist.get_backend()):
            mine = mine.cuda()
        dist.all_reduce(mine)
        step, codec, wait = (mine.cpu() / dist.get_world_size()).tolist()
        # The exposed wait by site, over the same iterations (ranks may have waited at different sites: gathered
        # as objects). Before the CUDA return: every rank joins this collective whatever its device.
        base = self._first_sites if len(self.times) > 1 else {}
        local = {k: (v - base.get(k, 0.0)) / n for k, v in self._last_sites.items()}
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        if on_cuda:
            # Host timers see launches and host blocking, not stream time: no breakdown on CUDA
            # (use a profiler there), rather than a wrong one.
            return {"step_s": step, "codec_s": None, "exposed_comm_s": None, "compute_s": None,
                    "exposed_by_site": None}
        by_site = {k: sum(d.get(k, 0.0) for d in everyone) / len(everyone) for k in sorted({k for d in everyone for k in d})}
        return {"step_s": step, "codec_s": codec, "exposed_comm_s": wait, "compute_s": step - codec - wait,
                "exposed_by_site": by_site}

    def finish(self, losses: list[float], models: list, hooks=None, valid_loss: float | None = None,
               finite: bool = True, sharded: bool = False, replica_check=None) -> dict:
        """``sharded``: ZeRO-3, one copy of the weights, so there are no replicas to compare."""
        a = self.args
        if self._window is None:
            self.end_training()
        nic, stats = self._window
        steady = self.times[1:] or self.times  # the first iteration includes warm-up
        mean_s = statistics.mean(steady) if steady else float("nan")
        breakdown = self._breakdown()
        inter = sum(s.inter_bytes for s in stats.values())
        inter_base = sum(s.uncompressed_inter_bytes for s in stats.values())
        summary = {
            "iterations": len(losses), "first_loss": losses[0] if losses else float("nan"),
            "final_loss": losses[-1] if losses else float("nan"), "losses": losses, "grad_norms": self.grad_norms, "moe_aux_losses": self.moe_aux_losses, "valid_loss": valid_loss,
            "tokens_per_s": a.global_batch_size * a.seq_length / mean_s, "seconds_per_iteration": mean_s,
            "iteration_seconds": list(self.times),
            "traffic": {t: vars(s) | {"inter_ratio": s.inter_ratio} for t, s in stats.items()},
            "inter_bytes": inter, "inter_bytes_uncompressed": inter_base, "policy": self.policy.to_dict(),
            "dp_replicas_identical": None if sharded else dp_replicas_identical(models),
            "finite": finite, "breakdown": breakdown, "nic": nic,
            "hpz_bytes_per_rank": hooks.hpz_bytes if hooks is not None else 0,
            "memory": self.resources.gathered(), "traffic_intervals": self.traffic_intervals,
            "gpu_peak_memory_bytes": gpu_peak_memory_bytes(self.device),
            "replica_check": None if replica_check is None else {
                "uses_compared": replica_check.result.uses_compared, "mismatches": replica_check.result.mismatch_count,
                "expert_uses_compared": replica_check.result.expert_uses_compared,
                "first_mismatches": replica_check.result.mismatches},
        }
        self.log(f"> summary: {len(losses)} iterations, lm loss {summary['first_loss']:.4f} -> "
                 f"{summary['final_loss']:.4f}, {summary['tokens_per_s']:.0f} tokens/s "
                 f"({mean_s * 1e3:.0f} ms/iteration after the first)"
                 + (f"; validation lm loss {valid_loss:.4f}" if valid_loss is not None else ""))
        self.log(f"> summary: data-parallel replicas bit-identical: {summary['dp_replicas_identical']}; "
                 f"parameters finite: {summary['finite']}"
                 + (f"; hpZ secondary copies: {summary['hpz_bytes_per_rank'] / MB:.2f} MB per rank"
                    if summary["hpz_bytes_per_rank"] else ""))
        if summary["gpu_peak_memory_bytes"] is not None:
            self.log(f"> summary: peak GPU memory allocated (max over ranks): "
                     f"{summary['gpu_peak_memory_bytes'] / MB:.0f} MB")
        if replica_check is not None:
            r = summary["replica_check"]
            self.log(f"> summary: weights at the point of use, compared across data-parallel replicas every "
                     f"iteration: {r['uses_compared']} uses on this rank, {r['mismatches']} mismatches"
                     + "".join(f"\n>   {m}" for m in r["first_mismatches"][:5]))
        for tag in sorted(stats):
            s = stats[tag]
            self.log(f"> summary: {tag} (analytic bytes): {s.calls} calls, inter-node {s.inter_bytes / MB:.2f} MB vs "
                     f"{s.uncompressed_inter_bytes / MB:.2f} MB uncompressed (x{s.inter_ratio:.4f}), intra-node "
                     f"{s.intra_bytes / MB:.2f} MB vs {s.uncompressed_intra_bytes / MB:.2f} MB")
        if breakdown["codec_s"] is not None:
            self.log(f"> summary: step time (measured on the host, mean over ranks, after the first iteration): "
                     f"compute and the rest {breakdown['compute_s'] * 1e3:.0f} ms, exposed data-parallel "
                     f"communication {breakdown['exposed_comm_s'] * 1e3:.0f} ms, codec and reductions "
                     f"{breakdown['codec_s'] * 1e3:.0f} ms")
            self.log("> summary: exposed data-parallel communication by where it was waited for (ms per iteration): "
                     + (", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(breakdown["exposed_by_site"].items(),
                                                                           key=lambda kv: -kv[1])) or "none"))
        if nic is not None:
            self.log(f"> summary: cross-node bytes on the NICs ({nic['interface']}, measured, {nic['nodes']} nodes): "
                     f"{nic['tx_bytes'] / MB:.2f} MB, TCP payload {nic['payload_bytes'] / MB:.2f} MB vs "
                     f"{inter / MB:.2f} MB counted (x{nic['payload_bytes'] / inter if inter else float('nan'):.4f})")
        if inter_base:
            self.log(f"> summary: all tags: cross-node {inter / MB:.2f} MB sent vs {inter_base / MB:.2f} MB the "
                     f"uncompressed collectives would have sent (x{inter / inter_base:.4f})")
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in summary.items()
                                       if k not in ("losses", "grad_norms", "moe_aux_losses", "memory", "traffic_intervals")})
            # Flat per-iteration figures, so a sweep's table and metric read them without unnesting.
            n = max(len(losses), 1)
            self.wandb.summary.update({"inter_bytes_per_iteration": inter / n,
                                       "nic_payload_bytes_per_iteration": nic["payload_bytes"] / n if nic else None,
                                       **{f"breakdown/{k}": v for k, v in breakdown.items()}})
            self.wandb.finish()
        return summary
