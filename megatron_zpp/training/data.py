"""Training data through Megatron-Core's datasets: ``GPTDataset`` samples, built by
``BlendedMegatronDatasetBuilder`` over memory-mapped indexed datasets (``.bin``/``.idx``).

Sources (Megatron-LM's flags and syntax):

- ``--data-path A`` / ``--data-path A B`` (weights from the datasets' sizes) / ``--data-path 0.3 A 0.7 B``,
  divided into train / valid / test by ``--split`` (default ``"969, 30, 1"``, Megatron-LM's), or
  ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` (the same syntax), each
  prefix made by ``tools/preprocess_data.py`` (or Megatron-LM's).
- Without any of these, the built-in corpus: the Python standard library's own sources (``*.py``
  under ``sysconfig``'s stdlib path, tests and site-packages left out: ~700 files, ~13 MB), one
  document per file, tokenized with ``ByteTokenizer`` (UTF-8 bytes, end-of-document 256). It is
  written once into ``~/.cache/megatron_zpp/data/`` (``$ZPP_CACHE_DIR/data``; rank 0 writes, the
  others wait), keyed by Python version and the file list.

The tokenizer (``--tokenizer-type``, ``megatron_zpp.training.tokenizer``) gives the vocabulary; the
model's embedding is it padded to a multiple of ``--make-vocab-size-divisible-by`` x TP, as in
Megatron-LM. Before building, every prefix is checked: both files exist, its largest token id is
below the tokenizer's vocabulary (a corpus made with a larger vocabulary would index past the
embedding table), and every split it feeds holds at least ``--seq-length + 1`` tokens.

The builder gets Megatron-LM's sample counts: train ``train_iters x global_batch``, valid
``(train_iters // eval_interval + 1) x eval_iters x global_batch`` (one evaluation at the end when
``--eval-interval`` is unset), test ``eval_iters x global_batch``; seed ``--seed``. Its index caches
(document, sample and shuffle orders; built on rank 0 first, then read by the others) go to
``--data-cache-path``, by default under ``~/.cache/megatron_zpp/data/indices/`` keyed by the
prefixes' paths, sizes and times (Megatron-LM's default writes them next to the data instead).
Micro-batches follow Megatron-LM's ``MegatronPretrainingSampler``: consecutive global batches
from the consumed-samples count (``iteration x global_batch`` on resume); within each group of
``micro_batch x DP`` samples, data-parallel rank ``r`` takes the ``r``-th ``micro_batch``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from megatron_zpp.training.cache import CACHE_ROOT

CACHE_DIR = CACHE_ROOT / "data"
DEFAULT_SPLIT = "969, 30, 1"  # Megatron-LM's default with --data-path
SPLIT_NAMES = ("train", "valid", "test")
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
CACHE_MAX_TOKEN_ID_FROM = 256 << 20  # bytes of .bin; smaller files are read again (well under a second)

Blend = tuple[list[str], "list[float] | None"]


# ---------------------------------------------------------------------------------------------------
# Flags: blends, split, and the checks that need no data read


def parse_blend(values: Sequence[str] | None, flag: str = "--data-path") -> Blend | None:
    """Megatron-LM's blend syntax: ``[A, B]`` (weights from the sizes) or ``[w1, A, w2, B]``.

    Prefixes come back absolute: the index caches are keyed by the path as written."""
    if values is None:
        return None
    values = [v.strip() for v in values]
    if not values:
        raise ValueError(f"{flag} needs at least one prefix")
    numeric = [_is_number(v) for v in values]
    if not any(numeric):
        return [os.path.abspath(v) for v in values], None
    pairs = len(values) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2])
    if not pairs:
        raise ValueError(f"{flag} {' '.join(values)}: expected weight/prefix pairs (e.g. {flag} 0.3 A 0.7 B) or "
                         f"prefixes only (e.g. {flag} A B); got {len(values)} values, "
                         f"{sum(numeric)} of them numbers")
    weights = [float(v) for v in values[0::2]]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{flag}: weights {weights} must be >= 0 with a positive sum")
    return [os.path.abspath(v) for v in values[1::2]], weights


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def parse_split(split: str) -> list[float]:
    """``"969, 30, 1"`` -> normalized train/valid/test shares; at most 3 non-negative numbers, missing
    ones 0 (as Megatron-LM reads it)."""
    parts = [p.strip() for p in str(split).split(",")]
    try:
        shares = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to 3 comma-separated numbers, train,valid,test "
                         f"(e.g. \"{DEFAULT_SPLIT}\")") from None
    if len(shares) > 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ValueError(f"--split {split!r}: expected up to 3 non-negative numbers with a positive sum, "
                         f"train,valid,test (e.g. \"{DEFAULT_SPLIT}\")")
    shares += [0.0] * (3 - len(shares))
    return [s / sum(shares) for s in shares]


def validate_data_args(args) -> None:
    """Derive the data defaults (``--split``, ``--tokenizer-type``) and check the data flags without reading
    any data: the errors Megatron would otherwise raise as bare asserts or hangs."""
    from megatron_zpp.training.tokenizer import DEFAULT_TOKENIZER, check_tokenizer_args

    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    args.blend = parse_blend(args.data_path, "--data-path")
    args.blend_per_split = None
    if any(p is not None for p in per_split):
        if args.data_path is not None:
            raise ValueError("--data-path and --train-data-path/--valid-data-path/--test-data-path are exclusive "
                             "(as in Megatron-LM): give one or the other")
        if args.split is not None:
            raise ValueError(f"--split {args.split!r} applies to --data-path only; with --train-data-path/"
                             "--valid-data-path/--test-data-path each split has its own data")
        args.blend_per_split = [parse_blend(p, f"--{name}-data-path") for p, name in zip(per_split, SPLIT_NAMES)]
        if args.blend_per_split[0] is None:
            raise ValueError("--valid-data-path/--test-data-path without --train-data-path: nothing to train on")
        if args.blend_per_split[1] is None and args.eval_iters:
            raise ValueError(f"--eval-iters {args.eval_iters} needs --valid-data-path (or --eval-iters 0)")
    else:
        args.split = args.split if args.split is not None else DEFAULT_SPLIT
        shares = parse_split(args.split)
        if shares[0] == 0:
            raise ValueError(f"--split {args.split!r} leaves nothing to train on (the first share is 0)")
        if shares[1] == 0 and args.eval_iters:
            raise ValueError(f"--split {args.split!r} gives the validation split no data, but --eval-iters is "
                             f"{args.eval_iters}: give it a share or pass --eval-iters 0")
    if args.tokenizer_type is None:
        args.tokenizer_type = DEFAULT_TOKENIZER
    if args.blend is None and args.blend_per_split is None and args.tokenizer_type != DEFAULT_TOKENIZER:
        raise ValueError(f"--tokenizer-type {args.tokenizer_type} needs --data-path: the built-in corpus is "
                         f"tokenized with {DEFAULT_TOKENIZER}; make a dataset for this tokenizer with "
                         "tools/preprocess_data.py")
    check_tokenizer_args(args.tokenizer_type, tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                         merge_file=args.merge_file, vocab_size=args.vocab_size)
    for prefix in blend_prefixes(args.blend, args.blend_per_split):
        check_prefix(prefix)


def blend_prefixes(blend: Blend | None, blend_per_split: list[Blend | None] | None) -> list[str]:
    blends = [blend] if blend else [b for b in (blend_per_split or []) if b]
    return list(dict.fromkeys(p for prefixes, _ in blends for p in prefixes))


def check_prefix(prefix: str) -> None:
    missing = [prefix + s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
    if missing:
        hint = ""
        if Path(prefix + "_text_document.bin").is_file():
            hint = (f" (did you mean {prefix}_text_document? tools/preprocess_data.py names its output "
                    "PREFIX_KEY_document)")
        raise FileNotFoundError(f"data prefix {prefix}: {' and '.join(missing)} not found{hint}; make a dataset with "
                                "tools/preprocess_data.py")
    check_index_covers_data(prefix)


def check_index_covers_data(prefix: str) -> None:
    """The ``.idx`` must parse and the ``.bin`` must hold every token it points to. A truncated ``.bin`` (a copy cut
    short, a full disk) is otherwise found only when a sample past its end is read, mid-training and on one rank:
    numpy's "offset must be non-negative and no greater than buffer length", while the other ranks wait in the
    next collective. Reads the index's header and its last entry only (a memory map), so it is cheap at any size."""
    import struct

    from megatron.core.datasets.indexed_dataset import _IndexReader

    idx, bin_path = prefix + ".idx", prefix + ".bin"
    try:
        index = _IndexReader(idx, multimodal=False)
        count = len(index.sequence_lengths)
        needed = 0 if count == 0 else int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * \
            index.dtype_size
        if count != index.sequence_count:
            raise ValueError(f"{index.sequence_count} sequences declared, {count} present")
    except (AssertionError, ValueError, struct.error, KeyError) as e:  # what Megatron's reader raises on bad bytes
        raise ValueError(f"data prefix {prefix}: {idx} is not a readable Megatron index ({type(e).__name__}: {e}); "
                         "it is truncated or corrupt: remake the dataset with tools/preprocess_data.py") from None
    size = Path(bin_path).stat().st_size
    if size < needed:
        raise ValueError(f"data prefix {prefix}: {bin_path} holds {size} bytes, but its index points to {needed} "
                         f"({count} sequences); the .bin is truncated: remake or recopy the dataset")


