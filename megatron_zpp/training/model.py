"""The GPT the driver trains: Megatron-Core's ``GPTModel`` with Transformer Engine's or Megatron-Core's layers.

Why ``GPTModel`` although Megatron-Core 0.19 logs "GPTModel IS DEPRECATED ... use HybridModel" when one
is built: the driver follows the class that ``megatron.training``'s GPT path builds in the pinned version,
and in megatron-core 0.19.2 that is still ``GPTModel`` (``gpt_config_from_args`` -> ``GPTModelConfig`` ->
``GPTModelBuilder.build_model`` -> ``GPTModel``; Megatron-LM's ``pretrain_gpt.py`` at ``core_v0.19.0`` does the
same). ``HybridModel`` is built only by ``pretrain_hybrid.py`` / ``--hybrid-layer-pattern``. Its constructor
accepts what this GPT needs (pattern ``*-`` per layer, learned absolute positions, tied embeddings, TP/SP,
PP through the pattern's ``|``, Megatron-FSDP), but in 0.19.2 it cannot be built without Transformer Engine:
the shipped stack (``hybrid_stack_spec``) is TE modules, and ``HybridStack`` creates its final norm as
``TENorm`` whatever the spec (``hybrid_block.py``), which raises "Transformer Engine is not installed" on this
CPU path even with Megatron-Core's local attention and MLP specs (tried). Its checkpoints also use other
keys (``decoder.final_norm``, one layer index per sublayer), and the migration guide
(``docs/user-guide/hybrid-model-migration.md``) says its declarative builder rejects virtual pipeline
stages. The warning says nothing a user of this driver can act on, so it is silenced with that reason
(``megatron_zpp/training/quiet.py``). See docs/megatron-lm.md, "GPTModel, not HybridModel".
"""

from __future__ import annotations

import argparse
import importlib

import torch

from megatron_zpp.policy import ConfigError
from megatron_zpp.training.arguments import TE_INSTALL
from megatron_zpp.training.moe import moe_config_kwargs

# Megatron-LM turns these on by default; each needs a GPU, some also a library (checked by import).
FUSIONS = ("gradient_accumulation_fusion", "bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
           "persist_layer_norm", "apply_rope_fusion")


def _importable(*modules: str) -> bool:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            return False
    return True


