"""Pretrain a GPT on Megatron-Core with megatron_zpp communication compression.

Megatron-LM's flag names plus ``--zpp-*``; see ``python pretrain_gpt.py --help``. Launch with torchrun:

    torchrun --nproc-per-node 4 pretrain_gpt.py --use-distributed-optimizer --zpp-policy zeropp \\
        --zpp-ranks-per-node 2 --train-iters 50

Without a GPU it runs on CPU processes with gloo (the CPU shim is applied automatically).
"""

import os
import sys
import traceback

from megatron_zpp.training.trainer import pretrain
from megatron_zpp.training.watchdog import EXIT_CODE, RankFailureError, stop_child_processes

if __name__ == "__main__":
    try:
        pretrain(sys.argv[1:])
    except RankFailureError:
        # Another rank died or hung (the message names it): exit now. The interpreter's own shutdown would
        # join communication and checkpoint-writer threads that wait on the dead peer, for seconds or minutes.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        stop_child_processes()
        os._exit(EXIT_CODE)
