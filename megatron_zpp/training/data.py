"""Training data: Megatron's indexed dataset format (.bin/.idx), a byte-level tokenizer, and a
built-in corpus that needs no download.

The built-in corpus is the Python standard library's own sources (``*.py`` under
``sysconfig``'s stdlib path, tests and site-packages left out: ~700 files, ~13 MB here),
one document per file, tokenized as bytes (ids 0..255) with an end-of-document id 256. It
is written once with ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` into
``~/.cache/megatron_zpp/data/`` (rank 0 writes, the others wait), keyed by Python version
and the file list, and read back with ``IndexedDataset``. ``--data-path PREFIX`` reads a
user's data preprocessed by ``tools/preprocess_data.py`` (same tokenizer) instead.

Samples are windows of ``seq_length + 1`` tokens over the documents laid end to end (as
Megatron's GPTDataset does), in a seeded shuffled order shared by all ranks; each data-
parallel rank takes its own micro-batches of every global batch.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

EOD = 256
VOCAB_SIZE = 257  # bytes + end-of-document
CACHE_DIR = Path(os.environ.get("ZPP_CACHE_DIR", Path.home() / ".cache" / "megatron_zpp")) / "data"


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus an end-of-document token."""

    vocab_size = VOCAB_SIZE
    eod = EOD

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def write_indexed_dataset(prefix: Path, documents, tokenizer: ByteTokenizer | None = None) -> Path:
    """Tokenize ``documents`` (an iterable of str) into ``prefix.bin`` / ``prefix.idx``; each document
    ends with the end-of-document token. Written under a temporary name, then renamed."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tokenizer = tokenizer or ByteTokenizer()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(prefix.name + f".tmp{os.getpid()}")
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=np.uint16)
    count = 0
    for text in documents:
        ids = tokenizer.tokenize(text) + [tokenizer.eod]
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
        count += 1
    if count == 0:
        raise ValueError(f"no documents to write into {prefix}")
    builder.finalize(f"{tmp}.idx")
    os.replace(f"{tmp}.bin", f"{prefix}.bin")
    os.replace(f"{tmp}.idx", f"{prefix}.idx")
    return prefix


def builtin_corpus_prefix() -> Path:
    """The built-in corpus, written on first use (call on one rank, then barrier)."""
    files = stdlib_sources()
    key = hashlib.sha1("\n".join(f"{p}:{p.stat().st_size}" for p in files).encode()).hexdigest()[:12]
    prefix = CACHE_DIR / f"python{sysconfig.get_python_version()}-stdlib-bytes-{key}"
    if not (Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists()):
        write_indexed_dataset(prefix, (p.read_text(encoding="utf-8", errors="replace") for p in files))
    return prefix


class TokenWindows:
    """Fixed-length windows over an indexed dataset's documents laid end to end.

    Split by documents into train / valid (``valid_fraction`` of the documents at the end).
    """

    def __init__(self, prefix: str | Path, seq_length: int, split: str = "train", valid_fraction: float = 0.02,
                 seed: int = 1234) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        if split not in ("train", "valid"):
            raise ValueError(f"split={split!r}; valid: train, valid")
        prefix = str(prefix)
        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).exists():
                raise FileNotFoundError(f"--data-path {prefix}: {prefix + suffix} does not exist; "
                                        "make one with tools/preprocess_data.py")
        dataset = IndexedDataset(prefix)
        n_docs = len(dataset)
        n_valid = max(1, int(n_docs * valid_fraction)) if n_docs > 1 else 0
        docs = range(0, n_docs - n_valid) if split == "train" else range(n_docs - n_valid, n_docs)
        tokens = np.concatenate([dataset.get(i) for i in docs]).astype(np.int64)
        self.window = seq_length + 1
        self.num_samples = len(tokens) // self.window
        if self.num_samples < 1:
            raise ValueError(f"{prefix} ({split}) has {len(tokens)} tokens, fewer than seq_length + 1 = "
                             f"{self.window}")
        self.tokens = torch.from_numpy(tokens[: self.num_samples * self.window]).view(self.num_samples, self.window)
        self.order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(seed))
        self.num_tokens = len(tokens)

    def sample(self, index: int) -> torch.Tensor:
        """Window ``index`` of the shuffled order (wrapping around: epochs)."""
        return self.tokens[self.order[index % self.num_samples]]


def micro_batches(windows: TokenWindows, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
                  start_sample: int = 0):
    """Yield this data-parallel rank's micro-batches: dicts of tokens, labels, loss_mask, position_ids.

    Global batch ``k`` covers samples ``[start + k*G, start + (k+1)*G)``; rank ``r`` takes the
    contiguous ``G / dp`` of them at ``r * G / dp``, in micro-batches of ``micro_batch``.
    """
    per_rank = global_batch // dp_size
    sample = start_sample
    while True:
        first = sample + dp_rank * per_rank
        for m in range(0, per_rank, micro_batch):
            rows = torch.stack([windows.sample(first + m + i) for i in range(micro_batch)])
            tokens, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
            seq = tokens.shape[1]
            yield {
                "tokens": tokens,
                "labels": labels,
                "loss_mask": torch.ones_like(tokens, dtype=torch.float32),
                "position_ids": torch.arange(seq).unsqueeze(0).expand(micro_batch, seq).contiguous(),
            }
        sample += global_batch
