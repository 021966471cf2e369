"""Per-rank body of the plugin test: Megatron-LM's own ``megatron.training.pretrain()`` with the plugin.

The wheel ships ``megatron.training`` but not Megatron-LM's ``pretrain_gpt.py``, so the dataset
provider and forward step here are this test's own, with the same contract (``--mock-data``:
Megatron-Core's ``MockGPTDataset`` through ``BlendedMegatronDatasetBuilder``). What it takes to run
``megatron.training`` on CPU, on top of ``megatron_zpp.megatron.cpu_shim`` (which ``megatron.core``
needs), is in :func:`megatron_training_on_cpu`.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

LOSSES: list[tuple[float, int]] = []  # (summed token loss, tokens) of every micro-batch on this rank


def megatron_training_on_cpu() -> None:
    """Test-only patches for ``megatron.training`` 0.19 on a machine without a GPU (no source edits).

    - ``pretrain()`` calls ``initialize_megatron()`` without ``allow_no_cuda``: assert "Megatron requires
      CUDA". It is called with ``allow_no_cuda=True``.
    - ``_initialize_distributed`` creates the model-parallel groups only when ``torch.cuda.device_count()
      > 0``: it reports one device (which the CPU shim maps to the CPU).
    - rank 0 runs ``make`` in ``megatron/core/datasets`` to build the dataset helpers; the wheel ships
      them compiled but no Makefile, so ``make`` fails and Megatron calls ``sys.exit(1)``. The build is
      skipped (this one applies on GPUs too, to the pip-installed package without a Megatron-LM checkout).
    """
    from megatron_zpp.megatron.cpu_shim import install_cpu_shim

    install_cpu_shim()
    torch.cuda.device_count = lambda: 1
    import megatron.core.datasets.utils as dataset_utils
    import megatron.training.training as training
    from megatron.training.initialize import initialize_megatron

    dataset_utils.compile_helpers = lambda: None
    training.initialize_megatron = partial(initialize_megatron, allow_no_cuda=True)


def _datasets(num_samples, vp_stage=None):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, split="1,1,1",
                              tokenizer=get_tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config).build()


_datasets.is_distributed = True  # every rank builds its datasets (Megatron-LM's pretrain_gpt.py sets the same)


def _loss(loss_mask, output):
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output.float().view(-1) * mask)
    tokens = mask.sum().to(torch.int)
    LOSSES.append((float(loss), int(tokens)))
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.float().view(1)])}


def _forward_step(data_iterator, model, return_schedule_plan=False):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss, batch["loss_mask"])


def megatron_lm_pretrain(argv: list[str], plugin: bool) -> dict:
    """Parse ``argv`` with Megatron-LM's parser plus ``--zpp-*``, install the plugin (when ``plugin``) as the
    docs/megatron-lm.md tells users to, and run ``megatron.training.pretrain``; the micro-batch losses and bytes."""
    megatron_training_on_cpu()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_zpp.comm import comm_stats
    from megatron_zpp.megatron import install_from_args, zpp_extra_args_provider

    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_and_validate_args(extra_args_provider=zpp_extra_args_provider,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    hooks = install_from_args(args) if plugin else None
    comm_stats().reset()
    try:
        config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(config, _datasets, ModelType.encoder_or_decoder, _forward_step)
    finally:
        if hooks is not None:
            hooks.uninstall()
    traffic = {tag: {"inter_ratio": s.inter_ratio, "inter_bytes": s.inter_bytes}
               for tag, s in comm_stats().snapshot().items()}
    return {"losses": list(LOSSES), "traffic": traffic, "curr_iteration": args.curr_iteration,
            "policy": hooks.policy.to_dict() if hooks is not None else None}
