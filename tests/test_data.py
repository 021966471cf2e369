"""Data through Megatron-Core's datasets and real tokenizers: preprocessing with a BPE tokenizer trained
offline, a weighted blend trained on 2 ranks whose first batch equals Megatron-Core's own GPTDataset,
the vocabulary check, and the clear errors for bad data flags."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_zpp.testing import run_distributed
from megatron_zpp.training import data
from megatron_zpp.training.arguments import PROJECT_RECIPE, build_parser, validate_args
from megatron_zpp.training.tokenizer import ByteTokenizer, build_tokenizer, check_tokenizer_args

REPO = Path(__file__).resolve().parents[1]
BPE_VOCAB = 500  # not a multiple of 128: the model's embedding must be padded to 512
EOD_TOKEN = "<|endoftext|>"
needs_tokenizers = pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None or importlib.util.find_spec("transformers") is None,
    reason="needs the tokenizers extra: pip install 'megatron_zpp[tokenizers]'")


def _stdlib_texts(start: int, count: int) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in data.stdlib_sources()[start:start + count]]


def _preprocess(*argv: str) -> str:
    result = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), *argv],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> dict:
    """A byte-level BPE (500 ids, <|endoftext|> = 0) trained on ~2 MB of the built-in corpus's text, saved as a
    Hugging Face tokenizer directory (tokenizer.json and its config naming the eos token) and as GPT-2's
    vocab.json + merges.txt; two JSON-lines corpora (plus a plain-text file) preprocessed with it, one per
    tokenizer type."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("bpe")
    texts, size = [], 0
    for text in _stdlib_texts(0, 400):
        texts.append(text)
        size += len(text)
        if size > 2 << 20:
            break
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(texts, vocab_size=BPE_VOCAB, min_frequency=2, special_tokens=[EOD_TOKEN])
    hf_dir = root / "hf"
    PreTrainedTokenizerFast(tokenizer_object=trainer._tokenizer, eos_token=EOD_TOKEN).save_pretrained(hf_dir)
    trainer.save_model(str(root))  # vocab.json, merges.txt

    corpora = {"a": _stdlib_texts(400, 40), "b": _stdlib_texts(440, 60)}
    for name, docs in corpora.items():
        with (root / f"{name}.jsonl").open("w") as f:
            for text in docs:
                f.write(json.dumps({"text": text}) + "\n")
    (root / "extra.txt").write_text("a plain-text document: one file, one document\n")
    corpora["a"].append((root / "extra.txt").read_text())
    out = {"root": root, "hf_dir": hf_dir, "vocab": root / "vocab.json", "merges": root / "merges.txt",
           "corpora": corpora, "hf_prefix": str(root / "a_text_document"), "gpt2_prefix": str(root / "b_text_document")}
    out["hf_stdout"] = _preprocess("--input", str(root / "a.jsonl"), str(root / "extra.txt"), "--output-prefix",
                                   str(root / "a"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                   str(hf_dir / "tokenizer.json"), "--append-eod", "--workers", "2")
    out["gpt2_stdout"] = _preprocess("--input", str(root / "b.jsonl"), "--output-prefix", str(root / "b"),
                                     "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(out["vocab"]),
                                     "--merge-file", str(out["merges"]), "--append-eod")
    return out


@needs_tokenizers
@pytest.mark.parametrize("kind", ["hf", "gpt2"])
def test_preprocessed_ids_are_the_tokenizers_encoding_plus_eod(bpe, kind):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(bpe["hf_dir"] / "tokenizer.json"))
    eod = reference.token_to_id(EOD_TOKEN)
    prefix = bpe[f"{kind}_prefix"]
    documents = bpe["corpora"]["a" if kind == "hf" else "b"]
    dataset = IndexedDataset(prefix)
    assert len(dataset) == len(documents), bpe[f"{kind}_stdout"]
    assert dataset.index.dtype == np.uint16  # Megatron's choice for a vocabulary under 65500
    for i, text in enumerate(documents):
        assert dataset[i].tolist() == reference.encode(text).ids + [eod], i
    assert int(max(dataset[i].max() for i in range(len(dataset)))) < BPE_VOCAB


