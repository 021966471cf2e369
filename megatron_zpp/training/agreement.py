"""Steps that end in a collective agree on success: a failure on one rank is the same named error on every rank.

Without this, an exception raised on one rank only (a checkpoint write that hits a full disk, a data file that
one node cannot read, a corrupt payload that only its receiver sees) ends that rank, while the others wait in
the next collective of the step until the watchdog's stall timeout or the process-group timeout fires, and then
say nothing of the cause.

Two kinds of step, told apart by whether the work inside issues collectives:

* **Local** (``step(name, local=True)``, or :meth:`Agreement.agree` directly): the work issues no collective,
  so every rank reaches the agreement whatever happened. Every rank joins one MIN all-reduce of a success flag
  (one float: cheap; it runs at step boundaries only, never per micro-batch); when it reads 0, the ranks
  all-gather their messages and every rank raises the same :class:`StepFailedError`, naming each failed rank
  and its error. When every rank failed with the same error (a user error, such as a missing ``--load``
  directory) the original exception is raised instead, as it was already agreed.
* **Collective** (``step(name)``): the work issues collectives, so a rank that fails inside cannot join
  anything (its peers may sit in a collective it will never enter, and a mismatched collective may even
  "succeed" with garbage). It publishes ``StepFailedError: rank R failed in STEP: ExcType: message`` to the
  rank watchdog's store, whose thread on every other rank polls it at each heartbeat and ends that process
  (``os._exit``, code 75) printing it: the peers blocked inside a collective that will never complete exit
  within one heartbeat interval. The failed rank waits (bounded) until they have, then raises the error
  itself. On success (``confirm=True``) the ranks still agree, so no rank goes on while another failed.

An error that the code raising it knows every rank raises at that point (a bad flag, or a verdict rank 0
broadcast) is marked with :func:`mark_agreed` and passes through a step unchanged, as does a nested step's.
Collectives that fail because a peer is gone (a socket error) are not this rank's failure: they are
re-raised as they are, and the trainer names the peer through the watchdog.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from megatron_zpp.training.watchdog import EXIT_CODE, RankFailureError

OWN_FAILURE_EXIT_CODE = 1  # the rank whose step failed: its own traceback is above the error


class StepFailedError(RankFailureError):
    """A step failed on one or more ranks; every rank raises (or prints) this same error.

    Attributes:
        step: what failed ("checkpoint save", "data loading", ...).
        failures: failed rank -> ``"ExcType: message"``.
        exit_code: for the process: 1 on a rank that failed itself, 75 (EX_TEMPFAIL, as the watchdog's) on the
            others.
    """

    def __init__(self, step: str, failures: dict[int, str], this_rank: int | None = None) -> None:
        self.step = step
        self.failures = dict(sorted(failures.items()))
        self.exit_code = OWN_FAILURE_EXIT_CODE if this_rank in self.failures else EXIT_CODE
        super().__init__("; ".join(f"rank {r} failed in {step}: {m}" for r, m in self.failures.items()))

    @property
    def ranks(self) -> list[int]:
        return list(self.failures)


def describe(error: BaseException) -> str:
    """``ExcType: message`` on one line (a step's error as its peers print it)."""
    text = " ".join(str(error).split())
    if len(text) > 1000:  # a message that long is a dump; its head names the problem
        text = text[:1000] + " ..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Agreement:
    """One per rank and run.

    Args:
        device: where the success flag lives (a CUDA device under NCCL).
        watchdog: the rank watchdog (``watchdog.py``); its store carries a collective step's failure to the
            peers. Without one (or with ``--zpp-rank-timeout 0``) a failure inside a collective step is raised
            on its rank only, and its peers wait for the process-group timeout, as before.
        group: the ranks that agree (default: the world; every step here is a world-wide one).
    """

    def __init__(self, *, device: torch.device | str = "cpu", watchdog=None, group=None) -> None:
        self.device = torch.device(device)
        self.watchdog = watchdog
        self.group = group

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def agree(self, step: str, error: BaseException | None = None) -> None:
        """Every rank of the group calls this at the same point, with no collective of the step pending:
        return when every rank passed ``error=None``, else raise the same error on every rank."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            if error is not None:  # no peer to differ from: agreed as it is
                mark_agreed(error)
                raise error
            return
        ok = torch.tensor([0.0 if error is not None else 1.0], device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if ok.item() == 1.0:
            return
        messages: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(messages, None if error is None else describe(error), group=self.group)
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else range(len(messages))
        failures = {r: m for r, m in zip(ranks, messages) if m is not None}
        if error is not None and len(failures) == len(messages) and len(set(failures.values())) == 1:
            mark_agreed(error)
            raise error  # the same error everywhere: already agreed (a user error), raised as it is
        agreed = StepFailedError(step, failures, self.rank)
        mark_agreed(agreed)
        raise agreed from error

    @contextlib.contextmanager
    def step(self, name: str, *, local: bool = False, confirm: bool = True,
             on_failure: Callable[[], None] | None = None):
        """Run the body as step ``name`` (module docstring).

        Args:
            local: the body issues no collective: a failure is agreed through :meth:`agree`.
            confirm: after a body that succeeded, agree (one MIN all-reduce) before going on. Off where the
                step's own collectives follow anyway (the training iteration, each micro-batch's data).
            on_failure: runs on a failed rank before the error is raised (after its peers gave up, for a
                collective step), and on rank 0 for an agreed failure: cleanup, e.g. removing a partial
                checkpoint.
        """
        try:
            yield
        except StepFailedError:
            raise  # a nested step's, already agreed or published
        except Exception as e:  # noqa: BLE001 - any failure of this rank is the step's
            if is_agreed(e):
                raise  # every rank raises it at this point (a user error found by every rank): nothing to tell
            if local:
                try:
                    self.agree(name, e)  # raises on every rank
                finally:
                    if on_failure is not None and self.rank == 0:
                        on_failure()
            if communication_error(e):
                raise  # a peer is gone: the trainer names it through the watchdog
            failure = StepFailedError(name, {self.rank: describe(e)}, self.rank)
            self.report(failure)
            if on_failure is not None:
                on_failure()
            raise failure from e
        if confirm:
            try:
                self.agree(name)
            except StepFailedError:
                if on_failure is not None and self.rank == 0:
                    on_failure()
                raise

    def report(self, failure: StepFailedError) -> None:
        """Publish this rank's failure to the peers' watchdogs and wait (bounded) until they have given up:
        rank 0 may host the store, and a cleanup (``on_failure``) must not race a peer still writing."""
        if self.watchdog is None or not self.watchdog.enabled:
            return
        self.watchdog.report_failure(f"{type(failure).__name__}: {failure}", failure.ranks)
        self.watchdog.wait_for_peers_to_exit()


def mark_agreed(error: BaseException) -> None:
    """Every rank raises ``error`` at this point (the trainer then does not report it as this rank's own)."""
    try:
        error.zpp_agreed = True
    except AttributeError:  # an exception type without a __dict__: reported, which is harmless
        pass


def is_agreed(error: BaseException) -> bool:
    """Whether every rank raises ``error`` (an agreed :class:`StepFailedError`, or ``mark_agreed``)."""
    return getattr(error, "zpp_agreed", False)


def communication_error(e: BaseException) -> bool:
    """Whether ``e`` came from torch.distributed (NCCL/gloo backend, store, network), by type or, for gloo's
    plain RuntimeErrors, by its message."""
    if isinstance(e, (dist.DistBackendError, dist.DistStoreError, dist.DistNetworkError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        marker in text for marker in ("gloo", "Connection reset", "Connection closed", "Connection refused",
                                      "Broken pipe"))  # not "timed out" or "NCCL": a rank's own error may say it
