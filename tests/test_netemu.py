"""tools/netemu.py: shaping delivers the nominal rate, link counters measure what crossed, jobs are
torn down on failure, and a training run's NIC-measured bytes match its byte accounting.

Needs root (network namespaces); every test skips with the reason where they cannot be made."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import netemu  # noqa: E402

OK, WHY = netemu.namespaces_available()
needs_namespaces = pytest.mark.skipif(not OK, reason=f"netemu: {WHY}")


def _our_namespaces(cluster) -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()} & set(cluster.namespaces)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="rate '100mbps' must be a positive number with a unit in bit, kbit"):
        netemu.NetemuConfig(rate="100mbps")
    with pytest.raises(ValueError, match="nodes=0"):
        netemu.NetemuConfig(nodes=0)
    with pytest.raises(ValueError, match="mtu=100"):
        netemu.NetemuConfig(mtu=100)
    assert netemu.parse_rate("2.5gbit") == 2.5e9
    assert netemu.NetemuConfig(rate="unshaped").rate is None


def test_help_prints_every_config_field(capsys):
    with pytest.raises(SystemExit) as exit_:
        netemu.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(f"--{name}" in out for name in ("nodes", "ranks-per-node", "rate", "delay", "mtu"))
    assert "under 1% of the bytes" in out  # the docstring, % and all


@needs_namespaces
def test_shaped_stream_reaches_the_rate_and_counters_measure_the_payload():
    with netemu.EmulatedCluster(netemu.NetemuConfig(nodes=2, rate="200mbit")) as cluster:
        shaped = netemu.measure_stream(cluster, 16 << 20)
        cluster.set_rate(None)
        unshaped = netemu.measure_stream(cluster, 16 << 20)
        namespaces = _our_namespaces(cluster)
    print(f"\n200mbit: {shaped['bits_per_s'] / 1e6:.1f} Mbit/s; unshaped {unshaped['bits_per_s'] / 1e6:.0f} Mbit/s; "
          f"payload from counters {shaped['payload_bytes']} vs {shaped['bytes']} sent")
    assert 0.8 * 200e6 <= shaped["bits_per_s"] <= 1.05 * 200e6, shaped
    assert unshaped["bits_per_s"] > 2 * shaped["bits_per_s"], (unshaped, shaped)  # the shaping is what limits
    # The counters on the node's link see every byte sent, and headers are subtracted per packet.
    assert abs(shaped["payload_bytes"] - shaped["bytes"]) <= 0.01 * shaped["bytes"], shaped
    assert namespaces == set(cluster.namespaces)
    assert not _our_namespaces(cluster)  # torn down


@needs_namespaces
def test_a_failing_node_stops_the_job_and_everything_is_removed(tmp_path):
    script = tmp_path / "job.py"
    # Node 1 fails at once; node 0 would wait forever for it without netemu killing it.
    script.write_text("import os, sys, time\nif os.environ['GROUP_RANK'] == '1': sys.exit(3)\ntime.sleep(600)\n")
    with netemu.EmulatedCluster(netemu.NetemuConfig(nodes=2, ranks_per_node=1)) as cluster:
        result = cluster.run_torchrun([str(script)], timeout=120, master_port=netemu.free_port(), echo=False)
    assert result.returncode != 0 and result.failure, result
    assert result.seconds < 100, result.seconds
    assert not _our_namespaces(cluster)


@pytest.mark.slow
@needs_namespaces
def test_training_bytes_measured_on_the_links_match_the_accounting(tmp_path):
    """2 nodes x 2 ranks, zeropp and megatron's own collectives: the TCP payload the emulated NICs
    carried during training is within 5% of what comm_stats counted."""
    summary = tmp_path / "s.json"
    repo = Path(__file__).resolve().parents[1]
    for policy in ("none", "zeropp"):
        with netemu.EmulatedCluster(netemu.NetemuConfig(nodes=2, ranks_per_node=2, rate="1gbit")) as cluster:
            result = cluster.run_torchrun(
                [str(repo / "pretrain_gpt.py"), "--use-distributed-optimizer", "--overlap-grad-reduce",
                 "--zpp-policy", policy, "--train-iters", "3", "--eval-iters", "0", "--num-layers", "2",
                 "--hidden-size", "128", "--summary-json", str(summary)],
                timeout=600, master_port=netemu.free_port(), echo=False)
        result.summary_path = summary
        assert result.returncode == 0, result.output[-3000:]
        s = result.job_summary()
        ratio = s["nic"]["payload_bytes"] / s["inter_bytes"]
        print(f"\n{policy}: measured {s['nic']['payload_bytes']} B vs counted {s['inter_bytes']} B (x{ratio:.4f})")
        assert s["nic"]["nodes"] == 2
        assert abs(ratio - 1) <= 0.05, (policy, s["nic"], s["inter_bytes"])


@needs_namespaces
def test_sigterm_removes_the_namespaces_and_their_processes(tmp_path):
    """A netemu job killed with SIGTERM (timeout, SLURM) leaves no namespace and no process behind,
    even the torchrun workers, which run in sessions of their own."""
    import os
    import signal
    import time

    script = tmp_path / "job.py"
    script.write_text("import time\ntime.sleep(600)\n")
    pidfile = tmp_path / "pids"
    existing = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    proc = subprocess.Popen([sys.executable, str(Path(netemu.__file__)), "--ranks-per-node", "1", "--",
                             str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    names: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not names:  # wait until the job's workers run
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        for name in listed:
            if name.startswith(netemu.PREFIX) and name not in existing:  # ours, not another run's
                pids = netemu.namespace_pids(name)
                if len(pids) >= 2:  # torchrun (exec-ed by ip netns exec and env) and its worker
                    names.append(name)
        time.sleep(0.5)
    assert names, "the job never started"
    workers = [pid for n in names for pid in netemu.namespace_pids(n)]
    pidfile.write_text(" ".join(map(str, workers)))
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names), listed
    alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}")]
    assert not alive, alive