# ---------------------------------------------------------------------------------------------------
# Indexed datasets: the built-in corpus, writing, inspecting


class DatasetWriter:
    """Writes token-id documents into ``prefix.bin`` / ``prefix.idx`` (one sequence per document) with the
    smallest dtype that holds ``vocab_size`` ids (as Megatron-LM's preprocessing). Written under a temporary
    name and renamed by ``finalize``, so a reader never sees a partial dataset."""

    def __init__(self, prefix: Path | str, vocab_size: int) -> None:
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

        self.prefix, self.vocab_size, self.count = Path(prefix), vocab_size, 0
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.prefix.with_name(self.prefix.name + f".tmp{os.getpid()}")
        self.dtype = DType.optimal_dtype(vocab_size)
        self._builder = IndexedDatasetBuilder(f"{self._tmp}.bin", dtype=self.dtype)

    def add(self, ids: Sequence[int]) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"{self.prefix}: document {self.count} has token id {int(ids.max())} outside the "
                             f"vocabulary of {self.vocab_size}")
        self._builder.add_document(ids.astype(self.dtype), [int(ids.size)])
        self.count += 1

    def finalize(self) -> Path:
        if self.count == 0:
            self._builder.data_file.close()
            Path(f"{self._tmp}.bin").unlink(missing_ok=True)
            raise ValueError(f"no documents to write into {self.prefix}")
        self._builder.finalize(f"{self._tmp}.idx")
        os.replace(f"{self._tmp}.bin", f"{self.prefix}.bin")
        os.replace(f"{self._tmp}.idx", f"{self.prefix}.idx")
        return self.prefix


