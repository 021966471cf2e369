"""Emulate a multi-node cluster with slow inter-node links on one Linux host, and run a job on it.

One network namespace per emulated node, each joined to a private Linux bridge (the "switch") by
a veth pair. Ranks of one node share its namespace and talk over its loopback, unshaped (the fast
intra-node link); traffic between nodes crosses the bridge, shaped by a token bucket (``tbf``) on
both directions of every node's link, so incast (an all-to-all into one node) is throttled too.
Delay is added with ``netem`` where the kernel has it. Traffic goes only between the namespaces
this tool creates; nothing else is addressed.

    sudo python tools/netemu.py --nodes 2 --ranks-per-node 2 --rate 100mbit -- \\
        pretrain_gpt.py --use-distributed-optimizer --zpp-policy zeropp --train-iters 8

launches ``torchrun`` in every namespace (``LOCAL_WORLD_SIZE`` = ranks per node, gloo bound to
the emulated NIC), streams node 0's output, and prints the bytes that crossed the emulated
network, read from the kernel's counters of every node's link, beside the bytes the job's own
accounting reports (``pretrain_gpt.py`` measures the same counters over its training window; see
``NicWindow`` in ``megatron_zpp/training/nic.py``). Everything is torn down on exit, on failure
and on Ctrl-C; ``--teardown-stale`` removes what a killed run left behind.

Needs root (or CAP_NET_ADMIN) and iproute2. Without ``netem`` there is no delay emulation: add
latency analytically (the performance model's α) instead. On 2 CPU cores, emulate at most about
1 Gbit/s and always run an unshaped control: above that the CPU, not the link, is the bottleneck.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from megatron_zpp.policy.cli import field_docs  # noqa: E402  (the CLI's help from the dataclass docstrings)
from megatron_zpp.training.nic import tcp_payload_bytes  # noqa: E402  (one definition of the header arithmetic)
from process_group import stop_process_group  # noqa: E402
PREFIX = "zpp"  # every namespace, bridge and veth this tool makes starts with it (see --teardown-stale)
SUBNET = "10.77.0"
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(rate: str) -> float:
    """``"100mbit"`` -> bits per second (tc's units: bit, kbit, mbit, gbit, tbit)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", rate.lower())
    if not m or m.group(2) not in RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"rate {rate!r} must be a positive number with a unit in {', '.join(RATE_UNITS)} "
                         "(e.g. 100mbit, 1gbit), or 'unshaped'")
    return float(m.group(1)) * RATE_UNITS[m.group(2)]


@dataclass(kw_only=True)
class NetemuConfig:
    nodes: int = 2
    """Emulated nodes (one network namespace each)."""
    ranks_per_node: int = 2
    """Processes per node; they share the node's namespace and its unshaped loopback."""
    rate: str | None = None
    """Inter-node link rate per node and direction, in tc units (``100mbit``, ``1gbit``); None: unshaped."""
    delay: str | None = None
    """One-way delay added to each node's uplink and downlink (``1ms``); needs the kernel's netem."""
    mtu: int = 9000
    """MTU of the emulated links. 9000 (jumbo frames, as cloud and HPC fabrics use) keeps TCP/IP
    header overhead under 1% of the bytes counted on the links."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"nodes={self.nodes} and ranks_per_node={self.ranks_per_node} must be >= 1")
        if self.nodes > 250:
            raise ValueError(f"nodes={self.nodes}: at most 250 (one /24 subnet)")
        if self.rate in ("unshaped", "none", ""):
            self.rate = None
        if self.rate is not None:
            parse_rate(self.rate)
        if not 1280 <= self.mtu <= 65535:
            raise ValueError(f"mtu={self.mtu} must be in [1280, 65535]")


@dataclass
class LinkCounters:
    """Kernel counters of one node's link, read on the host side of its veth: ``rx`` is what the
    node sent into the network, ``tx`` what the network delivered to it."""

    rx_bytes: int = 0
    rx_packets: int = 0
    tx_bytes: int = 0
    tx_packets: int = 0

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    @property
    def sent_payload_bytes(self) -> int:
        """TCP payload the node sent."""
        return tcp_payload_bytes(self.rx_bytes, self.rx_packets)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def namespaces_available() -> tuple[bool, str]:
    """Whether this process can create network namespaces and shape links; else the reason."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 (ip, tc) is not installed"
    name = f"{PREFIX}probe{os.getpid()}"
    proc = _run(["ip", "netns", "add", name], check=False)
    if proc.returncode:
        return False, f"cannot create a network namespace (needs root or CAP_NET_ADMIN): {proc.stderr.strip()}"
    _run(["ip", "netns", "del", name], check=False)
    return True, ""