@needs_tokenizers
def test_both_bpe_tokenizers_match_megatron_cores_and_know_their_eod(bpe):
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(bpe["hf_dir"]))
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=str(bpe["vocab"]), merge_file=str(bpe["merges"]))
    text = bpe["corpora"]["b"][0][:4000] + " héllo <|endoftext|> 日本"
    assert hf.tokenize(text) == gpt2.tokenize(text)
    assert hf.vocab_size == gpt2.vocab_size == BPE_VOCAB and hf.eod == gpt2.eod == 0
    # Megatron-Core's own builder gives the same HuggingFaceTokenizer ids.
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build_tokenizer

    from megatron_zpp.training.tokenizer import _megatron_args

    core = megatron_build_tokenizer(_megatron_args("HuggingFaceTokenizer", tokenizer_model=str(bpe["hf_dir"])))
    assert core.tokenize(text) == hf.tokenize(text)


def _record_first_batch_and_train(argv: list[str]) -> dict:
    """Per rank: train, keeping the first micro-batch this rank's data iterator gave."""
    from megatron_zpp.training import trainer

    original, first = trainer._forward_step, []

    def recording(device, on_micro_batch, agreement, data_iterator, model):
        batch = next(data_iterator)
        if not first:
            first.append(batch["tokens"].clone())
        return original(device, on_micro_batch, agreement, iter([batch]), model)

    trainer._forward_step = recording
    try:
        summary = trainer.pretrain(argv, log=lambda *a, **k: None)
    finally:
        trainer._forward_step = original
    return {"first_tokens": first[0].tolist(), "losses": summary["losses"], "tokenizer": summary["tokenizer"],
            "model_vocab_size": summary["model_vocab_size"], "valid_loss": summary.get("valid_loss"),
            "finite": summary["finite"]}


