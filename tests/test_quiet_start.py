"""A quiet start (issue 22, item 4): the known-harmless upstream warnings are silenced precisely (their text *and*
their origin), every other warning still reaches the user, and ``make train``'s launch prints at most 5 lines
containing "warn", with the start-up from rank 0 only."""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_zpp.training import quiet

REPO = Path(__file__).resolve().parents[1]
MAX_WARN_LINES = 5

# The texts the pinned megatron-core (and the CPU shim's frame) emit, with their origin: each table entry must
# silence its sample, so the table and these stay in step.
WARNING_SAMPLES = [
    ("megatron.core.optimizer", "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."),
    ("megatron.core.optimizer.optimizer", "Transformer Engine and Apex are not installed. Falling back to local "
                                          "implementations of multi_tensor_applier and multi_tensor_scale"),
    ("megatron.core.optimizer.clip_grads", "Transformer Engine and Apex are not installed. Falling back to local "
                                           "implementations of multi_tensor_applier, multi_tensor_l2norm, and "
                                           "multi_tensor_scale"),
    ("megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
     "Transformer Engine and Apex are not installed. Falling back to local implementations of multi_tensor_applier "
     "and multi_tensor_scale"),
    ("megatron.core.models.gpt.gpt_layer_specs", "Apex is not installed. Falling back to Torch Norm"),
    ("megatron.core.models.backends", "Apex is not installed. Falling back to Torch Norm"),
    ("megatron.core.hyper_comm_grid", "absl.logging is not installed. Using logging.getLogger(__name__) instead. "
                                      "Please install absl.logging with `pip install absl-py` to use absl.logging."),
    ("megatron.core.models.mimo.config.base_configs", "MimoModelConfig is experimental and still under active "
                                                      "development. The API may change without notice in future "
                                                      "releases."),
    ("megatron.core.transformer.transformer_config", "full scope is deprecated. Use empty cuda_graph_modules to "
                                                     "capture the whole layer."),
    ("megatron_zpp.megatron.cpu_shim", "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. "
                                       "Its .grad attribute won't be populated during autograd.backward()."),
    ("megatron.core.optimizer.optimizer", "The .grad attribute of a Tensor that is not a leaf Tensor is being "
                                          "accessed. Its .grad attribute won't be populated during autograd.backward()."),
    ("megatron.core.tensor_parallel.layers", "When using sequence parallelism it is recommended to set the environment "
                                             "variable CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"),
]
RECORD_SAMPLES = [
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no "
                                           "new features."),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel: full_param_layout not provided "
                                                            "with use_distributed_optimizer=True. Auto-computing "
                                                            "layout inside DDP."),
    ("megatron.core.tensor_parallel.random", "CPU RNG state changed within GPU RNG context"),
    ("megatron.core.distributed.fsdp.src.megatron_fsdp.utils", "CPU RNG state changed within GPU RNG context"),
    ("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
     "[Rank 1] Megatron-FSDP is using device cpu instead of the current device cuda:0, which may cause "
     "process-to-device mapping issues"),
]


def _entry(table, origin: str, text: str) -> quiet.KnownWarning:
    matches = [e for e in table if re.match(e.message, text, re.IGNORECASE)
               and (re.fullmatch(e.origin, origin) if table is quiet.KNOWN_WARNINGS else e.origin == origin)]
    assert len(matches) == 1, f"{origin}: {text!r} matches {len(matches)} entries"
    return matches[0]


@pytest.fixture
def restored_logging():
    """install_warning_filters() adds logger filters: take them off again after the test."""
    names = {e.origin for e in quiet.KNOWN_LOG_RECORDS} | {"megatron.core.elsewhere"}
    saved = {n: list(logging.getLogger(n).filters) for n in names}
    yield
    for name, filters in saved.items():
        logging.getLogger(name).filters[:] = filters


def _shown(origin: str, text: str, *, gpu: bool) -> bool:
    """Whether a UserWarning ``text`` attributed to module ``origin`` reaches the user after the filters."""
    with warnings.catch_warnings(record=True) as seen:  # restores the process's filters on exit
        warnings.simplefilter("always")
        quiet.install_warning_filters(gpu=gpu)
        warnings.warn_explicit(text, UserWarning, "somewhere.py", 1, module=origin)
    return bool(seen)


