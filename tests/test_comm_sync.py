"""The comm path's alignment, host reads, deferred validation, issue order and overlapped all-reduce
(issue 21, item 5), on gloo with simulated nodes; and the container's size limit."""

import pytest
import torch

import comm_sync_checks as checks
from megatron_zpp.compression import container, mpc
from megatron_zpp.testing import run_distributed


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (1, 3)], ids=["2x2", "1x3"])
def test_variable_size_payloads_arrive_16_byte_aligned(nodes, per_node):
    results = run_distributed(checks.alignment_worker, nodes * per_node, ranks_per_node=per_node)
    for r in results:
        assert r["exact"]
        misaligned = [(off, n) for off, n in r["seen"] if off]
        assert not misaligned, misaligned
        # payloads of lengths that are not multiples of 16 were exchanged: the check could fail
        assert any(n % 16 for _, n in r["seen"]), r["seen"]


@pytest.mark.parametrize("nodes,per_node,rs_reads", [(2, 2, 3), (1, 4, 2)], ids=["2x2", "1x4"])
def test_host_reads_per_hop_and_where(nodes, per_node, rs_reads):
    """Variable-size (mpc): one host read per hop's sizes plus one per call for the deferred
    validation records (hop 1's travel with hop 2's sizes); fixed-size (ZFP): none. The size read
    happens at the next progress point, not at the call."""
    results = run_distributed(checks.host_reads_worker, nodes * per_node, ranks_per_node=per_node)
    for r in results:
        assert r["counts"] == {("mpc", "rs"): rs_reads, ("mpc", "ag"): 2,
                               ("zfp:rate=16", "rs"): 0, ("zfp:rate=16", "ag"): 0}, r["counts"]
        assert r["at_call"] == 0 and r["at_next_call"] == 1, r
        assert r["exact"]


@pytest.mark.parametrize("collective,nodes,per_node,where", [
    ("rs", 2, 2, "same call"), ("rs", 1, 2, "next call"), ("ag", 1, 2, "next call")])
def test_corrupt_payload_in_a_collective_raises_naming_it(collective, nodes, per_node, where):
    results = run_distributed(checks.corruption_worker, nodes * per_node, collective, ranks_per_node=per_node)
    for r in results:
        assert r["where"] == where, r
        assert "mpc:dim=1 payload is corrupt: checksum mismatch" in r["message"], r


def test_issue_order_no_head_of_line_blocking_and_all_reduce_gather_at_progress_point():
    results = run_distributed(checks.issue_order_worker, 4, ranks_per_node=2)
    for r in results:
        assert r == results[0]  # the same collectives in the same order on every rank (SPMD)
    r = results[0]
    # call B's hop 1 goes before call A's hop 2 (the old order was intra, inter, intra)
    assert r["rs_order"] == ["intra", "intra", "inter"], r["rs_order"]
    gather = ("flat", "all_gather_into_tensor")
    assert [(role, op) for role, op, _ in r["after_ar_call"]] == [("intra", "all_to_all_single")]
    assert gather not in [(role, op) for role, op, _ in r["after_point1"]]
    assert gather in [(role, op) for role, op, _ in r["after_point2"]]  # issued before any wait()
    assert r["after_ar_wait"] == r["after_point2"]  # the all-reduce's wait() issues nothing
    assert r["ar_equal"]


def test_async_all_reduces_in_flight_waited_out_of_order():
    results = run_distributed(checks.all_reduce_in_flight_worker, 4, ranks_per_node=2)
    for r in results:
        assert all(r["equal"]), r
        assert r["exact_lossless"] == [True, True], r


def test_container_size_table_limit_refused_before_encoding():
    container.check_segment_sizes([container.MAX_SEGMENT_BYTES, 8])  # at the limit: fine
    with pytest.raises(ValueError, match=r"body segment 0 would hold 4294967296 bytes .*at most 4294967295"):
        container.check_segment_sizes([2**32])
    with pytest.raises(ValueError, match=r"at most 4294967295"):
        container.pack_header("nvcomp", torch.float32, 1, 10, [8, 2**32 + 5])
    # MPC: the worst-case plane segment of 2^30 float32 values is 4 GiB + 0: refused, no allocation
    with pytest.raises(ValueError, match=r"mpc: 1073741824 torch.float32 values: body segment 1 would hold "
                                         r"4294967296 bytes"):
        mpc.check_size("mpc", 2**30, torch.float32)
    mpc.check_size("mpc", 2**30 - 32, torch.float32)  # one group of 32 fewer: 4 GiB - 128, fits
    mpc.check_size("mpc", 2**30, torch.bfloat16)  # 16-bit words: half the planes


def _corruptions(payload: torch.Tensor):
    flip = payload.clone()
    flip[container.header_bytes(2) + 5] ^= 0x01
    numel = payload.clone()
    numel[8] ^= 0x01  # the numel field: the checksum catches it first
    magic = payload.clone()
    magic[0] = ord("X")
    yield "flipped body byte", flip
    yield "numel field", numel
    yield "magic", magic
    yield "truncated", payload[:-17].clone()
    yield "header only", payload[:20].clone()