@needs_tokenizers
def test_weighted_blend_trains_on_megatron_cores_gpt_dataset(bpe, tmp_path):
    """--data-path 0.3 P1 0.7 P2 on 2 ranks (DP2): each rank's first micro-batch is what Megatron-Core's
    BlendedMegatronDatasetBuilder + GPTDataset give for the same seed, split and sample counts (built here,
    independently, in this process); the loss is finite and falls; the embedding is the padded vocabulary."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    iters, micro, dp, seq, eval_iters, split, seed = 20, 2, 2, 64, 2, "90,10,0", 1234
    p1, p2 = bpe["hf_prefix"], bpe["gpt2_prefix"]
    argv = PROJECT_RECIPE + [
        "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", str(seq),
        "--micro-batch-size", str(micro), "--train-iters", str(iters), "--eval-iters", str(eval_iters),
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "constant", "--seed", str(seed),
        "--data-path", "0.3", p1, "0.7", p2, "--split", split, "--data-cache-path", str(tmp_path / "cache"),
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(bpe["hf_dir"])]
    ranks = run_distributed(_record_first_batch_and_train, dp, argv, timeout_s=300)

    tokenizer = MegatronTokenizer.from_pretrained(tokenizer_path=str(bpe["hf_dir"]),
                                                  metadata_path={"library": "huggingface"})
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq, blend=([p1, p2], [0.3, 0.7]), split=split,
                              path_to_cache=str(tmp_path / "reference-cache"), tokenizer=tokenizer,
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    batch = micro * dp
    # Megatron-LM's counts: train iters x batch, (iters // eval_interval + 1) x eval_iters x batch (one
    # evaluation: no --eval-interval), eval_iters x batch.
    sizes = [iters * batch, eval_iters * batch, eval_iters * batch]
    train = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()[0]
    for rank, result in enumerate(ranks):
        expected = [train[i]["tokens"].tolist() for i in range(rank * micro, (rank + 1) * micro)]
        assert result["first_tokens"] == expected, rank
    # Both prefixes feed the run (weights 0.3/0.7 over 80 samples).
    sources = {int(train[i]["dataset_id"]) for i in range(iters * batch)}
    assert sources == {0, 1}

    losses = ranks[0]["losses"]
    assert all(math.isfinite(x) for x in losses) and ranks[0]["finite"], losses
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3, losses
    assert math.isfinite(ranks[0]["valid_loss"])
    assert ranks[0]["tokenizer"] == {"type": "HuggingFaceTokenizer", "vocab_size": BPE_VOCAB,
                                     "padded_vocab_size": 512}
    assert ranks[0]["model_vocab_size"] == 512
    print(f"\nfirst micro-batch of each of {dp} ranks: {micro} x {seq} token ids equal to Megatron-Core's "
          f"GPTDataset; lm loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def _pretrain_error(argv: list[str]) -> str:
    from megatron_zpp.training.trainer import pretrain

    try:
        pretrain(argv, log=lambda *a, **k: None)
    except ValueError as e:
        return str(e)
    return "no error"


@needs_tokenizers
def test_a_bpe_corpus_read_with_the_byte_tokenizer_is_refused(bpe):
    """The BPE corpus's ids (up to 499) do not fit the default ByteTokenizer's 257: the trainer says so, naming
    the prefix, the largest id and the vocabulary, before building anything."""
    prefix = bpe["gpt2_prefix"]
    message = run_distributed(_pretrain_error, 1, ["--data-path", prefix, "--split", "90,10,0", "--train-iters", "2",
                                                   "--eval-iters", "1"], timeout_s=300)[0]
    largest = data.max_token_id(prefix)
    assert largest >= 257
    assert f"data prefix {prefix}: token id {largest} is outside the vocabulary of --tokenizer-type ByteTokenizer " \
           "(257 ids" in message, message


@needs_tokenizers
def test_null_tokenizer_with_too_small_a_vocabulary_is_refused(bpe):
    with pytest.raises(ValueError, match=r"token id \d+ is outside the vocabulary of --tokenizer-type NullTokenizer "
                                         r"\(300 ids"):
        data.check_vocab([bpe["hf_prefix"]], 300, "NullTokenizer")
    data.check_vocab([bpe["hf_prefix"]], BPE_VOCAB, "NullTokenizer")  # fits


def test_byte_tokenizer_is_megatron_compatible():
    from megatron.core.tokenizers import MegatronTokenizerBase

    tok = build_tokenizer()
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, MegatronTokenizerBase)
    assert (tok.vocab_size, tok.eod) == (257, 256)
    assert tok.tokenize("é") == [0xC3, 0xA9] and tok.detokenize(tok.tokenize("héllo") + [256]) == "héllo"
    assert tok.unique_identifiers["vocab_size"] == 257


def test_sampler_order_is_megatron_lms():
    """``sample_indices`` against Megatron-LM's MegatronPretrainingSampler, resumes included."""
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    for consumed, total, micro, dp in [(0, 50, 2, 2), (8, 50, 2, 2), (12, 101, 3, 4), (0, 7, 1, 3), (40, 64, 4, 2)]:
        for rank in range(dp):
            ours = list(data.sample_indices(consumed, total, micro, rank, dp))
            theirs = list(MegatronPretrainingSampler(total, consumed, micro, rank, dp))
            assert ours == theirs, (consumed, total, micro, dp, rank)


