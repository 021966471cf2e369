"""A quiet start: the upstream warnings every run of ``pretrain_gpt.py`` would print, and that ask nothing of the
user, silenced here in one place, each with the reason it is harmless.

Every entry matches one warning precisely: a regular expression at the start of its text *and* the module (for
``warnings.warn``) or the logger (for ``logging``) that emits it, so the same words from anywhere else, and every
other warning, still reach the user. Three kinds of entries:

- harmless everywhere (a notice about a fallback that changes nothing, a deprecation of something the driver must
  use in the pinned Megatron-Core);
- harmless without a GPU only (``only_without_gpu``): an artefact of ``megatron_zpp.megatron.cpu_shim`` or a GPU
  tuning hint; on a GPU they stay visible, where they may be actionable;
- Transformer Engine / Apex missing: silenced everywhere, since without a GPU neither can run, and on a GPU
  :func:`megatron_zpp.training.model.optimizer_fallback_note` replaces the eight per-rank lines with one line
  from rank 0 (and the trainer's '> fusions off' line names apex where a fusion needs it).

Some of these fire while Megatron-Core is being imported, so :func:`install_warning_filters` must run before the
first ``import megatron``: ``pretrain_gpt.py`` calls it before importing the trainer, and
``pretrain()`` installs them again for callers that import it directly (idempotent).

Only rank 0 prints the start-up lines (the driver's ``log`` calls are rank-0 only; Megatron-Core's INFO records are
not shown on any rank, as no handler is configured), so with these filters the other ranks print nothing at start
unless something is wrong.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownWarning:
    """One upstream warning that is expected on every run and asks nothing of the user."""

    message: str
    """Regular expression matched (case-insensitively, as ``warnings.filterwarnings`` does) at the start of the
    warning's text."""
    origin: str
    """For a ``warnings.warn``: a regular expression matched against the whole name of the module the warning is
    attributed to. For a log record: the exact name of the logger."""
    why: str
    """Why it is harmless here (one line)."""
    only_without_gpu: bool = False
    """Harmless only where no GPU exists (an artefact of the CPU shim, or a CUDA tuning hint); on a GPU it is shown."""


_FSDP = r"(megatron\.core\.distributed\.fsdp\.src\.)?megatron_fsdp"  # vendored in megatron-core, or the standalone package

