import sys
from pathlib import Path
sys.path.insert(0, "/work/main/tools"); sys.path.insert(0, "/work/main")
import bench_training
from netemu import EmulatedCluster, NetemuConfig
pols = sys.argv[1].split(",")
rate = sys.argv[2]
out = Path(sys.argv[3]); out.mkdir(parents=True, exist_ok=True)
with EmulatedCluster(NetemuConfig(nodes=2, ranks_per_node=2)) as c:
    bench_training.launch(c, "distopt", rate, pols, iters=16, log_interval=2, log_dir=out,
                          model_extra=["--micro-batch-size", "1", "--global-batch-size", "4"])