def test_sample_counts_are_megatron_lms():
    args = validate_args(build_parser().parse_args(["--train-iters", "100", "--eval-interval", "30", "--eval-iters",
                                                    "5", "--micro-batch-size", "2"]), 4)
    assert data.sample_counts(args) == [100 * 8, (100 // 30 + 1) * 5 * 8, 5 * 8]


# ---------------------------------------------------------------------------------------------------
# Clear errors before Megatron's asserts (or hangs)


def _validate(flags: list[str]):
    return validate_args(build_parser().parse_args(flags), 1)


@pytest.fixture
def tiny_prefix(tmp_path) -> str:
    """10 byte-tokenized documents of 21 tokens each."""
    prefix = tmp_path / "tiny_text_document"
    data.write_indexed_dataset(prefix, [list(range(20)) + [256]] * 10, 257)
    return str(prefix)


def test_data_path_defaults_follow_megatron_lm(tiny_prefix):
    args = _validate(["--data-path", tiny_prefix])
    assert args.split == "969, 30, 1" and args.tokenizer_type == "ByteTokenizer"
    assert args.blend == ([tiny_prefix], None)
    args = _validate(["--data-path", "1", tiny_prefix, "3", tiny_prefix])
    assert args.blend == ([tiny_prefix, tiny_prefix], [1.0, 3.0])
    args = _validate(["--data-path", tiny_prefix, tiny_prefix])  # weights from the sizes
    assert args.blend == ([tiny_prefix, tiny_prefix], None)


@pytest.mark.parametrize("flags, error, message", [
    (["--data-path", "/nonexistent/corpus"], FileNotFoundError,
     r"data prefix /nonexistent/corpus: /nonexistent/corpus.bin and /nonexistent/corpus.idx not found"),
    (["--data-path", "0.3", "A", "0.7"], ValueError, r"--data-path 0.3 A 0.7: expected weight/prefix pairs"),
    (["--data-path", "0.3", "A", "B", "0.7"], ValueError, r"expected weight/prefix pairs"),
    (["--data-path", "-1", "A"], ValueError, r"weights \[-1.0\] must be >= 0"),
    (["--split", "90,x,0"], ValueError, r"--split '90,x,0': expected up to 3 comma-separated numbers"),
    (["--split", "90,5,3,2"], ValueError, r"expected up to 3 non-negative numbers"),
    (["--split", "0,100,0"], ValueError, r"leaves nothing to train on"),
    (["--split", "100,0,0"], ValueError, r"gives the validation split no data, but --eval-iters is 100"),
    (["--train-data-path", "A", "--data-path", "B"], ValueError, r"are exclusive"),
    (["--valid-data-path", "A"], ValueError, r"without --train-data-path"),
    (["--tokenizer-type", "GPT2BPETokenizer"], ValueError, r"needs --data-path: the built-in corpus is tokenized"),
])
def test_bad_data_flags_fail_clearly(flags, error, message, tmp_path):
    with pytest.raises(error, match=message):
        _validate(flags)


def test_missing_prefix_hints_at_megatrons_output_name(tiny_prefix):
    with pytest.raises(FileNotFoundError, match=r"did you mean .*tiny_text_document\?"):
        _validate(["--data-path", tiny_prefix.removesuffix("_text_document")])


def test_unknown_tokenizer_type_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tokenizer-type", "SentencePieceTokenizer"])
    err = capsys.readouterr().err
    assert "invalid choice: 'SentencePieceTokenizer'" in err and "ByteTokenizer" in err and "NullTokenizer" in err
    with pytest.raises(ValueError, match=r"--tokenizer-type 'Foo' is not supported; valid: ByteTokenizer, "
                                         r"GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer"):
        check_tokenizer_args("Foo")


@pytest.mark.parametrize("kind, kwargs, error, message", [
    ("GPT2BPETokenizer", {}, ValueError, r"needs --vocab-file"),
    ("GPT2BPETokenizer", {"vocab_file": "/nonexistent/vocab.json", "merge_file": "/nonexistent/merges.txt"},
     FileNotFoundError, r"--vocab-file /nonexistent/vocab.json: no such file"),
    ("HuggingFaceTokenizer", {}, ValueError, r"needs --tokenizer-model"),
    ("HuggingFaceTokenizer", {"tokenizer_model": "/nonexistent/tok"}, FileNotFoundError,
     r"--tokenizer-model /nonexistent/tok: no such file or directory"),
    ("NullTokenizer", {}, ValueError, r"needs --vocab-size >= 2"),
])
def test_tokenizer_files_and_flags_missing(kind, kwargs, error, message):
    with pytest.raises(error, match=message):
        check_tokenizer_args(kind, **kwargs)


def test_empty_tokenizer_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer.json"):
        check_tokenizer_args("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))


def test_dataset_too_small_for_seq_length(tiny_prefix):
    """210 tokens in 10 documents: --split 969,30,1 leaves the valid and test splits empty; a sample of 256 does
    not fit the train split."""
    with pytest.raises(ValueError, match=r"its valid split \(documents 10..10 of 10, --split '969, 30, 1'\) holds 0 "
                                         r"tokens, fewer than --seq-length \+ 1 = 65"):
        data.check_splits(([tiny_prefix], None), None, "969, 30, 1", 64)
    with pytest.raises(ValueError, match=r"its train split .* holds 168 tokens, fewer than --seq-length \+ 1 = 257"):
        data.check_splits(([tiny_prefix], None), None, "80,20,0", 256)
    data.check_splits(([tiny_prefix], None), None, "80,20,0", 40)  # fits
    with pytest.raises(ValueError, match=r"the train data holds 210 tokens, fewer than --seq-length \+ 1 = 257"):
        data.check_splits(None, [([tiny_prefix], None), ([tiny_prefix], None), None], None, 256)
