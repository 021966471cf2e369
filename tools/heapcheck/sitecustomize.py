"""Loaded by every Python process started with ``tools/heapcheck`` on ``PYTHONPATH``: installs the in-flight
free detector (``inflight_free_check.py``) when ``ZPP_INFLIGHT_CHECK`` is set, and does nothing otherwise."""

import os

if os.environ.get("ZPP_INFLIGHT_CHECK"):
    import inflight_free_check

    inflight_free_check.install(os.environ["ZPP_INFLIGHT_CHECK"])
