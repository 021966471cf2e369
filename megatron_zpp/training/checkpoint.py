"""Per-rank checkpoints for ``--save`` / ``--load``.

Each rank writes ``iter_NNNNNNN/rank_RRRRR.pt``: the model's state dict (not for Megatron-FSDP,
whose weights live in shards), the optimizer's main weights as this rank holds them (fp32,
sharded with the distributed optimizer or FSDP), the local optimizer state (Adam's moments),
the LR scheduler and the RNG state; ``latest`` names the newest iteration. Resuming needs the same world and
parallel layout (Megatron's resharding ``dist_checkpointing`` is the tool for changing it).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def main_params(optimizer) -> list[torch.Tensor]:
    """The parameters the optimizer updates (fp32 main weights / this rank's shards), local views."""
    return [_local(p) for opt in _inner_optimizers(optimizer) for group in opt.optimizer.param_groups
            for p in group["params"]]


def _is_fsdp(models) -> bool:
    model = models[0]
    return hasattr(model, "install_optimized_model_weights") or \
        hasattr(getattr(model, "module", None), "install_optimized_model_weights")


def save_checkpoint(directory: str, iteration: int, models: list, optimizer, scheduler, hooks=None) -> Path:
    """Megatron-FSDP keeps weights only as shards (its ``state_dict`` holds freed gathered buffers),
    so for it the optimizer's main-weight shards are the checkpoint; the model weights are
    re-installed from them on load."""
    rank = dist.get_rank()
    folder = Path(directory) / f"iter_{iteration:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    fsdp = _is_fsdp(models)
    state = {
        "iteration": iteration,
        "world_size": dist.get_world_size(),
        "model": None if fsdp else [m.state_dict() for m in models],
        "main_params": [p.detach().clone() for p in main_params(optimizer)],
        "optimizer": [opt.optimizer.state_dict() for opt in _inner_optimizers(optimizer)],
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
        "compression": hooks.state_dict() if hooks is not None else {},
    }
    torch.save(state, folder / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        (Path(directory) / "latest").write_text(str(iteration))
    return folder


def load_checkpoint(directory: str, models: list, optimizer, scheduler, hooks=None) -> int:
    """Load the newest checkpoint under ``directory``; return its iteration."""
    latest = Path(directory) / "latest"
    if not latest.exists():
        raise FileNotFoundError(f"--load {directory}: no 'latest' file; nothing was saved there")
    iteration = int(latest.read_text())
    path = Path(directory) / f"iter_{iteration:07d}" / f"rank_{dist.get_rank():05d}.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["world_size"] != dist.get_world_size():
        raise ValueError(f"--load {directory}: saved with world size {state['world_size']}, now "
                         f"{dist.get_world_size()}; per-rank checkpoints need the same layout")
    if state["model"] is not None:
        for m, m_state in zip(models, state["model"]):
            m.load_state_dict(m_state)
    for opt, opt_state in zip(_inner_optimizers(optimizer), state["optimizer"]):
        opt.optimizer.load_state_dict(opt_state)
    with torch.no_grad():
        for p, saved in zip(main_params(optimizer), state["main_params"]):
            p.copy_(saved)
    if _is_fsdp(models):
        for model in models:
            target = model if hasattr(model, "install_optimized_model_weights") else model.module
            target.install_optimized_model_weights()  # model weights from the restored main weights

    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    if hooks is not None:
        hooks.load_state_dict(state.get("compression", {}))
    return iteration
