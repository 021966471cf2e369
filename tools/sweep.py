"""W&B policy sweeps on the emulated cluster: policy x inter-node rate x ZeRO path, from a W&B sweep YAML.

    sudo WANDB_MODE=offline python tools/sweep.py configs/sweeps/smoke.yaml --local    # make sweep
    python tools/sweep.py configs/sweeps/policies-vs-bandwidth.yaml --dry-run          # grid and launches
    python tools/sweep.py --table-only out/sweeps/smoke                                # redraw table, plots

The sweep file is W&B's own format (``name``, ``method``, ``metric``, ``parameters`` with ``values``
or ``value``, ``program``, ``command``), so the same file drives ``wandb sweep``. Parameters:
``policy`` (``megatron``, ``fair``, ``qwz``, ``hpz``, ``qgz`` or a preset in ``configs/policies``),
``rate`` (tc units, or ``unshaped``), ``path`` (``distopt``, ``fsdp``), and optionally ``iters``,
``log_interval``, ``nodes``, ``ranks_per_node``, ``micro_batch_size`` and ``global_batch_size`` (the
make-train model's 4 and 32 unless set; 1 and the rank count is the tiny-batch-per-GPU regime of a large job).

``--local`` expands the grid itself (no W&B server): each grid point is one ``torchrun`` launch
(``tools/bench_training.py``'s launcher), on one emulated cluster per layout, so every run starts in
fresh processes. ``--shared-launch`` instead trains the policies of one (layout, path, batch, rate,
iterations) one after another in one launch, paying start-up once per rate; it is faster but not fair
for timing: the same policy trained again in the same processes measured up to 16% slower steps the
second time and 29% the third (docs/bench/2026-11-28-fair-launches).
Every run is a W&B run created by the trainer on one rank (offline unless ``WANDB_MODE`` says
otherwise): group = the sweep's name, job type = the path, name = ``policy@rate``; config:
policy (and the resolved per-dimension codecs), rate, path, layout; per log interval: step time,
tokens/s, loss, ``comm/{tag}/{intra,inter}_MB`` counted; summary: seconds per iteration, tokens/s,
cross-node bytes per iteration counted and measured on the emulated NICs, step-time breakdown.

At the end, into ``--out-dir``: ``results.csv`` (one row per run, bench_training's columns),
``summary.csv`` and ``summary.md`` (per path and rate: ms/iteration, tokens/s, speedup vs megatron
and vs fair, cross-node MB counted and measured, the W&B run directory), ``throughput.png`` and
``breakdown.png``; the offline W&B runs are under ``OUT/wandb/`` (upload with ``wandb sync``).

``--agent SWEEP_ID`` joins a sweep created with ``wandb sweep CONFIG.yaml``: ``wandb.agent`` calls
one function per point, which runs that point on its own emulated cluster; the trainer's W&B run
becomes the sweep's run (the agent's ``WANDB_RUN_ID``/``WANDB_SWEEP_ID`` reach it through the
environment). ``wandb agent SWEEP_ID`` runs the YAML's ``command`` instead, i.e. ``--run-one``.
Needs root for the namespaces (see ``tools/netemu.py``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import os
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import bench_training  # noqa: E402  (tools/ is not a package)

# W&B's documented top-level sweep keys; anything else is a typo we would silently ignore.
TOP_LEVEL_KEYS = ("name", "description", "program", "method", "metric", "parameters", "command", "project",
                  "entity", "early_terminate", "run_cap")
METHODS = ("grid", "random", "bayes")
# Summary keys the trainer writes to each W&B run (log.py), usable as the sweep's metric.
METRICS = ("tokens_per_s", "seconds_per_iteration", "final_loss", "inter_bytes_per_iteration",
           "nic_payload_bytes_per_iteration")
RESULT_FIELDS = bench_training.FIELDS + ["layout", "micro_batch_size", "global_batch_size"]
TABLE_FIELDS = ["path", "rate", "policy", "ms_per_iteration", "tokens_per_s", "speedup_vs_megatron",
                "speedup_vs_fair", "inter_MB_counted", "inter_MB_measured", "final_loss", "wandb_run"]
DEFAULT_PROJECT = "megatron_zpp-sweeps"


# ------------------------------------------------------------------ grid points
@dataclass(frozen=True, kw_only=True)
class GridPoint:
    """One run of a sweep; the fields are the sweep parameters a YAML may set."""

    policy: str
    """megatron, fair, qwz, hpz, qgz, or a preset in configs/policies (bench_training's policies)."""
    rate: str
    """Inter-node link per node and direction, tc units (25mbit, 1gbit), or 'unshaped'."""
    path: str = "distopt"
    """ZeRO path: distopt (distributed optimizer, ZeRO-1/2) or fsdp (Megatron-FSDP, ZeRO-3)."""
    iters: int = 8
    """Training iterations (the first is not timed)."""
    log_interval: int = 2
    """Iterations per logged W&B step."""
    nodes: int = 2
    """Emulated nodes."""
    ranks_per_node: int = 2
    """gloo ranks per emulated node."""
    micro_batch_size: int = bench_training.MICRO_BATCH_SIZE
    """Sequences per rank per micro-batch (Megatron's --micro-batch-size)."""
    global_batch_size: int = bench_training.GLOBAL_BATCH_SIZE
    """Sequences per iteration over all data-parallel ranks (Megatron's --global-batch-size): a multiple of
    micro_batch_size x nodes x ranks_per_node (every rank is a data-parallel rank here). Equal to that product,
    each rank runs one micro-batch per iteration, so the next step's parameter gathers can overlap only that
    one forward pass: the regime of a large job with a tiny batch per GPU, where communication bounds a step."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_value(f.name, getattr(self, f.name), ranks_per_node=self.ranks_per_node)
        per_iteration = self.micro_batch_size * self.nodes * self.ranks_per_node
        if self.global_batch_size % per_iteration:
            default = (self.micro_batch_size, self.global_batch_size) == (bench_training.MICRO_BATCH_SIZE,
                                                                         bench_training.GLOBAL_BATCH_SIZE)
            raise ValueError(f"parameter 'global_batch_size': {self.global_batch_size} is not a multiple of "
                             f"micro_batch_size x nodes x ranks_per_node = {self.micro_batch_size} x {self.nodes} x "
                             f"{self.ranks_per_node} = {per_iteration}"
                             + ("; that batch is the make-train default: set micro_batch_size and global_batch_size "
                                "for this layout" if default else ""))

    @property
    def batch_flags(self) -> list[str]:
        """The trainer's batch flags for this point (after the model's, so these win)."""
        return ["--micro-batch-size", str(self.micro_batch_size), "--global-batch-size", str(self.global_batch_size)]

    @property
    def run_name(self) -> str:
        return f"{self.policy}@{self.rate}"

    @property
    def layout(self) -> str:
        return f"{self.nodes}x{self.ranks_per_node}"

    def skip_reason(self) -> str | None:
        """Why this point cannot run (W&B's grid still lists it), or None."""
        if self.policy == "hpz" and self.path != "fsdp":
            return "hpZ exists on the Megatron-FSDP path only (path fsdp)"
        return None


PARAMETERS = {f.name: f for f in dataclasses.fields(GridPoint)}
ONE_VALUE_PER_SWEEP = ("micro_batch_size", "global_batch_size")
REQUIRED = tuple(name for name, f in PARAMETERS.items() if f.default is dataclasses.MISSING)


def check_value(name: str, value, ranks_per_node: int = 2) -> None:
    """Raise ValueError naming the parameter, the value and the valid choices."""
    if name == "policy":
        bench_training.policy_flags(str(value), ranks_per_node)  # raises, listing the valid policies
    elif name == "rate":
        if value != "unshaped":
            from netemu import parse_rate

            try:
                parse_rate(str(value))
            except ValueError as e:
                raise ValueError(f"parameter 'rate': {e}") from None
    elif name == "path":
        if value not in bench_training.PATHS:
            raise ValueError(f"parameter 'path': {value!r}: valid: {', '.join(bench_training.PATHS)}")
    elif name in ("iters", "log_interval", "nodes", "ranks_per_node", "micro_batch_size", "global_batch_size"):
        low = {"iters": 2, "log_interval": 1, "nodes": 2, "ranks_per_node": 1, "micro_batch_size": 1,
               "global_batch_size": 1}[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            why = {"iters": " (the first iteration is not timed)", "nodes": " (a sweep over inter-node rates)"}
            raise ValueError(f"parameter {name!r}: {value!r} must be an integer >= {low}{why.get(name, '')}")
    else:
        raise ValueError(f"unknown parameter {name!r}; valid: {', '.join(PARAMETERS)}")


# ------------------------------------------------------------------ the sweep file
@dataclass
class SweepConfig:
    """A W&B sweep file, checked against what tools/sweep.py can run."""

    name: str
    method: str
    metric: dict
    parameters: dict[str, list] = field(default_factory=dict)
    """Parameter -> its values (``value: x`` is ``[x]``), in the file's order."""
    raw: dict = field(default_factory=dict)
    source: Path | None = None

    @classmethod
    def load(cls, path: str | Path) -> SweepConfig:
        import yaml

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"sweep file {str(path)!r} not found; the shipped ones: "
                                    + ", ".join(str(p.relative_to(REPO)) for p in sorted(
                                        (REPO / "configs" / "sweeps").glob("*.yaml"))))
        data = yaml.safe_load(path.read_text())
        return cls.from_dict(data, source=path)

    @classmethod
    def from_dict(cls, data: dict, source: Path | None = None) -> SweepConfig:
        where = f"{source}: " if source else ""
        if not isinstance(data, dict):
            raise ValueError(f"{where}a sweep file is a mapping of W&B's keys ({', '.join(TOP_LEVEL_KEYS)})")
        unknown = [k for k in data if k not in TOP_LEVEL_KEYS]
        if unknown:
            raise ValueError(f"{where}unknown key(s) {', '.join(map(repr, unknown))}; valid (W&B's sweep keys): "
                             f"{', '.join(TOP_LEVEL_KEYS)}")
        method = data.get("method")
        if method not in METHODS:
            raise ValueError(f"{where}method {method!r}: valid: {', '.join(METHODS)}")
        metric = data.get("metric") or {"name": "tokens_per_s", "goal": "maximize"}
        if metric.get("name") not in METRICS or metric.get("goal", "minimize") not in ("minimize", "maximize"):
            raise ValueError(f"{where}metric {metric!r}: name one of {', '.join(METRICS)}, goal minimize or maximize")
        params = data.get("parameters")
        if not isinstance(params, dict) or not params:
            raise ValueError(f"{where}'parameters' must map parameter names to {{values: [...]}} or {{value: x}}")
        values: dict[str, list] = {}
        for name, spec in params.items():
            if name not in PARAMETERS:
                raise ValueError(f"{where}unknown parameter {name!r}; valid: {', '.join(PARAMETERS)}")
            if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in ("values", "value"):
                raise ValueError(f"{where}parameter {name!r}: {spec!r}: tools/sweep.py takes exactly one of "
                                 "'values: [...]' or 'value: x' (distributions such as min/max need a "
                                 "W&B server: wandb sweep, then --agent)")
            vals = spec["values"] if "values" in spec else [spec["value"]]
            if not isinstance(vals, list) or not vals:
                raise ValueError(f"{where}parameter {name!r}: 'values' must be a non-empty list, got {vals!r}")
            for v in vals:
                try:
                    check_value(name, v)
                except ValueError as e:
                    raise ValueError(f"{where}{e}") from None
            if name in ONE_VALUE_PER_SWEEP and len(vals) > 1:
                raise ValueError(f"{where}parameter {name!r}: {vals!r}: one value per sweep file (its runs are "
                                 "named policy@rate and its tables keyed by path and rate); give each batch its "
                                 "own sweep file")
            values[name] = vals
        missing = [n for n in REQUIRED if n not in values]
        if missing:
            raise ValueError(f"{where}parameter(s) {', '.join(missing)} missing; required: {', '.join(REQUIRED)}")
        config = cls(name=str(data.get("name") or (source.stem if source else "sweep")), method=method,
                     metric=metric, parameters=values, raw=data, source=source)
        try:
            config.grid()  # the checks that span parameters (the batch against the layout)
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None
        return config

    def grid(self) -> tuple[list[GridPoint], list[tuple[GridPoint, str]]]:
        """Every combination, in the file's order: ``(runnable points, [(skipped point, why)])``."""
        names = list(self.parameters)
        runnable, skipped = [], []
        for combo in itertools.product(*(self.parameters[n] for n in names)):
            point = GridPoint(**dict(zip(names, combo)))
            why = point.skip_reason()
            (skipped.append((point, why)) if why else runnable.append(point))
        return runnable, skipped

    def point(self, params: dict) -> GridPoint:
        """The grid point a W&B agent hands out (``{name: value}``), checked like the file."""
        unknown = [k for k in params if k not in PARAMETERS]
        if unknown:
            raise ValueError(f"unknown parameter(s) {', '.join(unknown)}; valid: {', '.join(PARAMETERS)}")
        return GridPoint(**params)


@dataclass
class Launch:
    """Grid points that share one emulated launch: same layout, path, rate, iterations and batch."""

    nodes: int
    ranks_per_node: int
    path: str
    rate: str
    iters: int
    log_interval: int
    micro_batch_size: int
    global_batch_size: int
    points: list[GridPoint] = field(default_factory=list)

    @property
    def policies(self) -> list[str]:
        return [p.policy for p in self.points]

    @property
    def log_tag(self) -> str | None:
        """What tells a one-run launch's log from the others at its path and rate (bench_training's ``log_tag``);
        None for a shared launch (one log per path and rate)."""
        if len(self.points) != 1:
            return None
        return f"{self.points[0].policy}-{self.nodes}x{self.ranks_per_node}-{self.iters}it"


def group_launches(points: list[GridPoint], *, shared: bool = False) -> list[Launch]:
    """Points as launches, layouts contiguous (one cluster each), first-seen order otherwise.

    One launch per point unless ``shared``: then the points of one (layout, path, rate, iterations, batch)
    train in one launch, one after another in the same processes (start-up paid once, timings biased by
    the order; see the module docstring)."""
    launches: dict[tuple, Launch] = {}
    for p in points:
        key = (p.nodes, p.ranks_per_node, p.path, p.rate, p.iters, p.log_interval, p.micro_batch_size,
               p.global_batch_size)
        launch = launches.setdefault(key, Launch(*key))
        if p.policy not in launch.policies:  # a policy twice in 'values' trains once
            launch.points.append(p)
    layouts = list(dict.fromkeys((launch.nodes, launch.ranks_per_node) for launch in launches.values()))
    grouped = sorted(launches.values(), key=lambda launch: layouts.index((launch.nodes, launch.ranks_per_node)))
    if shared:
        return grouped
    # The policies compared at one path and rate stay adjacent in time, so a drift in the machine's load
    # reaches them alike.
    return [dataclasses.replace(launch, points=[p]) for launch in grouped for p in launch.points]


def wandb_flags(point: GridPoint, *, project: str, save_dir: Path, group: str | None) -> list[str]:
    """Trainer flags that make its W&B run this point's run."""
    flags = ["--wandb-project", project, "--wandb-exp-name", point.run_name, "--wandb-job-type", point.path,
             "--wandb-save-dir", str(save_dir)]
    if group:
        flags += ["--wandb-group", group]
    for key, value in (("policy", point.policy), ("rate", point.rate), ("path", point.path),
                       ("layout", point.layout), ("iters", point.iters), ("log_interval", point.log_interval),
                       ("micro_batch_size", point.micro_batch_size), ("global_batch_size", point.global_batch_size)):
        flags += ["--wandb-config", f"{key}={value}"]
    return flags


# ------------------------------------------------------------------ running
@dataclass
class RunOptions:
    out_dir: Path
    shared_launch: bool = False
    """Train the policies of one path and rate in one launch (``group_launches(shared=True)``)."""
    project: str = DEFAULT_PROJECT
    group: str | None = None
    timeout: float = 3600
    python: str = sys.executable
    verbose: bool = False


def _require_namespaces() -> None:
    from netemu import namespaces_available

    ok, why = namespaces_available()
    if not ok:
        raise PermissionError(f"tools/sweep.py runs on netemu's emulated cluster, which needs root: {why}. "
                              "Run it with sudo (e.g. sudo WANDB_MODE=offline python tools/sweep.py ...).")


def _append_rows(csv_path: Path, rows: list[dict]) -> None:
    new = not csv_path.exists()
    with open(csv_path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_FIELDS)
        if new:
            writer.writeheader()
        writer.writerows(rows)


def run_launch(cluster, launch: Launch, opts: RunOptions) -> tuple[list[dict], list[str]]:
    """Train a launch's policies on ``cluster``; ``(rows, policies that produced no summary)``."""
    extra = {p.policy: wandb_flags(p, project=opts.project, save_dir=opts.out_dir, group=opts.group)
             for p in launch.points}
    print(f"\n=== {launch.path}, inter-node {launch.rate}, {launch.nodes}x{launch.ranks_per_node}, batch "
          f"{launch.micro_batch_size}/{launch.global_batch_size}: {', '.join(launch.policies)}", flush=True)
    t0 = time.monotonic()
    _, summaries = bench_training.launch(cluster, launch.path, launch.rate, launch.policies, iters=launch.iters,
                                         log_interval=launch.log_interval, log_dir=opts.out_dir,
                                         timeout=opts.timeout, python=opts.python, verbose=opts.verbose,
                                         extra_flags=extra, model_extra=launch.points[0].batch_flags,
                                         log_tag=launch.log_tag)
    rows = []
    for name, s in summaries.items():
        row = bench_training.summary_row(launch.path, launch.rate, name, s) | {
            "layout": f"{launch.nodes}x{launch.ranks_per_node}", "micro_batch_size": launch.micro_batch_size,
            "global_batch_size": launch.global_batch_size}
        rows.append(row)
        print(bench_training.row_text(row), flush=True)
    print(f"    ({time.monotonic() - t0:.0f} s for this launch)", flush=True)
    return rows, [p for p in launch.policies if p not in summaries]


def run_local(config: SweepConfig, opts: RunOptions) -> list[str]:
    """Run the whole grid here; returns the failed points' names (results land in ``opts.out_dir``)."""
    from netemu import EmulatedCluster, NetemuConfig

    points, skipped = config.grid()
    for point, why in skipped:
        print(f"sweep: skipping {point.path} {point.run_name}: {why}")
    launches = group_launches(points, shared=opts.shared_launch)
    _require_namespaces()
    from netemu import terminate_like_ctrl_c

    terminate_like_ctrl_c()  # a kill from timeout/SLURM still removes the namespaces
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    # Local sweeps need no W&B server; a user who wants live upload sets WANDB_MODE=online.
    os.environ.setdefault("WANDB_MODE", "offline")
    csv_path = opts.out_dir / "results.csv"
    csv_path.unlink(missing_ok=True)
    failed = []
    print(f"sweep {config.name}: {len(points)} runs in {len(launches)} launches -> {opts.out_dir}", flush=True)
    for (nodes, rpn), group in itertools.groupby(launches, key=lambda launch: (launch.nodes, launch.ranks_per_node)):
        with EmulatedCluster(NetemuConfig(nodes=nodes, ranks_per_node=rpn)) as cluster:
            for launch in group:
                rows, missing = run_launch(cluster, launch, opts)
                _append_rows(csv_path, rows)
                failed += [f"{launch.path} {p}@{launch.rate}" for p in missing]
    return failed


def run_one(point: GridPoint, opts: RunOptions) -> dict | None:
    """One grid point on its own emulated cluster (what a W&B agent runs); its row, or None if it failed."""
    from netemu import EmulatedCluster, NetemuConfig

    why = point.skip_reason()
    if why:
        print(f"sweep: {point.path} {point.run_name} not run: {why}")
        return None
    _require_namespaces()
    from netemu import terminate_like_ctrl_c

    terminate_like_ctrl_c()  # a kill from timeout/SLURM still removes the namespaces
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    launch = Launch(point.nodes, point.ranks_per_node, point.path, point.rate, point.iters, point.log_interval,
                    point.micro_batch_size, point.global_batch_size, [point])
    with EmulatedCluster(NetemuConfig(nodes=point.nodes, ranks_per_node=point.ranks_per_node)) as cluster:
        rows, _ = run_launch(cluster, launch, opts)
    _append_rows(opts.out_dir / "results.csv", rows)
    return rows[0] if rows else None


def read_sweep_params(path: str | Path) -> dict:
    """The parameters a W&B agent wrote for its current run (``{name: {value: v}}``) as ``{name: v}``."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    return {k: v["value"] if isinstance(v, dict) and "value" in v else v for k, v in data.items()
            if k != "wandb_version"}


def run_agent(sweep_id: str, config: SweepConfig, opts: RunOptions, *, count: int | None = None,
              entity: str | None = None) -> None:
    """``wandb.agent`` calling ``run_one`` once per point the sweep server hands out."""
    import wandb

    def one() -> None:
        params = read_sweep_params(os.environ[wandb.env.SWEEP_PARAM_PATH])
        if run_one(config.point(params), opts) is None:
            raise RuntimeError(f"sweep point {params} produced no run summary; see {opts.out_dir}/log-*.txt")

    wandb.agent(sweep_id, function=one, entity=entity or config.raw.get("entity"),
                project=opts.project, count=count)


# ------------------------------------------------------------------ offline W&B runs
@dataclass
class WandbRun:
    """What one W&B run directory holds, read back from its ``run-ID.wandb`` log."""

    dir: Path
    id: str = ""
    name: str = ""
    group: str = ""
    job_type: str = ""
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def _wandb_records(path: Path):
    """Raw records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB-log framing: 32 KiB blocks of [crc32 u32, length u16, type u8] chunks, where type 1 is a
    whole record and 2/3/4 are its first/middle/last pieces."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run log (header {data[:7]!r})")
    block, pos, pieces = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero fill: skip to the next block
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pieces = chunk
        elif kind == 3:
            pieces += chunk
        elif kind == 4:
            yield pieces + chunk
            pieces = b""


