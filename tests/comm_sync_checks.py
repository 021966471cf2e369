"""Worker bodies for ``test_comm_sync.py``: payload alignment, host reads, deferred validation,
issue order and the overlapped all-reduce of the comm path (issue 21, item 5)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_zpp.comm import Topology, compressed_all_reduce, qgz_reduce_scatter, quantized_all_gather
from megatron_zpp.comm import any_codec
from megatron_zpp.compression import PayloadError, container
from megatron_zpp.compression.host_read import host_reads


def _data(seed: int, rank: int, n: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return (torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(2 * torch.rand(n, generator=g))).to(dtype)


def alignment_worker() -> dict:
    """Every payload the variable-size collectives hand to the decoder starts on a 16-byte boundary, for
    payloads of odd lengths; lossless results stay bit-exact against the uncompressed algorithm."""
    topo = Topology(None)
    size, rank = topo.size, topo.rank
    seen: list[tuple[int, int]] = []
    original = any_codec.decode

    def recording(fmt, payload, *args, **kwargs):
        seen.append((payload.data_ptr() % 16, payload.numel()))
        return original(fmt, payload, *args, **kwargs)

    any_codec.decode = recording
    exact = True
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for length in (1, 7, 333):
                x = _data(1 + length, rank, size * length, dtype)
                out, ref = torch.empty(length, dtype=dtype), torch.empty(length, dtype=dtype)
                qgz_reduce_scatter(out, x, topo, codec="mpc", op="sum")
                qgz_reduce_scatter(ref, x, topo, codec="none", op="sum")
                exact &= torch.equal(out, ref)
                full, full_ref = torch.empty(size * length, dtype=dtype), torch.empty(size * length, dtype=dtype)
                quantized_all_gather(full, x[:length], topo, codec="mpc")
                dist.all_gather_into_tensor(full_ref, x[:length].contiguous())
                exact &= torch.equal(full, full_ref)
    finally:
        any_codec.decode = original
    return {"seen": seen, "exact": bool(exact)}


def host_reads_worker() -> dict:
    """Host reads (sync points on a GPU) per call, in steady state, and where they happen."""
    topo = Topology(None)
    size, rank, length = topo.size, topo.rank, 500
    x = _data(3, rank, size * length)
    y = torch.empty(length)
    full = torch.empty(size * length)
    counts = {}
    for spec in ("mpc", "zfp:rate=16"):
        qgz_reduce_scatter(y, x, topo, codec=spec)  # first use: the settings handshake
        quantized_all_gather(full, x[:length], topo, codec=spec)
        before = host_reads()
        for _ in range(3):
            qgz_reduce_scatter(y, x, topo, codec=spec)
        counts[(spec, "rs")] = (host_reads() - before) / 3
        before = host_reads()
        for _ in range(3):
            quantized_all_gather(full, x[:length], topo, codec=spec)
        counts[(spec, "ag")] = (host_reads() - before) / 3
    # Where: the first step only starts the size read; the next collective's progress point reads it.
    qgz_reduce_scatter(y, x, topo, codec="zfp:rate=16")  # consumes the last deferred check: none pending
    before = host_reads()
    h1 = qgz_reduce_scatter(y, x, topo, codec="mpc", async_op=True)
    at_call = host_reads() - before
    y2 = torch.empty(length)
    h2 = qgz_reduce_scatter(y2, x, topo, codec="mpc", async_op=True)
    at_next_call = host_reads() - before - at_call
    h1.wait()
    h2.wait()
    ref = torch.empty(length)
    qgz_reduce_scatter(ref, x, topo, codec="none")
    return {"counts": counts, "at_call": at_call, "at_next_call": at_next_call,
            "exact": torch.equal(y, ref) and torch.equal(y2, ref)}


def corruption_worker(collective: str) -> dict:
    """Every rank corrupts one body byte of every payload it encodes: the checksum catches it and a
    PayloadError naming it is raised by this call's wait() (a checked hop 1) or the next collective
    on the topology (the last hop's check, deferred), before that collective issues anything."""
    topo = Topology(None)
    size, rank, length = topo.size, topo.rank, 256
    x = _data(5, rank, size * length)
    original = any_codec.encode

    def corrupting(fmt, t):
        payload = original(fmt, t).clone()
        payload[container.header_bytes(2) + 3] ^= 0x10
        return payload

    def run():
        if collective == "rs":
            qgz_reduce_scatter(torch.empty(length), x, topo, codec="mpc")
        else:
            quantized_all_gather(torch.empty(size * length), x[:length], topo, codec="mpc")

    run()  # settings handshake, uncorrupted
    any_codec.encode = corrupting
    where, message = None, None
    try:
        try:
            run()
            where = "next call"
            any_codec.encode = original
            run()
        except PayloadError as exc:
            where = where or "same call"
            message = str(exc)
    finally:
        any_codec.encode = original
    return {"where": where, "message": message}


def _logging_dist(topo: Topology, log: list):
    groups = topo._groups
    roles = {id(g.group): name for name, g in (("flat", groups.flat), ("intra", groups.intra),
                                               ("inter", groups.inter)) if g.group is not None}
    originals = {n: getattr(dist, n) for n in ("all_to_all_single", "all_gather_into_tensor")}

    def logged(name):
        def call(out, inp, *args, group=None, **kwargs):
            log.append((roles.get(id(group), "other"), name, inp.numel() * inp.element_size()))
            return originals[name](out, inp, *args, group=group, **kwargs)
        return call

    for n in originals:
        setattr(dist, n, logged(n))
    return originals


def issue_order_worker() -> dict:
    """A second async qgZ call's first hop is issued before the first call's second hop (no head-of-line
    blocking), and the compressed all-reduce's gather is issued at a progress point, not at wait()."""
    topo = Topology(None)
    size, rank, length = topo.size, topo.rank, 512
    xa, xb = _data(7, rank, size * length), _data(8, rank, size * length)
    ya, yb = torch.empty(length), torch.empty(length)
    log: list = []
    qgz_reduce_scatter(ya, xa, topo, codec="int8:block=256")  # settings handshake, not logged
    t = xa[:1000].clone()
    compressed_all_reduce(t, topo, codec="int8:block=256")
    originals = _logging_dist(topo, log)
    try:
        ha = qgz_reduce_scatter(ya, xa, topo, codec="int8:block=256", async_op=True)
        hb = qgz_reduce_scatter(yb, xb, topo, codec="int8:block=256", async_op=True)
        rs_order = [role for role, _, _ in log]
        ha.wait()
        hb.wait()
        del log[:]
        ar = compressed_all_reduce(t, topo, codec="int8:block=256", async_op=True)
        after_ar_call = list(log)
        y1, y2 = torch.empty(length), torch.empty(length)
        o1 = qgz_reduce_scatter(y1, xa, topo, codec="int8:block=256", async_op=True)  # progress point 1
        after_point1 = list(log)
        o2 = qgz_reduce_scatter(y2, xb, topo, codec="int8:block=256", async_op=True)  # progress point 2
        after_point2 = list(log)
        ar.wait()
        after_ar_wait = list(log)
        o1.wait()
        o2.wait()
        after_wait = list(log)
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)
    ref = xa[:1000].clone()
    for _ in range(2):
        compressed_all_reduce(ref, topo, codec="int8:block=256")
    return {"rs_order": rs_order, "after_ar_call": after_ar_call, "after_point1": after_point1,
            "after_point2": after_point2, "after_ar_wait": after_ar_wait, "after_wait": after_wait,
            "ar_equal": torch.equal(t, ref)}


