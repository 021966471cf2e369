"""Tokenizers for ``pretrain_gpt.py`` and ``tools/preprocess_data.py`` (``--tokenizer-type``).

- ``ByteTokenizer`` (the default): UTF-8 bytes as ids 0..255 and an end-of-document id 256, a
  vocabulary of 257. This project's own; the built-in corpus is tokenized with it.
- ``HuggingFaceTokenizer``: ``--tokenizer-model`` is a local directory holding ``tokenizer.json``
  (and, for an end-of-document id, a ``tokenizer_config.json`` naming its ``eos_token``), or that
  ``tokenizer.json`` itself.
- ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file``
  (merges.txt); ``<|endoftext|>`` ends documents.
- ``NullTokenizer``: the text is whitespace-separated ids; ``--vocab-size`` ids, the last one ends
  documents.

The last three are Megatron-Core's own (``megatron.core.tokenizers``), built the way Megatron-LM's
``build_tokenizer`` builds them, so the ids are Megatron-LM's. One exception: Megatron-LM's
GPT2BPETokenizer fetches GPT-2's tokenizer configuration from the Hugging Face hub on every start
and this machine has no network; here the same tokenizer class (transformers' GPT-2 tokenizer, with
``<|endoftext|>`` as its end-of-sequence token) is configured from a local file instead. The
Hugging Face ones need ``transformers``, imported only when asked for.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_zpp.training.cache import CACHE_ROOT

DEFAULT_TOKENIZER = "ByteTokenizer"
TOKENIZER_TYPES = ("ByteTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
INSTALL_HINT = "pip install 'megatron_zpp[tokenizers]' (or: pip install transformers tokenizers)"


class ByteTokenizer(MegatronTokenizerBase):
    """UTF-8 bytes as token ids, plus an end-of-document token (id 256, vocabulary 257).

    What Megatron-Core's ``GPTDataset`` needs: ``vocab_size``, ``eod`` and ``unique_identifiers`` (its
    index caches are keyed by them). There is no padding token, so no real token is ever masked as one.
    """

    EOD = 256

    def __init__(self) -> None:
        super().__init__(path=None, config={"library": "zpp-bytes"})

    @property
    def vocab_size(self) -> int:
        return self.EOD + 1

    @property
    def eod(self) -> int:
        return self.EOD

    @property
    def vocab(self) -> dict[str, int]:
        return {**{f"<0x{i:02X}>": i for i in range(256)}, "<eod>": self.EOD}

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(**{"class": f"{type(self).__module__}.{type(self).__qualname__}",
                              "vocab_size": self.vocab_size, "eod": self.EOD})

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("ByteTokenizer has no chat template")


def build_tokenizer(tokenizer_type: str | None = None, *, tokenizer_model: str | None = None,
                    vocab_file: str | None = None, merge_file: str | None = None,
                    vocab_size: int | None = None) -> MegatronTokenizerBase:
    """The tokenizer ``--tokenizer-type`` names (default: ``ByteTokenizer``); see the module docstring."""
    tokenizer_type = tokenizer_type or DEFAULT_TOKENIZER
    check_tokenizer_args(tokenizer_type, tokenizer_model=tokenizer_model, vocab_file=vocab_file,
                         merge_file=merge_file, vocab_size=vocab_size)
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build_tokenizer

    if tokenizer_type == "GPT2BPETokenizer":
        return _gpt2_bpe_tokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        model = Path(tokenizer_model)
        # Megatron-LM passes --tokenizer-model to AutoTokenizer, which wants the directory.
        model = model.parent if model.is_file() else model
        return megatron_build_tokenizer(_megatron_args(tokenizer_type, tokenizer_model=str(model)))
    return megatron_build_tokenizer(_megatron_args(tokenizer_type, vocab_size=vocab_size))


def check_tokenizer_args(tokenizer_type: str, *, tokenizer_model: str | None = None, vocab_file: str | None = None,
                         merge_file: str | None = None, vocab_size: int | None = None) -> None:
    """Clear errors for a tokenizer that cannot be built: an unknown type, a missing file or flag, or a
    missing ``transformers``."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; valid: {', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                raise ValueError(f"--tokenizer-type GPT2BPETokenizer needs {flag} (GPT-2's "
                                 f"{'vocab.json' if flag == '--vocab-file' else 'merges.txt'})")
            if not Path(path).is_file():
                raise FileNotFoundError(f"{flag} {path}: no such file")
    elif tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model: a directory holding "
                             "tokenizer.json, or the tokenizer.json file")
        model = Path(tokenizer_model)
        if not model.exists():
            raise FileNotFoundError(f"--tokenizer-model {tokenizer_model}: no such file or directory")
        if model.is_file() and model.name != "tokenizer.json":
            raise ValueError(f"--tokenizer-model {tokenizer_model}: expected a directory or a file named "
                             "tokenizer.json (Hugging Face loads tokenizers by directory)")
        if model.is_dir() and not any((model / name).is_file() for name in
                                      ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
            raise FileNotFoundError(f"--tokenizer-model {tokenizer_model}: the directory has no tokenizer.json "
                                    "(nor tokenizer_config.json)")
    elif tokenizer_type == "NullTokenizer":
        if not vocab_size or vocab_size < 2:
            raise ValueError(f"--tokenizer-type NullTokenizer needs --vocab-size >= 2 (got {vocab_size}): its "
                             "ids are 0 .. vocab-size - 1, the last one ending documents")
    if tokenizer_type in ("GPT2BPETokenizer", "HuggingFaceTokenizer"):
        missing = [m for m in ("transformers", "tokenizers") if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(f"--tokenizer-type {tokenizer_type} needs {' and '.join(missing)}: {INSTALL_HINT}")


def tokenizer_from_args(args) -> MegatronTokenizerBase:
    return build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                           merge_file=args.merge_file, vocab_size=args.vocab_size)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron-LM's embedding size: the vocabulary padded to a multiple of divisible-by x TP."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


def _megatron_args(tokenizer_type: str, **values) -> SimpleNamespace:
    """The attributes Megatron-Core's ``build_tokenizer`` reads, at Megatron-LM's defaults."""
    args = SimpleNamespace(tokenizer_type=tokenizer_type, tokenizer_model=None, vocab_file=None, merge_file=None,
                           vocab_size=None, special_tokens=None, tokenizer_hf_no_use_fast=False,
                           trust_remote_code=False, tokenizer_hf_no_include_special_tokens=False, chat_template=None,
                           metadata_path=None, pad_vocab_size=False, null_tokenizer_eod_id=None,
                           null_tokenizer_pad_id=None)
    for key, value in values.items():
        setattr(args, key, value)
    return args


# transformers' GPT-2 tokenizer settings, as GPT-2's hub configuration gives them; model_max_length is
# raised from 1024 only to keep transformers from warning on every document longer than that.
_GPT2_CONFIG = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 10**30, "add_prefix_space": False,
                "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}


def _gpt2_bpe_tokenizer(vocab_file: str, merge_file: str) -> MegatronTokenizerBase:
    from megatron.core.tokenizers import MegatronTokenizer

    config_dir = CACHE_ROOT / "tokenizers" / "gpt2-bpe"
    config = config_dir / "tokenizer_config.json"
    text = json.dumps(_GPT2_CONFIG, indent=1)
    if not config.is_file() or config.read_text() != text:
        config_dir.mkdir(parents=True, exist_ok=True)
        tmp = config.with_name(f"{config.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, config)  # atomic: ranks and preprocessing workers may race here
    # The keyword arguments Megatron-Core's build_tokenizer passes for GPT2BPETokenizer.
    return MegatronTokenizer.from_pretrained(
        tokenizer_path=str(config_dir), metadata_path={"library": "huggingface"},
        vocab_file=str(Path(vocab_file).resolve()), merges_file=str(Path(merge_file).resolve()),
        additional_special_tokens=[], use_fast=True, trust_remote_code=False, include_special_tokens=True)