def write_indexed_dataset(prefix: Path | str, documents: Iterable[Sequence[int]], vocab_size: int) -> Path:
    """Write token-id documents into ``prefix.bin`` / ``prefix.idx`` (see ``DatasetWriter``)."""
    writer = DatasetWriter(prefix, vocab_size)
    for ids in documents:
        writer.add(ids)
    return writer.finalize()


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def builtin_corpus_prefix() -> Path:
    """The built-in corpus, byte-tokenized with an end-of-document token after each file; written on first
    use (call on one rank, then barrier)."""
    from megatron_zpp.training.tokenizer import ByteTokenizer

    files = stdlib_sources()
    key = hashlib.sha1("\n".join(f"{p}:{p.stat().st_size}" for p in files).encode()).hexdigest()[:12]
    prefix = CACHE_DIR / f"python{sysconfig.get_python_version()}-stdlib-bytes-{key}"
    if not (Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists()):
        tokenizer = ByteTokenizer()
        documents = (tokenizer.tokenize(p.read_text(encoding="utf-8", errors="replace")) + [tokenizer.eod]
                     for p in files)
        write_indexed_dataset(prefix, documents, tokenizer.vocab_size)
    return prefix


def max_token_id(prefix: str) -> int:
    """The largest token id in ``prefix.bin`` (-1 when empty), read in chunks through a memory map. For a
    large file (a full read takes a while) it is cached under the cache directory by path, size and
    modification time."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    bin_path = Path(prefix + ".bin").resolve()
    stat = bin_path.stat()
    stamp = {"path": str(bin_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    cache = CACHE_DIR / "max-token-id" / (hashlib.sha1(str(bin_path).encode()).hexdigest()[:16] + ".json")
    try:
        cached = json.loads(cache.read_text())
        if {k: cached.get(k) for k in stamp} == stamp:
            return int(cached["max"])
    except (OSError, ValueError, KeyError):
        pass
    dtype = IndexedDataset(prefix, mmap=True).index.dtype
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    chunk = 1 << 26
    largest = max((int(tokens[i:i + chunk].max()) for i in range(0, tokens.size, chunk)), default=-1)
    del tokens
    if stat.st_size < CACHE_MAX_TOKEN_ID_FROM:
        return largest
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({**stamp, "max": largest}))
    os.replace(tmp, cache)
    return largest


def check_vocab(prefixes: Sequence[str], vocab_size: int, tokenizer_type: str) -> None:
    """Every token id of every prefix must index the tokenizer's vocabulary. Reads the data only when its
    dtype can hold ids past the vocabulary."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in prefixes:
        dtype = IndexedDataset(prefix, mmap=True).index.dtype
        if np.iinfo(dtype).max < vocab_size:
            continue
        largest = max_token_id(prefix)
        if largest >= vocab_size:
            raise ValueError(f"data prefix {prefix}: token id {largest} is outside the vocabulary of --tokenizer-type "
                             f"{tokenizer_type} ({vocab_size} ids, largest valid id {vocab_size - 1}); the data was "
                             "tokenized with a larger vocabulary: pass the --tokenizer-type (and --vocab-file/"
                             "--merge-file/--tokenizer-model/--vocab-size) it was made with")