def all_reduce_in_flight_worker() -> dict:
    """Several async compressed all-reduces (blockwise, lossless and ZFP) in flight, waited out of order,
    equal bit for bit to the same calls made synchronously one at a time."""
    topo = Topology(None)
    rank = topo.rank
    specs = ["int8:block=256", "mpc", "zfp:rate=16", "int4:block=128", "mpc"]
    sizes = [1000, 333, 64, 7, 1]
    inputs = [_data(20 + i, rank, n) for i, n in enumerate(sizes)]
    sync = [x.clone() for x in inputs]
    for t, spec in zip(sync, specs):
        compressed_all_reduce(t, topo, codec=spec)
    flying = [x.clone() for x in inputs]
    handles = [compressed_all_reduce(t, topo, codec=spec, async_op=True) for t, spec in zip(flying, specs)]
    for i in (3, 0, 4, 2, 1):
        handles[i].wait()
    exact_lossless = []
    for t, x, spec in zip(sync, inputs, specs):
        if spec == "mpc":
            ref = x.clone()
            compressed_all_reduce(ref, topo, codec="none")
            exact_lossless.append(torch.equal(t, ref))
    return {"equal": [torch.equal(a, b) for a, b in zip(sync, flying)], "exact_lossless": exact_lossless}


def p2p_worker() -> dict:
    """Megatron's pipeline p2p with a variable-size codec (mpc) through the installed hooks, batched and
    not: received tensors bit-exact, and one host read per p2p call (lengths sent and received together)."""
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    from megatron_zpp.megatron.model_parallel import ModelParallelHooks

    rank = dist.get_rank()
    other = 1 - rank
    hooks = ModelParallelHooks("mpc", "none", None).install()
    out = {}
    try:
        for name in ("_batched_p2p_ops", "_p2p_ops"):
            for pattern in ("both ways", "one way"):
                x = _data(40 + rank, rank, 1001).view(7, 143)
                recv = torch.empty(7, 143)
                none = dict(tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=None,
                            tensor_recv_next=None)
                if rank == 0:
                    kwargs = {**none, "tensor_send_next": x}
                    if pattern == "both ways":
                        kwargs["tensor_recv_next"] = recv
                else:
                    kwargs = {**none, "tensor_recv_prev": recv}
                    if pattern == "both ways":
                        kwargs["tensor_send_prev"] = x
                before = host_reads()
                reqs = getattr(p2p, name)(group=dist.group.WORLD, prev_pipeline_rank=other,
                                          next_pipeline_rank=other, **kwargs)
                for r in (reqs.values() if isinstance(reqs, dict) else reqs):
                    r.wait()
                reads = host_reads() - before
                received = rank == 1 or pattern == "both ways"
                exact = torch.equal(recv, _data(40 + other, other, 1001).view(7, 143)) if received else None
                out[(name, pattern)] = (reads, exact)
    finally:
        hooks.uninstall()
    return out


