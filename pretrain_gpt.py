"""Pretrain a GPT on Megatron-Core with megatron_zpp communication compression.

Megatron-LM's flag names plus ``--zpp-*``; see ``python pretrain_gpt.py --help``. Launch with torchrun:

    torchrun --nproc-per-node 4 pretrain_gpt.py --use-distributed-optimizer --zpp-policy zeropp \\
        --zpp-ranks-per-node 2 --train-iters 50

Without a GPU it runs on CPU processes with gloo (the CPU shim is applied automatically).

A configuration error (a bad flag value, policy or combination: ``ConfigError``) is one line from rank 0, and
every rank exits with 2, as argparse does for a bad flag. A ``--load`` checkpoint that cannot be loaded
(``CheckpointLoadError``: missing, of another format, vocabulary padding or optimizer layout, failing verification),
once every rank agreed on it, is likewise one line from rank 0, exit 66 (EX_NOINPUT) everywhere. Any other exception is a bug and keeps its traceback.
"""

import os
import sys
import traceback

# First, before anything imports Megatron-Core: some of its known-harmless warnings fire at import time.
from megatron_zpp.training.quiet import install_warning_filters, launch_rank

install_warning_filters()

from megatron_zpp.policy import ConfigError
from megatron_zpp.training.agreement import is_agreed
from megatron_zpp.training.checkpoint import CheckpointLoadError
from megatron_zpp.training.trainer import pretrain
from megatron_zpp.training.watchdog import EXIT_CODE, RankFailureError, stop_child_processes

USAGE_ERROR = 2  # argparse's exit status for a bad command line
CHECKPOINT_LOAD_ERROR = 66  # sysexits' EX_NOINPUT: the input (a checkpoint) cannot be used; not a bug's 1


def _end_process_group() -> None:
    """Release the process group before exit (NCCL warns at exit on every rank otherwise). Only after every rank
    finished, or failed the same way (a configuration error): nothing is in flight."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    try:
        pretrain(argv)
        _end_process_group()
    except (ConfigError, CheckpointLoadError) as e:
        # Every rank reads the same command line and raises the same error: rank 0 says it, once. A load error
        # only once the ranks agreed on it (agreement.py raises the original error only when every rank failed
        # with it, a StepFailedError naming the rank otherwise); one rank's own keeps its traceback.
        if isinstance(e, CheckpointLoadError) and not is_agreed(e):
            raise
        if launch_rank() == 0:
            print(f"{os.path.basename(__file__)}: error: {e}", file=sys.stderr, flush=True)
        _end_process_group()
        sys.exit(USAGE_ERROR if isinstance(e, ConfigError) else CHECKPOINT_LOAD_ERROR)
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


if __name__ == "__main__":
    main(sys.argv[1:])
