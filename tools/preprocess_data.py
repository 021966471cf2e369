"""Preprocess your own text into Megatron's indexed dataset format for ``pretrain_gpt.py --data-path``.

Inputs: plain-text files (one document per file) or JSON-lines files (one document per line,
its text under ``--json-key``, default ``text``). Tokenizer: UTF-8 bytes plus an end-of-document
token, the same as the built-in corpus (``megatron_zpp.training.data.ByteTokenizer``).

    python tools/preprocess_data.py --input corpus.jsonl notes/*.txt --output-prefix data/mycorpus
    torchrun --nproc-per-node 4 pretrain_gpt.py --data-path data/mycorpus ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_zpp.training.data import write_indexed_dataset  # noqa: E402


def documents(paths: list[Path], json_key: str):
    for path in paths:
        if path.suffix in (".jsonl", ".json"):
            with path.open(encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if json_key not in record:
                        raise SystemExit(f"{path}:{n}: no key {json_key!r} (keys: {sorted(record)}); "
                                         f"set --json-key")
                    yield str(record[json_key])
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help=".txt files and/or .jsonl files")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--json-key", default="text")
    args = p.parse_args()
    paths = [Path(x) for x in args.input]
    missing = [str(x) for x in paths if not x.is_file()]
    if missing:
        raise SystemExit(f"input file(s) not found: {missing}")
    prefix = write_indexed_dataset(Path(args.output_prefix), documents(paths, args.json_key))
    print(f"wrote {prefix}.bin and {prefix}.idx")


if __name__ == "__main__":
    main()
