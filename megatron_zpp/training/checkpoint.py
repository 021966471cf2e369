"""Per-rank checkpoints for ``--save`` / ``--load``.

Each rank writes ``iter_NNNNNNN/rank_RRRRR.pt``: the model's state dict, the local optimizer
state (for the distributed optimizer: this rank's shard of Adam's moments), the LR scheduler,
and the RNG states; ``latest`` names the newest iteration. Resuming needs the same world and
parallel layout (Megatron's resharding ``dist_checkpointing`` is the tool for changing it).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def save_checkpoint(directory: str, iteration: int, model, optimizer, scheduler) -> Path:
    rank = dist.get_rank()
    folder = Path(directory) / f"iter_{iteration:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        "iteration": iteration,
        "world_size": dist.get_world_size(),
        "model": model.state_dict(),
        "optimizer": [opt.optimizer.state_dict() for opt in _inner_optimizers(optimizer)],
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
    }
    torch.save(state, folder / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        (Path(directory) / "latest").write_text(str(iteration))
    return folder


def load_checkpoint(directory: str, model, optimizer, scheduler) -> int:
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
    model.load_state_dict(state["model"])
    for opt, opt_state in zip(_inner_optimizers(optimizer), state["optimizer"]):
        opt.optimizer.load_state_dict(opt_state)
        opt.reload_model_params()  # main (fp32) params from the loaded model params
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return iteration
