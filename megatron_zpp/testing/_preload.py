"""Imported once by the test forkserver (``spawn.preload_rank_modules``): imports the modules it names.

A module that fails is reported and skipped, whatever it raises, so the server stays up and the ranks import it
themselves (and fail there, with a traceback the test shows). The list comes from the environment the server
started with.
"""

import importlib
import os
import sys
import traceback

from megatron_zpp.testing.spawn import _PRELOAD_ENV  # (the package imports spawn anyway)

for _name in filter(None, os.environ.get(_PRELOAD_ENV, "").split(",")):
    try:
        importlib.import_module(_name)
    except BaseException:  # noqa: BLE001 - anything, a warning made an error included: the server must live
        print(f"megatron_zpp.testing: the forkserver could not preload {_name}; ranks will import it themselves:\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