def check_splits(blend: Blend | None, blend_per_split: list[Blend | None] | None, split: str | None,
                 seq_length: int) -> None:
    """Every split a prefix feeds must hold at least ``seq_length + 1`` tokens (one sample): Megatron's
    GPTDataset loops forever on an empty split and repeats a short one within a sample."""
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if blend is not None:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        feeds = [(p, matrix) for p in blend[0]]
    else:
        feeds = []
        for i, b in enumerate(blend_per_split or []):
            for p in (b[0] if b else []):
                feeds.append((p, [(0.0, 1.0) if j == i else None for j in range(3)]))
    for prefix, matrix in feeds:
        dataset = IndexedDataset(prefix, mmap=True)  # held: its lengths live in its memory map
        lengths = dataset.sequence_lengths
        n = len(lengths)
        for name, bookends in zip(SPLIT_NAMES, matrix):
            if bookends is None:
                continue
            # The document range Megatron's builder gives this split.
            begin, end = int(round(bookends[0] * n)), int(round(bookends[1] * n))
            tokens = int(np.sum(lengths[begin:end], dtype=np.int64))
            if tokens < seq_length + 1:
                where = (f"its {name} split (documents {begin}..{end} of {n}, --split {split!r})"
                         if blend is not None else f"the {name} data")
                raise ValueError(f"data prefix {prefix}: {where} holds {tokens} tokens, fewer than --seq-length + 1 = "
                                 f"{seq_length + 1} (one sample); use more data, a shorter --seq-length, or a "
                                 "--split that gives this split more documents (or none: a 0 share)")


# ---------------------------------------------------------------------------------------------------
# Datasets and micro-batches


@dataclass
class Data:
    train: object
    valid: object | None
    test: object | None
    description: str


def sample_counts(args) -> list[int]:
    """Megatron-LM's train/valid/test sample counts (``get_train_valid_test_num_samples``)."""
    evaluations = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1
    return [args.train_iters * args.global_batch_size, evaluations * args.eval_iters * args.global_batch_size,
            args.eval_iters * args.global_batch_size]


