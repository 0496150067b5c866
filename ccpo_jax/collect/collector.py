"""``ccpo-jax data collect``: a resumable run of the CCPO protocol against live endpoints.

Files (``OUT`` is the ``--out`` path):

* ``OUT`` - the cache, in the human JSONL format (docs/caches.md): the manifest
  line, then one line per finished question, appended (and fsync-ed) as each
  question finishes; when every question is done it is rewritten once,
  atomically, in the questions file's order (:mod:`~ccpo_jax.collect.cachefile`;
  for endpoints that answer a request the same way each time, a killed and
  resumed run ends byte-identical to an uninterrupted one).
* ``OUT.calls`` - the call log (:mod:`~ccpo_jax.collect.calllog`): one line per
  API call made. On ``--resume`` every call already paid for is replayed from
  it instead of being sent again (the questions that were in flight when a run
  was killed or stopped resume without paying twice), and identical requests
  within a run (e.g. LLM-EXIT's first round of the base model = the protocol's
  first base call) are sent once. Latency lives here, not in the cache, so that
  the cache is a function of the endpoints' answers only.

Costs: USD per million tokens per model (``--base-price``/``--guide-price``,
a ``--pricing`` file, or ``envs.importers.pricing``'s list prices), tokens from each
reply's ``usage`` (estimated at 4 characters per token, and flagged
``tokens_estimated``, only when an endpoint sends none). ``--max-cost-usd`` is a
cap on the whole collection (earlier runs' calls in the call log count): before
each call its worst case is reserved (:mod:`~ccpo_jax.collect.caller`,
:mod:`~ccpo_jax.collect.meter`), and a call whose reservation would cross the
cap is not sent: the run stops cleanly (exit status 3), keeping every finished
question, and ``--resume`` with a higher cap continues it.

This module is the run itself: check the output, open the files, run the
questions on worker threads (:func:`~ccpo_jax.collect.rounds.collect_question`
each), and finish the file. Ctrl-C: the first waits for the calls in flight, a
second stops at once (:func:`_run`).
"""
from __future__ import annotations

import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ccpo_jax.collect.bound import cost_bound, format_bound
from ccpo_jax.collect.cachefile import CacheFile, read_existing
from ccpo_jax.collect.caller import Caller
from ccpo_jax.collect.calllog import CallLog
from ccpo_jax.collect.client import ChatClient
from ccpo_jax.collect.meter import BudgetStop, Meter
from ccpo_jax.collect.rounds import collect_question
from ccpo_jax.collect.settings import Execution, Settings
from ccpo_jax.collect.summary import Outcome, Progress
from ccpo_jax.errors import UserError
from ccpo_jax.llm.questions import Question
from ccpo_jax.llm.wire import EndpointError, Stopped

#: Exit status of a run stopped by --max-cost-usd.
EXIT_BUDGET = 3


