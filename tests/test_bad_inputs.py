"""Bad-input sweep (issue [9] item 4): one table of bad inputs across the CLI, YAML policies, codecs, compressed
collectives, data, checkpoints and the SLURM script. Every row ends in a clear error naming the bad value (and the
valid choices, where there are choices) or in a result checked against an uncompressed reference: within the codec's
error bound, exact for lossless codecs, and non-finite wherever a NaN/Inf went in.

Most rows run in this process (argument validation, policy resolution, codec decode). The collective rows run in a
few gloo worlds of 3, 5 and 6 ranks, spawned once each and shared by their rows; the checkpoint rows in one 2-rank
world. Every spawned run is bounded twice: gloo's timeout inside (``run_distributed``) and a wall clock outside
(``_bounded``), which stops the spawned processes and fails the row; the SLURM script runs under
``subprocess.run(timeout=...)``.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import re
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

import comm_checks
from megatron_zpp.testing import run_distributed

REPO = Path(__file__).resolve().parents[1]
U32 = 2.0**-24  # fp32 unit roundoff: the comparisons of uncompressed and lossless sums are bounded by it
SPAWN_LIMIT_S = 300  # wall clock of one spawned world (generous: the 2 cores are shared); gloo's timeout (below) fires first on a hung collective
GLOO_TIMEOUT_S = 60


# ---------------------------------------------------------------------------------------------------
# Bounding spawned runs


@contextmanager
def _bounded(seconds: int, what: str):
    """Fail with TimeoutError after ``seconds`` of wall clock, stopping the processes this test spawned."""
    def expire(signum, frame):
        for child in multiprocessing.active_children():  # only the processes spawned from this process
            child.terminate()
        raise TimeoutError(f"{what} ran past its {seconds} s wall-clock bound (a hang)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _spawn(fn, world: int, *args, ranks_per_node: int):
    with _bounded(SPAWN_LIMIT_S, f"{fn.__name__} on {world} ranks"):
        return run_distributed(fn, world, *args, ranks_per_node=ranks_per_node, timeout_s=GLOO_TIMEOUT_S)


# ---------------------------------------------------------------------------------------------------
# In-process rows: each calls the code path the driver runs and expects an error matching a regex that names the
# bad value (and the choices where there are some).


def _validate(flags: list[str], world: int = 1):
    from megatron_zpp.training.arguments import build_parser, validate_args

    return validate_args(build_parser().parse_args(flags), world)


def _policy_from_flags(flags: list[str]):
    """What pretrain does after validate_args: the --zpp-* flags resolved into the hooks' policy."""
    from megatron_zpp.megatron import hooks_from_args

    return hooks_from_args(_validate(flags)).policy


def _policy_file(tmp_path: Path, content: dict):
    from megatron_zpp.policy import ZppConfig, resolve_policy

    path = tmp_path / "bad_policy.yaml"
    path.write_text(yaml.safe_dump(content))
    return resolve_policy(ZppConfig(policy=str(path)))


def _codec(spec: str):
    from megatron_zpp.compression import get_codec

    return get_codec(spec)