def p2p_corrupt_worker() -> dict:
    """A pipeline p2p payload corrupted on the wire: the receiver's output is NaN at once (Megatron's
    found-inf check sees it this iteration) and its container check, pending for the next p2p call's host
    read, names the corruption."""
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    from megatron_zpp.compression import container as container_module
    from megatron_zpp.megatron.model_parallel import ModelParallelHooks

    rank = dist.get_rank()
    hooks = ModelParallelHooks("mpc", "none", None).install()
    try:
        if rank == 0:
            encode = hooks.pp.codec.encode

            def corrupting_encode(x):
                packed = encode(x)
                packed.payload.view(-1)[container_module.header_bytes(2) + 300] ^= 0x10
                return packed

            hooks.pp.codec.encode = corrupting_encode
        none = dict(tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=None, tensor_recv_next=None)
        recv = torch.zeros(7, 143)
        kwargs = {**none, "tensor_send_next": _data(50, 0, 1001).view(7, 143)} if rank == 0 else \
            {**none, "tensor_recv_prev": recv}
        reqs = p2p._p2p_ops(group=dist.group.WORLD, prev_pipeline_rank=1 - rank, next_pipeline_rank=1 - rank,
                            **kwargs)
        for r in (reqs.values() if isinstance(reqs, dict) else reqs):
            r.wait()
        if rank == 0:
            return {}
        pending = list(hooks.pp.pending_checks)
        try:
            for check in pending:
                check.raise_if_invalid(check.record)
            error = None
        except container_module.PayloadError as exc:
            error = str(exc)
        return {"all_nan": bool(torch.isnan(recv).all()), "pending": len(pending), "error": error}
    finally:
        hooks.uninstall()