class StopSignal(threading.Event):
    """Set once the run must stop; ``reason``: the first cause ("budget" or an endpoint's error)."""

    def __init__(self):
        super().__init__()
        self.reason: str | None = None
        self._lock = threading.Lock()

    def stop(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
        self.set()


def calls_path(out: Path) -> Path:
    return out.with_name(out.name + ".calls")


def collect(s: Settings, questions: list[Question], out: str | os.PathLike, ex: Execution = Execution(),
            echo: Callable[[str], Any] = print, *, sleep: Callable[[float], Any] | None = None) -> Outcome:
    """Run (or resume) the collection of ``questions`` into ``out``; see the module docstring."""
    out = Path(out)
    log_path = calls_path(out)
    _check_out(out, log_path, ex)
    _check_keys(s, ex, echo)
    selected = questions[: ex.limit] if ex.limit is not None else questions
    log_created = not log_path.exists()
    log, man, done = _open_existing(out, log_path, log_created, s, ex)
    todo = [q for q in selected if q.id not in done]
    paid = log.paid_usd if log is not None else 0.0
    echo(format_bound(s, cost_bound(s, todo), len(todo), ex.max_cost_usd, paid))
    if done:
        echo(f"resuming: {len(done)} question(s) already in {out}, {len(todo)} to collect")
    meter = Meter(ex.max_cost_usd, paid)
    if ex.dry_run:
        return Outcome(out, False, len(done), len(selected), "dry run", meter, 0.0)

    if todo:
        check_models(s, ex, echo)
    created = man is None
    cache = _create_cache(out, s) if created else CacheFile(out, man, done)
    log = log if log is not None else _new_log(out, log_path)
    t0 = time.perf_counter()
    try:
        stopped = _run(todo, s, ex, log, meter, cache, Progress(ex.progress, len(selected), len(done), meter), sleep)
    finally:
        log.close()
    elapsed = time.perf_counter() - t0
    complete = all(q.id in cache.done for q in selected)
    removed = not complete and created and log_created and not cache.done and not log.replies
    if removed:
        # stopped before anything was paid or finished (a bad key, an unknown model, a tiny cap):
        # the files hold nothing worth resuming, and would only block the corrected rerun
        for p in (out, log_path):
            try:
                p.unlink()
            except OSError:
                pass
    sha = cache.finish([q.id for q in questions]) if complete else None
    n_done = sum(1 for q in selected if q.id in cache.done)
    return Outcome(out, complete, n_done, len(selected), stopped, meter, elapsed, sha, removed)


def check_models(s: Settings, ex: Execution, echo: Callable[[str], Any]) -> None:
    """Before the first paid call: each endpoint must list its model (``GET /models``); an unlisted
    model, or an endpoint that lists none, is an error (a note with ``allow_unlisted_model``)."""
    listed: dict[tuple, list[str] | str] = {}
    for r in s.roles():
        ep = s.endpoint(r)
        where = (ep.completions_url, ep.key_env)
        if where not in listed:
            cl = ChatClient(ep, ex.retry, max_connections=1)
            try:
                listed[where] = cl.served_models()
            except EndpointError as e:
                if getattr(e, "refused", False):
                    raise
                listed[where] = str(e)
            finally:
                cl.close()
        got = listed[where]
        if isinstance(got, str):
            msg = (f"the {r} endpoint does not list its models ({got}); pass --allow-unlisted-model to call "
                   f"{ep.model!r} anyway")
        elif ep.model in got:
            continue
        else:
            msg = (f"the {r} endpoint {ep.public_url} does not serve the model {ep.model!r}; it lists: "
                   f"{', '.join(repr(m) for m in got) or '(none)'} (use one of these names, or "
                   "--allow-unlisted-model for a gateway that does not list what it serves)")
        if not ex.allow_unlisted_model:
            raise UserError(msg)
        echo(f"note: {msg}; called anyway (--allow-unlisted-model)")


def _check_out(out: Path, log_path: Path, ex: Execution) -> None:
    if out.is_dir():
        raise UserError(f"{out}: is a directory; give a file name ending in .jsonl", field="out")
    if out.suffix != ".jsonl":
        raise UserError(f"{out}: the cache is written in the human format; give a file name ending in .jsonl",
                        field="out")
    if not ex.resume and (out.exists() or log_path.exists()):
        raise UserError(f"{out}: already exists (or its call log {log_path.name}); pass `resume` to continue "
                        "that collection, or choose another `out`", field="out")
    if not ex.dry_run:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"{out}: cannot create its folder ({e.strerror or e})", field="out") from None


def _check_keys(s: Settings, ex: Execution, echo: Callable[[str], Any]) -> None:
    """A missing key variable is an error before anything is written (a note in a dry run)."""
    for r in s.roles():
        try:
            s.endpoint(r).api_key()
        except UserError as e:
            if not ex.dry_run:
                raise
            echo(f"note: {e}; the real run needs it")


def _open_existing(out: Path, log_path: Path, log_created: bool, s: Settings,
                   ex: Execution) -> tuple[CallLog | None, dict | None, dict]:
    """(call log, stored manifest, {question id: line}) of the collection being resumed (or read by a
    dry run); (None, None, {}) for a new one."""
    try:
        log = CallLog(log_path, read_only=True) if ex.dry_run else (CallLog(log_path) if ex.resume else None)
    except OSError as e:
        raise UserError(f"{out}: cannot write its call log ({e.strerror or e})", field="out") from None
    if not (ex.resume and out.exists()):
        return log, None, {}
    try:
        man, done = read_existing(out, s, repair=not ex.dry_run)
    except BaseException:
        if log is not None:
            log.close()
            if log_created:
                log_path.unlink(missing_ok=True)
        raise
    return log, man, done


def _create_cache(out: Path, s: Settings) -> CacheFile:
    try:
        return CacheFile.create(out, s)
    except OSError as e:
        raise UserError(f"{out}: cannot write ({e.strerror or e})", field="out") from None


