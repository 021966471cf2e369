"""Where the training layer keeps what it derives once and reuses (the built-in corpus, dataset index
orders, tokenizer configurations): ``$ZPP_CACHE_DIR``, by default ``~/.cache/megatron_zpp``.

Its own module so that ``data.py`` and ``tokenizer.py`` share it without importing each other."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ROOT = Path(os.environ.get("ZPP_CACHE_DIR", Path.home() / ".cache" / "megatron_zpp"))