def _item_key(item) -> str:
    return item.key or ".".join(item.nested_key)


def read_wandb_run(run_dir: Path) -> WandbRun:
    """Config, history rows and final summary of an (offline or synced) W&B run directory."""
    from wandb.proto import wandb_internal_pb2 as pb

    logs = sorted(Path(run_dir).glob("run-*.wandb"))
    if not logs:
        raise FileNotFoundError(f"{run_dir}: no run-*.wandb log")
    run = WandbRun(dir=Path(run_dir))
    for raw in _wandb_records(logs[0]):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.id, run.name, run.group, run.job_type = r.run_id, r.display_name, r.run_group, r.job_type
            run.config.update({_item_key(i): json.loads(i.value_json) for i in r.config.update})
        elif kind == "config":
            run.config.update({_item_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            run.history.append({_item_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            run.summary.update({_item_key(i): json.loads(i.value_json) for i in record.summary.update})
            for i in record.summary.remove:
                run.summary.pop(_item_key(i), None)
    run.config.pop("_wandb", None)
    return run


def index_wandb_runs(wandb_dir: Path) -> dict[tuple[str, str], WandbRun]:
    """``(job type, run name) -> run``, the newest when a name repeats (directories sort by time)."""
    runs = {}
    for d in sorted(Path(wandb_dir).glob("*run-*")):
        if d.is_symlink() or not d.is_dir():  # latest-run points at one of the others
            continue
        try:
            run = read_wandb_run(d)
        except (FileNotFoundError, ValueError):
            continue
        runs[(run.job_type, run.name)] = run
    return runs


# ------------------------------------------------------------------ the summary table
def summary_table(rows: list[dict], runs: dict[tuple[str, str], WandbRun] | None = None,
                  root: Path | None = None) -> list[dict]:
    """Per path and rate, each policy: ms/iteration, tokens/s, speedups over megatron and fair, cross-node
    MB per iteration counted and NIC-measured, final loss and its W&B run directory."""
    table = []
    for path in dict.fromkeys(r["path"] for r in rows):
        for rate in dict.fromkeys(r["rate"] for r in rows if r["path"] == path):
            sel = {r["policy"]: r for r in rows if r["path"] == path and r["rate"] == rate}
            base = {b: float(sel[b]["seconds_per_iteration"]) for b in ("megatron", "fair") if b in sel}
            for name, r in sel.items():
                t = float(r["seconds_per_iteration"])
                measured = float(r["nic_payload_bytes_per_iteration"] or 0)
                run = (runs or {}).get((path, f"{name}@{rate}"))
                table.append({
                    "path": path, "rate": rate, "policy": name, "ms_per_iteration": round(t * 1e3, 1),
                    "tokens_per_s": round(float(r["tokens_per_s"]), 1),
                    "speedup_vs_megatron": round(base["megatron"] / t, 3) if "megatron" in base else "",
                    "speedup_vs_fair": round(base["fair"] / t, 3) if "fair" in base else "",
                    "inter_MB_counted": round(float(r["inter_bytes_per_iteration"]) / 1e6, 3),
                    "inter_MB_measured": round(measured / 1e6, 3) if measured else "",
                    "final_loss": round(float(r["final_loss"]), 4),
                    "wandb_run": "" if run is None else str(run.dir.relative_to(root) if root else run.dir)})
    return table


def markdown(table: list[dict], title: str) -> str:
    heads = ["rate", "policy", "ms/iteration", "tokens/s", "x megatron", "x fair", "cross-node MB/it counted",
             "measured (NIC)", "final loss", "W&B run"]
    keys = ["rate", "policy", "ms_per_iteration", "tokens_per_s", "speedup_vs_megatron", "speedup_vs_fair",
            "inter_MB_counted", "inter_MB_measured", "final_loss", "wandb_run"]
    out = [f"# {title}", ""]
    for path in dict.fromkeys(r["path"] for r in table):
        out += [f"## {path}", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        for r in (r for r in table if r["path"] == path):
            out.append("| " + " | ".join(str(r[k]) for k in keys) + " |")
        out.append("")
    return "\n".join(out)


def finish(out_dir: Path, title: str) -> list[Path]:
    """Table (printed, CSV, Markdown) and plots from ``out_dir/results.csv`` and ``out_dir/wandb``."""
    csv_path = out_dir / "results.csv"
    if not csv_path.exists():
        raise FileNotFoundError(f"{csv_path}: no results (did every launch fail? see {out_dir}/log-*.txt)")
    rows = bench_training.read_rows(csv_path)
    runs = index_wandb_runs(out_dir / "wandb")
    table = summary_table(rows, runs, root=out_dir)
    with open(out_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=TABLE_FIELDS)
        writer.writeheader()
        writer.writerows(table)
    md = markdown(table, title)
    (out_dir / "summary.md").write_text(md)
    print("\n" + md)
    with_metrics = [r for r in runs.values() if r.history and "tokens_per_s" in r.summary]
    print(f"W&B: {len(runs)} runs under {out_dir / 'wandb'}, {len(with_metrics)} with logged history and summary")
    written = [out_dir / "summary.csv", out_dir / "summary.md"] + bench_training.plot(rows, out_dir)
    for f in written:
        print(f"wrote {f}")
    return written


# ------------------------------------------------------------------ command line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Needs root (network namespaces); see tools/netemu.py.")
    p.add_argument("config", nargs="?", type=Path, help="W&B sweep YAML (configs/sweeps/)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="run the whole grid here (offline W&B runs)")
    mode.add_argument("--agent", metavar="SWEEP_ID", help="join the W&B sweep SWEEP_ID (from `wandb sweep`)")
    mode.add_argument("--dry-run", action="store_true", help="print the grid and its launches, run nothing")
    mode.add_argument("--run-one", action="store_true", help="one grid point from --policy, --rate, ... "
                                                             "(the sweep YAML's command, for `wandb agent`)")
    mode.add_argument("--table-only", type=Path, metavar="OUT_DIR", help="redraw table and plots from OUT_DIR")
    p.add_argument("--out-dir", type=Path, default=None, help="default: out/sweeps/NAME")
    p.add_argument("--project", default=None, help=f"W&B project (default: the file's, else {DEFAULT_PROJECT})")
    p.add_argument("--count", type=int, default=None, help="--agent: at most this many runs")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    p.add_argument("--python", default=sys.executable, help="interpreter for torchrun on the nodes")
    p.add_argument("--verbose", action="store_true", help="echo node 0's training log")
    p.add_argument("--shared-launch", action="store_true",
                   help="--local: train a path and rate's policies one after another in one launch (start-up paid "
                        "once per rate, but a policy's timing then depends on what trained before it in the same "
                        "processes); default: one launch per run")
    points = p.add_argument_group("--run-one: the point (W&B's ${args} spells them --name=value)")
    for name, f in PARAMETERS.items():
        spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        points.add_argument(*spellings, dest=name, type=int if f.type == "int" else str, default=None)
    a = p.parse_args(argv)
    try:
        return _main(p, a)
    except (ValueError, FileNotFoundError, PermissionError) as e:  # bad input: one line, no traceback
        p.exit(2, f"{p.prog}: error: {e}\n")


def _main(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    if a.table_only:
        finish(a.table_only, f"Sweep {a.table_only.name}")
        return 0
    if a.run_one:
        given = {n: getattr(a, n) for n in PARAMETERS if getattr(a, n) is not None}
        config = SweepConfig.load(a.config) if a.config else None
        if config:  # the file's fixed parameters (a 'value:'), e.g. its batch, unless the flags say otherwise
            given = {n: v[0] for n, v in config.parameters.items() if len(v) == 1} | given
        missing = [n for n in REQUIRED if n not in given]
        if missing:
            p.error(f"--run-one needs --{' and --'.join(missing)}")
        point = GridPoint(**given)
        name = config.name if config else "run-one"
        opts = RunOptions(out_dir=a.out_dir or REPO / "out" / "sweeps" / name, timeout=a.timeout, python=a.python,
                          verbose=a.verbose, project=a.project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                          group=config.name if config else None)
        return 0 if run_one(point, opts) is not None or point.skip_reason() else 1
    if a.config is None:
        p.error("give a sweep YAML (configs/sweeps/*.yaml)")
    if not (a.local or a.agent or a.dry_run):
        p.error("choose --local, --agent SWEEP_ID, --dry-run, --run-one or --table-only")
    config = SweepConfig.load(a.config)
    opts = RunOptions(out_dir=a.out_dir or REPO / "out" / "sweeps" / config.name, timeout=a.timeout, python=a.python,
                      verbose=a.verbose, project=a.project or config.raw.get("project") or DEFAULT_PROJECT,
                      group=config.name, shared_launch=a.shared_launch)
    if a.dry_run or a.local:
        if config.method != "grid":
            p.error(f"--local and --dry-run expand method 'grid' only (the file says {config.method!r}); "
                    f"random and bayes need the W&B server: wandb sweep {a.config}, then --agent SWEEP_ID")
        points, skipped = config.grid()
        launches = group_launches(points, shared=a.shared_launch)
        if a.dry_run:
            print(f"sweep {config.name}: {len(points)} runs in {len(launches)} launches"
                  + (f", {len(skipped)} skipped" if skipped else ""))
            for launch in launches:
                print(f"  {launch.nodes}x{launch.ranks_per_node} {launch.path:8s} {launch.rate:9s} "
                      f"{launch.iters} iterations, batch {launch.micro_batch_size}/{launch.global_batch_size}: "
                      f"{', '.join(launch.policies)}")
            for point, why in skipped:
                print(f"  skipped {point.path} {point.run_name}: {why}")
            return 0
        failed = run_local(config, opts)
        finish(opts.out_dir, f"Sweep {config.name} ({time.strftime('%Y-%m-%d')}, {bench_training.machine()})")
        if failed:
            print(f"FAILED runs (see {opts.out_dir}/log-*.txt): {', '.join(failed)}")
            return 1
        return 0
    run_agent(a.agent, config, opts, count=a.count)
    if (opts.out_dir / "results.csv").exists():
        finish(opts.out_dir, f"Sweep {config.name}, agent's share of {a.agent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
