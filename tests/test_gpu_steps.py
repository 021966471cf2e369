"""The GPU check kit's training and comm steps (``tools/gpu_steps/{comm_cuda,pretrain_gpt,megatron_lm}.py``)
where there is no GPU: each writes "skipped" and exits 0; their verdict logic fails what it must; the comm
step's whole logic runs on CPU tensors (``--device cpu``); the two training steps' CPU self-checks are slow."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = REPO / "tools" / "gpu_steps"
OWN_STEPS = ("comm_cuda", "pretrain_gpt", "megatron_lm")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_step_{name}", STEPS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name: str, out: Path, *flags: str, hide_gpu: bool = False, timeout: float = 600) -> tuple[int, dict, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, str(STEPS / f"{name}.py"), "--out", str(out), *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    result = json.loads((out / f"{name}.json").read_text()) if (out / f"{name}.json").exists() else {}
    return proc.returncode, result, proc.stdout + proc.stderr


def _schema(result: dict) -> None:
    assert set(result) == {"status", "figures", "rows", "detail"}, result.keys()
    assert result["status"] in ("pass", "fail", "unsupported", "skipped")
    assert isinstance(result["figures"], dict) and isinstance(result["rows"], list)
    assert isinstance(result["detail"], str)


@pytest.mark.parametrize("name", OWN_STEPS)
def test_without_a_gpu_the_step_is_skipped(name, tmp_path):
    code, result, output = _run(name, tmp_path, "--quick", hide_gpu=True, timeout=120)
    assert code == 0, output
    _schema(result)
    assert result["status"] == "skipped" and "no CUDA device" in result["detail"], result


# ----------------------------------------------------------------------------- verdicts
def _rank(rank: int, bit_identical: bool = True, syncs: float = 0.0, strict: str = "no host sync") -> dict:
    rows = [{"check": "equal_to_cpu", "case": "qgz int4 fp32", "length": 1000, "rank": rank,
             "bit_identical": bit_identical, "max_abs_diff": 0.0 if bit_identical else 1e-3},
            {"check": "ordering", "mode": "async_out_of_order", "call": 0, "rank": rank, "bit_identical": True}]
    return {"rank": rank, "rows": rows, "probe": {"all_gather_into_tensor": "ok", "all_to_all_single": "ok"},
            "figures": {"first_async_launch_host_ms": 1.0, "caller_stream_busy_ms": 50.0,
                        "host_syncs_per_call": {"qgz int4": syncs, "qwz int8": 0.0},
                        "strict_size1": {"qgz int4": strict, "qwz int8": "no host sync"}}}


def test_comm_cuda_verdicts():
    step = _load("comm_cuda")
    assert step.summarize([_rank(r) for r in range(4)], "cuda")[0] == "pass"
    status, figures, _, detail = step.summarize([_rank(0), _rank(1, bit_identical=False), _rank(2), _rank(3)], "cuda")
    assert status == "fail" and "differ from the CPU path" in detail and figures["cases_bit_identical"] == 3
    stale = _rank(2)
    stale["rows"][1]["bit_identical"] = False
    status, figures, _, detail = step.summarize([_rank(0), _rank(1), stale, _rank(3)], "cuda")
    assert status == "fail" and "stream ordering" in detail and figures["ordering_mismatches"] == 1
    status, figures, _, detail = step.summarize([_rank(0, syncs=1.0)] + [_rank(r) for r in (1, 2, 3)], "cuda")
    assert status == "fail" and figures["host_syncs_per_call"]["qgz int4"] == 1.0 and "host syncs" in detail
    status, _, _, detail = step.summarize([_rank(r, strict="host sync: called a synchronizing CUDA operation")
                                           for r in range(4)], "cuda")
    assert status == "fail" and "one-member" in detail
    refused = [dict(_rank(r), rows=[], probe={"all_gather_into_tensor": "ok", "all_to_all_single": "RuntimeError: x"})
               for r in range(4)]
    assert step.summarize(refused, "cuda")[0] == "unsupported"


def test_comm_cuda_names_where_each_host_sync_came_from(monkeypatch):
    """The sync counter records the Python frames that led to each synchronizing operation (torch raises
    its sync-debug warning there), so a failing count says which call to fix."""
    import torch
    import warnings as w

    step = _load("comm_cuda")

    def syncing_call():
        w.warn("called a synchronizing CUDA operation")

    def quiet_call():  # torch's one-time notice on entering the mode is no sync
        w.warn("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations")

    def native_call():  # what a C++ thread without Python's warning handler prints
        os.write(2, b"[W CUDAFunctions.cpp:162] Warning: called a synchronizing CUDA operation\n" * 3)

    monkeypatch.setattr(step, "_steady_calls", lambda topo, device, n: {"syncs": syncing_call, "quiet": quiet_call,
                                                                         "native": native_call})
    counts, sites, native = step._count_syncs(None, torch.device("cpu"), repeats=2)
    assert counts == {"syncs": 0.5, "quiet": 0.0, "native": 0.0}  # a steady call is two collectives (sync, async)
    assert native == {"syncs": 0.0, "quiet": 0.0, "native": 1.5}  # counted apart, from fd 2
    assert list(sites) == ["syncs"]
    (where, n), = sites["syncs"].items()
    assert n == 2 and where.startswith("test_gpu_steps.py:") and "in syncing_call" in where, where


def test_comm_cuda_compares_bit_patterns():
    import torch

    step = _load("comm_cuda")
    nan = torch.tensor([float("nan"), 0.0, 1.0])
    assert torch.equal(step._bits(nan), step._bits(nan.clone()))  # NaN equals itself bitwise
    assert not torch.equal(step._bits(torch.tensor([0.0])), step._bits(torch.tensor([-0.0])))
    assert not torch.equal(step._bits(torch.tensor([1.0], dtype=torch.bfloat16)),
                           step._bits(torch.tensor([1.0078125], dtype=torch.bfloat16)))  # one bf16 ulp


def _training_row(run_key: str, name: str, first: float, last: float, **extra) -> dict:
    row = {run_key: name, "tokens_per_s": 1000.0, "seconds_per_iteration": 0.1, "iterations": 12,
           "first_loss": first, "final_loss": last, "finite": True, "gpu_peak_memory_bytes": 2**30,
           "losses": [first] * 6 + [last] * 6, "parameters": 120_000_000, "transformer_impl": "local",
           "peak_memory_bytes": 2**30, "traffic": {"dp.grad": {"calls": 12, "inter_ratio": 1.0}}}
    row.update(extra)
    return row


def test_pretrain_gpt_verdicts():
    step = _load("pretrain_gpt")
    ok = [_training_row("policy", p, 5.0, 3.0) for p in step.POLICIES]
    status, figures, _ = step.judge(ok, cpu=False)
    assert status == "pass" and figures["zeropp_peak_memory_mb"] == 1024
    assert figures["zeropp_over_none_tokens_per_s"] == 1
    flat = [_training_row("policy", "zeropp", 5.0, 5.0), ok[1]]
    assert step.judge(flat, cpu=False)[0] == "fail"
    no_memory = [_training_row("policy", "zeropp", 5.0, 3.0, gpu_peak_memory_bytes=None), ok[1]]
    status, _, detail = step.judge(no_memory, cpu=False)
    assert status == "fail" and "gpu_peak_memory_bytes" in detail
    crashed = [{"policy": "zeropp", "error": "exit code 1", "log_tail": "Traceback ..."}, ok[1]]
    assert step.judge(crashed, cpu=False)[0] == "fail"


def test_run_summary_peak_memory_is_none_off_the_gpu():
    """pretrain_gpt's figure comes from the run summary's ``gpu_peak_memory_bytes``; on CPU there is none."""
    import torch

    from megatron_zpp.training.log import gpu_peak_memory_bytes

    assert gpu_peak_memory_bytes(torch.device("cpu")) is None


def test_megatron_lm_names_the_ranks_own_error():
    step = _load("megatron_lm")
    log = ("  persist_layer_norm .......... True\n[rank0]: Traceback (most recent call last):\n"
           "[rank0]:   File \"x.py\", line 1, in f\n"
           "[rank0]: AssertionError: persist_layer_norm not supported by torch LayerNorm\n"
           "Traceback (most recent call last):\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n====\nFailures:\n")
    assert step.root_error(log) == "AssertionError: persist_layer_norm not supported by torch LayerNorm"
    assert step.root_error("all fine\n") == ""
    noisy = ("[rank0]: Traceback (most recent call last):\n[rank0]: ValueError: the real cause\n"
             "Exception ignored in: <function X.__del__>\nTraceback (most recent call last):\n"
             "AttributeError: 'NoneType' object has no attribute 'x'\n")
    assert step.root_error(noisy) == "ValueError: the real cause"  # a rank's own error wins over shutdown noise
    caught = "ModuleNotFoundError: No module named 'transformer_engine'\nSegmentation fault\n"
    assert step.root_error(caught) == ""  # not in a traceback: a caught import error is no cause


def test_megatron_lm_verdicts():
    step = _load("megatron_lm")
    ok = [_training_row("run", r, 7.0, 2.0) for r in step.RUNS]
    status, figures, _ = step.judge(ok, cpu=False)
    assert status == "pass" and figures["plugin_over_absent_tokens_per_s"] == 1
    rising = [_training_row("run", "plugin", 2.0, 7.0), ok[1]]
    assert step.judge(rising, cpu=False)[0] == "fail"
    unhooked = [_training_row("run", "plugin", 7.0, 2.0, traffic={}), ok[1]]
    status, _, detail = step.judge(unhooked, cpu=False)
    assert status == "fail" and "no data-parallel collective" in detail
    small = [_training_row("run", r, 7.0, 2.0, parameters=10_000_000) for r in step.RUNS]
    assert step.judge(small, cpu=False)[0] == "fail"
    assert step.judge(small, cpu=True)[0] == "pass"  # the CPU self-check's model is tiny on purpose
    nan = [_training_row("run", "plugin", 7.0, float("nan")), ok[1]]
    assert step.judge(nan, cpu=False)[0] == "fail"


# ----------------------------------------------------------------------------- CPU self-checks
def test_comm_cuda_self_check_on_cpu(tmp_path):
    """The whole comm step on CPU tensors (4 gloo ranks, 2 simulated nodes): every case and the async
    out-of-order calls run and compare; CPU against itself must be bit-identical."""
    code, result, output = _run("comm_cuda", tmp_path, "--quick", "--device", "cpu", timeout=300)
    assert code == 0, output
    _schema(result)
    assert result["status"] == "pass", result["detail"]
    f = result["figures"]
    assert f["world_size"] == 4 and f["cases_compared"] == f["cases_bit_identical"] == 20 * 4
    assert f["ordering_checks"] == 2 * 3 * 4 and f["ordering_mismatches"] == 0  # sync and async, 3 calls, 4 ranks
    assert len(f["steady_calls_run"]) == 6  # the host-sync counting's calls ran (without sync debug mode)
    print(f"\ncomm_cuda --device cpu --quick: {result['detail']}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ("pretrain_gpt", "megatron_lm"))
def test_training_step_self_check_on_cpu(name, tmp_path):
    code, result, output = _run(name, tmp_path, "--device", "cpu", timeout=900)
    assert code == 0, output
    _schema(result)
    assert result["status"] == "pass", result["detail"]
    for row in result["rows"]:
        assert row["returncode"] == 0 and row["iterations"] >= 4, row
    if name == "pretrain_gpt":  # the summary carries the peak-memory figure (None on CPU)
        summary = json.loads((tmp_path / "pretrain_gpt-zeropp.summary.json").read_text())
        assert "gpu_peak_memory_bytes" in summary and summary["gpu_peak_memory_bytes"] is None
    print(f"\n{name} --device cpu: {result['detail']}")
