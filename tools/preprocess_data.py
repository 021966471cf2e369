"""Tokenize text into Megatron's indexed dataset format for ``pretrain_gpt.py --data-path``.

Megatron-LM's ``tools/preprocess_data.py`` flags: ``--input`` JSON-lines files (one document per
line, its text under each of ``--json-keys``, default ``text``) and/or plain-text files (anything
not ending in .json/.jsonl: one document per file), ``--output-prefix``, ``--tokenizer-type`` with
``--vocab-file``/``--merge-file`` (GPT2BPETokenizer), ``--tokenizer-model`` (HuggingFaceTokenizer)
or ``--vocab-size`` (NullTokenizer), ``--append-eod`` (end each document with the tokenizer's
end-of-document id; Megatron-LM's default, as here, is not to) and ``--workers`` (tokenizing
processes). The tokenizer is built exactly as the trainer builds it
(``megatron_zpp.training.tokenizer``); ``--tokenizer-type`` defaults to ``ByteTokenizer`` (UTF-8
bytes, as the built-in corpus). Each key is written to ``PREFIX_{key}_document.bin/.idx``, Megatron-LM's
names; pass that prefix to ``--data-path``::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2/vocab.json --merge-file gpt2/merges.txt \\
        --append-eod --workers 4
    torchrun --nproc-per-node 4 pretrain_gpt.py --data-path data/corpus_text_document \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2/vocab.json --merge-file gpt2/merges.txt ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from multiprocessing import Pool
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_zpp.training.data import DatasetWriter  # noqa: E402
from megatron_zpp.training.tokenizer import (DEFAULT_TOKENIZER, TOKENIZER_TYPES, build_tokenizer,  # noqa: E402
                                             check_tokenizer_args)

_tokenizer = None  # one per worker process
_append_eod = False


def _init_worker(tokenizer_kwargs: dict, append_eod: bool) -> None:
    global _tokenizer, _append_eod
    _tokenizer, _append_eod = build_tokenizer(**tokenizer_kwargs), append_eod


def _encode(record: dict[str, str]) -> dict[str, list[int]]:
    out = {}
    for key, text in record.items():
        ids = list(_tokenizer.tokenize(text))
        out[key] = ids + [_tokenizer.eod] if _append_eod else ids
    return out


def documents(paths: list[Path], json_keys: list[str]) -> Iterator[dict[str, str]]:
    """One ``{key: text}`` per document: a line of a JSON-lines file, or a whole plain-text file."""
    for path in paths:
        if path.suffix in (".jsonl", ".json"):
            with path.open(encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise SystemExit(f"{path}:{n}: not a JSON line ({e}); --input takes one JSON object per "
                                         "line") from None
                    missing = [k for k in json_keys if k not in record]
                    if missing:
                        raise SystemExit(f"{path}:{n}: no key {missing[0]!r} (keys: {sorted(record)}); set --json-keys")
                    bad = [k for k in json_keys if not isinstance(record[k], str)]
                    if bad:
                        raise SystemExit(f"{path}:{n}: {bad[0]!r} is a {type(record[bad[0]]).__name__}, not text")
                    yield {k: record[k] for k in json_keys}
        else:
            yield {json_keys[0]: path.read_text(encoding="utf-8", errors="replace")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="JSON-lines files (.jsonl/.json, one document per line) and/or plain-text files (one "
                        "document each)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin and .idx")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=DEFAULT_TOKENIZER)
    p.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a directory with tokenizer.json")
    p.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    p.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: the number of ids")
    p.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document id")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    paths = [Path(x) for x in args.input]
    missing = [str(x) for x in paths if not x.is_file()]
    if missing:
        raise SystemExit(f"--input file(s) not found: {missing}")
    if len(args.json_keys) > 1 and any(p.suffix not in (".jsonl", ".json") for p in paths):
        raise SystemExit(f"--json-keys {' '.join(args.json_keys)}: plain-text inputs hold one text each; give one "
                         "key, or JSON-lines inputs only")
    if args.workers < 1:
        raise SystemExit(f"--workers {args.workers} must be >= 1")
    tokenizer_kwargs = dict(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                            vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size)
    try:
        check_tokenizer_args(**tokenizer_kwargs)
        tokenizer = build_tokenizer(**tokenizer_kwargs)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise SystemExit(str(e)) from None
    if args.append_eod and tokenizer.eod is None:
        raise SystemExit(f"--append-eod: {args.tokenizer_type} {args.tokenizer_model or ''} has no end-of-document "
                         "token (Hugging Face: no eos_token); name one in tokenizer_config.json next to "
                         'tokenizer.json, e.g. {"eos_token": "<|endoftext|>"}')
    writers = {k: DatasetWriter(f"{args.output_prefix}_{k}_document", tokenizer.vocab_size) for k in args.json_keys}
    start = time.perf_counter()
    docs = documents(paths, args.json_keys)
    if args.workers == 1:
        _init_worker(tokenizer_kwargs, args.append_eod)
        encoded = map(_encode, docs)
        pool = None
    else:
        pool = Pool(args.workers, initializer=_init_worker, initargs=(tokenizer_kwargs, args.append_eod))
        encoded = pool.imap(_encode, docs, chunksize=16)  # in order: document i of the output is document i
    try:
        tokens = 0
        for record in encoded:
            for key, ids in record.items():
                writers[key].add(ids)
                tokens += len(ids)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    for writer in writers.values():
        prefix = writer.finalize()
        print(f"wrote {prefix}.bin and {prefix}.idx ({writer.count} documents)")
    print(f"{tokens:,} tokens ({args.tokenizer_type}, vocabulary {tokenizer.vocab_size}) in "
          f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
