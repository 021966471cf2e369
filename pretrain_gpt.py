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
    except RankFailureError as e:
        # Another rank died, hung or failed a step (the message names it), or this rank failed a step and its
        # peers were told (agreement.py): exit now. The interpreter's own shutdown would join communication and
        # checkpoint-writer threads that wait on a dead peer, for seconds or minutes. 75 (EX_TEMPFAIL) where
        # another rank failed, 1 on the rank whose own step failed.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        stop_child_processes()
        os._exit(getattr(e, "exit_code", EXIT_CODE))
