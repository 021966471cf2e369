"""Distributed checkpoints for ``--save`` / ``--load``: Megatron-Core's ``dist_checkpointing``, made atomic and
verified.

Format (``--ckpt-format``, Megatron-LM's flag and names):

- ``torch_dist`` (the default; distributed optimizer or plain DDP): ``megatron.core.dist_checkpointing`` with the
  model's and the optimizer's ``sharded_state_dict``. Tensors are stored by their global shape and offsets, so a
  checkpoint saved on one layout loads on another (DP, TP and PP sizes may all change) as long as the optimizer
  state was saved ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``); Megatron-LM's default,
  ``dp_reshardable``, stores the distributed optimizer's flat buffers and reshards across DP only.
- ``fsdp_dtensor`` (Megatron-FSDP, which Megatron-LM also requires it for): PyTorch DCP over the DTensors that
  Megatron-FSDP's model and optimizer state dicts hold; DCP reshards them on load.

A checkpoint ``DIR/iter_NNNNNNN/`` holds, beside Megatron's files:

- ``zpp_rank_state/rank_RRRRR.pt``: per-rank state that does not reshard: the RNG states and the compression
  state (error-feedback residuals by bucket) with the layout they belong to. They are restored only when the
  layout is unchanged; on another layout the RNGs are re-seeded from ``--seed`` and the iteration, and the
  residuals restart from zero (what error feedback does at step 0), both said in the log. The dp.grad schedule
  position is the iteration itself, and hpZ's secondary copies are rebuilt on first use after a load.
- ``zpp_manifest.json``: size and SHA-256 of every file, written last. A load checks them all first, so a
  truncated or corrupted file is named in the error instead of failing deep inside DCP (or loading wrong bytes).

Atomic saves: every rank writes into ``iter_NNNNNNN.partial/``; the ranks agree that each one wrote its
share, rank 0 writes the manifest, every rank verifies its share of the files against it, the ranks agree
again, and only then rank 0 renames the directory into place and points ``latest_checkpointed_iteration.txt``
(Megatron-LM's tracker file, replaced atomically) at it. A step that fails on one rank is the same error on
every rank (``agreement.py``) and the ``.partial`` directory is removed: a checkpoint is complete and verified,
or absent. A save killed midway (SIGKILL) leaves the tracker on the previous checkpoint, which stays
loadable; its stale ``.partial`` directory is removed by the next save. A load agrees likewise before any rank
uses what it read.

No arbitrary unpickling: tensors and the RNG/compression state load with ``torch.load(weights_only=True)``
(torch's and Megatron's defaults), and DCP's ``.metadata`` pickle is first read by a restricted unpickler that
admits only DCP's metadata classes and plain values; anything else is refused with an error naming it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_zpp.training import faults
from megatron_zpp.training.agreement import Agreement, mark_agreed

CKPT_FORMATS = ("torch_dist", "fsdp_dtensor")
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name
MANIFEST = "zpp_manifest.json"
RANK_STATE = "zpp_rank_state"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, truncated, corrupted, or of another kind."""


class CheckpointLoadError(CheckpointError):
    """``--load`` names a checkpoint this run cannot load (missing, of another format, vocabulary padding or
    optimizer layout, failing verification). Raised as agreed (``agreement.mark_agreed``) once every rank found
    it, so ``pretrain_gpt.py`` says it once, from rank 0, as a user error; a save that fails verification stays a
    :class:`CheckpointError`, printed by every rank."""