def build_datasets(args, tokenizer) -> Data:
    """Check the data against the flags and the tokenizer, then build the GPTDataset splits (call on every
    rank, after ``torch.distributed`` is initialized)."""
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megatron_zpp.training.agreement import mark_agreed

    blend, blend_per_split, split = args.blend, args.blend_per_split, args.split
    source = None
    if blend is None and blend_per_split is None:
        if dist.get_rank() == 0:
            builtin_corpus_prefix()
        dist.barrier()
        blend, source = ([str(builtin_corpus_prefix())], None), "built-in corpus (Python stdlib sources)"
    prefixes = blend_prefixes(blend, blend_per_split)
    # Rank 0 checks the splits and reads the data for its largest id (cached for large files); every rank raises
    # rank 0's verdict, so a node-local copy that differs cannot fail some ranks only (agreement.py).
    verdict = [None]
    if dist.get_rank() == 0:
        try:
            check_splits(blend, blend_per_split, split, args.seq_length)
            check_vocab(prefixes, tokenizer.vocab_size, args.tokenizer_type)
        except ValueError as e:
            verdict = [e]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        error = verdict[0]
        mark_agreed(error)  # every rank raises rank 0's verdict, with its type
        raise error

    path_to_cache = Path(args.data_cache_path) if args.data_cache_path else index_cache_dir(prefixes)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=split if blend is not None else None, path_to_cache=str(path_to_cache), tokenizer=tokenizer,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        mmap_bin_files=True)
    sizes, rank = sample_counts(args), dist.get_rank()
    # First rank 0 alone writes (or finds) the index caches, under a file lock: another job with the same data
    # and flags may be writing the same files, which Megatron saves in place. Then every rank reads them (each
    # reads its own micro-batches); the others wait in the builder's barriers meanwhile.
    with _locked(path_to_cache) if rank == 0 else contextlib.nullcontext():
        BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: rank == 0, config).build()
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    names = source or ", ".join(_blend_text(b, name) for b, name in
                                ([(blend, "")] if blend else zip(blend_per_split, SPLIT_NAMES)) if b)
    description = (f"{names}" + (f", split {split}" if blend is not None else "")
                   + f"; {len(train):,} train samples of {args.seq_length} tokens")
    return Data(train, valid, test, description)


def _blend_text(blend: Blend, split_name: str) -> str:
    prefixes, weights = blend
    names = [Path(p).name for p in prefixes]
    text = " ".join(names) if weights is None else " ".join(f"{w:g} {n}" for w, n in zip(weights, names))
    return f"{split_name}: {text}" if split_name else text


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def index_cache_dir(prefixes: Sequence[str]) -> Path:
    """Where the builder caches its indices by default: keyed by the prefixes' paths, sizes and modification
    times, so a dataset rewritten under the same prefix gets fresh indices."""
    stamps = []
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            stat = Path(prefix + suffix).stat()
            stamps.append(f"{Path(prefix + suffix).resolve()}:{stat.st_size}:{stat.st_mtime_ns}")
    return CACHE_DIR / "indices" / hashlib.sha1("\n".join(stamps).encode()).hexdigest()[:16]


def sample_indices(consumed_samples: int, total_samples: int, micro_batch: int, dp_rank: int,
                   dp_size: int) -> Iterator[list[int]]:
    """The sample indices of this data-parallel rank's micro-batches, in the order of Megatron-LM's
    ``MegatronPretrainingSampler``: from ``consumed_samples`` on, each block of ``micro_batch x dp_size``
    consecutive samples gives rank ``r`` its ``r``-th ``micro_batch``; an incomplete last block is dropped.
    (Mirrored rather than imported: it lives in ``megatron.training``, and ``tests/test_data.py`` checks
    the two agree.)"""
    block = micro_batch * dp_size
    for first in range(consumed_samples, total_samples - block + 1, block):
        start = first + dp_rank * micro_batch
        yield list(range(start, start + micro_batch))


def micro_batches(dataset, consumed_samples: int, micro_batch: int, dp_rank: int,
                  dp_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches of ``dataset`` (dicts of tokens, labels, loss_mask, position_ids, stacked as
    Megatron-LM's DataLoader collates them)."""
    for indices in sample_indices(consumed_samples, len(dataset), micro_batch, dp_rank, dp_size):
        samples = [dataset[i] for i in indices]
        yield {k: torch.stack([s[k] for s in samples]) for k in BATCH_KEYS}