def transformer_engine_available() -> bool:
    """Megatron-Core's own test (``megatron.core.extensions.transformer_engine.HAVE_TE``)."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def resolve_transformer_impl(args: argparse.Namespace, *, cuda: bool, te: bool, tp_compressed: bool) -> tuple[str, str]:
    """The layer implementation to build, and a line saying why when it is not what Megatron-LM would use.

    Megatron-LM's default is Transformer Engine. Without TE or a GPU, or with a ``tp`` codec (TE's layers
    run their own tensor-parallel collectives, which the ``--zpp-tp`` hooks do not see), the default
    becomes ``local`` with one log line; an explicit ``--transformer-impl transformer_engine`` is an error.
    """
    if args.transformer_impl != "transformer_engine":
        return args.transformer_impl, ""
    reason = ""
    if not te:
        reason = f"Transformer Engine is not installed (on a CUDA machine: {TE_INSTALL})"
    elif not cuda:
        reason = "Transformer Engine's layers need a GPU and this machine has none"
    elif tp_compressed:
        reason = ("the --zpp-tp codec compresses Megatron-Core's tensor-parallel collectives, and Transformer "
                  "Engine's layers issue their own")
    if not reason:
        return "transformer_engine", ""
    if args.transformer_impl_explicit:
        raise ConfigError(f"--transformer-impl transformer_engine: {reason}; or use --transformer-impl local")
    return "local", f"> --transformer-impl local (Megatron-LM's default is transformer_engine): {reason}"


def optimizer_fallback_note(cuda: bool) -> str:
    """On a GPU without Transformer Engine or Apex: one line saying Megatron-Core's optimizer falls back to torch's
    (it replaces Megatron-Core's per-module, per-rank warnings, silenced in ``quiet.py``); else ``""``."""
    if not cuda:
        return ""  # neither library runs without a GPU: nothing to act on
    from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER

    if not USING_PYTORCH_OPTIMIZER:
        return ""
    return (f"> Transformer Engine and Apex are not installed: Megatron-Core uses torch's AdamW and multi-tensor "
            f"fallbacks, slower on a GPU ({TE_INSTALL})")


def resolve_fusions(args: argparse.Namespace, impl: str, *, cuda: bool) -> tuple[dict[str, bool], dict[str, str]]:
    """Megatron-LM's default-on fusions, on where they can run; returns them and why each requested one is off.

    Without a GPU all are off (the CPU path computes exactly what it did before these flags existed).
    """
    requested = {
        "gradient_accumulation_fusion": args.gradient_accumulation_fusion,
        "bias_activation_fusion": args.bias_gelu_fusion,
        "masked_softmax_fusion": args.masked_softmax_fusion,
        "bias_dropout_fusion": args.bias_dropout_fusion,
        "persist_layer_norm": not args.no_persist_layer_norm,
        "apply_rope_fusion": False,  # rotary only; this GPT has learned absolute positions (as Megatron-LM sets it)
    }
    te = impl == "transformer_engine"
    needs = {
        # Megatron-Core's own ColumnParallelLinear (the output layer, with TE too) calls apex's kernel.
        "gradient_accumulation_fusion": ("apex's fused_weight_gradient_mlp_cuda",
                                         _importable("fused_weight_gradient_mlp_cuda")),
        "bias_activation_fusion": ("", True),
        "masked_softmax_fusion": ("apex's scaled_masked_softmax_cuda kernels",
                                  te or _importable("scaled_masked_softmax_cuda",
                                                    "scaled_upper_triang_masked_softmax_cuda")),
        "bias_dropout_fusion": ("", True),
        # Megatron-Core's torch LayerNorm fallback refuses persist_layer_norm; TE's norm and apex's accept it.
        "persist_layer_norm": ("apex", te or _importable("apex")),
    }
    fusions, off = {}, {}
    for name, wanted in requested.items():
        library, present = needs.get(name, ("", True))
        fusions[name] = bool(wanted and cuda and present)
        if wanted and not fusions[name]:
            off[name] = "no GPU" if not cuda else f"needs {library}"
    return fusions, off


def _moe_block_spec(config, impl: str, args: argparse.Namespace, vp_stage: int | None):
    """The decoder block of a MoE GPT for one (virtual) pipeline stage, as Megatron-LM's GPT builder makes it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.enums import AttnBackend

    te = impl == "transformer_engine"
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization=config.normalization,
                                       vp_stage=vp_stage)
    if te and args.attention_backend == AttnBackend.local:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = DotProductAttention
    return block


def build_model(args: argparse.Namespace, device: torch.device, impl: str, fusions: dict[str, bool]):
    """The model chunks (one per virtual pipeline stage) and their ``TransformerConfig``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, sequence_parallel=args.sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16, fp16=args.fp16,
        use_cpu_initialization=device.type == "cpu", init_method_std=args.init_method_std,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, transformer_impl=impl,
        attention_backend=args.attention_backend, **fusions,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        batch_p2p_comm=not args.overlap_p2p_comm, overlap_p2p_comm=args.overlap_p2p_comm,
        **moe_config_kwargs(args))
    if args.num_experts is not None:
        # MoE: Megatron-LM's GPT builder's block spec (dense and MoE layers by --moe-layer-freq), per stage below.
        spec = None
    elif impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec()
        if args.attention_backend == AttnBackend.local:
            # As megatron.training's GPTModelBuilder: TE's layers around Megatron-Core's attention core.
            from megatron.core.transformer.dot_product_attention import DotProductAttention

            spec.submodules.self_attention.submodules.core_attention = DotProductAttention
    else:
        spec = get_gpt_layer_local_spec()
    padded_vocab = args.padded_vocab_size  # the tokenizer's vocabulary, padded as Megatron-LM (trainer)
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):  # one chunk per virtual pipeline stage (interleaved schedule)
        stage = vp_stage if vpp else None
        layer_spec = spec if spec is not None else _moe_block_spec(config, impl, args, stage)
        model = GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=padded_vocab,
                         max_sequence_length=args.max_position_embeddings,
                         pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=not vpp, vp_stage=stage),
                         post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=not vpp, vp_stage=stage),
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                         position_embedding_type="learned_absolute", vp_stage=stage)
        if device.type == "cuda":
            model.cuda(device)
        if args.bf16 or args.fp16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)  # 16-bit weights and activations, fp32 logits (as Megatron-LM)
        chunks.append(model)
    return config, chunks
