"""Rank watchdog: when a rank dies or hangs, every other rank exits soon, naming it.

A rank killed mid-step (a hardware fault, the OOM killer) leaves its peers either with a socket error
from the collective they share ("Connection closed by peer", which names no rank) or blocked in one
until the process-group timeout (``--distributed-timeout-minutes``, 10 by default). A rank hung in a
kernel or a collective leaves them blocked. Neither says which rank to look at.

Each rank runs a daemon thread that writes a heartbeat to the rendezvous store every
``--zpp-heartbeat-interval`` seconds: a counter and the rank's progress (iteration and micro-batch, marked
by the training loop, then the number of collectives it has launched, from the byte accounting, which
separates a rank stuck before a collective from those waiting inside it). Two ways out:

* the main thread's collective raises: ``explain()`` looks at the heartbeats, and a rank whose counter
  stopped is named in the error raised instead (``RankFailureError``);
* this rank has made no progress for ``--zpp-rank-timeout`` seconds: the thread names the ranks whose
  heartbeat stopped, or those behind the others, prints it and ends the process (``os._exit``: the
  main thread may be blocked inside a C++ collective that no Python exception can interrupt).

What one rank finds (or a step failure it reports, ``agreement.py``) is published in the store as the
run's verdict, first finding wins; every other rank's thread reads it at each heartbeat and ends its
process with it (at the first heartbeat that sees it; at the second for a failure its own rank reported),
so a rank blocked in a collective that will never complete exits within one or two intervals.

Under torchrun a dead worker also makes its node's agent stop the node's other workers; the watchdog
is what tells the other nodes' ranks, and the log reader, which rank it was. Restart with torchrun's
``--max-restarts N`` and ``--load`` on the ``--save`` directory: the run resumes from the last complete
checkpoint (saves are atomic, ``checkpoint.py``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

# A rank whose heartbeat has not changed over this many intervals is gone: wide enough for a loaded host
# to deschedule a live rank's heartbeat thread now and then (or its main thread to hold the GIL a while).
LOOK_INTERVALS = 4
EXIT_CODE = 75  # EX_TEMPFAIL: the job failed because of another rank; a restart may succeed


class RankFailureError(RuntimeError):
    """A collective failed because another rank died or hung; the message names it."""


@dataclass(kw_only=True)
class RankFailureConfig:
    rank_timeout: float | None = None
    """Seconds without progress (a micro-batch or an iteration finished) after which every rank exits
    naming the ranks whose heartbeat stopped or that are behind; default --distributed-timeout-minutes
    x 60 less 6 heartbeat intervals (it must act before the process-group timeout). 0 turns the watchdog off."""
    heartbeat_interval: float = 5.0
    """Seconds between heartbeats in the rendezvous store; a rank whose heartbeat has not changed for 4
    intervals counts as gone."""


def add_rank_failure_args(parser) -> None:
    from megatron_zpp.policy import add_dataclass_args

    add_dataclass_args(parser, RankFailureConfig, "zpp", "megatron_zpp rank failures")


def rank_failure_config_from_args(args) -> RankFailureConfig:
    from megatron_zpp.policy import dataclass_from_args

    config = dataclass_from_args(RankFailureConfig, args, "zpp")
    group_timeout = 60.0 * args.distributed_timeout_minutes
    # The watchdog must name the failure before the process-group timeout fires (NCCL's own watchdog then
    # tears the process down with a message that names no rank): its stall timeout plus the look at the
    # heartbeats (LOOK_INTERVALS) and a margin stay under it.
    margin = (LOOK_INTERVALS + 2) * config.heartbeat_interval
    if config.rank_timeout is None:
        config.rank_timeout = max(group_timeout - margin, 0.5 * group_timeout)
    if config.rank_timeout and config.rank_timeout + margin > group_timeout:
        raise ValueError(f"--zpp-rank-timeout {config.rank_timeout:g} s plus {margin:g} s to look at the heartbeats "
                         f"exceeds --distributed-timeout-minutes {args.distributed_timeout_minutes} "
                         f"({group_timeout:g} s): the process-group timeout would fire first; lower the one or "
                         "raise the other")
    if config.rank_timeout < 0:
        raise ValueError(f"--zpp-rank-timeout {config.rank_timeout} must be >= 0 (0: no watchdog)")
    if not config.heartbeat_interval > 0:
        raise ValueError(f"--zpp-heartbeat-interval {config.heartbeat_interval} must be > 0 seconds")
    if config.rank_timeout and config.rank_timeout < 3 * config.heartbeat_interval:
        raise ValueError(f"--zpp-rank-timeout {config.rank_timeout} must be at least 3 x --zpp-heartbeat-interval "
                         f"{config.heartbeat_interval}: a live rank's heartbeat must be seen changing first")
    return config


def _watchdog_store(timeout_s: float):
    """A store of the watchdog's own, under a prefix unique to this run.

    Its own client connection where the rendezvous is a TCP store (MASTER_ADDR/MASTER_PORT: torchrun's agent
    store, or rank 0's): a TCPStore client serves one request at a time, and the main thread blocks in the
    shared one while communicators are created lazily, which would freeze the heartbeats. A file store
    (spawned test worlds) is shared. The prefix is a nonce from rank 0 (one collective, at start): torchrun's
    agent keeps its store across restarts, and a verdict left by the failed attempt must not end the next.
    """
    import datetime
    import uuid

    from torch.distributed import distributed_c10d

    nonce = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(nonce, src=0)
    base = distributed_c10d._get_default_store()
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port and isinstance(_innermost(base), dist.TCPStore):
        base = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    return dist.PrefixStore(f"zpp_watchdog/{nonce[0]}/", base)


def _innermost(store):
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class RankWatchdog:
    def __init__(self, config: RankFailureConfig, store=None, log=None) -> None:
        self.config = config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if store is None and self.config.rank_timeout:
            store = _watchdog_store(max(60.0, config.rank_timeout))
        self.store = store
        # Compare only iterations, not micro-batches or collectives: with pipeline parallelism healthy stages
        # differ in both (1F1B warm-up, first/last-stage collectives). Set by the trainer.
        self.coarse = False
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._progress = (0, 0)
        # None until the training loop marks its first iteration, and while paused (a checkpoint save or an
        # evaluation may legitimately take longer than the timeout); a rank that dies then is still named
        # through explain(), when its peers' collective fails.
        self._last_progress: float | None = None
        self._beats = 0
        self._gone: set[int] = set()
        self._paused = 0
        self._explaining = False
        # The main thread is handling a failure (its own, or one every rank raised): it ends the process, not
        # this thread, which only goes on beating (``main_thread_exiting``).
        self._main_exiting = False
        self._verdict_seen = 0  # consecutive heartbeats that found a verdict
        self._last_finder: int | None = None
        self._last_named: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.config.rank_timeout)

    def start(self) -> RankWatchdog:
        if self.enabled:
            self._beat()  # before the thread: every live rank has a key once the first collective passed
            self._thread = threading.Thread(target=self._run, name="zpp-rank-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.config.heartbeat_interval)

    def progress(self, iteration: int, micro_batch: int = 0) -> None:
        """The training loop finished ``micro_batch`` of 1-based ``iteration`` (cheap: no I/O)."""
        self._progress = (iteration, micro_batch)
        if self._paused == 0:
            self._last_progress = time.monotonic()

    def loop_done(self) -> None:
        """The training loop is over: no stall timeout from now on (heartbeats continue, so a peer that
        fails in the final save or evaluation still sees this rank alive)."""
        self._paused += 1
        self._last_progress = None

    @contextlib.contextmanager
    def paused(self):
        """No stall timeout inside (checkpoint saves, evaluations); the clock restarts on the way out."""
        self._paused += 1
        self._last_progress = None
        try:
            yield
        finally:
            self._paused -= 1
            if self._paused == 0:
                self._last_progress = time.monotonic()

    # ------------------------------------------------------------------ heartbeats
    def _key(self, rank: int) -> str:
        return f"rank{rank}"

    def _point(self) -> tuple[int, int, int]:
        """(iteration, micro-batch, collectives launched): compared in that order."""
        from megatron_zpp.comm import comm_stats

        launched = sum(s.calls for s in comm_stats().snapshot().values())  # under the counters' lock
        return (*self._progress, launched)

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(self._key(self.rank), " ".join(map(str, (self._beats, *self._point()))))

    def _read(self) -> dict[int, tuple[int, tuple[int, int, int]] | None]:
        """Every rank's (beats, point); None for a rank that never wrote one."""
        out: dict[int, tuple[int, tuple[int, int, int]] | None] = {}
        for r in range(self.world):
            key = self._key(r)
            if not self.store.check([key]):  # get() would wait for a missing key until the store times out
                out[r] = None
                continue
            beats, *point = (int(x) for x in self.store.get(key).decode().split())
            out[r] = (beats, tuple(point))
        return out

    def _run(self) -> None:
        interval = self.config.heartbeat_interval
        while not self._stop.wait(interval):
            try:
                self._beat()
                verdict = self._verdict()
            except Exception as e:  # noqa: BLE001 - any store failure means its host is gone
                if self._explaining or self._main_exiting:  # the main thread is naming the failed rank or exiting
                    continue
                self._abort(f"the rendezvous store is unreachable ({type(e).__name__}: {e}); it is hosted by rank 0 "
                            "or the launcher's agent, which has most likely died")
            if self._main_exiting:
                continue
            self._verdict_seen = self._verdict_seen + 1 if verdict is not None else 0
            # A failure its own rank reported (agreement.py) is acted on at the second heartbeat that sees it:
            # an error that every rank raises at about the same point (a user error) is then raised by each
            # rank's main thread, instead of this thread ending the ranks that were a moment behind.
            patience = 2 if verdict is not None and self._self_reported else 1
            if verdict is not None and not self._explaining and self._verdict_seen >= patience:
                self.mark_exiting()
                self.linger_if_store_host()  # rank 0 too may learn of the failure from the verdict
                self._abort(verdict)
            last = self._last_progress
            stalled = 0.0 if last is None else time.monotonic() - last
            if stalled > self.config.rank_timeout:
                found = self.find_failed()
                detail = found[1] if found else (
                    f"every rank is at {_where(self._point())} and none progressed: a collective that never "
                    "completes (a hang inside the communication library or the network)")
                message = f"no progress for {stalled:.1f} s (--zpp-rank-timeout {self.config.rank_timeout:g}): {detail}"
                if found and "(found by rank" not in detail:
                    self.publish(message, found[0])
                self.mark_exiting()
                self.linger_if_store_host()
                self._abort(message)

    def _verdict(self) -> str | None:
        """What another rank found (``publish``), so a rank blocked in a collective that did not fail exits
        at its next heartbeat instead of at its stall timeout."""
        found = self._published()
        return None if found is None else found[1]

    @property
    def _self_reported(self) -> bool:
        return self._last_finder is not None and self._last_named == [self._last_finder]

    def _published(self) -> tuple[list[int], str] | None:
        if not self.store.check(["verdict"]):
            return None
        finder, ranks, gone, detail = self.store.get("verdict").decode().split("|", 3)
        named = [int(r) for r in ranks.split(",") if r]
        self._last_finder, self._last_named = int(finder), named
        if gone == "1":
            # Ranks another rank found dead (their heartbeat stopped): nobody waits for them to mark themselves
            # exiting, which they never will (``linger_if_store_host`` would sit out its whole bound). A hung
            # rank is alive: its watchdog reads the verdict and marks itself exiting, so it is waited for.
            self._gone |= set(named)
        # A rank reporting its own failure names itself already.
        return named, detail if named == [int(finder)] else f"{detail} (found by rank {finder})"

    def publish(self, detail: str, ranks: list[int] = ()) -> None:
        """Tell every rank's watchdog what failed (best effort: the store may be going down). The first
        verdict stays: every rank then tells the same story, the root cause rather than its consequences."""
        # Whether the named ranks are dead (found by this rank's look at the heartbeats), not hung or failed alive.
        gone = bool(ranks) and set(ranks) <= self._gone
        try:
            self.store.compare_set("verdict", "", f"{self.rank}|{','.join(map(str, ranks))}|{int(gone)}|{detail}")
        except Exception:  # noqa: BLE001
            pass

    def report_failure(self, detail: str, ranks: list[int]) -> None:
        """This rank failed (``detail`` names it and the error): publish it, and leave its own exit to the
        main thread, which raises the error (``agreement.py``)."""
        self.main_thread_exiting()
        self.publish(detail, ranks)

    def main_thread_exiting(self) -> None:
        """The main thread is raising an error and will end the process: from now on this thread only beats
        (it neither acts on a verdict nor on the store's end, which rank 0's exit may bring any moment), and
        the peers' looks at the heartbeats do not count this rank as failed."""
        self._main_exiting = True
        self.mark_exiting()

    def wait_for_peers_to_exit(self) -> None:
        """After :meth:`report_failure`: wait (bounded by the look at the heartbeats) until every other rank
        has read the verdict and is exiting. Rank 0 may host the store, which its exit takes down, and a failed
        rank's cleanup must not race a peer still writing."""
        if self.enabled:
            self._wait_until_exiting([r for r in range(self.world) if r != self.rank])

    def mark_exiting(self) -> None:
        try:
            self.store.set(f"exiting{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass

    def explain(self) -> str | None:
        """Which ranks failed: those whose heartbeat stopped (watched over LOOK_INTERVALS heartbeats), else those
        behind the most advanced rank. None when every rank is alive and at the same point."""
        found = self.find_failed()
        return None if found is None else found[1]

    def find_failed(self) -> tuple[list[int], str] | None:
        """:meth:`explain` with the ranks it names (empty when the store itself is gone)."""
        self._explaining = True
        try:
            published = self._published()
            if published is not None:  # another rank has looked already: one story for everyone
                return published
            before = self._read()
            on_watchdog_thread = threading.current_thread() is self._thread
            for _ in range(LOOK_INTERVALS):
                time.sleep(self.config.heartbeat_interval)
                if on_watchdog_thread:  # its heartbeats must go on while it looks at everyone else's
                    self._beat()
            after = self._read()
            published = self._published()  # found meanwhile by another rank
            if published is not None:
                return published
            # A rank that exits after a verdict also stops its heartbeat: it is not the one that failed.
            exiting = {r for r in range(self.world) if self.store.check([f"exiting{r}"])}
        except Exception as e:  # noqa: BLE001
            return [], (f"the rendezvous store is unreachable ({type(e).__name__}: {e}); rank 0 or the launcher's "
                        "agent that hosts it has most likely died")
        finally:
            self._explaining = False
        gone = [r for r in range(self.world)
                if r != self.rank and r not in exiting and (after[r] is None or before[r] == after[r])]
        self._gone |= set(gone)
        if gone:
            where = "; ".join(f"rank {r}: " + ("never sent a heartbeat" if after[r] is None else
                                               f"last seen at {_where(after[r][1])}") for r in gone)
            return gone, (f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} stopped responding "
                          f"(no heartbeat for {LOOK_INTERVALS * self.config.heartbeat_interval:.1f} s; {where})")
        points = {r: v[1] for r, v in after.items()}
        points[self.rank] = self._point()
        key = (lambda p: p[0]) if self.coarse else (lambda p: p)
        ahead = max(points.values(), key=key)
        behind = sorted(r for r, p in points.items() if key(p) < key(ahead))
        if behind:
            where = ", ".join(f"rank {r} at {_where(points[r])}" for r in behind)
            return behind, (f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} hung: {where}, "
                            f"while the others reached {_where(ahead)}")
        return None

    def linger_if_store_host(self) -> None:
        """Rank 0 hosts the store when launched without torchrun (env:// rendezvous): on a failure it waits
        (bounded) until every rank still alive has read the verdict and is exiting, as its own exit takes the
        store down with it."""
        if self.rank == 0 and self.enabled:
            self._wait_until_exiting([r for r in range(1, self.world) if r not in self._gone])

    def _wait_until_exiting(self, waiting: list[int]) -> None:
        """Until each rank of ``waiting`` has marked itself exiting, bounded by the look at the heartbeats."""
        deadline = time.monotonic() + (LOOK_INTERVALS + 2) * self.config.heartbeat_interval
        while waiting and time.monotonic() < deadline:
            try:
                waiting = [r for r in waiting if not self.store.check([f"exiting{r}"])]
            except Exception:  # noqa: BLE001 - the store is gone: nobody left to wait for
                return
            time.sleep(0.1)

    def _abort(self, message: str) -> None:
        self.mark_exiting()
        stop_child_processes()
        self.log(f"[rank watchdog] rank {self.rank}: {message}; exiting (code {EXIT_CODE})")
        os._exit(EXIT_CODE)


def _where(point: tuple[int, int, int]) -> str:
    iteration, micro, launched = point
    return f"iteration {iteration}, micro-batch {micro} done, {launched} collectives launched"


def stop_child_processes() -> None:
    """Kill this process's children (Megatron's checkpoint-writer Manager, multiprocessing's resource
    tracker) before an ``os._exit``, which skips the exit handlers that would stop them: a rank that gives up
    leaves nothing behind holding its files and pipes."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
