"""What every step script of ``tools/gpu_check.py`` shares: its command line, its result file, and the
"is there a GPU to run on" decision.

The step contract (``tools/gpu_check.py`` runs each step as a subprocess)::

    python tools/gpu_steps/<name>.py --out DIR [--quick]

writes ``DIR/<name>.json`` = ``{"status": "pass"|"fail"|"unsupported"|"skipped", "figures": {...},
"rows": [{...}, ...], "detail": "text"}`` and exits 0 on pass/unsupported/skipped, non-zero on fail.
A step that raises is recorded as a fail with its traceback (``run_step``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the repo's megatron_zpp, not an installed copy
    sys.path.insert(0, str(REPO))

STATUSES = ("pass", "fail", "unsupported", "skipped")


class StepOutcome(Exception):
    """Raised inside a step to end it with a given status (e.g. ``skipped`` without a GPU)."""

    def __init__(self, status: str, detail: str, figures: dict | None = None, rows: list | None = None):
        super().__init__(detail)
        if status not in STATUSES:
            raise ValueError(f"status={status!r} is not one of {STATUSES}")
        self.status, self.detail, self.figures, self.rows = status, detail, figures or {}, rows or []


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"tools/gpu_steps/{name}.py", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help=f"folder for {name}.json (and the step's other files)")
    ap.add_argument("--quick", action="store_true", help="the short variant (tools/gpu_check.py --quick)")
    return ap


def _clean(value):
    """JSON-safe: NaN/Inf become strings (json.dumps would write invalid JSON), tuples lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_result(out: Path, name: str, status: str, figures: dict, rows: list, detail: str) -> Path:
    if status not in STATUSES:
        raise ValueError(f"status={status!r} is not one of {STATUSES}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean({"status": status, "figures": figures, "rows": rows, "detail": detail}),
                              indent=1, default=str))
    tmp.replace(path)  # never a half-written result for the orchestrator to read
    return path


def run_step(name: str, body: Callable[[argparse.Namespace], tuple[str, dict, list, str]],
             ap: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse the arguments, run ``body(args) -> (status, figures, rows, detail)``, write the result and
    return the exit code of the contract (0 unless the status is fail)."""
    args = ap.parse_args(argv)
    try:
        status, figures, rows, detail = body(args)
    except StepOutcome as outcome:
        status, figures, rows, detail = outcome.status, outcome.figures, outcome.rows, outcome.detail
    except BaseException as exc:  # noqa: BLE001  (KeyboardInterrupt too: record why the step ended)
        status, figures, rows = "fail", {}, []
        detail = f"{type(exc).__name__}: {exc}\n" + traceback.format_exc()[-6000:]
    return finish(args.out, name, status, figures, rows, detail)


def finish(out: Path, name: str, status: str, figures: dict, rows: list, detail: str) -> int:
    """Write the result, print its one-line verdict and return the contract's exit code."""
    write_result(out, name, status, figures, rows, detail)
    print(f"[{name}] {status}: {detail.splitlines()[0] if detail else ''}", flush=True)
    return 1 if status == "fail" else 0


def require_cuda(what: str) -> None:
    """End the step as ``skipped`` (with why) when no CUDA device is usable."""
    try:
        import torch
    except ImportError as exc:
        raise StepOutcome("fail", f"torch cannot be imported ({exc}); the GPU check needs the image's CUDA torch")
    if not torch.cuda.is_available():
        why = "torch has no CUDA support (a CPU build)" if torch.version.cuda is None else \
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
        raise StepOutcome("skipped", f"no GPU: {why}; {what} needs one")