# ---------------------------------------------------------------------------------------------------- helpers
def _die_like_a_lost_node() -> None:
    """SIGKILL this rank and the helper processes it started (Megatron's checkpoint writer keeps a Manager
    server), as a lost node would; the helpers would otherwise outlive it."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def main_params(optimizer) -> list[torch.Tensor]:
    """The parameters the optimizer updates (fp32 main weights / this rank's shards), local views."""
    return [_local(p) for opt in _inner_optimizers(optimizer) for group in opt.optimizer.param_groups
            for p in group["params"]]


def is_fsdp(models) -> bool:
    model = models[0]
    return hasattr(model, "install_optimized_model_weights") or \
        hasattr(getattr(model, "module", None), "install_optimized_model_weights")


def _layout(args) -> dict:
    """What per-rank state depends on: the parallel layout, this rank's place in it, and what shapes the
    compression state (buckets, simulated nodes, the dp.grad codec)."""
    from megatron.core import parallel_state as ps

    layout = {"world_size": dist.get_world_size(), "rank": dist.get_rank(),
              "tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
              "dp": ps.get_data_parallel_world_size(), "vpp": args.virtual_pipeline_model_parallel_size,
              "ddp_bucket_size": args.ddp_bucket_size, "zpp_ranks_per_node": getattr(args, "zpp_ranks_per_node", None),
              "zpp_dp_grad": str(getattr(args, "zpp_dp_grad", None)), "zpp_policy": getattr(args, "zpp_policy", None)}
    if getattr(args, "num_experts", None) is not None:  # (dense layouts keep the keys they always had)
        # MoE: expert buckets (and their error-feedback residuals) follow the expert layout
        layout.update(num_experts=args.num_experts, ep=args.expert_model_parallel_size,
                      etp=args.expert_tensor_parallel_size)
    return layout


def _padded_vocab(models) -> int:
    from megatron.core.utils import unwrap_model

    model = unwrap_model(models)[0]
    while not hasattr(model, "vocab_size") and hasattr(model, "module"):  # Megatron-FSDP's inner wrapper
        model = model.module
    return int(model.vocab_size)


def _model_key(models, i: int) -> str:
    return "model" if len(models) == 1 else f"model{i}"  # Megatron-LM's keys, one per virtual stage


def _sharded_metadata(args) -> dict:
    """Megatron-LM's content metadata for ``sharded_state_dict`` (``_build_sharded_state_dict_metadata``)."""
    from megatron.core import parallel_state as ps

    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    if args.use_megatron_fsdp:
        metadata["distrib_optim_sharding_type"] = "fsdp_dtensor"
    elif args.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = (
            "fully_reshardable" if args.dist_ckpt_optim_fully_reshardable else "dp_reshardable")
    return metadata


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(),
             "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _reseed(seed: int, iteration: int) -> None:
    """On another layout the saved RNG streams have no owner: start fresh, deterministic ones."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed + iteration)
    tensor_parallel.model_parallel_cuda_manual_seed(seed + iteration)


def _materialize_adam_state(optimizer) -> None:
    """Give every parameter of a ``torch.optim.Adam`` its state (``step`` and zero moments) where it has none.

    torch's Adam creates state lazily at a parameter's first gradient, so a fresh optimizer (before a load) has
    none, and under Megatron-FSDP a rank whose shard of a parameter is empty never gets any. Megatron's
    ``init_state_fn`` creates the moments but not ``step``, which the distributed optimizer's ``state_dict`` reads
    when neither Transformer Engine's nor apex's fused Adam is installed (this CPU path, or a GPU without them),
    and Megatron-FSDP's DTensor checkpoint needs the same keys on every rank (its collectives run per key and
    hang otherwise). The step is the one the other parameters have (Megatron keeps them equal); a load replaces
    all of it."""
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        steps = [float(st["step"]) for st in inner.state.values() if "step" in st]
        local_step = torch.tensor([max(steps) if steps else 0.0], dtype=torch.float64)
        if dist.is_initialized():
            # NCCL reduces CUDA tensors only; every rank holds the same chained optimizers, so this stays in step.
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            local_step = local_step.to(device)
            dist.all_reduce(local_step, op=dist.ReduceOp.MAX)
            local_step = local_step.cpu()
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["step"] = torch.tensor(float(local_step), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


@contextlib.contextmanager
def _adam_step_fix(optimizer):
    """Megatron-Core 0.19 without TE/apex (torch's Adam keeps a ``step`` per parameter): loading a ``fully_reshardable`` distributed-optimizer state looks up
    torch Adam's per-parameter ``step`` among the loaded tensors, which leave it out on purpose (it is restored
    from the param groups just before), and fails with ``KeyError: 'step'``. Marking it absent (``None``, which
    Megatron skips) keeps the restored step."""
    patched = []
    for opt in _inner_optimizers(optimizer):
        original = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if original is None:
            continue

        def set_states(model_param, tensors, _original=original):
            return _original(model_param, tensors if "step" in tensors else {**tensors, "step": None})

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class's method
    # The step count itself: Megatron keeps one for all parameters in the param groups (it asserts they agree);
    # the per-parameter tensors torch's Adam reads can come back as the zeros of the load template (seen at DP4).
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            if "step" in group:
                for p in group["params"]:
                    if "step" in inner.state[p]:
                        inner.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


# ------------------------------------------------------------------------------------------ sharded state
def _state_dict_for(args, models, optimizer, scheduler, *, loading: bool) -> dict:
    """Megatron-LM's checkpoint layout: ``model``/``modelN``, ``optimizer``, ``opt_param_scheduler``, ``iteration``."""
    from megatron.core.utils import unwrap_model

    metadata = _sharded_metadata(args)
    models = unwrap_model(models)  # keys without the DDP / Float16Module prefixes, as Megatron-LM saves them
    state: dict = {}
    if args.ckpt_format == "torch_dist":
        for i, model in enumerate(models):
            state[_model_key(models, i)] = model.sharded_state_dict(metadata=metadata)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
    else:  # fsdp_dtensor: plain state dicts of DTensors; DCP reshards them
        from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
            preprocess_state_dict_for_uneven_dtensor,
        )

        for i, model in enumerate(models):
            state[_model_key(models, i)] = model.state_dict()
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
        preprocess_state_dict_for_uneven_dtensor(state)
    return state


