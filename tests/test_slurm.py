"""The SLURM script's --dry-run prints the launch it would run, for 1, 2 and 4 nodes."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm" / "pretrain_gpt.sbatch"


def _fake_scontrol(tmp_path: Path) -> Path:
    """`scontrol show hostnames` expands a node list; a stand-in prints node names."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text('#!/bin/bash\n# usage: scontrol show hostnames LIST ("gpu[01-04]" style, expanded)\n'
                    'list="$3"; prefix="${list%%[*}"; range="${list#*[}"; range="${range%]}"\n'
                    'if [[ "$list" == "$prefix" ]]; then echo "$list"; exit 0; fi\n'
                    'for i in $(seq -w ${range%-*} ${range#*-}); do echo "$prefix$i"; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return bin_dir


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_dry_run_prints_the_launch(tmp_path, nodes):
    nodelist = "gpu01" if nodes == 1 else f"gpu[01-{nodes:02d}]"
    env = dict(os.environ, SLURM_JOB_NUM_NODES=str(nodes), SLURM_GPUS_ON_NODE="8", SLURM_JOB_NODELIST=nodelist,
               SLURM_JOB_ID="4242", PATH=f"{_fake_scontrol(tmp_path)}:{os.environ['PATH']}")
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--zpp-policy", "zeropp", "--use-megatron-fsdp"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert f"nodes={nodes} gpus_per_node=8 world_size={8 * nodes} head=gpu01" in out
    launch = out.splitlines()[-1]
    assert launch.startswith("srun --ntasks-per-node=1 ")
    for piece in (f"--nnodes {nodes}", "--nproc-per-node 8", "--rdzv-backend c10d", "--rdzv-endpoint gpu01:29500",
                  "--rdzv-id 4242", "pretrain_gpt.py", "--distributed-backend nccl", "--zpp-ranks-per-node 8",
                  "--zpp-policy zeropp --use-megatron-fsdp"):
        assert piece in launch, (piece, launch)
    assert "--dry-run" not in launch