def _new_log(out: Path, log_path: Path) -> CallLog:
    try:
        return CallLog(log_path)
    except OSError as e:
        out.unlink(missing_ok=True)
        raise UserError(f"{out}: cannot write its call log ({e.strerror or e})", field="out") from None


def _run(todo: list[Question], s: Settings, ex: Execution, log: CallLog, meter: Meter, cache: CacheFile,
         progress: Progress, sleep: Callable[[float], Any] | None) -> str | None:
    """Collect ``todo`` on ``ex.concurrency`` worker threads, appending each finished question to
    ``cache`` (from this thread only); the reason the run stopped early, or None.

    The workers are daemon threads, so that nothing joins them at interpreter exit: a Ctrl-C
    there used to print "Exception ignored in threading._shutdown". A first Ctrl-C stops the run
    and waits for the calls in flight (:func:`_wait_in_flight`); a second stops waiting."""
    stop = StopSignal()
    clients = {r: ChatClient(s.endpoint(r), ex.retry, max_connections=ex.concurrency, stop=stop,
                             seed=i, sleep=sleep) for i, r in enumerate(s.roles())}
    warned: set[str] = set()
    warn_lock = threading.Lock()

    def warn(msg: str) -> None:  # each message once per run (workers may hit it together)
        with warn_lock:
            if msg in warned:
                return
            warned.add(msg)
        progress.write(msg)

    caller = Caller(s, log, meter, stop, clients, warn)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for q in todo:
        jobs.put(q)
    results: queue.SimpleQueue = queue.SimpleQueue()  # (question, its line or None, an unexpected error)

    def worker() -> None:
        while not stop.is_set():
            try:
                q = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                results.put((q, _work(q, s, caller, stop), None))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                stop.stop(f"{type(e).__name__}: {e}")
                results.put((q, None, e))

    threads = [threading.Thread(target=worker, name=f"collect-{i}", daemon=True)
               for i in range(min(ex.concurrency, len(todo)))]
    errors: list[BaseException] = []

    def drain(timeout: float | None) -> bool:
        """Append what the workers finished; False once they are all done and nothing is left."""
        alive = any(t.is_alive() for t in threads)  # (before the queue: a worker puts, then ends)
        try:
            q, rec, err = results.get(timeout=timeout) if timeout else results.get_nowait()
        except queue.Empty:
            return alive
        if err is not None:
            errors.append(err)
        elif rec is not None:
            cache.append(q.id, rec)
            progress.advance()
        return True

    again = threading.Event()  # a second Ctrl-C
    old_handler = None
    try:
        with cache:
            for t in threads:
                t.start()
            try:
                while drain(0.5):
                    progress.refresh()
            except KeyboardInterrupt:
                stop.set()
                if threading.current_thread() is threading.main_thread():  # (handlers live there only)
                    # from here on Ctrl-C only sets a flag: none can land in the middle of closing the files
                    old_handler = signal.signal(signal.SIGINT, lambda *_: again.set())
                _wait_in_flight(threads, drain, progress, again)
                raise
    finally:
        progress.close()
        for cl in clients.values():
            cl.close()
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
    if errors:
        raise errors[0]
    return stop.reason


def _work(q: Question, s: Settings, caller: Caller, stop: StopSignal) -> dict | None:
    """The question's line, or None when the run stops (the first cause is kept in ``stop``)."""
    if stop.is_set():
        return None
    try:
        return collect_question(q, s, caller)
    except BudgetStop:
        stop.stop("budget")  # at once, so that this worker does not start the next question
    except EndpointError as e:
        stop.stop(str(e))
    except Stopped:
        pass
    return None


def _wait_in_flight(threads: list[threading.Thread], drain: Callable[[float | None], bool],
                    progress: Progress, again: threading.Event) -> None:
    """After a first Ctrl-C: wait for the calls in flight (paid: their replies reach the call log,
    so ``--resume`` does not pay again; questions they finish reach the cache) until the workers
    end or ``again`` is set (a second Ctrl-C; the workers left running are daemons)."""
    if any(t.is_alive() for t in threads):
        progress.write("interrupted: waiting for the calls in flight (paid; their replies are kept); "
                       "Ctrl-C again to stop at once (then they are paid again on --resume)")
    while not again.is_set() and drain(0.1):
        pass