def _agreement_for(agreement: Agreement | None) -> Agreement:
    """The caller's agreement (the trainer's, which reaches blocked peers through the watchdog), else one of
    this call's (agreement by all-reduce only)."""
    if agreement is not None:
        return agreement
    return Agreement(device=torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                     else "cpu")


def save_checkpoint(args, iteration: int, models: list, optimizer, scheduler, hooks=None, *,
                    agreement: Agreement | None = None) -> Path:
    """Save iteration ``iteration`` under ``args.save`` (collective: every rank calls it); raise the same error on
    every rank when any rank fails, leaving no ``iter_NNNNNNN`` (nor ``.partial``) directory for it."""
    from megatron.core import dist_checkpointing

    agreement = _agreement_for(agreement)
    rank = dist.get_rank()
    root = Path(args.save)
    final = root / f"iter_{iteration:07d}"
    partial = root / f"iter_{iteration:07d}.partial"

    def discard() -> None:
        shutil.rmtree(partial, ignore_errors=True)

    with agreement.step("checkpoint save", local=True, on_failure=discard):
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if partial.exists():  # left by a save that was killed
                shutil.rmtree(partial)
            partial.mkdir()

    # The write is collective (DCP's planning and metadata exchange): a rank that fails inside publishes its
    # error (its peers may be blocked in one of those collectives); on success the ranks confirm.
    with agreement.step("checkpoint save", on_failure=discard):
        _materialize_adam_state(optimizer)
        state = _state_dict_for(args, models, optimizer, scheduler, loading=False)
        state["opt_param_scheduler"] = scheduler.state_dict()
        state["iteration"] = iteration
        if args.ckpt_format == "torch_dist":
            from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

            # The content metadata (the optimizer's sharding type) tells a later load how to read the state back.
            dist_checkpointing.save(state, str(partial), validate_access_integrity=True,
                                    content_metadata=_clean_metadata_for_serialization(_sharded_metadata(args)))
        else:
            import torch.distributed.checkpoint as dcp

            dcp.save(state, checkpoint_id=str(partial))

        rank_dir = partial / RANK_STATE
        rank_dir.mkdir(exist_ok=True)
        rank_state = {"layout": _layout(args), "rng": _rng_state(),
                      "compression": hooks.state_dict() if hooks is not None else {}}
        with (rank_dir / f"rank_{rank:05d}.pt").open("wb") as f:
            torch.save(rank_state, f)
            f.flush()
            os.fsync(f.fileno())
        faults.raise_if("save", iteration)

    if os.environ.get("ZPP_TEST_KILL_DURING_SAVE") == str(iteration) and rank == 0:
        _die_like_a_lost_node()  # tests: a kill after the data, before the commit

    # Every rank hashes its share of the files (rank 0 alone would keep the others at the barrier for as long
    # as hashing a large checkpoint takes, past collective timeouts).
    with agreement.step("checkpoint save", local=True, on_failure=discard):
        files = sorted(str(p.relative_to(partial)) for p in partial.rglob("*") if p.is_file())
        mine = {name: {"bytes": (partial / name).stat().st_size, "sha256": _file_digest(partial / name)}
                for name in files[rank::dist.get_world_size()]}
    shares: list = [None] * dist.get_world_size()
    dist.all_gather_object(shares, mine)
    with agreement.step("checkpoint save", local=True, on_failure=discard):
        if rank == 0:
            layout = _layout(args)
            manifest = {"format": args.ckpt_format, "iteration": iteration, "padded_vocab_size": _padded_vocab(models),
                        "layout": {k: v for k, v in layout.items() if k != "rank"},
                        "files": {name: entry for share in shares for name, entry in sorted(share.items())}}
            _write_atomically(partial / MANIFEST, json.dumps(manifest, indent=1))

    # What was written reads back as the manifest says, on every rank's share, before anything points at it.
    try:
        verify_checkpoint(partial, iteration=iteration)
    except Exception:
        if rank == 0:
            discard()  # every rank raises here (verification is agreed): nobody writes into it any more
        raise

    with agreement.step("checkpoint commit", local=True, on_failure=discard):
        if rank == 0:
            old = root / f"iter_{iteration:07d}.old"
            if old.exists():  # left by a save of this iteration that died between the two renames below
                shutil.rmtree(old)
            if final.exists():  # saving the same iteration again (a rerun): swap, then drop the old one
                final.rename(old)
            try:
                partial.rename(final)
            except BaseException:
                if old.exists() and not final.exists():
                    old.rename(final)  # the tracker may name this iteration: keep its verified copy in place
                raise
            _fsync_dir(root)
            _write_atomically(root / TRACKER, str(iteration))
            if old.exists():
                shutil.rmtree(old)
    return final