# Python warnings (warnings.warn), most of them at import time.
KNOWN_WARNINGS = (
    KnownWarning(
        "Transformer Engine and Apex are not installed",
        rf"megatron\.core\.optimizer(\.optimizer|\.clip_grads)?|{_FSDP}\.mixed_precision",
        "import-time notice that Megatron-Core uses torch's optimizers and multi-tensor kernels: neither library runs "
        "without a GPU; on a GPU the trainer says it in one line (model.optimizer_fallback_note)"),
    KnownWarning(
        "Apex is not installed. Falling back to Torch Norm", r"megatron\.core\.models\.[\w.]+",
        "import-time notice that the local layer spec uses torch's LayerNorm: apex's fused norm needs a GPU; on a GPU "
        "the trainer's '> fusions off' line names apex where a fusion needs it"),
    KnownWarning(
        "absl.logging is not installed", r"megatron\.core\.hyper_comm_grid",
        "Megatron-Core then logs through Python's logging module instead of absl's: the same records, nothing lost"),
    KnownWarning(
        "MimoModelConfig is experimental", r"megatron\.core\.models\.mimo\.config\.base_configs",
        "emitted when Megatron-Core imports its multimodal (MIMO) model config; this driver never builds one"),
    KnownWarning(
        "full scope is deprecated", r"megatron\.core\.transformer\.transformer_config",
        "TransformerConfig's own default (cuda_graph_modules='full') triggers it on every construction; it concerns "
        "CUDA graph capture, which this driver does not enable"),
    KnownWarning(
        re.escape("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
        r"megatron\.core\.optimizer\.optimizer|megatron_zpp\.megatron\.cpu_shim",
        "the distributed optimizer's zero_grad (_zero_grad_group_helper) reads .grad of its parameter-shard views to "
        "test it for None; views never hold one, so the read changes nothing (on CPU the shim's frame is blamed)"),
    KnownWarning(
        "When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        r"megatron\.core\.tensor_parallel\.layers",
        "a CUDA stream-scheduling hint; without a GPU there are no streams to schedule", only_without_gpu=True),
)

# Log records (logging), through Python's last-resort handler: WARNING and above, every rank that emits them.
KNOWN_LOG_RECORDS = (
    KnownWarning(
        "GPTModel IS DEPRECATED", "megatron.core.models.gpt.gpt_model",
        "the driver builds GPTModel as Megatron-LM's GPT path does in the pinned megatron-core; HybridModel needs "
        "Transformer Engine there (see megatron_zpp/training/model.py)"),
    KnownWarning(
        "DistributedDataParallel: full_param_layout not provided", "megatron.core.distributed.distributed_data_parallel",
        "DDP then computes the layout itself with DistributedOptimizer.compute_full_param_layout, the very call the "
        "message asks callers to make: the same layout"),
    KnownWarning(
        "CPU RNG state changed within GPU RNG context", "megatron.core.tensor_parallel.random",
        "the CPU shim makes the CUDA generator the CPU one, so the RNG tracker's 'GPU' context draws from the CPU "
        "generator by design", only_without_gpu=True),
    KnownWarning(
        "CPU RNG state changed within GPU RNG context", "megatron.core.distributed.fsdp.src.megatron_fsdp.utils",
        "as for megatron.core.tensor_parallel.random: Megatron-FSDP's copy of the RNG tracker", only_without_gpu=True),
    KnownWarning(
        r"\[Rank \d+\] Megatron-FSDP is using device cpu instead of the current device cuda:",
        "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
        "the driver places Megatron-FSDP on the CPU on purpose (trainer: device=cpu) and the CPU shim reports CUDA "
        "device 0 as current", only_without_gpu=True),
)


def launch_rank() -> int:
    """This process's global rank: torch.distributed's once initialized, else the launcher's ``RANK`` (torchrun,
    Slurm through tools/slurm_local.py), else ``SLURM_PROCID``, else 0 (a single process started by hand).
    ``SLURM_PROCID`` only keeps an argument error said once when ``srun`` starts the ranks without torchrun;
    torch.distributed's env:// rendezvous still needs ``RANK`` (our sbatch script runs torchrun per node, whose
    ``RANK`` wins over the node's task id)."""
    import sys

    dist = sys.modules.get("torch.distributed")  # not imported here: this runs before anything heavy
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in ("RANK", "SLURM_PROCID"):
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return 0


class _KnownRecords(logging.Filter):
    """Drops the log records of ``KNOWN_LOG_RECORDS`` for one logger; lets every other record through."""

    def __init__(self, patterns: list[re.Pattern]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(p.match(text) for p in self.patterns)


def _gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


def install_warning_filters(*, gpu: bool | None = None) -> None:
    """Silence the entries of ``KNOWN_WARNINGS`` and ``KNOWN_LOG_RECORDS`` in this process (those marked
    ``only_without_gpu`` only where ``gpu`` is false; ``None``: ask torch). Idempotent. Run it before Megatron-Core
    is imported: some of the warnings fire at import time."""
    gpu = _gpu_present() if gpu is None else gpu
    for entry in KNOWN_WARNINGS:
        if not (entry.only_without_gpu and gpu):
            # "ignore" filters go in front; re-adding an identical filter moves it instead of duplicating it.
            warnings.filterwarnings("ignore", message=entry.message, module=rf"(?:{entry.origin})\Z")
    by_logger: dict[str, list[re.Pattern]] = {}
    for entry in KNOWN_LOG_RECORDS:
        if not (entry.only_without_gpu and gpu):
            by_logger.setdefault(entry.origin, []).append(re.compile(entry.message, re.IGNORECASE))
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)  # the same object Megatron-Core's module gets when it is imported later
        for old in [f for f in logger.filters if isinstance(f, _KnownRecords)]:
            logger.removeFilter(old)
        logger.addFilter(_KnownRecords(patterns))