def _corrupt_and_decode(spec: str, damage: str):
    """Encode a tensor with a lossless codec, damage the payload, decode: the container must refuse it."""
    codec = _codec(spec)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(3))
    packed = codec.encode(x)
    payload = packed.payload.clone()
    if damage == "flip":  # one byte in the body, past the header: only the checksum can tell
        payload[payload.numel() // 2] ^= 0x40
    elif damage == "truncate":
        payload = payload[: payload.numel() - 17]
    elif damage == "header":  # the numel field: a payload for another tensor
        payload[8] ^= 0x01
    from megatron_zpp.compression import Packed

    return codec.decode(Packed(payload=payload, shape=packed.shape, dtype=packed.dtype))


def _tiny_prefix(tmp_path: Path, name: str = "tiny_text_document", ids=None, vocab: int = 257) -> str:
    from megatron_zpp.training import data

    prefix = tmp_path / name
    data.write_indexed_dataset(prefix, ids or [list(range(40)) + [256]] * 10, vocab)
    return str(prefix)


def _truncated(tmp_path: Path, suffix: str, keep: int) -> str:
    prefix = _tiny_prefix(tmp_path)
    path = Path(prefix + suffix)
    path.write_bytes(path.read_bytes()[:keep])
    return prefix


DATA_FLAGS = ["--split", "80,20,0", "--seq-length", "32", "--max-position-embeddings", "32"]

# (row id, the bad input as the report shows it, call(tmp_path), expected exception, regex of its message)
IN_PROCESS_ROWS = [
    # --- codec specs
    ("codec-unknown", "get_codec('int3')", lambda t: _codec("int3"), ValueError,
     r"unknown codec 'int3'.*valid codecs: int4, int8, mpc, none, nvcomp, zfp, zstd"),
    ("codec-wrong-case", "get_codec('INT8')", lambda t: _codec("INT8"), ValueError,
     r"unknown codec 'INT8'.*valid codecs: int4, int8"),
    ("codec-empty-value", "get_codec('int8:block=')", lambda t: _codec("int8:block="), ValueError,
     r"malformed parameter 'block=' in spec 'int8:block='; expected key=value"),
    ("codec-trailing-comma", "get_codec('int8:block=256,')", lambda t: _codec("int8:block=256,"), ValueError,
     r"malformed parameter '' in spec 'int8:block=256,'"),
    ("codec-unknown-param", "get_codec('int4:bits=3')", lambda t: _codec("int4:bits=3"), ValueError,
     r"unknown parameter 'bits' for codec 'int4'.*valid: block, rounding, seed"),
    ("codec-not-integer", "get_codec('int8:block=1e3')", lambda t: _codec("int8:block=1e3"), ValueError,
     r"block='1e3' is not an integer"),
    ("codec-bad-choice", "get_codec('int8:rounding=up')", lambda t: _codec("int8:rounding=up"), ValueError,
     r"rounding='up' is not valid; valid: nearest, stochastic"),
    ("codec-out-of-range", "get_codec('mpc:dim=33')", lambda t: _codec("mpc:dim=33"), ValueError,
     r"dim=33 is not valid; valid: an integer in 1..32"),
    ("codec-duplicate-param", "get_codec('zfp:rate=8,rate=16')", lambda t: _codec("zfp:rate=8,rate=16"), ValueError,
     r"parameter 'rate' given twice"),
    ("codec-int-tensor", "int8 encode of an int32 tensor", lambda t: _codec("int8").encode(torch.ones(4, dtype=torch.int32)),
     (TypeError, ValueError), r"int32"),
    # --- corrupted lossless payloads: the container's checksum and sizes
    ("mpc-flipped-byte", "mpc payload, one body byte flipped", lambda t: _corrupt_and_decode("mpc", "flip"),
     ValueError, r"mpc:dim=1 payload is corrupt: checksum mismatch"),
    ("mpc-truncated", "mpc payload, last 17 bytes cut", lambda t: _corrupt_and_decode("mpc", "truncate"),
     ValueError, r"mpc:dim=1 payload is truncated: the header says \d+ bytes, the buffer holds \d+"),
    ("zstd-flipped-byte", "zstd payload, one body byte flipped", lambda t: _corrupt_and_decode("zstd", "flip"),
     ValueError, r"zstd:level=1 payload is corrupt: checksum mismatch"),
    ("zstd-truncated", "zstd payload, last 17 bytes cut", lambda t: _corrupt_and_decode("zstd", "truncate"),
     ValueError, r"zstd:level=1 payload is truncated"),
    ("zstd-header-numel", "zstd payload, numel field changed", lambda t: _corrupt_and_decode("zstd", "header"),
     ValueError, r"zstd:level=1 payload is corrupt: checksum mismatch"),
    # --- policies: flags and YAML
    ("policy-unknown-preset", "--zpp-policy zeroplusplus", lambda t: _policy_from_flags(["--zpp-policy", "zeroplusplus"]),
     ValueError, r"policy 'zeroplusplus' is neither a preset \(fair, hybrid, mzhybrid, none, sdp4bit, zeropp, zhybrid\)"),
    ("policy-flag-bad-codec", "--zpp-dp-grad int3", lambda t: _policy_from_flags(["--zpp-dp-grad", "int3"]),
     ValueError, r"unknown codec 'int3'.*valid codecs"),
    ("policy-hpz-not-blockwise", "--zpp-policy zeropp --zpp-dp-param mpc",
     lambda t: _policy_from_flags(["--zpp-policy", "zeropp", "--zpp-dp-param", "mpc"]),
     ValueError, r"hpz_size=node .* needs dp.param in none, int8, int4; dp.param is 'mpc:dim=1'"),
    ("policy-hpz-zero", "--zpp-hpz-size 0", lambda t: _policy_from_flags(["--zpp-hpz-size", "0"]),
     ValueError, r"hpz_size=0 must be a positive integer or 'node'"),
    ("yaml-unknown-dimension", "codecs: {dp.grads: int4}", lambda t: _policy_file(t, {"codecs": {"dp.grads": "int4"}}),
     ValueError, r"unknown dimension\(s\) \['dp.grads'\]; valid: dp.grad, dp.param, tp, pp"),
    ("yaml-unknown-key", "hpz: 2", lambda t: _policy_file(t, {"hpz": 2}),
     ValueError, r"unknown key\(s\) \['hpz'\]; valid: codecs, dp_grad_intra, hpz_size"),
    ("yaml-codecs-not-mapping", "codecs: [int8]", lambda t: _policy_file(t, {"codecs": ["int8"]}),
     ValueError, r"codecs must be a mapping of dimension to codec spec .* got \['int8'\]; valid dimensions: dp.grad"),
    ("yaml-codec-not-string", "codecs: {tp: 8}", lambda t: _policy_file(t, {"codecs": {"tp": 8}}),
     ValueError, r"tp: codec must be a spec string like 'int8:block=256', got 8"),
    ("yaml-bool-stages", "qgz_stages: true", lambda t: _policy_file(t, {"qgz_stages": True}),
     ValueError, r"qgz_stages=True must be a positive integer"),
    ("yaml-bool-hpz", "hpz_size: true", lambda t: _policy_file(t, {"hpz_size": True}),
     ValueError, r"hpz_size=True must be a positive integer or 'node'"),
    ("yaml-bool-until", "dp_grad_until: true", lambda t: _policy_file(t, {"dp_grad_until": True}),
     ValueError, r"dp_grad_until=True must be in \(0, 1\]"),
    ("yaml-uncompressed-route", "dp_uncompressed: nccl", lambda t: _policy_file(t, {"dp_uncompressed": "nccl"}),
     ValueError, r"dp_uncompressed='nccl'; valid: megatron, hierarchical"),
    # --- simulated nodes and hpZ against the world
    ("rpn-not-dividing", "--zpp-ranks-per-node 4 on 6 ranks", lambda t: _validate(["--zpp-ranks-per-node", "4"], 6),
     ValueError, r"--zpp-ranks-per-node 4 does not divide the world size 6; valid: 1, 2, 3, 6"),
    ("rpn-larger-than-world", "--zpp-ranks-per-node 8 on 4 ranks", lambda t: _validate(["--zpp-ranks-per-node", "8"], 4),
     ValueError, r"--zpp-ranks-per-node 8 is larger than the world size 4; valid: 1, 2, 4"),
    ("rpn-zero", "--zpp-ranks-per-node 0", lambda t: _validate(["--zpp-ranks-per-node", "0"], 4),
     ValueError, r"--zpp-ranks-per-node 0 is not a positive integer for the world size 4; valid: 1, 2, 4"),
    ("hpz-not-dividing-node", "--zpp-hpz-size 3 --zpp-ranks-per-node 4 on 8 ranks",
     lambda t: _validate(["--zpp-hpz-size", "3", "--zpp-ranks-per-node", "4", "--zpp-policy", "zeropp"], 8),
     ValueError, r"--zpp-hpz-size 3 does not divide --zpp-ranks-per-node 4; valid: 1, 2, 4"),
    # --- schedule, checkpoint format
    ("warmup-equals-iters", "--lr-warmup-iters 10 --train-iters 10",
     lambda t: _validate(["--lr-warmup-iters", "10", "--train-iters", "10"]),
     ValueError, r"--lr-warmup-iters 10 must be smaller than the decay iterations 10"),
    ("warmup-exceeds-iters", "--lr-warmup-iters 50 --train-iters 10",
     lambda t: _validate(["--lr-warmup-iters", "50", "--train-iters", "10"]),
     ValueError, r"--lr-warmup-iters 50 must be smaller than the decay iterations 10"),
    ("ckpt-format-vs-fsdp", "--ckpt-format fsdp_dtensor --load DIR without --use-megatron-fsdp",
     lambda t: _validate(["--ckpt-format", "fsdp_dtensor", "--load", str(t)]),
     ValueError, r"--ckpt-format fsdp_dtensor without --use-megatron-fsdp"),
    # --- data
    ("data-missing-prefix", "--data-path /nonexistent/corpus", lambda t: _validate(["--data-path", "/nonexistent/corpus"]),
     FileNotFoundError, r"data prefix /nonexistent/corpus: /nonexistent/corpus.bin and /nonexistent/corpus.idx not found"),
    ("data-missing-idx", "--data-path P with P.idx deleted",
     lambda t: (Path(_tiny_prefix(t) + ".idx").unlink(), _validate(["--data-path", str(t / "tiny_text_document")])),
     FileNotFoundError, r"tiny_text_document.idx not found"),
    ("data-truncated-bin", "--data-path P, P.bin cut to 100 bytes",
     lambda t: _validate(["--data-path", _truncated(t, ".bin", 100)] + DATA_FLAGS),
     ValueError, r"tiny_text_document.bin holds 100 bytes, but its index points to 820 \(10 sequences\); the .bin is "
                 r"truncated"),
    ("data-empty-bin", "--data-path P, P.bin empty",
     lambda t: _validate(["--data-path", _truncated(t, ".bin", 0)] + DATA_FLAGS),
     ValueError, r"tiny_text_document.bin holds 0 bytes, but its index points to 820"),
    ("data-truncated-idx", "--data-path P, P.idx cut by 30 bytes",
     lambda t: _validate(["--data-path", _truncated(t, ".idx", 242 - 30)] + DATA_FLAGS),
     ValueError, r"tiny_text_document.idx is not a readable Megatron index .*truncated or corrupt"),
    ("data-idx-header-only", "--data-path P, P.idx cut to 20 bytes",
     lambda t: _validate(["--data-path", _truncated(t, ".idx", 20)] + DATA_FLAGS),
     ValueError, r"tiny_text_document.idx is not a readable Megatron index"),
    ("data-vocab-mismatch", "ids up to 299 read with ByteTokenizer (257 ids)",
     lambda t: __import__("megatron_zpp.training.data", fromlist=["check_vocab"]).check_vocab(
         [_tiny_prefix(t, "wide", [list(range(250, 300))] * 4, 300)], 257, "ByteTokenizer"),
     ValueError, r"token id 299 is outside the vocabulary of --tokenizer-type ByteTokenizer \(257 ids, largest valid "
                 r"id 256\)"),
    ("data-null-vocab", "--tokenizer-type NullTokenizer --vocab-size 1",
     lambda t: _validate(["--data-path", _tiny_prefix(t), "--tokenizer-type", "NullTokenizer", "--vocab-size", "1"]),
     ValueError, r"NullTokenizer needs --vocab-size >= 2 \(got 1\)"),
]


@pytest.mark.parametrize("row, bad_input, call, error, message", IN_PROCESS_ROWS,
                         ids=[r[0] for r in IN_PROCESS_ROWS])
def test_in_process_row(row, bad_input, call, error, message, tmp_path):
    with pytest.raises(error) as caught:
        call(tmp_path)
    text = str(caught.value)
    print(f"\n{row} | {bad_input} | {type(caught.value).__name__}: {text[:200]}")
    assert re.search(message, text), f"{row}: {text!r} does not match {message!r}"


def test_codec_size_zero_one_odd_round_trip():
    """Codec level of the sizes row: numel 0, 1 and odd through every CPU codec: exact for lossless ones, within
    the quantization step (half of it: round to nearest) for INT8/INT4; the shapes and dtypes come back."""
    from megatron_zpp.compression import layout

    for spec in ("none", "int8:block=256", "int4:block=128", "mpc", "zstd", "zfp:rate=16"):
        codec = _codec(spec)
        for shape in ((0,), (1,), (7,), (3, 0), (5, 3)):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
            y = codec.decode(codec.encode(x))
            assert y.shape == x.shape and y.dtype == x.dtype, (spec, shape)
            if codec.lossless:
                assert torch.equal(y, x), (spec, shape)
            elif spec.startswith("int"):
                # one block here (numel <= 15 < block): the step is absmax / qmax, the error at most half of it
                step = x.abs().max() / layout.qmax_for_bits(codec.bits) if x.numel() else 0
                assert (y - x).abs().max() <= step / 2 * (1 + 1e-6) if x.numel() else True, (spec, shape)


# ---------------------------------------------------------------------------------------------------
# Spawned rows: compressed collectives on worlds of 3, 5 and 6 ranks


BLOCKWISE = ("int8:block=256", "int4:block=128")
SIZES = (0, 1, 7)  # per-rank chunk or shard: empty, one element, odd (and not a multiple of any block)


def _exact_sum_bound(parts: list[torch.Tensor], divisor: int) -> torch.Tensor:
    """How far an fp32 sum of ``parts`` (any order, any tree) divided by ``divisor`` may be from the exact result:
    (n - 1) roundings of partial sums bounded by sum |x|, plus the division's own rounding."""
    magnitude = torch.stack([p.double().abs() for p in parts]).sum(0)
    return ((len(parts) - 1) * U32 * magnitude + U32 * magnitude) / divisor + 1e-300


def _record(failures: list[str], what: str, check) -> None:
    try:
        check()
    except AssertionError as e:
        failures.append(f"{what}: {e}")


def _sizes_worker() -> dict:
    """Reduce-scatter, all-gather and all-reduce with 0 / 1 / odd elements per rank and codecs none, INT8, INT4, MPC,
    against the exact float64 result: within the codec bound of ``comm_checks`` for INT8/INT4, within fp32 summation
    rounding for none and MPC (and MPC equal to none bit for bit: lossless on the wire)."""
    from megatron_zpp.comm import Topology, compressed_all_reduce, qgz_reduce_scatter, quantized_all_gather
    from megatron_zpp.compression import layout

    topo = Topology(None)
    size, rank = topo.size, topo.rank
    failures: list[str] = []
    checked = 0
    for length in SIZES:
        grads = [comm_checks.heavy_tailed(size * length, comm_checks.gen(61, r)).float() for r in range(size)]
        mine = [g.view(size, length)[rank] for g in grads]
        exact = torch.stack([m.double() for m in mine]).sum(0) / size
        outs = {}
        for codec in ("none",) + BLOCKWISE + ("mpc",):
            out = torch.full((length,), float("nan"))
            qgz_reduce_scatter(out, grads[rank].clone(), topo, codec=codec)
            outs[codec] = out
            if codec in BLOCKWISE and length:
                expected, bound = comm_checks.qgz_expected_and_bound(grads, topo, rank, codec, None, 1, size,
                                                                     torch.float32)
            else:
                expected, bound = exact, _exact_sum_bound(mine, size)
            _record(failures, f"reduce-scatter {codec} length {length}",
                    lambda: comm_checks.check_close(f"rs {codec}", out, expected, bound))
            checked += 1
        _record(failures, f"reduce-scatter mpc == none, length {length}",
                lambda: torch.testing.assert_close(outs["mpc"], outs["none"], rtol=0, atol=0, equal_nan=False))

        shards = [comm_checks.heavy_tailed(length, comm_checks.gen(62, r)).float() for r in range(size)]
        full = torch.cat(shards)
        for codec in ("none",) + BLOCKWISE + ("mpc",):
            out = torch.full((size * length,), float("nan"))
            quantized_all_gather(out, shards[rank], topo, codec=codec)
            if codec in BLOCKWISE and length:
                bound = comm_checks.all_gather_bound(full.double(), length, codec, torch.float32)
                _record(failures, f"all-gather {codec} length {length}",
                        lambda: comm_checks.check_close(f"ag {codec}", out, full.double(), bound))
            else:  # none and lossless: the shards themselves; an empty gather is empty
                _record(failures, f"all-gather {codec} length {length}",
                        lambda: torch.testing.assert_close(out, full, rtol=0, atol=0))
            checked += 1

        for codec in ("none",) + BLOCKWISE + ("mpc",):
            data = [comm_checks.heavy_tailed(length, comm_checks.gen(63, r)).float() for r in range(size)]
            t = data[rank].clone()
            compressed_all_reduce(t, topo, codec=codec)
            exact_mean = torch.stack([d.double() for d in data]).sum(0) / size
            if codec in BLOCKWISE and length:
                # comm_checks.all_reduce_worker's bound: the reduce-scatter's on each rank's share of the padded
                # tensor, plus one quantization step of the gather's re-encoding of the reduced mean
                chunk = -(-length // size)
                padded = [torch.nn.functional.pad(d, (0, chunk * size - length)) for d in data]
                rs_bound = torch.cat([comm_checks.qgz_expected_and_bound(padded, topo, d, codec, None, 1, size,
                                                                         torch.float32)[1] for d in range(size)])
                mean = torch.stack([p.double() for p in padded]).sum(0) / size
                bits, block, k = comm_checks.codec_params(codec)
                step = k * (comm_checks.block_absmax(mean, chunk, block) + comm_checks.block_absmax(rs_bound, chunk, block)) \
                    / layout.qmax_for_bits(bits)
                bound = (rs_bound + step * (1 + comm_checks.FP32_SLOP) + comm_checks.FP32_SLOP * mean.abs())[:length]
            else:  # none, MPC, and an empty tensor
                bound = _exact_sum_bound(data, size)
            _record(failures, f"all-reduce {codec} numel {length}",
                    lambda: comm_checks.check_close(f"ar {codec}", t, exact_mean, bound))
            checked += 1
    return {"failures": failures, "checked": checked, "nodes": topo.num_nodes, "node_size": topo.node_size}


# Per dimension, the codecs its policies put there (presets: zeropp, hybrid, mzhybrid, zhybrid) and the collectives
# the hooks route through them.
NONFINITE_DIMS = {
    "dp.grad": (("int4:block=128", "zfp:rate=8", "none"), ("reduce-scatter", "all-reduce")),
    "dp.param": (("int8:block=256", "mpc", "zfp:rate=16"), ("all-gather",)),
    "tp": (("mpc", "zfp:rate=16", "int8:block=256"), ("all-gather", "reduce-scatter-sum", "all-reduce-sum")),
}
POISON = 5  # the element the last rank poisons


def _nonfinite_worker() -> dict:
    """The last rank puts NaN (fp32) or Inf (bf16) at element 5 of what rank 0 owns (reduce-scatter), of its own shard
    (all-gather), of its tensor (all-reduce) or of a pipeline send: the output there must be non-finite where
    Megatron's found-inf / grad-norm check reads it, and ranks that received nothing poisoned must stay finite."""
    from megatron_zpp.comm import Topology, compressed_all_reduce, qgz_reduce_scatter, quantized_all_gather
    from megatron_zpp.comm.p2p import P2PCodec

    topo = Topology(None)
    size, rank, length = topo.size, topo.rank, 300
    last = size - 1
    failures, checked = [], 0

    def poisoned(x: torch.Tensor, bad: float, where: int) -> torch.Tensor:
        if rank == last:
            x[where] = bad
        return x

    for dtype, bad in ((torch.float32, float("nan")), (torch.bfloat16, float("inf"))):
        for dim, (codecs, kinds) in NONFINITE_DIMS.items():
            for codec in codecs:
                for kind in kinds:
                    what = f"{dim} {kind} {codec} {dtype} {bad}"
                    x = comm_checks.heavy_tailed(size * length, comm_checks.gen(71, rank)).to(dtype)
                    if kind.startswith("reduce-scatter"):
                        out = torch.empty(length, dtype=dtype)
                        qgz_reduce_scatter(out, poisoned(x, bad, POISON), topo, codec=codec,
                                           op="sum" if kind.endswith("sum") else "mean")
                        hit = not bool(torch.isfinite(out[POISON])) if rank == 0 else None
                        clean = rank == 0 or bool(torch.isfinite(out).all())
                    elif kind == "all-gather":
                        shard = poisoned(x[:length].clone(), bad, POISON)
                        out = torch.empty(size * length, dtype=dtype)
                        quantized_all_gather(out, shard, topo, codec=codec)
                        hit = not bool(torch.isfinite(out[last * length + POISON]))
                        clean = bool(torch.isfinite(out[: last * length]).all())  # the clean ranks' shards
                    else:
                        out = poisoned(x[:length].clone(), bad, POISON)
                        compressed_all_reduce(out, topo, codec=codec, op="sum" if kind.endswith("sum") else "mean")
                        hit, clean = not bool(torch.isfinite(out[POISON])), True
                    if hit is False:
                        failures.append(f"{what}: element {POISON} came out finite")
                    if not clean:
                        failures.append(f"{what}: non-finite values on a rank that received nothing poisoned")
                    checked += 1
        # pp: a stage sends a poisoned activation to the next one over a real p2p, as the pp hooks encode it
        for codec in ("int8:block=256", "mpc", "zfp:rate=16"):
            p2p = P2PCodec(codec)
            if rank in (0, last):
                act = comm_checks.heavy_tailed(length, comm_checks.gen(72, 0)).to(dtype)
                if rank == last:
                    act[POISON] = bad
                    payload = p2p.encode(act, site="pp.send_next")
                    dist.send(torch.tensor([payload.numel()]), dst=0)
                    dist.send(payload, dst=0)
                else:
                    n = torch.zeros(1, dtype=torch.int64)
                    dist.recv(n, src=last)
                    payload = p2p.empty_payload(act, int(n))
                    dist.recv(payload, src=last)
                    out = torch.empty_like(act)
                    p2p.decode_into(payload, out)
                    if bool(torch.isfinite(out[POISON])):
                        failures.append(f"pp p2p {codec} {dtype} {bad}: element {POISON} came out finite")
            checked += 1
    return {"failures": failures, "checked": checked}


def _layout_worker() -> dict:
    """Inputs that differ across ranks or do not fit the nodes, on the world's own layout."""
    from megatron_zpp.comm import Topology
    from megatron_zpp.policy import ZppConfig, check_policy_agreement, resolve_policy

    size, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    # Policies differing across ranks: rank 0 passed another --zpp-tp than the others.
    try:
        check_policy_agreement(resolve_policy(ZppConfig(policy="hybrid", tp="mpc" if rank == 0 else "zfp:rate=16")))
        out["policy-differs"] = "no error"
    except ValueError as e:
        out["policy-differs"] = str(e)
    # ranks per node that do not divide the group, and an hpZ partition that does not divide the node
    for key, kwargs in (("topology-rpn", {"ranks_per_node": 4}), ("topology-hpz", {"hpz_partition_size": 2})):
        try:
            Topology(None, **kwargs)
            out[key] = "no error"
        except ValueError as e:
            out[key] = str(e)
    return out


# world size -> ranks per node: 3 nodes of 1, one node of 5, 2 nodes of 3
WORLDS = {3: 1, 5: 5, 6: 3}


@functools.cache
def _world_results(world: int) -> list[dict]:
    return _spawn(_world_worker, world, ranks_per_node=WORLDS[world])


def _world_worker() -> dict:
    result = {"sizes": _sizes_worker(), "nonfinite": _nonfinite_worker()}
    if dist.get_world_size() == 6:
        result["layout"] = _layout_worker()
    return result


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_sizes_zero_one_odd_on_worlds_3_5_6(world):
    """Rows sizes-world{3,5,6}: 0 / 1 / 7 elements per rank in the compressed collectives on these worlds, against
    the uncompressed reference within the codec's bound (exact for none and MPC up to fp32 summation)."""
    results = _world_results(world)
    for r in results:
        print(f"\nsizes-world{world} rank: {r['sizes']['checked']} comparisons, nodes {r['sizes']['nodes']} x "
              f"{r['sizes']['node_size']}, failures {r['sizes']['failures']}")
        assert r["sizes"]["checked"] == len(SIZES) * 3 * 4
        assert not r["sizes"]["failures"], r["sizes"]["failures"]


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_nonfinite_reaches_the_output_in_every_dimension(world):
    """Rows nonfinite-world{3,5,6}: NaN / Inf in dp.grad, dp.param, tp and pp traffic stays non-finite."""
    expected = sum(len(c) * len(k) for c, k in NONFINITE_DIMS.values()) * 2 + 3 * 2
    for r in _world_results(world):
        assert r["nonfinite"]["checked"] == expected
        assert not r["nonfinite"]["failures"], r["nonfinite"]["failures"]


def test_policies_differing_across_ranks_and_layouts_that_do_not_fit():
    """Rows policy-differs-across-ranks, topology-rpn-not-dividing, topology-hpz-not-dividing (6 ranks, 2 nodes of 3)."""
    for r in _world_results(6):
        layout = r["layout"]
        assert re.search(r"compression policy differs across ranks.*codecs: rank 0 has .*'tp': 'mpc:dim=1'.*rank 1 "
                         r"has .*'tp': 'zfp:rate=16", layout["policy-differs"]), layout["policy-differs"]
        assert re.search(r"ranks_per_node=4; every node must hold the same number", layout["topology-rpn"]), layout
        assert re.search(r"hpz_partition_size=2 must divide the 3 group members per node; valid: \[1, 3\]",
                         layout["topology-hpz"]), layout


# ---------------------------------------------------------------------------------------------------
# A checkpoint from another layout or policy (one 2-rank world, a 2-iteration save)


def _checkpoint_worker(workdir: str) -> dict:
    import megatron_checks
    from megatron_zpp.training.checkpoint import CheckpointError
    from megatron_zpp.training.trainer import pretrain

    # Padded to 256 rows' multiples, the vocabulary is the same at TP1 and TP2 (the TP row tests the optimizer format)
    base = megatron_checks.SMALL + ["--use-distributed-optimizer", "--zpp-ranks-per-node", "1", "--eval-iters", "0",
                                    "--make-vocab-size-divisible-by", "256"]
    pretrain(base + ["--train-iters", "2", "--save", workdir], log=megatron_checks._quiet)
    out: dict = {}
    for row, extra in (("ckpt-other-vocab-padding", ["--make-vocab-size-divisible-by", "128"]),
                       ("ckpt-other-tp-dp-reshardable", ["--tensor-model-parallel-size", "2"])):
        try:
            pretrain(base + extra + ["--train-iters", "3", "--load", workdir], log=megatron_checks._quiet)
            out[row] = "no error"
        except CheckpointError as e:
            out[row] = str(e)
    # Another policy: weights and optimizer do not depend on it, so the first loss after the resume (a forward pass
    # of the loaded weights) is the same bit for bit as resuming with the saving policy; the log says the
    # compression state (RNG, residuals) restarts. Its dp.param stays uncompressed: with a lossy weight gather
    # the fp32 weights are gathered (decoded) once after the load, as every forward of that policy sees them.
    lines: list[str] = []
    same = pretrain(base + ["--train-iters", "3", "--load", workdir, "--zpp-policy", "none"],
                    log=megatron_checks._quiet)["losses"]
    other = pretrain(base + ["--train-iters", "3", "--load", workdir, "--zpp-policy", "zeropp", "--zpp-dp-param", "none"],
                     log=lines.append)["losses"]
    out["ckpt-other-policy"] = {"same": same, "other": other, "log": [str(x) for x in lines]}
    return out


def test_checkpoint_from_another_layout_or_policy(tmp_path):
    """Rows ckpt-other-vocab-padding and ckpt-other-tp-dp-reshardable: refused naming both sides; row
    ckpt-other-policy: accepted, the first loss equal to the saving policy's resume, the re-seed logged."""
    with _bounded(SPAWN_LIMIT_S + 60, "checkpoint rows"):
        r = run_distributed(_checkpoint_worker, 2, str(tmp_path), ranks_per_node=1, timeout_s=GLOO_TIMEOUT_S * 3)[0]
    print(f"\n{r}")
    assert re.search(r"saved with a padded vocabulary of 512 rows, this run pads to 384 "
                     r"\(--make-vocab-size-divisible-by 128", r["ckpt-other-vocab-padding"])
    assert re.search(r"saved dp_reshardable at TP1 x PP1.*this run is TP2 x PP1.*--dist-ckpt-optim-fully-reshardable",
                     r["ckpt-other-tp-dp-reshardable"])
    policy = r["ckpt-other-policy"]
    assert len(policy["same"]) == 1 and policy["other"][0] == policy["same"][0] and math.isfinite(policy["same"][0])
    assert any("differs from this run's" in line and "RNG re-seeded" in line for line in policy["log"]), policy["log"]


# ---------------------------------------------------------------------------------------------------
# The SLURM script outside an allocation


def test_sbatch_dry_run_outside_an_allocation(tmp_path):
    """Row sbatch-dry-run-no-slurm: no SLURM_* variable and no scontrol on PATH: --dry-run prints the launch for one
    local node and exits 0 (bounded by subprocess.run's timeout)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = "/usr/bin:/bin"  # no scontrol: the script must not need it outside an allocation
    script = REPO / "scripts" / "slurm" / "pretrain_gpt.sbatch"
    done = subprocess.run(["bash", str(script), "--dry-run", "--zpp-policy", "zeropp"], env=env, capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    print(f"\nsbatch-dry-run-no-slurm | rc {done.returncode} | {done.stdout.strip()}")
    assert done.returncode == 0, done.stderr
    launch = [line for line in done.stdout.splitlines() if line.startswith("srun ")]
    assert len(launch) == 1 and "pretrain_gpt.py" in launch[0] and "--zpp-policy zeropp" in launch[0], done.stdout
    assert "--dry-run" not in launch[0] and "--nnodes 1" in launch[0], launch