# -------------------------------------------------------------------------------------------------- load
def read_tracker(directory: str, flag: str = "--load") -> int:
    """The iteration ``directory``'s tracker names; errors name the directory as ``flag`` (the option it came
    from: ``--load``, or ``--save`` for the divergence guard's reload)."""
    root = Path(directory)
    tracker = root / TRACKER
    if not tracker.exists():
        raise CheckpointLoadError(f"{flag} {directory}: no {TRACKER}; nothing was saved there (or a save never "
                                  "finished)")
    text = tracker.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointLoadError(f"{flag} {directory}: {TRACKER} holds {text!r}, not an iteration number") from None


_ALLOWED_PICKLE_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                           "torch.distributed.checkpoint.filesystem", "torch.distributed._shard.sharded_tensor.metadata",
                           "torch.distributed._shard.metadata", "megatron.core.dist_checkpointing")
_ALLOWED_PICKLE_GLOBALS = {("torch", "Size"), ("torch", "float32"), ("torch", "float16"), ("torch", "bfloat16"),
                           ("torch", "float64"), ("torch", "int64"), ("torch", "int32"), ("torch", "uint8"),
                           ("torch", "int8"), ("torch", "bool"), ("torch", "strided"), ("torch", "contiguous_format"),
                           ("torch", "device"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                           ("collections", "OrderedDict"), ("builtins", "set"),
                           ("builtins", "frozenset"), ("builtins", "slice")}


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes and plain values only (DCP itself reads the file with ``pickle.load``)."""

    def find_class(self, module: str, name: str):
        # No dotted names: pickle would walk attributes from an allowed module to anything (e.g. ``os.system``).
        if "." not in name and (module.startswith(_ALLOWED_PICKLE_MODULES) or (module, name) in _ALLOWED_PICKLE_GLOBALS):
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to unpickle {module}.{name} from a checkpoint's DCP metadata "
                              "(only torch.distributed.checkpoint's metadata classes are allowed)")


@contextlib.contextmanager
def _safe_unpickling():
    """During a load, DCP's own reads go through the restricted unpickler (its ``.metadata``) and
    ``torch.load(weights_only=True)`` (its byte entries: Megatron's common state, sharded objects, the scheduler),
    where torch 2.15 uses plain ``pickle.load`` and ``weights_only=False``."""
    import types

    import torch.distributed.checkpoint.default_planner as planner_module
    import torch.distributed.checkpoint.filesystem as fs_module

    original_pickle, original_load_bytes = fs_module.pickle, planner_module.DefaultLoadPlanner.load_bytes

    def load_bytes(self, read_item, value):
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    fs_module.pickle = types.SimpleNamespace(load=lambda f: _DcpMetadataUnpickler(f).load(), dump=pickle.dump)
    planner_module.DefaultLoadPlanner.load_bytes = load_bytes
    try:
        yield
    finally:
        fs_module.pickle, planner_module.DefaultLoadPlanner.load_bytes = original_pickle, original_load_bytes


def _check_dcp_metadata(folder: Path) -> None:
    path = folder / ".metadata"
    if not path.exists():
        raise CheckpointError(f"{folder}: no .metadata file; not a torch_dist / fsdp_dtensor checkpoint")
    try:
        _DcpMetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated or garbled
        raise CheckpointError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})") from None


def verify_checkpoint(folder: Path, *, iteration: int | None = None) -> None:
    """Check every file against the manifest, spread over the ranks; raise the same :class:`CheckpointError` on
    every rank if any fails, naming the rank that found each problem. ``iteration``: of the save being verified
    (test fault injection)."""
    try:
        problems = _verify_share(folder, iteration)
    except Exception as e:  # noqa: BLE001 - this rank could not check its share: a problem, agreed below
        from megatron_zpp.training.agreement import describe

        problems = [f"{folder}: could not be verified ({describe(e)})"]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    finders: dict[str, list[int]] = {}  # problem -> the ranks that found it, in rank order
    for r, rank_problems in enumerate(gathered):
        for p in rank_problems:
            finders.setdefault(p, []).append(r)
    world = dist.get_world_size()
    found = [("every rank" if len(ranks) == world > 1 else
              f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}") + f": {p}"
             for p, ranks in finders.items()]
    if found:
        from megatron_zpp.training.agreement import mark_agreed

        error = CheckpointError("checkpoint failed verification: " + "; ".join(found))
        mark_agreed(error)
        raise error


def _verify_share(folder: Path, iteration: int | None) -> list[str]:
    """The problems this rank finds in its share of ``folder``'s files."""
    manifest_path = folder / MANIFEST
    problems: list[str] = []
    if not folder.is_dir():
        problems.append(f"{folder} does not exist")
    elif not manifest_path.exists():
        problems.append(f"{folder}: no {MANIFEST} (not saved by megatron_zpp, or its save did not finish)")
    else:
        try:
            files = json.loads(manifest_path.read_text())["files"]
        except (ValueError, KeyError) as e:
            files = {}
            problems.append(f"{manifest_path}: unreadable ({e})")
        rank, world = dist.get_rank(), dist.get_world_size()
        if iteration is not None:
            faults.corrupt_first_file([folder / name for name in sorted(files)[rank::world]], iteration)
        for name in sorted(files)[rank::world]:
            expected, path = files[name], folder / name
            if not path.exists():
                problems.append(f"{path} is missing")
            elif path.stat().st_size != expected["bytes"]:
                problems.append(f"{path} has {path.stat().st_size} bytes, the manifest says {expected['bytes']} "
                                "(truncated?)")
            elif _file_digest(path) != expected["sha256"]:
                problems.append(f"{path}: SHA-256 differs from the manifest (corrupted)")
        if rank == 0 and not problems:
            try:
                _check_dcp_metadata(folder)
            except CheckpointError as e:
                problems.append(str(e))
    return problems


def _load_sharded(args, folder: Path, state: dict, models, optimizer) -> dict:
    from megatron.core import dist_checkpointing

    if args.ckpt_format != "torch_dist":
        import torch.distributed.checkpoint as dcp

        dcp.load(state, checkpoint_id=str(folder))
        return state
    content = dist_checkpointing.load_content_metadata(str(folder)) or {}
    saved_sharding = content.get("distrib_optim_sharding_type")  # checked against this layout: _check_loadable
    if saved_sharding is not None:
        # Load in the format it was saved in (as Megatron-LM does); this run's sharding applies to saves.
        metadata = dict(_sharded_metadata(args), distrib_optim_sharding_type=saved_sharding)
        state["optimizer"] = optimizer.sharded_state_dict(
            {k: v for k, v in state.items() if k.startswith("model")}, is_loading=True, metadata=metadata)
    return dist_checkpointing.load(state, str(folder), validate_access_integrity=True)


def load_checkpoint(args, models: list, optimizer, scheduler, hooks=None, log=print, *,
                    agreement: Agreement | None = None) -> int:
    """Load the checkpoint ``args.load``'s tracker names (on any layout); return its iteration. Every rank agrees
    that each one found it, verified it and loaded it before any goes on (the same error on every rank else)."""
    agreement = _agreement_for(agreement)
    iteration = folder = None
    # Local reads first (a shared file system may show one rank something else), agreed before any collective.
    with agreement.step("checkpoint load", local=True):
        iteration = read_tracker(args.load)
        folder = Path(args.load) / f"iter_{iteration:07d}"
    _agree_on_iteration(args.load, iteration, agreement)
    try:
        verify_checkpoint(folder)
    except CheckpointError as e:  # agreed by every rank: a checkpoint this run cannot load
        error = CheckpointLoadError(f"--load {args.load}: {e}")
        mark_agreed(error)
        raise error from None
    with agreement.step("checkpoint load", local=True):
        _check_loadable(args, folder, models)
    # The read is collective (DCP); on success the ranks confirm before any uses it.
    with agreement.step("checkpoint load"):
        faults.raise_if("load", iteration)
        _load_into(args, folder, iteration, models, optimizer, scheduler, hooks, log)
    return iteration


def _agree_on_iteration(directory: str, iteration: int, agreement: Agreement) -> None:
    """Every rank read the same tracker (a shared file system with stale attribute caches may show ranks
    different ones after a restart: they would then load different folders)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    seen = torch.tensor([iteration, -iteration], dtype=torch.int64, device=agreement.device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    low, high = -int(seen[1].item()), int(seen[0].item())
    if low != high:
        error = CheckpointLoadError(f"--load {directory}: the ranks read different iterations from {TRACKER} "
                                f"({low} to {high}); a shared file system showing ranks different files?")
        mark_agreed(error)
        raise error


def _check_loadable(args, folder: Path, models) -> None:
    """What a load can tell from the manifest alone: the format, the vocabulary padding, the optimizer's
    sharding against this layout (the same answer on every rank)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    saved_format = manifest.get("format")
    if saved_format != args.ckpt_format:
        raise CheckpointLoadError(f"--load {args.load}: saved with --ckpt-format {saved_format}, this run uses "
                              f"{args.ckpt_format} (valid: {', '.join(CKPT_FORMATS)}; Megatron-FSDP needs fsdp_dtensor)")
    saved_vocab = manifest.get("padded_vocab_size")
    if saved_vocab is not None and saved_vocab != _padded_vocab(models):
        raise CheckpointLoadError(
            f"--load {args.load}: saved with a padded vocabulary of {saved_vocab} rows, this run pads to "
            f"{_padded_vocab(models)} (--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} x TP "
            f"{args.tensor_model_parallel_size}); the extra rows would change every softmax. Pick "
            "--make-vocab-size-divisible-by so that both layouts pad alike (e.g. a multiple of the larger TP)")
    if args.ckpt_format == "torch_dist":
        from megatron.core import dist_checkpointing

        content = dist_checkpointing.load_content_metadata(str(folder)) or {}
        if content.get("distrib_optim_sharding_type") == "dp_reshardable":
            saved = manifest.get("layout", {})
            now = _layout(args)
            if (saved.get("tp"), saved.get("pp")) != (now["tp"], now["pp"]):
                raise CheckpointLoadError(
                    f"--load {args.load}: the distributed optimizer was saved dp_reshardable at TP{saved.get('tp')} x "
                    f"PP{saved.get('pp')}, which reshards across data parallelism only; this run is TP{now['tp']} x "
                    f"PP{now['pp']}. Save with --dist-ckpt-optim-fully-reshardable to change TP/PP")


def _load_into(args, folder: Path, iteration: int, models, optimizer, scheduler, hooks, log) -> None:
    _materialize_adam_state(optimizer)
    state = _state_dict_for(args, models, optimizer, scheduler, loading=True)
    state["opt_param_scheduler"] = scheduler.state_dict()  # non-tensor entries come back in place
    try:
        with _safe_unpickling():
            loaded = _load_sharded(args, folder, state, models, optimizer)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointLoadError(f"--load {args.load}: loading {folder} failed ({type(e).__name__}: {e}); was it saved "
                              f"by another model configuration?") from e

    from megatron.core.utils import unwrap_model

    if args.ckpt_format == "torch_dist":
        for i, model in enumerate(unwrap_model(models)):
            model.load_state_dict(loaded[_model_key(models, i)])
        # no_grad: with fp32 weights the distributed optimizer's main parameters are views of the model's, which
        # autograd refuses to copy into (Megatron's dp_reshardable loader does not disable grad itself).
        with _adam_step_fix(optimizer), torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
    else:
        for i, model in enumerate(unwrap_model(models)):
            model.load_state_dict(loaded[_model_key(models, i)], strict=False)
        optimizer.load_state_dict(loaded["optimizer"])
        for model in models:  # model weights from the restored main weights
            target = model if hasattr(model, "install_optimized_model_weights") else model.module
            target.install_optimized_model_weights()

    scheduler.load_state_dict(loaded["opt_param_scheduler"])

    rank_path = folder / RANK_STATE / f"rank_{dist.get_rank():05d}.pt"
    rank_state = torch.load(rank_path, weights_only=True) if rank_path.exists() else None
    same_layout = rank_state is not None and rank_state["layout"] == _layout(args)
    if same_layout:
        _set_rng_state(rank_state["rng"])
        if hooks is not None:
            hooks.load_state_dict(rank_state["compression"])
    else:
        _reseed(args.seed, iteration)
        if dist.get_rank() == 0:
            saved = rank_state["layout"] if rank_state else "unknown"
            log(f"> checkpoint layout {saved} differs from this run's {_layout(args)}: weights, optimizer and scheduler "
                "resharded; RNG re-seeded from --seed and the iteration; error-feedback residuals (if any) restart "
                "from zero")