def test_every_entry_has_a_reason_and_a_sample():
    for table, samples in ((quiet.KNOWN_WARNINGS, WARNING_SAMPLES), (quiet.KNOWN_LOG_RECORDS, RECORD_SAMPLES)):
        covered = {id(_entry(table, origin, text)) for origin, text in samples}
        for entry in table:
            assert len(entry.why) > 20 and "\n" not in entry.why, entry
            assert id(entry) in covered, f"no sample for {entry.message!r} ({entry.origin}): add one"


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_known_warnings_are_silenced_from_their_origin_only(gpu):
    for origin, text in WARNING_SAMPLES:
        entry = _entry(quiet.KNOWN_WARNINGS, origin, text)
        # On a GPU, the CPU-only entries (shim artefacts, CUDA hints) stay visible.
        assert _shown(origin, text, gpu=gpu) == (gpu and entry.only_without_gpu), (origin, text)
        # The same words from anywhere else are not the known warning: they reach the user.
        assert _shown("megatron_zpp.training.trainer", text, gpu=gpu), text
        assert _shown("my_project." + origin, text, gpu=gpu), f"{origin}: the pattern must match from the start"
    # ... and to its end: a module whose name merely begins like a known one is another module.
    assert _shown("megatron.core.hyper_comm_grid_v2", "absl.logging is not installed.", gpu=gpu)
    # An unrelated warning from a module that has a known one, and one from user code, are not swallowed.
    assert _shown("megatron.core.optimizer", "loss scale underflow: 17 steps skipped", gpu=gpu)
    assert _shown("__main__", "something the user must see", gpu=gpu)


def test_known_log_records_are_silenced_on_their_logger_only(restored_logging):
    quiet.install_warning_filters(gpu=False)
    quiet.install_warning_filters(gpu=False)  # idempotent: one filter per logger, not two

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.texts = []

        def emit(self, record):
            self.texts.append(record.getMessage())

    for origin, text in RECORD_SAMPLES:
        logger = logging.getLogger(origin)
        assert sum(isinstance(f, quiet._KnownRecords) for f in logger.filters) == 1
        collect = Collect()
        logger.addHandler(collect)
        try:
            logger.warning(text)
            logger.warning("bucket 3 did not finish its reduce-scatter")  # an unrelated record: shown
            logger.error("(reworded) " + text)  # other text: shown
        finally:
            logger.removeHandler(collect)
        assert collect.texts == ["bucket 3 did not finish its reduce-scatter", "(reworded) " + text]
        other = logging.getLogger("megatron.core.elsewhere")
        collect = Collect()
        other.addHandler(collect)
        try:
            other.warning(text)  # the known text from another logger: shown
        finally:
            other.removeHandler(collect)
        assert collect.texts == [text]


def _makefile_train_args() -> tuple[int, list[str]]:
    """NPROC and TRAIN_ARGS as the Makefile sets them (so this launch follows `make train`'s defaults)."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    nproc = int(re.search(r"^NPROC \?= (\d+)", text, re.M).group(1))
    args = shlex.split(re.search(r"^TRAIN_ARGS \?= (.*)$", text, re.M).group(1))
    return nproc, args


def test_make_train_starts_quietly(tmp_path):
    """`make train`'s command (torchrun, the Makefile's TRAIN_ARGS, 1 iteration and 1 evaluation batch): at most
    5 lines containing "warn" in torchrun's and every rank's output together, the start-up from rank 0 only, and
    nothing at all from the other ranks on a healthy run."""
    nproc, args = _makefile_train_args()
    args += ["--train-iters", "1", "--lr-warmup-iters", "0", "--eval-iters", "1"]  # later flags win
    logs = tmp_path / "logs"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")  # as the Makefile's train target
    env.pop("PYTHONWARNINGS", None)
    # --redirects 3: each rank's stdout and stderr in its own files under --log-dir, so they can be told apart.
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--log-dir", str(logs), "--redirects", "3", str(REPO / "pretrain_gpt.py"), *args],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    per_rank = {}
    for path in logs.rglob("*.log"):
        rank = int(path.parent.name)  # <log-dir>/<run id>/attempt_0/<local rank>/{stdout,stderr}.log
        per_rank[rank] = per_rank.get(rank, "") + path.read_text(errors="replace")
    combined = done.stdout + done.stderr + "".join(per_rank.values())
    assert done.returncode == 0, combined[-4000:]
    assert sorted(per_rank) == list(range(nproc)), sorted(per_rank)
    warn_lines = [line for line in combined.splitlines() if re.search("warn", line, re.IGNORECASE)]
    print(f"\n{len(warn_lines)} lines containing 'warn':" + "".join(f"\n  {line}" for line in warn_lines))
    assert len(warn_lines) <= MAX_WARN_LINES, "\n".join(warn_lines)
    assert per_rank[0].count("> megatron_zpp: world") == 1, per_rank[0]  # the start-up, from rank 0
    assert "iteration        1/" in per_rank[0], per_rank[0]
    for rank in range(1, nproc):
        assert per_rank[rank].strip() == "", f"rank {rank} printed:\n{per_rank[rank][:3000]}"