def netem_available() -> bool:
    """Whether the kernel offers the netem qdisc (delay emulation)."""
    ns = f"{PREFIX}netem{os.getpid()}"
    if _run(["ip", "netns", "add", ns], check=False).returncode:
        return False
    try:
        return _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                    check=False).returncode == 0
    finally:
        _run(["ip", "netns", "del", ns], check=False)


def namespace_pids(name: str) -> list[int]:
    return [int(p) for p in _run(["ip", "netns", "pids", name], check=False).stdout.split()]


def kill_namespace_processes(name: str) -> None:
    for pid in namespace_pids(name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while namespace_pids(name) and time.monotonic() < deadline:
        time.sleep(0.1)


def teardown_stale(force: bool = False) -> tuple[list[str], list[str]]:
    """Remove namespaces and bridges with this tool's prefix left by killed runs. A namespace with
    processes inside belongs to a live run and is kept unless ``force`` (which kills them).
    Returns (removed, kept)."""
    removed, kept, live_ids = [], [], set()
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)n\d+|{PREFIX}(probe|netem)\d+", name)
        if not m:
            continue
        if namespace_pids(name) and not force:
            kept.append(name)
            live_ids.add(m.group(1))
            continue
        kill_namespace_processes(name)
        _run(["ip", "netns", "del", name], check=False)
        removed.append(name)
    for line in _run(["ip", "-o", "link", "show", "type", "bridge"], check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        m = re.fullmatch(rf"{PREFIX}br(\d+)", name)
        if m and m.group(1) not in live_ids:
            _run(["ip", "link", "del", name], check=False)
            removed.append(name)
    return removed, kept


class EmulatedCluster:
    """The namespaces, bridge and shaped links of one emulation; a context manager that tears
    everything down on exit. ``run_torchrun`` launches a job across the nodes."""

    def __init__(self, config: NetemuConfig) -> None:
        self.config = config
        # Random, not the pid: a stale run's names (same pid after a reboot) or a concurrent
        # emulation must never be taken for ours, or teardown would delete them.
        self.id = int.from_bytes(os.urandom(4), "little") % 100000
        self.bridge = f"{PREFIX}br{self.id}"
        self.namespaces = [f"{PREFIX}{self.id}n{i}" for i in range(config.nodes)]
        self.host_links = [f"zv{self.id}n{i}" for i in range(config.nodes)]  # <= 15 characters
        self._owned: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order

    def node_address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    # ---------------------------------------------------------------- set-up / tear-down
    def __enter__(self) -> EmulatedCluster:
        ok, why = namespaces_available()
        if not ok:
            raise PermissionError(f"netemu: {why}")
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self._owned.append(("link", self.bridge))
            _run(["ip", "link", "set", self.bridge, "up"])
            for i, (ns, host) in enumerate(zip(self.namespaces, self.host_links)):
                _run(["ip", "netns", "add", ns])
                self._owned.append(("netns", ns))
                _run(["ip", "link", "add", host, "mtu", str(self.config.mtu), "type", "veth", "peer", "name", "eth0",
                      "mtu", str(self.config.mtu), "netns", ns])
                _run(["ip", "link", "set", host, "master", self.bridge, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.node_address(i)}/24", "dev", "eth0"])
                _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            self.set_rate(self.config.rate, self.config.delay)
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Idempotent; removes only what this instance created. Processes still inside a namespace
        are killed first (torchrun starts its workers in their own sessions, so killing torchrun's
        process group can leave them behind, and a namespace with processes outlives its name).
        Signals are held off meanwhile, so a second Ctrl-C cannot leave half a cluster."""
        if not self._owned:
            return
        held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)} \
            if threading.current_thread() is threading.main_thread() else {}
        try:
            for kind, name in reversed(self._owned):
                if kind == "netns":
                    kill_namespace_processes(name)
                    _run(["ip", "netns", "del", name], check=False)  # also deletes its veth pair
                else:
                    _run(["ip", "link", "del", name], check=False)
            self._owned = []
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)

    def set_rate(self, rate: str | None, delay: str | None = None) -> None:
        """(Re)shape every node's uplink (its eth0) and downlink (the host end of its veth)."""
        rate = None if rate in (None, "unshaped", "none", "") else rate
        if delay and not netem_available():
            raise RuntimeError(f"delay {delay!r} needs the kernel's netem qdisc (sch_netem), which this kernel "
                               "lacks; emulate bandwidth only and add latency in the performance model")
        for ns, host in zip(self.namespaces, self.host_links):
            for prefix, dev in ((["ip", "netns", "exec", ns], "eth0"), ([], host)):
                _run(prefix + ["tc", "qdisc", "del", "dev", dev, "root"], check=False)
                if rate is None and not delay:
                    continue
                parent = ["root"]
                if delay:
                    _run(prefix + ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", delay,
                                   "limit", "100000"])
                    parent = ["parent", "1:", "handle", "10:"]
                if rate is not None:
                    _run(prefix + ["tc", "qdisc", "add", "dev", dev] + parent + ["tbf", "rate", rate, "burst",
                                   f"{self._burst_bytes(rate)}b", "latency", "50ms"])
        self.config.rate, self.config.delay = rate, delay

    def _burst_bytes(self, rate: str) -> int:
        # tbf refills once per kernel tick (HZ=250 here): a burst below rate/HZ caps the rate below
        # nominal, and it must hold a GSO super-packet (64 KiB). 256 KiB reached 89-96% of nominal.
        return int(max(256 * 1024, parse_rate(rate) / 8 / 250 * 1.5, 4 * self.config.mtu))

    # ---------------------------------------------------------------- counters
    def counters(self) -> list[LinkCounters]:
        """Per node, the kernel's counters of its link (host side of the veth)."""
        out = []
        for host in self.host_links:
            stats = Path("/sys/class/net") / host / "statistics"
            out.append(LinkCounters(*(int((stats / f).read_text()) for f in
                                      ("rx_bytes", "rx_packets", "tx_bytes", "tx_packets"))))
        return out

    # ---------------------------------------------------------------- launching
    def node_command(self, node: int, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """``argv`` run inside node ``node``'s namespace with gloo bound to its emulated NIC."""
        variables = {"GLOO_SOCKET_IFNAME": "eth0", "ZPP_NIC": "eth0", "PYTHONUNBUFFERED": "1",
                     "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        variables.update(env or {})
        return ["ip", "netns", "exec", self.namespaces[node], "env"] + [f"{k}={v}" for k, v in variables.items()] + argv

    def torchrun_command(self, node: int, script: list[str], master_port: int, python: str = sys.executable,
                         env: dict[str, str] | None = None) -> list[str]:
        c = self.config
        return self.node_command(node, [python, "-m", "torch.distributed.run", "--nnodes", str(c.nodes),
                                        "--node-rank", str(node), "--nproc-per-node", str(c.ranks_per_node),
                                        "--master-addr", self.node_address(0), "--master-port", str(master_port)]
                                 + script, env)

    def run_torchrun(self, script: list[str], *, timeout: float = 1800, master_port: int = 29500,
                     python: str = sys.executable, env: dict[str, str] | None = None, echo: bool = True,
                     log_path: Path | None = None, on_line=None) -> RunResult:
        """Run ``python -m torch.distributed.run ... script`` on every node; wait for all of them.

        If one node fails or the time runs out, the others are killed (they would wait on the
        failed peer forever). Returns node 0's output and the link counters over the run.

        ``on_line(node, line)`` is called with every output line as it arrives (tools/auto_evidence.py changes the
        link's rate at an iteration).
        """
        before = self.counters()
        procs = [subprocess.Popen(self.torchrun_command(i, script, master_port, python, env), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for i in range(self.config.nodes)]
        outputs: list[list[str]] = [[] for _ in procs]
        log = open(log_path, "w") if log_path else None

        def pump(i: int) -> None:
            for line in procs[i].stdout:
                outputs[i].append(line)
                if on_line is not None:
                    on_line(i, line)
                if log:
                    log.write(f"[node {i}] {line}")
                if echo and i == 0:
                    sys.stdout.write(line)
                    sys.stdout.flush()

        threads = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(len(procs))]
        for t in threads:
            t.start()
        start, failed = time.monotonic(), None
        try:
            while any(p.poll() is None for p in procs):
                bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                if bad:
                    failed = f"node {bad[0]} exited with {procs[bad[0]].returncode}"
                    break
                if time.monotonic() - start > timeout:
                    failed = f"timed out after {timeout:.0f} s"
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                stop_process_group(p, term_grace_s=10)
            for t in threads:
                t.join(timeout=10)
            if log:
                log.close()
        seconds = time.monotonic() - start
        codes = [p.returncode for p in procs]
        if failed is None and any(codes):
            failed = f"exit codes {codes}"
        links = [a - b for a, b in zip(self.counters(), before)]
        return RunResult(returncode=0 if failed is None else 1, failure=failed, seconds=seconds, links=links,
                         output="".join(outputs[0]), outputs=["".join(o) for o in outputs])


def terminate_like_ctrl_c() -> None:
    """SIGTERM (from SLURM, ``timeout``, a supervisor) unwinds like Ctrl-C, through every
    ``finally``, so the namespaces are removed."""
    def handler(*_):
        raise KeyboardInterrupt("SIGTERM")
    signal.signal(signal.SIGTERM, handler)


@dataclass
class RunResult:
    returncode: int
    failure: str | None
    seconds: float
    links: list[LinkCounters]
    output: str
    outputs: list[str]

    @property
    def cross_node_bytes(self) -> int:
        """Bytes every node sent into the emulated network (headers included)."""
        return sum(c.rx_bytes for c in self.links)

    @property
    def cross_node_payload_bytes(self) -> int:
        return sum(c.sent_payload_bytes for c in self.links)

    summary_path: Path | None = None

    def job_summary(self) -> dict | None:
        """The summary ``pretrain_gpt.py --summary-json`` wrote; None if absent."""
        if self.summary_path is None or not self.summary_path.is_file():
            return None
        return json.loads(self.summary_path.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def describe(result: RunResult) -> str:
    """The link counters beside the job's own accounting, as text."""
    MB = 1e6
    lines = [f"netemu: {len(result.links)} nodes, {result.seconds:.1f} s"
             + (f", FAILED: {result.failure}" if result.failure else "")]
    for i, c in enumerate(result.links):
        lines.append(f"netemu: node {i} link (measured): sent {c.rx_bytes / MB:.2f} MB in {c.rx_packets} packets "
                     f"(TCP payload {c.sent_payload_bytes / MB:.2f} MB), received {c.tx_bytes / MB:.2f} MB")
    lines.append(f"netemu: cross-node total (measured, whole job incl. start-up): {result.cross_node_bytes / MB:.2f} MB"
                 f" on the links, {result.cross_node_payload_bytes / MB:.2f} MB TCP payload")
    summary = result.job_summary()
    if summary and summary.get("nic"):
        nic = summary["nic"]
        lines.append(f"netemu: training window: {nic['payload_bytes'] / MB:.2f} MB TCP payload measured on the links "
                     f"vs {summary['inter_bytes'] / MB:.2f} MB counted by comm_stats "
                     f"(measured/counted x{nic['payload_bytes'] / max(summary['inter_bytes'], 1):.4f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    docs = field_docs(NetemuConfig)
    for f in dataclasses.fields(NetemuConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=int if f.type == "int" else str, default=f.default,
                       help=docs.get(f.name, "").replace("%", "%%"))  # argparse formats help with %
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the job is killed")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs torchrun on the nodes")
    p.add_argument("--log", type=Path, default=None, help="write every node's output here")
    p.add_argument("--json", type=Path, default=None, help="write the counters and the job summary here")
    p.add_argument("--teardown-stale", action="store_true", help="remove namespaces/bridges left by killed runs")
    p.add_argument("--force", action="store_true", help="with --teardown-stale: also remove live namespaces")
    p.add_argument("--verify", action="store_true",
                   help="measure one TCP stream between node 0 and node 1 instead of running a job")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS... run with torchrun on every node")
    a = p.parse_args(argv)
    if a.teardown_stale:
        removed, kept = teardown_stale(force=a.force)
        print("removed:", " ".join(removed) or "nothing")
        if kept:
            print("kept (processes inside, a live run; --force kills them):", " ".join(kept))
        return 0
    script = a.script[1:] if a.script[:1] == ["--"] else a.script
    config = NetemuConfig(nodes=a.nodes, ranks_per_node=a.ranks_per_node, rate=a.rate, delay=a.delay, mtu=a.mtu)
    if not script and not a.verify:
        p.error("give a script to run after --, or --verify")
    terminate_like_ctrl_c()
    with EmulatedCluster(config) as cluster:
        print(f"netemu: {config.nodes} nodes x {config.ranks_per_node} ranks, inter-node link "
              f"{config.rate or 'unshaped'} per direction" + (f", delay {config.delay}" if config.delay else "")
              + f", MTU {config.mtu}", flush=True)
        if a.verify:
            result = measure_stream(cluster, 64 << 20)
            print(f"netemu: one TCP stream node 0 -> node 1: {result['bytes'] / 1e6:.1f} MB in {result['seconds']:.2f} s "
                  f"= {result['bits_per_s'] / 1e6:.1f} Mbit/s; link counters: {result['payload_bytes'] / 1e6:.2f} MB "
                  f"payload ({result['counted_bytes'] / 1e6:.2f} MB with headers)")
            return 0
        summary_path = None
        if Path(script[0]).name == "pretrain_gpt.py" and "--summary-json" not in script:
            # So the training window's measured bytes can be printed beside the counted ones.
            summary_path = Path(tempfile.mkdtemp(prefix="netemu")) / "summary.json"
            script = script + ["--summary-json", str(summary_path)]
        result = cluster.run_torchrun(script, timeout=a.timeout, master_port=free_port(), python=a.python,
                                      log_path=a.log)
        result.summary_path = summary_path
        print(describe(result), flush=True)
        if a.json:
            a.json.write_text(json.dumps({"config": dataclasses.asdict(config), "seconds": result.seconds,
                                          "failure": result.failure,
                                          "links": [dataclasses.asdict(c) for c in result.links],
                                          "job_summary": result.job_summary()}, indent=1))
        return result.returncode


def measure_stream(cluster: EmulatedCluster, nbytes: int) -> dict:
    """Push ``nbytes`` over one TCP connection from node 0 to node 1 (a self-check of the shaping
    and of the payload estimate from the link counters)."""
    if cluster.config.nodes < 2:
        raise ValueError("measure_stream needs at least 2 nodes")
    port = free_port()
    receiver = (f"import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
                f"s.bind(('{cluster.node_address(1)}',{port}));s.listen(1);c,_=s.accept();n=0\n"
                "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\nprint(n)")
    sender = (f"import socket,time;c=socket.create_connection(('{cluster.node_address(1)}',{port}));"
              f"b=bytes(1<<20);t=time.perf_counter()\nfor _ in range({nbytes >> 20}): c.sendall(b)\n"
              "c.shutdown(socket.SHUT_WR);c.recv(1);print(time.perf_counter()-t)")
    rx = subprocess.Popen(cluster.node_command(1, [sys.executable, "-c", receiver]), stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        before = cluster.counters()
        tx = subprocess.run(cluster.node_command(0, [sys.executable, "-c", sender]), capture_output=True,
                            text=True, timeout=600)
        out = rx.communicate(timeout=60)[0].strip()
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    received = int(out) if out.isdigit() else -1
    if tx.returncode or received != (nbytes >> 20 << 20):
        raise RuntimeError(f"stream failed: sender rc {tx.returncode} {tx.stderr.strip()}, received {received}")
    seconds = float(tx.stdout.strip())
    delta = cluster.counters()[0] - before[0]
    return {"bytes": received, "seconds": seconds, "bits_per_s": received * 8 / seconds,
            "payload_bytes": delta.sent_payload_bytes, "counted_bytes": delta.rx_bytes}


if __name__ == "__main__":
    sys.exit(main())
