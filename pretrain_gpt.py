"""Pretrain a GPT on Megatron-Core with megatron_zpp communication compression.

Megatron-LM's flag names plus ``--zpp-*``; see ``python pretrain_gpt.py --help``. Launch with torchrun:

    torchrun --nproc-per-node 4 pretrain_gpt.py --use-distributed-optimizer --zpp-policy zeropp \\
        --zpp-ranks-per-node 2 --train-iters 50

Without a GPU it runs on CPU processes with gloo (the CPU shim is applied automatically).
"""

import sys

from megatron_zpp.training.trainer import pretrain

if __name__ == "__main__":
    pretrain(sys.argv[1:])