def test_deferred_validation_raises_what_eager_validation_raises():
    """mpc's deferred check (the comm path's) names the same problem as decode() for every corruption;
    a valid payload decodes identically and its check passes."""
    from megatron_zpp.compression import Packed, PayloadError, get_codec

    codec = get_codec("mpc")
    x = torch.randn(3000)
    packed = codec.encode(x)
    out, check = codec.decode_deferred(packed)
    assert torch.equal(out, x)
    check.raise_if_invalid(check.record)
    for name, bad in _corruptions(packed.payload):
        bad_packed = Packed(payload=bad, shape=packed.shape, dtype=packed.dtype)
        with pytest.raises(PayloadError) as eager:
            codec.decode(bad_packed)
        with pytest.raises(PayloadError) as deferred:
            _, check = codec.decode_deferred(bad_packed)
            check.raise_if_invalid(check.record)
        assert str(deferred.value) == str(eager.value), (name, str(deferred.value), str(eager.value))


def test_deferred_decode_of_a_corrupt_payload_is_nan_before_its_check_raises():
    """The deferred check raises at the next progress point; the output the optimizer may read before then
    is NaN (found-inf skips the step), never plausible garbage. A valid payload is untouched."""
    from megatron_zpp.compression import Packed, get_codec

    codec = get_codec("mpc")
    x = torch.randn(3000)
    packed = codec.encode(x)
    out, _ = codec.decode_deferred(packed)
    assert torch.equal(out, x)
    bad = packed.payload.clone()
    bad[container.header_bytes(2) + 700] ^= 0x10  # a body byte the decoder itself cannot notice
    out, check = codec.decode_deferred(Packed(payload=bad, shape=packed.shape, dtype=packed.dtype))
    assert torch.isnan(out).all()
    with pytest.raises(container.PayloadError, match="checksum mismatch"):
        check.raise_if_invalid(check.record)


def test_deferred_validation_keeps_a_decoder_error_behind_a_valid_container():
    """A payload whose container is valid (checksum rewritten) but whose body the decoder refuses: the
    deferred check raises the decoder's error, so nothing is swallowed."""
    from megatron_zpp.compression import Packed, PayloadError, get_codec

    codec = get_codec("mpc")
    packed = codec.encode(torch.randn(3000))
    bad = packed.payload.clone()
    bad[container.header_bytes(2)] ^= 0xFF  # bitmap bits: the body no longer matches its size
    container.write_checksum_(bad, container.checksum_tensor_reference(bad))
    bad_packed = Packed(payload=bad, shape=packed.shape, dtype=packed.dtype)
    with pytest.raises(PayloadError) as eager:
        codec.decode(bad_packed)
    out, check = codec.decode_deferred(bad_packed)
    assert torch.isnan(out).all()
    with pytest.raises(PayloadError) as deferred:
        check.raise_if_invalid(check.record)
    assert str(deferred.value) == str(eager.value)


def test_pipeline_p2p_variable_size_one_host_read_per_call():
    results = run_distributed(checks.p2p_worker, 2, timeout_s=300)
    for rank, r in enumerate(results):
        for (name, pattern), (reads, exact) in r.items():
            assert reads == 1, (rank, name, pattern, reads)
            assert exact in (True, None) and (exact is True or (rank == 0 and pattern == "one way")), \
                (rank, name, pattern, exact)


def test_a_deferred_check_waits_for_its_read_but_no_longer_than_the_lag():
    """Checks run at the first progress point where their host read has arrived, or are forced after
    MAX_CHECK_LAG points (a sync on a GPU); one that raises leaves the others queued."""
    from megatron_zpp.comm.execution import MAX_CHECK_LAG, InFlight

    in_flight, ran = InFlight(), []
    in_flight.defer(lambda: ran.append("slow"), ready=lambda: False)
    in_flight.defer(lambda: ran.append("arrived"), ready=lambda: True)
    in_flight._run_deferred()
    assert ran == ["arrived"]
    for _ in range(MAX_CHECK_LAG - 1):
        in_flight._run_deferred()
    assert ran == ["arrived"]
    in_flight._run_deferred()
    assert ran == ["arrived", "slow"]

    def corrupt():
        raise container.PayloadError("corrupt")

    in_flight.defer(corrupt)
    in_flight.defer(lambda: ran.append("after"))
    with pytest.raises(container.PayloadError):
        in_flight._run_deferred()
    in_flight._run_deferred()
    assert ran[-1] == "after"


def test_pipeline_p2p_corrupt_payload_is_nan_and_named_at_the_next_read():
    r = run_distributed(checks.p2p_corrupt_worker, 2, timeout_s=120)[1]
    assert r["all_nan"] and r["pending"] == 1, r
    assert r["error"] and "checksum mismatch" in r["error"], r
