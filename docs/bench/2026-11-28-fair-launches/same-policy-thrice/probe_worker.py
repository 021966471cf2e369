import gc, os, sys, threading, resource
sys.path.insert(0, "/work/main/tools"); sys.path.insert(0, "/work/main")
import bench_training
import megatron_zpp.training.trainer as T
orig = T.pretrain
def pretrain(*a, **k):
    r = orig(*a, **k)
    if os.environ.get("PROBE_DESTROY"):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        default = c10d._get_default_group()
        for pg in list(c10d._world.pg_map):
            if pg is not default:
                dist.destroy_process_group(pg)
        import megatron_zpp.comm.topology as topo
        topo._GROUP_CACHE.clear()
    gc.collect()
    import torch.distributed as dist
    ntask = len(os.listdir("/proc/self/task"))
    import collections
    names = collections.Counter(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    from torch.distributed import distributed_c10d as c10d
    print(f"PROBE names rank {os.environ.get('RANK')}: {dict(names)} pgs {len(c10d._world.pg_map)}", flush=True)
    # who holds tensors
    import torch
    big = collections.Counter()
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            big[tuple(o.shape)[:2]] += 1
    if os.environ.get("RANK") == "0":
        import torch.nn as nn, types
        mods = [o for o in gc.get_objects() if isinstance(o, nn.Module) and type(o).__name__ in ("GPTModel", "DistributedDataParallel", "FullyShardedDataParallel")]
        print("PROBE modules:", [type(m).__name__ for m in mods], flush=True)
        if mods:
            seen = set(); frontier = [(mods[0], type(mods[0]).__name__)]
            for depth in range(6):
                nxt = []
                for obj, path in frontier:
                    for r in gc.get_referrers(obj):
                        if id(r) in seen or r is frontier or isinstance(r, types.FrameType) or r is mods: continue
                        seen.add(id(r))
                        desc = type(r).__name__
                        if isinstance(r, dict):
                            keys = [k for k, v in r.items() if v is obj][:2]
                            desc += f"{keys}"
                        if isinstance(r, types.ModuleType): desc += f"<{r.__name__}>"
                        if isinstance(r, types.FunctionType): desc += f"<{r.__qualname__}>"
                        nxt.append((r, path + " <- " + desc))
                frontier = nxt[:30]
                for _, pth in frontier[:12]:
                    print("PROBE ref", depth, pth[-300:], flush=True)
    print(f"PROBE tensors rank {os.environ.get('RANK')}: {big.most_common(8)}", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    import torch
    nt = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
    print(f"PROBE rank {os.environ.get('RANK')}: os threads {ntask}, py threads {threading.active_count()}, "
          f"gc objects {len(gc.get_objects())}, tensors {nt}, maxrss {rss} MB", flush=True)
    return r
T.pretrain = pretrain
sys.exit(bench_training.main(sys.argv[1:]))
