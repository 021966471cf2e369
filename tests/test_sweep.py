"""tools/sweep.py: W&B sweep files -> grid -> launches -> summary table; the agent path; the offline runs.

The end-to-end smoke sweep (netemu, root) is marked slow: ``make test ARGS="-m slow -k sweep"``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import sweep  # noqa: E402

SWEEPS = REPO / "configs" / "sweeps"


def config(**parameters) -> dict:
    return {"name": "t", "method": "grid", "metric": {"name": "tokens_per_s", "goal": "maximize"},
            "program": "tools/sweep.py", "parameters": {k: ({"values": v} if isinstance(v, list) else {"value": v})
                                                        for k, v in parameters.items()}}


# ------------------------------------------------------------------ the sweep files
def test_shipped_sweep_files_are_valid_and_expand():
    smoke = sweep.SweepConfig.load(SWEEPS / "smoke.yaml")
    points, skipped = smoke.grid()
    assert [(p.policy, p.rate, p.path, p.iters) for p in points] == [
        ("megatron", "50mbit", "distopt", 4), ("megatron", "unshaped", "distopt", 4),
        ("zeropp", "50mbit", "distopt", 4), ("zeropp", "unshaped", "distopt", 4)]
    assert skipped == []
    full = sweep.SweepConfig.load(SWEEPS / "policies-vs-bandwidth.yaml")
    points, skipped = full.grid()
    assert len(points) == 7 * 6 * 2 - 6 and len(skipped) == 6
    assert all(p.policy == "hpz" and p.path == "distopt" for p, _ in skipped)
    for c in (smoke, full):
        # What `wandb agent` runs: this program with the point's parameters as flags.
        assert c.raw["program"] == "tools/sweep.py" and (REPO / c.raw["program"]).is_file()
        assert c.raw["command"][-2:] == ["--run-one", "${args}"]
        assert c.metric == {"name": "tokens_per_s", "goal": "maximize"}


def test_sdp4bit_speed_sweep_expands():
    points, skipped = sweep.SweepConfig.load(SWEEPS / "sdp4bit-speed.yaml").grid()
    assert sorted({p.policy for p in points}) == ["fair", "sdp4bit", "zeropp"] and skipped == []
    assert {p.rate for p in points} == {"25mbit", "100mbit", "unshaped"} and {p.iters for p in points} == {16}


class _CapturingCluster:
    """netemu's EmulatedCluster as bench_training.launch uses it: records the launch and writes each policy's run
    summary where the worker would, so the rows are built as after a real launch."""

    def __init__(self, ranks_per_node: int = 2):
        self.config = type("Config", (), {"ranks_per_node": ranks_per_node})()
        self.script = None

    def set_rate(self, rate):
        self.rate = rate

    def run_torchrun(self, script, **kwargs):
        self.script, self.log_path = script, kwargs.get("log_path")
        work = Path(script[script.index("--worker") + 1])
        for name in script[script.index("--policies") + 1].split(","):
            (work / f"{name}.json").write_text(json.dumps({
                "iterations": 4, "seconds_per_iteration": 1.0, "tokens_per_s": 1024.0, "inter_bytes": 4e6,
                "breakdown": {"compute_s": 0.5, "exposed_comm_s": 0.4, "codec_s": 0.1}, "final_loss": 3.7,
                "dp_replicas_identical": True}))
        return netemu_result()


def netemu_result():
    import netemu

    return netemu.RunResult(returncode=0, failure=None, seconds=1.0, links=[], output="", outputs=[])


def test_tiny_batch_sweep_expands_and_its_batch_reaches_the_trainer(tmp_path):
    points, skipped = sweep.SweepConfig.load(SWEEPS / "sdp4bit-tiny-batch.yaml").grid()
    assert skipped == [] and {(p.micro_batch_size, p.global_batch_size) for p in points} == {(1, 4)}
    assert {p.path for p in points} == {"distopt", "fsdp"} and len(points) == 3 * 3 * 2
    launch = sweep.group_launches(points, shared=True)[0]
    cluster = _CapturingCluster()
    rows, missing = sweep.run_launch(cluster, launch, sweep.RunOptions(out_dir=tmp_path, shared_launch=True))
    # What each policy's trainer parses: the worker's arguments, then the policy's and the W&B flags (as
    # bench_training.worker builds them), through the trainer's own parser (the last occurrence of a flag wins).
    from megatron_zpp.training.arguments import build_parser

    worker_args = json.loads(cluster.script[cluster.script.index("--worker-args") + 1])
    extra = json.loads(cluster.script[cluster.script.index("--worker-extra") + 1])
    for policy in launch.policies:
        args = build_parser().parse_args(worker_args + sweep.bench_training.policy_flags(policy, 2) + extra[policy])
        assert (args.micro_batch_size, args.global_batch_size) == (1, 4), policy
    assert missing == [] and [(r["policy"], r["micro_batch_size"], r["global_batch_size"]) for r in rows] == \
        [(p, 1, 4) for p in launch.policies]
    # The make-train batch by default, so the older sweep files keep their runs.
    default = sweep.Launch(2, 2, "distopt", "25mbit", 4, 2, 4, 32, [sweep.GridPoint(policy="fair", rate="25mbit")])
    sweep.run_launch(cluster, default, sweep.RunOptions(out_dir=tmp_path))
    args = build_parser().parse_args(json.loads(cluster.script[cluster.script.index("--worker-args") + 1]))
    assert (args.micro_batch_size, args.global_batch_size) == (4, 32)


def test_run_one_takes_the_sweep_files_fixed_parameters(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(sweep, "run_one", lambda point, opts: seen.append(point) or {})
    tiny = str(SWEEPS / "sdp4bit-tiny-batch.yaml")
    assert sweep.main([tiny, "--run-one", "--policy=zeropp", "--rate=25mbit", "--out-dir", str(tmp_path)]) == 0
    assert (seen[-1].micro_batch_size, seen[-1].global_batch_size, seen[-1].iters) == (1, 4, 16)
    # A flag still wins over the file, in either spelling.
    assert sweep.main([tiny, "--run-one", "--policy=zeropp", "--rate=25mbit", "--micro-batch-size", "2",
                       "--global_batch_size=8", "--out-dir", str(tmp_path)]) == 0
    assert (seen[-1].micro_batch_size, seen[-1].global_batch_size) == (2, 8)


def test_sweep_median_refuses_repeats_of_different_batches(tmp_path):
    import sweep_median

    fields = "path,rate,policy,seconds_per_iteration,micro_batch_size,global_batch_size\n"
    (tmp_path / "a.csv").write_text(fields + "distopt,25mbit,zeropp,1.0,1,4\n")
    (tmp_path / "b.csv").write_text(fields + "distopt,25mbit,zeropp,3.0,4,32\n")
    with pytest.raises(ValueError, match=r"zeropp@25mbit ran at batch \(micro, global\) \('4', '32'\)"):
        sweep_median.load([tmp_path / "a.csv", tmp_path / "b.csv"])
    assert len(sweep_median.load([tmp_path / "a.csv", tmp_path / "a.csv"])[("distopt", "25mbit", "zeropp")]) == 2
    # Files from before the batch was recorded ran at the make-train default, and mix with default-batch files.
    (tmp_path / "old.csv").write_text("path,rate,policy,seconds_per_iteration\ndistopt,25mbit,zeropp,3.0\n")
    assert len(sweep_median.load([tmp_path / "old.csv", tmp_path / "b.csv"])[("distopt", "25mbit", "zeropp")]) == 2
    with pytest.raises(ValueError, match="ran at batch"):
        sweep_median.load([tmp_path / "old.csv", tmp_path / "a.csv"])
    assert sweep_median.DEFAULT_BATCH == (str(sweep.bench_training.MICRO_BATCH_SIZE),
                                          str(sweep.bench_training.GLOBAL_BATCH_SIZE))


def test_sweep_median_takes_the_median_of_repeats_and_its_ratios(tmp_path):
    import sweep_median

    fields = ["path", "rate", "policy", "seconds_per_iteration", "inter_bytes_per_iteration",
              "nic_payload_bytes_per_iteration", "final_loss"]
    files = []
    for k, (zeropp, sdp) in enumerate(((3.0, 2.0), (3.3, 2.4), (2.7, 1.0))):
        path = tmp_path / f"results{k}.csv"
        path.write_text(",".join(fields) + "\n" + f"distopt,25mbit,zeropp,{zeropp},6829000,6850000,3.8\n"
                        + f"distopt,25mbit,sdp4bit,{sdp},3000000,3010000,3.81\n")
        files.append(path)
    rows = {(e["policy"]): e for e in sweep_median.table(sweep_median.load(files), ["zeropp"])}
    assert rows["sdp4bit"]["ms_per_iteration"] == 2000.0 and rows["zeropp"]["ms_per_iteration"] == 3000.0
    assert rows["sdp4bit"]["x_zeropp"] == 1.5 and rows["zeropp"]["x_zeropp"] == 1.0
    assert rows["sdp4bit"]["spread"] == 0.7 and rows["sdp4bit"]["inter_MB_counted"] == 3.0


@pytest.mark.parametrize("data, message", [
    (config(policy=["megatron"], rate=["1gbit"], lr=[1e-3]), "unknown parameter 'lr'; valid: policy, rate, path"),
    (config(policy=["megatron", "zerop"], rate=["1gbit"]), "policy 'zerop': valid: megatron, fair, qwz"),
    (config(policy=["megatron"], rate=["fast"]), "rate 'fast' must be a positive number with a unit in bit"),
    (config(policy=["megatron"], rate=["1gbit"], path=["zero3"]), "'path': 'zero3': valid: distopt, fsdp"),
    (config(policy=["megatron"], rate=["1gbit"], iters=1), "'iters': 1 must be an integer >= 2"),
    (config(policy=["megatron"], rate=["1gbit"], global_batch_size=6),
     "'global_batch_size': 6 is not a multiple of micro_batch_size x nodes x ranks_per_node = 4 x 2 x 2 = 16"),
    (config(policy=["megatron"], rate=["1gbit"], micro_batch_size=0), "'micro_batch_size': 0 must be an integer >= 1"),
    (config(policy=["megatron"], rate=["1gbit"], micro_batch_size=1, global_batch_size=[4, 8]),
     "'global_batch_size': [4, 8]: one value per sweep file"),
    (config(policy=["megatron"]), "parameter(s) rate missing; required: policy, rate"),
    (config(policy=["megatron"], rate=["1gbit"]) | {"methd": "grid"}, "unknown key(s) 'methd'; valid"),
    (config(policy=["megatron"], rate=["1gbit"]) | {"method": "hyperband"}, "method 'hyperband': valid: grid"),
    (config(policy=["megatron"], rate=["1gbit"]) | {"metric": {"name": "acc"}}, "metric {'name': 'acc'}: name one"),
    ({**config(policy=["megatron"]), "parameters": {"policy": {"values": ["megatron"]},
                                                    "rate": {"min": 1, "max": 2}}}, "exactly one of 'values"),
])
def test_bad_sweep_files_are_rejected_naming_the_valid_choices(data, message):
    with pytest.raises(ValueError) as e:
        sweep.SweepConfig.from_dict(data)
    assert message in str(e.value)


def test_local_expands_grid_only(capsys):
    path = SWEEPS / "smoke.yaml"
    random = path.read_text().replace("method: grid", "method: random")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"sweep-random-{os.getpid()}.yaml"
    tmp.write_text(random)
    try:
        with pytest.raises(SystemExit):
            sweep.main([str(tmp), "--dry-run"])
    finally:
        tmp.unlink()
    assert "expand method 'grid' only" in capsys.readouterr().err


# ------------------------------------------------------------------ launches
def test_points_group_into_one_launch_per_layout_path_rate():
    c = sweep.SweepConfig.from_dict(config(policy=["megatron", "qwz", "hpz"], rate=["25mbit", "unshaped"],
                                           path=["distopt", "fsdp"], nodes=[2, 4]))
    points, skipped = c.grid()
    assert len(skipped) == 4  # hpz x distopt x 2 rates x 2 layouts
    launches = sweep.group_launches(points, shared=True)
    assert [(x.nodes, x.path, x.rate, x.policies) for x in launches] == [
        (2, "distopt", "25mbit", ["megatron", "qwz"]), (2, "fsdp", "25mbit", ["megatron", "qwz", "hpz"]),
        (2, "distopt", "unshaped", ["megatron", "qwz"]), (2, "fsdp", "unshaped", ["megatron", "qwz", "hpz"]),
        (4, "distopt", "25mbit", ["megatron", "qwz"]), (4, "fsdp", "25mbit", ["megatron", "qwz", "hpz"]),
        (4, "distopt", "unshaped", ["megatron", "qwz"]), (4, "fsdp", "unshaped", ["megatron", "qwz", "hpz"])]
    assert sum(len(x.points) for x in launches) == len(points)


def test_by_default_each_run_is_its_own_launch_with_its_own_log(tmp_path):
    # A policy trained second in the same processes timed slower than trained first, so by default no run shares
    # a launch. The compared policies of a path and rate stay adjacent, in the file's order.
    c = sweep.SweepConfig.from_dict(config(policy=["zeropp", "sdp4bit"], rate=["25mbit", "unshaped"],
                                           path=["distopt", "fsdp"]))
    points, _ = c.grid()
    launches = sweep.group_launches(points)
    assert [(x.path, x.rate, x.policies) for x in launches] == [
        (path, rate, [policy]) for rate in ("25mbit", "unshaped") for path in ("distopt", "fsdp")
        for policy in ("zeropp", "sdp4bit")]
    cluster = _CapturingCluster()
    logs = []
    for launch in launches[:2]:
        rows, missing = sweep.run_launch(cluster, launch, sweep.RunOptions(out_dir=tmp_path))
        assert missing == [] and [r["policy"] for r in rows] == launch.policies
        assert cluster.script[cluster.script.index("--policies") + 1] == launch.policies[0]
        logs.append(cluster.log_path)
    # One log per run: the second launch at the same path and rate does not overwrite the first's.
    assert [p.name for p in logs] == ["log-distopt-25mbit-zeropp-2x2-8it.txt", "log-distopt-25mbit-sdp4bit-2x2-8it.txt"]
    # Nor does a run in another layout or of another length, and a shared launch keeps one log per path and rate.
    other = sweep.group_launches([sweep.GridPoint(policy="zeropp", rate="25mbit", nodes=4, micro_batch_size=1,
                                                  global_batch_size=8, iters=6)])[0]
    assert other.log_tag == "zeropp-4x2-6it"
    assert sweep.group_launches(points, shared=True)[0].log_tag is None


def test_wandb_flags_are_trainer_flags():
    from megatron_zpp.training.arguments import build_parser, parse_wandb_config

    point = sweep.GridPoint(policy="qgz", rate="25mbit", path="fsdp", iters=6)
    args = build_parser().parse_args(sweep.wandb_flags(point, project="p", save_dir=Path("/tmp/x"), group="g"))
    assert (args.wandb_project, args.wandb_exp_name, args.wandb_group, args.wandb_job_type) == \
        ("p", "qgz@25mbit", "g", "fsdp")
    assert parse_wandb_config(args.wandb_config) == {"policy": "qgz", "rate": "25mbit", "path": "fsdp",
                                                     "layout": "2x2", "iters": 6, "log_interval": 2,
                                                     "micro_batch_size": 4, "global_batch_size": 32}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_wandb_config(["rate"])


# ------------------------------------------------------------------ single points: --run-one and --agent
def test_run_one_takes_wandb_args_spelling(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(sweep, "run_one", lambda point, opts: seen.append((point, opts)) or {})
    # W&B's ${args}: --name=value with the parameter's own spelling (underscores).
    assert sweep.main(["--run-one", "--policy=zeropp", "--rate=100mbit", "--path=fsdp", "--iters=4",
                       "--log_interval=1", "--out-dir", str(tmp_path)]) == 0
    point, opts = seen[0]
    assert point == sweep.GridPoint(policy="zeropp", rate="100mbit", path="fsdp", iters=4, log_interval=1)
    assert opts.out_dir == tmp_path
    with pytest.raises(SystemExit):
        sweep.main(["--run-one", "--policy=zeropp"])


def test_agent_calls_run_one_with_the_points_the_server_hands_out(monkeypatch, tmp_path):
    """The agent itself needs a W&B server; a stand-in hands out points the way wandb's pyagent does
    (parameters in the YAML file named by WANDB_SWEEP_PARAM_PATH, run and sweep ids in the environment)."""
    import wandb
    from wandb.sdk.lib import config_util

    calls, seen = [], []

    def fake_agent(sweep_id, function=None, entity=None, project=None, count=None, **kw):
        calls.append((sweep_id, project, count))
        for i, params in enumerate([{"policy": "megatron", "rate": "25mbit"}, {"policy": "qwz", "rate": "1gbit"}]):
            path = tmp_path / f"config-{i}.yaml"
            config_util.save_config_file_from_dict(path, {k: {"value": v} for k, v in
                                                          (params | {"path": "distopt", "iters": 4}).items()})
            monkeypatch.setenv(wandb.env.SWEEP_PARAM_PATH, str(path))
            function()

    monkeypatch.setattr(wandb, "agent", fake_agent)
    monkeypatch.setattr(sweep, "run_one", lambda point, opts: seen.append(point) or {})
    assert sweep.main([str(SWEEPS / "smoke.yaml"), "--agent", "me/proj/abc123", "--count", "2",
                       "--out-dir", str(tmp_path)]) == 0
    assert calls == [("me/proj/abc123", sweep.DEFAULT_PROJECT, 2)]
    assert [(p.policy, p.rate, p.iters) for p in seen] == [("megatron", "25mbit", 4), ("qwz", "1gbit", 4)]


# ------------------------------------------------------------------ the table
def _row(policy, rate, seconds, inter, nic=0.0, path="distopt"):
    return {"path": path, "rate": rate, "policy": policy, "seconds_per_iteration": str(seconds),
            "tokens_per_s": str(8192 / seconds), "inter_bytes_per_iteration": str(inter),
            "nic_payload_bytes_per_iteration": str(nic), "final_loss": "5.5"}


def test_summary_table_speedups_and_bytes():
    rows = [_row("megatron", "25mbit", 4.0, 30e6, 30.3e6), _row("fair", "25mbit", 2.0, 10e6, 10.1e6),
            _row("zeropp", "25mbit", 1.0, 3e6, 3.05e6), _row("zeropp", "unshaped", 0.5, 3e6)]
    runs = {("distopt", "zeropp@25mbit"): sweep.WandbRun(dir=Path("/o/wandb/offline-run-1-abc"))}
    table = sweep.summary_table(rows, runs, root=Path("/o"))
    z = table[2]
    assert (z["policy"], z["ms_per_iteration"], z["speedup_vs_megatron"], z["speedup_vs_fair"]) == \
        ("zeropp", 1000.0, 4.0, 2.0)
    assert (z["inter_MB_counted"], z["inter_MB_measured"], z["wandb_run"]) == (3.0, 3.05, "wandb/offline-run-1-abc")
    # No baseline at that rate, no NIC measurement: blank, not made up.
    assert (table[3]["speedup_vs_megatron"], table[3]["inter_MB_measured"]) == ("", "")
    md = sweep.markdown(table, "T")
    assert "## distopt" in md and "| 25mbit | zeropp | 1000.0 | 8192.0 | 4.0 | 2.0 | 3.0 | 3.05 |" in md


# ------------------------------------------------------------------ reading offline W&B runs back
def test_read_wandb_run_reads_back_an_offline_run(tmp_path):
    code = ("import wandb\n"
            "r = wandb.init(project='p', name='zeropp@25mbit', group='smoke', job_type='distopt',"
            f" dir={str(tmp_path)!r}, mode='offline', config={{'policy': 'zeropp', 'rate': '25mbit'}})\n"
            "for i in range(1, 4): r.log({'lm loss': 6.0 - i, 'comm/dp.grad/inter_MB': 0.5 * i}, step=i)\n"
            "r.summary.update({'tokens_per_s': 123.0, 'breakdown': {'codec_s': 0.1}})\n"
            "r.finish()\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120,
                   env={**os.environ, "WANDB_SILENT": "true"})
    runs = sweep.index_wandb_runs(tmp_path / "wandb")
    run = runs[("distopt", "zeropp@25mbit")]
    assert (run.group, run.config["policy"], run.config["rate"]) == ("smoke", "zeropp", "25mbit")
    assert [h["lm loss"] for h in run.history] == [5.0, 4.0, 3.0]
    assert [h["_step"] for h in run.history] == [1, 2, 3]
    assert run.history[-1]["comm/dp.grad/inter_MB"] == 1.5
    assert run.summary["tokens_per_s"] == 123.0 and run.summary["breakdown"] == {"codec_s": 0.1}


# ------------------------------------------------------------------ end to end (root, minutes)
@pytest.mark.slow
def test_smoke_sweep_end_to_end(tmp_path):
    from netemu import namespaces_available

    ok, why = namespaces_available()
    if not ok:
        pytest.skip(f"netemu cannot run here: {why}")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "sweep.py"), str(SWEEPS / "smoke.yaml"), "--local",
                           "--out-dir", str(tmp_path), "--timeout", "900"], capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_smoke_outputs(tmp_path)


def check_smoke_outputs(out_dir: Path) -> None:
    """What a finished smoke sweep leaves: table, plots, and one offline W&B run per point holding
    its config, per-interval history and summary (also run by hand on a sweep's out dir)."""
    for name in ("results.csv", "summary.csv", "summary.md", "throughput.png", "breakdown.png"):
        assert (out_dir / name).stat().st_size > 0, name
    table = (out_dir / "summary.md").read_text()
    assert "| 50mbit | zeropp |" in table and "| unshaped | megatron |" in table
    runs = sweep.index_wandb_runs(out_dir / "wandb")
    assert set(runs) == {("distopt", f"{p}@{r}") for p in ("megatron", "zeropp") for r in ("50mbit", "unshaped")}
    for (_, name), run in runs.items():
        policy, rate = name.split("@")
        assert (run.group, run.config["policy"], run.config["rate"], run.config["layout"]) == \
            ("smoke", policy, rate, "2x2")
        assert [h["_step"] for h in run.history] == [2, 4]
        assert all("lm loss" in h and "iteration-time" in h and "comm/dp.grad/inter_MB" in h for h in run.history)
        s = run.summary
        assert s["tokens_per_s"] > 0 and s["inter_bytes_per_iteration"] > 0
        assert s["nic_payload_bytes_per_iteration"] > 0.5 * s["inter_bytes_per_iteration"]
        assert json.dumps(s["breakdown"]) and s["traffic"]["dp.grad"]["inter_bytes"] > 0
