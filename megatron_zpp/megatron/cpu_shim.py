"""Run Megatron-Core on CPU with gloo: the shim for machines without a GPU.

Megatron-Core's training path assumes CUDA in a handful of places (the model-parallel
RNG tracker, ``device=torch.cuda.current_device()`` allocations, stream objects, a
``Tensor.type()`` check in the distributed optimizer, torch norms refusing sequence
parallelism). None of it is needed for the math, so on a machine without a GPU this
module redirects it to the CPU. It is applied only when ``torch.cuda.is_available()`` is
false, by ``pretrain_gpt.py`` and the tests; the GPU path never imports it.

What it does (see ../shared/notes/megatron.md, section 8, for each failure it answers):

- RNG: ``torch.cuda`` RNG calls and Megatron's ``_get/_set_cuda_rng_state`` use the CPU
  generator, so the RNG tracker (dropout in model-parallel regions) works.
- Devices: a global ``TorchFunctionMode`` maps ``device="cuda"`` / ``cuda:N`` / ordinals to
  the CPU in every torch call, ``.cuda()`` is a no-op, ``.to("cuda")`` stays on the CPU.
- Streams and events are inert objects; ``synchronize``/``set_device``/``empty_cache`` are no-ops.
- ``Tensor.type()`` reports ``torch.cuda.*Tensor`` (the distributed optimizer's dtype check).
- ``WrappedTorchNorm`` builds torch norms with sequence parallelism allowed (their params are
  marked ``sequence_parallel`` so ``finalize_model_grads`` all-reduces them over TP).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


def _to_cpu_device(device):
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str):
        return "cpu" if device.startswith("cuda") else device
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    return device


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device, int)) \
                and not isinstance(args[1], bool):
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        if func is torch.autograd.backward or func is torch.Tensor.backward:
            return _backward_with_mode(self, func, args, kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return func(*args, **kwargs)


def _backward_with_mode(mode: TorchFunctionMode, func, args, kwargs):
    """Run backward with the mode active for the Python hooks and autograd functions it calls.

    A mode is switched off while its own handler runs, and calling ``torch.autograd.backward``
    again would re-enter the handler; so the engine is called directly, under the mode.
    Megatron allocates with ``device=torch.cuda.current_device()`` inside backward (sequence-
    parallel reduce-scatter buffers, Megatron-FSDP gradient buckets).
    """
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    if func is torch.Tensor.backward:
        tensor, *rest = args
        names = ("gradient", "retain_graph", "create_graph", "inputs")
        options = dict(zip(names, rest)) | kwargs
        tensors, grad_tensors = (tensor,), options.get("gradient")
    else:
        names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")
        options = dict(zip(names, args)) | kwargs
        tensors = options["tensors"]
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        grad_tensors = options.get("grad_tensors")
    create_graph = bool(options.get("create_graph", False))
    retain_graph = options.get("retain_graph")
    retain_graph = create_graph if retain_graph is None else retain_graph
    inputs = options.get("inputs")
    inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False)
    with mode:
        _engine_run_backward(tensors, grads, retain_graph, create_graph, inputs, allow_unreachable=True,
                             accumulate_grad=True)


class _InertStream:
    """Stands in for torch.cuda.Stream / Event: every method is a no-op returning another inert
    object (``stream.record_event().wait()`` works)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: _InertStream()

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


def install_cpu_shim() -> None:
    """Apply the shim (idempotent). Call before building any Megatron-Core object."""
    global _INSTALLED
    if _INSTALLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("install_cpu_shim() is for machines without a GPU; CUDA is available here")

    cpu_get = torch.get_rng_state
    cpu_set = torch.set_rng_state
    cuda = torch.cuda
    cuda.get_rng_state = lambda device="cuda": cpu_get()
    cuda.set_rng_state = lambda new_state, device="cuda": cpu_set(new_state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.random.manual_seed = cuda.manual_seed
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls it; the CPU seed is already set
    cuda.random.manual_seed_all = cuda.manual_seed_all
    cuda.current_device = lambda: 0  # an ordinal: Megatron-FSDP formats f"cuda:{idx}"
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _InertStream
    cuda.Event = _InertStream
    cuda.current_stream = lambda device=None: _InertStream()
    cuda.default_stream = lambda device=None: _InertStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()

    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: \
        cpu_get().clone() if clone else cpu_get()
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: cpu_set(new_state)

    from megatron.core.transformer import torch_norm

    def _norm(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
              normalization="LayerNorm"):
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(config.normalization)
        if norm_cls is None:
            raise ValueError(f"normalization={config.normalization!r}; the CPU shim supports LayerNorm, RMSNorm")
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = _norm
    _install_moe_fixes()
    _CudaToCpuMode().__enter__()  # process-wide for the main thread, never exited
    _INSTALLED = True


def _install_moe_fixes() -> None:
    """Megatron-Core's MoE token dispatcher on the CPU.

    The alltoall dispatcher computes its split sizes on the device and copies them to the host as numpy arrays
    (``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)``), which it does only for CUDA tensors: on the CPU
    they stayed tensors and reached ``all_to_all_single`` and ``sum()`` as such. Here a CPU tensor asked for as
    numpy becomes numpy, what the GPU path gets.
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    # Megatron-Core's own layers (the local spec) with expert parallelism 1: an expert's linear_fc2 returns the
    # output of _ReduceFromModelParallelRegion, which over a group of one is its input as-is, and the expert MLP
    # then adds the bias in place (``output += output_bias * per_token_scale``), which autograd forbids ("is a
    # view and is being modified inplace"). Not CPU-specific: on a GPU the same layers fail the same way, and
    # the driver refuses that combination there (megatron_zpp/training/moe.py); with Transformer Engine's layers
    # it does not arise. Here the expert's output is a fresh tensor (an exact copy).
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    row_forward = RowParallelLinear.forward

    def forward(self, *args, **kwargs):
        output, bias = row_forward(self, *args, **kwargs)
        if self.is_expert and not self.explicit_expert_comm:
            output = output.clone()
        return output, bias

    RowParallelLinear.forward = forward


def cpu_shim_installed() -> bool:
    return _INSTALLED
