# One process, world 1 (gloo): pretrain twice; who keeps the first model alive?
import gc, os, sys, types
sys.path.insert(0, "/work/main/tools"); sys.path.insert(0, "/work/main")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
import bench_training
from megatron_zpp.training.trainer import pretrain
import torch, torch.nn as nn
args = bench_training.MODEL_ARGS + ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "4",
                                    "--log-interval", "2", "--use-distributed-optimizer"] + bench_training.policy_flags("zeropp", 1)
pretrain(args, log=lambda *a, **k: None)
gc.collect()
mods = [o for o in gc.get_objects() if isinstance(o, nn.Module) and type(o).__name__ in ("GPTModel", "DistributedDataParallel")]
print("alive after run 1:", [type(m).__name__ for m in mods], flush=True)
if mods:
    target = [m for m in mods if type(m).__name__ == "DistributedDataParallel"] or mods
    tgt = id(target[0])
    if os.environ.get("CLEAR_ACCS"):
        for m in target:
            print("grad_accs:", len(getattr(m, "grad_accs", [])), flush=True)
            m.grad_accs.clear()
    del mods, target
    gc.collect()
    left = [type(o).__name__ for o in gc.get_objects() if isinstance(o, nn.Module) and type(o).__name__ in ("GPTModel", "DistributedDataParallel")]
    print("alive after clearing:", left, flush=True)
    # forward BFS from sys.modules and thread frames, with parents
    from collections import deque
    roots = [sys.modules]
    for fr in sys._current_frames().values():
        roots.append(fr)
    parent = {id(r): None for r in roots}
    objs = {id(r): r for r in roots}
    q = deque(roots)
    found = None
    while q:
        o = q.popleft()
        if id(o) == tgt:
            found = o; break
        for r in gc.get_referents(o):
            if id(r) not in parent and not isinstance(r, (int, float, str, bytes)):
                parent[id(r)] = id(o); objs[id(r)] = r; q.append(r)
    if found is None:
        print("DDP not reachable from sys.modules or frames: held from C", flush=True)
    else:
        chain = []
        i = tgt
        while i is not None:
            o = objs[i]
            d = type(o).__name__
            if isinstance(o, types.ModuleType): d += "<" + o.__name__ + ">"
            if isinstance(o, types.FunctionType): d += "<" + o.__qualname__ + ">"
            if isinstance(o, dict):
                d += "{" + ",".join(str(k)[:30] for k in list(o)[:3]) + "}"
            chain.append(d)
            i = parent[i]
        print("PATH:", " <- ".join(chain[:25]), flush=True)
# direct referrers of the DDP and GPTModel, by type (excluding frames and this module's dict)
ddp = [o for o in gc.get_objects() if isinstance(o, nn.Module) and type(o).__name__ == "DistributedDataParallel"]
for d in ddp[:1]:
    for r in gc.get_referrers(d):
        if isinstance(r, types.FrameType) or r is ddp or r is globals():
            continue
        desc = type(r).__name__
        if isinstance(r, dict):
            keys = [k for k, v in r.items() if v is d][:3]
            owners = [type(o).__name__ for o in gc.get_referrers(r) if not isinstance(o, types.FrameType)][:3]
            desc += f" keys={keys} owners={owners}"
        if type(r).__name__ == "cell":
            fns = [getattr(f, "__qualname__", type(f).__name__) for f in gc.get_referrers(r) if not isinstance(f, types.FrameType)][:3]
            fns2 = []
            for f in gc.get_referrers(r):
                if isinstance(f, tuple):
                    fns2 += [getattr(g, "__qualname__", type(g).__name__) for g in gc.get_referrers(f) if not isinstance(g, types.FrameType)][:2]
            desc += f" in {fns} {fns2[:3]}"
        if isinstance(r, types.MethodType):
            desc += f" {r.__func__.__qualname__}"
        print("REF", desc[:300], flush=True)
