"""Multi-process test harness: a reusable pool of gloo ranks on CPU.

Starting a process group is the expensive part of a distributed test (every
rank has to import torch), so a :class:`DistPool` starts its ``world_size``
worker processes once and then runs many tasks on them::

    from tests._dist import get_pool

    def _sum_ranks():                      # module level: shipped by name
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert get_pool(2).run(_sum_ranks) == [1.0, 1.0]

``run(fn, *args, **kwargs)`` calls ``fn`` on every rank at once and returns
the per-rank results in rank order.  ``fn`` travels as ``module + qualname``
(so it must be a module-level function); ``args``/``kwargs``/return values
travel by pickle.

Guarantees between tasks:

* every task starts with ``torch.manual_seed(0)`` (and ``random``/``numpy``
  seeded with 0), float32 default dtype, grad mode on, 1 intra-op thread;
* if any rank raised, :class:`WorkerError` is raised after all ranks are
  collected; its message holds every failing rank's traceback and captured
  output, each line prefixed ``[rank r]``;
* a rank that raised while the others are blocked in a collective does not
  hang the pool: once one rank has failed, the others get ``failure_grace``
  seconds to finish; whatever is still running then (or once ``timeout``
  seconds have passed without progress) has its Python stack dumped, the pool
  is killed and restarted, and :class:`WorkerTimeoutError` (a ``WorkerError``
  *and* a ``TimeoutError``) names the function;
* progress: ``timeout`` counts from the task's start or from the last
  :func:`progress` call on any rank, so a long sweep that calls
  :func:`progress` after each configuration may run as long as it needs while
  a hang is still reported ``timeout`` seconds after it began;
* if ranks end a task with different collective counts on the default group
  (a rank died, raised half way, or a test left the group out of step), the
  pool is restarted so the next task begins with a clean group.

Worker stdout/stderr (file-descriptor level, so C++ output too) go to a
per-rank log; the slice a task wrote is echoed to the parent's stdout with a
``[rank r]`` prefix (pytest shows it for a failing test) and put into the
error message when the task fails.

Workers are started with multiprocessing's ``forkserver`` method where it
exists (a clean server process that has imported torch forks them, so a pool
starts or restarts in well under a second instead of every rank importing
torch), otherwise ``spawn``; never plain ``fork`` of the test process.

What a worker process runs (joining the group, the task loop, progress) is
in :mod:`tests._dist_worker`; this module is the parent's side.

Environment: ``FSDP_WRAP_TEST_TIMEOUT`` (seconds) changes the default
no-progress timeout of :func:`get_pool` (60 s); ``FSDP_WRAP_TEST_START_METHOD=spawn`` forces spawn.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # noqa: F401  (registers its atexit hook before ours)
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any, Callable

from tests._dist_worker import (
    _HOST,
    TORCH_NOISE_MODULE,
    _resolve,
    _worker_main,
    progress,
    silence_torch_noise,
)

__all__ = [
    "TORCH_NOISE_MODULE",
    "WorkerError",
    "WorkerTimeoutError",
    "DistPool",
    "get_pool",
    "close_all_pools",
    "silence_torch_noise",
    "progress",
]

# Seconds a task may go without progress (see ``progress``): the longest any
# test waits on a hang.  Tasks in this suite finish, or call ``progress``,
# within a few seconds on a 2-core machine, so this leaves room for a machine
# ten times slower.
_DEFAULT_TIMEOUT = 60.0
_MAX_OUTPUT_CHARS = 20_000  # per rank, in error messages

class WorkerError(RuntimeError):
    """A task raised (or its process died) on at least one rank.

    ``failures`` maps each failing rank to its traceback text.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})


class WorkerTimeoutError(WorkerError, TimeoutError):
    """Ranks did not finish in time; the pool was killed and restarted."""


# --------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------


def _default_start_method() -> str:
    method = os.environ.get("FSDP_WRAP_TEST_START_METHOD")
    if method:
        return method
    # forkserver: workers are forked from a clean, single-threaded server
    # process (never from pytest itself), so it is as safe as spawn here.
    if "forkserver" in multiprocessing.get_all_start_methods():
        return "forkserver"
    return "spawn"


def _fn_ref(fn: Callable[..., Any]) -> tuple[str, str]:
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not callable(fn) or not module_name or not qualname or "<" in qualname:
        raise TypeError(
            f"DistPool.run needs a module-level function (shipped by module + qualname), "
            f"got {fn!r}; pass data through *args/**kwargs instead of closures/partials"
        )
    try:
        found = _resolve(module_name, qualname)
    except Exception as e:
        raise TypeError(f"{module_name}.{qualname} cannot be looked up by name: {e}") from e
    if found != fn:
        raise TypeError(
            f"{module_name}.{qualname} does not name {fn!r} (bound method or shadowed name?); "
            f"use a module-level function"
        )
    return module_name, qualname


def _prefix(text: str, tag: str) -> str:
    return "\n".join(f"{tag} {line}" for line in text.rstrip("\n").splitlines())


class DistPool:
    """``world_size`` worker processes in one process group, reused across tasks.

    ``backend`` is ``"gloo"`` (CPU, and CUDA tensors too) or ``"nccl"`` (one
    GPU per rank; rank ``r`` uses ``cuda:r``).
    """

    def __init__(
        self,
        world_size: int,
        timeout: float = _DEFAULT_TIMEOUT,
        failure_grace: float = 5.0,
        start_method: str | None = None,
        backend: str = "gloo",
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.world_size = world_size
        self.backend = backend
        self.timeout = float(timeout)
        self.failure_grace = float(failure_grace)
        self.generation = 0  # how many times the processes were (re)started
        self.start_method = start_method or _default_start_method()
        self._ctx: Any = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            # The fork server imports torch once; workers fork from it in
            # milliseconds instead of each importing torch (~2 s of CPU).
            # fsdp_wrap (DTensor, DCP) and torch's FSDP1 (the oracle) too:
            # nearly every task imports both, and every restart (each
            # exception test_sweeps injects is one) paid ~1.8 s of CPU a rank.
            # Neither does anything at import that depends on the rank.
            preload = ["torch", "torch.distributed", "fsdp_wrap", "torch.distributed.fsdp"]
            if "pytest" in sys.modules:
                preload.append("pytest")
            self._ctx.set_forkserver_preload(preload)
        self._lock = threading.Lock()
        self._logdir = tempfile.mkdtemp(prefix=f"fsdp_wrap_pool{world_size}_")
        self._logs = [os.path.join(self._logdir, f"rank{r}.log") for r in range(world_size)]
        self._procs: list[Any] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._store: Any = None
        self._ready = False
        self._busy = False  # a task was sent and its replies not all read
        self._recent_modules: list[str] = []  # imported by restarted workers
        self._closed = False
        _LIVE_POOLS.add(self)
        weakref.finalize(self, shutil.rmtree, self._logdir, True)
        self._start()

    # -- lifecycle ---------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def _start(self) -> None:
        """Spawn the workers; does not wait for them (see ``_wait_ready``)."""
        import torch.distributed as dist

        self.generation += 1
        pg_timeout = self.timeout + 60.0  # so orphaned stuck ranks give up eventually
        # The parent owns the rendezvous store: port 0 lets the OS pick a free
        # port and nobody can take it between choosing and binding.
        self._store = dist.TCPStore(
            _HOST,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=pg_timeout),
        )
        self._procs, self._conns = [], []
        for rank in range(self.world_size):
            parent_end, child_end = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.world_size,
                    self._store.port,
                    child_end,
                    self._logs[rank],
                    pg_timeout,
                    os.getpid(),
                    list(self._recent_modules),
                    self.backend,
                ),
                name=f"DistPool{self.world_size}-rank{rank}",
                daemon=False,  # workers may start processes of their own
            )
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        self._offsets = [self._log_size(r) for r in range(self.world_size)]
        self._ready = False
        self._start_time = time.monotonic()

    def _wait_ready(self) -> None:
        if self._ready:
            return
        pending = set(range(self.world_size))
        startup_timeout = max(self.timeout, 120.0)
        deadline = self._start_time + startup_timeout
        first = True
        while pending:
            remaining = deadline - time.monotonic()
            # Look at the pipes once before giving up: a pool whose first use came long
            # after its start (a slow fixture in between) may have been ready all along.
            if remaining <= 0 and not first:
                out = self._outputs(range(self.world_size))
                self._kill()
                msg = f"DistPool({self.world_size}) start-up timed out after {startup_timeout:.0f}s"
                raise WorkerTimeoutError(msg + self._format_outputs(out, sorted(pending)))
            waitables = [self._conns[r] for r in pending] + [
                self._procs[r].sentinel for r in pending
            ]
            multiprocessing.connection.wait(waitables, timeout=max(remaining, 0.0))
            first = False
            for r in sorted(pending):
                msg_ok = False
                try:
                    if self._conns[r].poll():
                        tag = pickle.loads(self._conns[r].recv_bytes())[0]
                        msg_ok = tag == "ready"
                    elif self._procs[r].is_alive():
                        continue
                except (EOFError, OSError):
                    pass
                if msg_ok:
                    pending.discard(r)
                    continue
                # died during start-up
                time.sleep(0.2)
                out = self._outputs(range(self.world_size))
                code = self._procs[r].exitcode
                self._kill()
                raise WorkerError(
                    f"DistPool({self.world_size}) rank {r} died during start-up "
                    f"(exit code {code})" + self._format_outputs(out, list(range(self.world_size)))
                )
        self._ready = True
        self._offsets = [self._log_size(r) for r in range(self.world_size)]

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._store = None
        self._ready = False

    def _restart(self) -> None:
        self._kill()
        self._start()  # start-up overlaps with whatever the caller does next

    def close(self) -> None:
        """Stop the workers (gracefully if idle) and remove their logs."""
        if self._closed:
            return
        self._closed = True
        if self._busy:
            self._kill()
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (EOFError, OSError):
                pass
        deadline = time.monotonic() + 2.0  # then kill: nothing is lost by it
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()
        shutil.rmtree(self._logdir, ignore_errors=True)

    def __enter__(self) -> DistPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"generation {self.generation}"
        return (
            f"DistPool(world_size={self.world_size}, backend={self.backend!r}, timeout={self.timeout}, "
            f"start_method={self.start_method!r}, {state})"
        )

    # -- output capture ----------------------------------------------------

    def _log_size(self, rank: int) -> int:
        try:
            return os.path.getsize(self._logs[rank])
        except OSError:
            return 0

    def _outputs(self, ranks: Any) -> dict[int, str]:
        out = {}
        for r in ranks:
            try:
                with open(self._logs[r], "rb") as f:
                    f.seek(self._offsets[r])
                    out[r] = f.read().decode("utf-8", errors="replace")
            except OSError:
                out[r] = ""
        return out

    @staticmethod
    def _format_outputs(out: dict[int, str], ranks: Any) -> str:
        parts = []
        for r in ranks:
            text = out.get(r, "")
            if not text.strip():
                continue
            if len(text) > _MAX_OUTPUT_CHARS:
                text = "...(truncated)...\n" + text[-_MAX_OUTPUT_CHARS:]
            parts.append(f"\n--- captured output of rank {r} ---\n" + _prefix(text, f"[rank {r}]"))
        return "".join(parts)

    # -- tasks -------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return results in rank order."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        module_name, qualname = _fn_ref(fn)
        if module_name in self._recent_modules:
            self._recent_modules.remove(module_name)
        self._recent_modules = [*self._recent_modules, module_name][-3:]
        name = f"{module_name}.{qualname}"
        payload = pickle.dumps((module_name, qualname, args, kwargs), pickle.HIGHEST_PROTOCOL)
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("DistPool.run is not re-entrant / thread-safe")
        try:
            return self._run(name, payload)
        finally:
            self._lock.release()

    def _run(self, name: str, payload: bytes) -> list[Any]:
        ws = self.world_size
        if self._busy:  # the previous run() was interrupted: replies may be in flight
            self._kill()
        if not self._procs:
            self._start()
        self._wait_ready()
        self._offsets = [self._log_size(r) for r in range(ws)]

        # ("ok", value, seq) | ("err", traceback, seq) | ("died", exitcode, None)
        results: dict[int, tuple[Any, Any, Any]] = {}

        last_progress = time.monotonic()

        def collect(r: int) -> None:
            nonlocal last_progress
            try:
                while self._conns[r].poll():
                    msg = pickle.loads(self._conns[r].recv_bytes())
                    if msg[0] == "beat":
                        last_progress = time.monotonic()
                        continue
                    results[r] = msg
                    return
            except (EOFError, OSError):
                pass
            except Exception:
                results[r] = (
                    "err",
                    "reply could not be unpickled:\n" + traceback.format_exc(),
                    None,
                )
                return
            if not self._procs[r].is_alive():
                results[r] = ("died", self._procs[r].exitcode, None)

        self._busy = True
        for r in range(ws):
            try:
                self._conns[r].send_bytes(payload)
            except (EOFError, OSError):
                self._procs[r].join(timeout=1)
                results[r] = ("died", self._procs[r].exitcode, None)

        start = last_progress = time.monotonic()
        first_failure: float | None = None
        timed_out = False
        while len(results) < ws:
            now = time.monotonic()
            if first_failure is None and any(v[0] != "ok" for v in results.values()):
                first_failure = now
            deadline = last_progress + self.timeout
            timed_out = now >= deadline
            wait_until = deadline
            if first_failure is not None:
                wait_until = min(deadline, first_failure + self.failure_grace)
            if now >= wait_until:
                break
            pending = [r for r in range(ws) if r not in results]
            waitables = [self._conns[r] for r in pending] + [
                self._procs[r].sentinel for r in pending
            ]
            multiprocessing.connection.wait(waitables, timeout=wait_until - now)
            for r in pending:
                collect(r)
        elapsed = time.monotonic() - start
        stuck = [r for r in range(ws) if r not in results]

        if stuck:  # ask for their stacks, then kill and restart everything
            for r in stuck:
                pid = self._procs[r].pid
                if hasattr(signal, "SIGUSR1") and pid is not None:
                    try:
                        os.kill(pid, signal.SIGUSR1)
                    except OSError:
                        pass
            time.sleep(0.3)
        out = self._outputs(range(ws))
        failures: dict[int, str] = {}
        for r, (tag, info, _) in sorted(results.items()):
            if tag == "err":
                failures[r] = info
            elif tag == "died":
                failures[r] = f"worker process died (exit code {info})"
        for r in range(ws):
            if out.get(r):
                sys.stdout.write(_prefix(out[r], f"[rank {r}]") + "\n")

        seqs = {v[2] for v in results.values()}
        unclean = bool(stuck) or len(seqs) != 1 or None in seqs
        if unclean:
            self._restart()
        self._busy = False

        if stuck:
            why = (
                f"after rank(s) {sorted(failures)} failed (failure_grace={self.failure_grace:g}s)"
                if failures and not timed_out
                else f"(no progress for timeout={self.timeout:g}s)"
            )
            msg = (
                f"{name} did not finish on rank(s) {stuck} of {ws} within {elapsed:.1f}s {why}; "
                f"the pool was killed and restarted. Stacks of unfinished ranks are in their output."
            )
            raise WorkerTimeoutError(msg + self._format_failures(failures, out), failures)
        if failures:
            msg = f"{name} failed on rank(s) {sorted(failures)} of {ws}"
            if unclean:
                msg += " (ranks ended out of step; the pool was restarted)"
            raise WorkerError(msg + self._format_failures(failures, out), failures)
        if unclean:
            sys.stderr.write(
                f"[DistPool] {name}: ranks ended with different collective counts "
                f"{[results[r][2] for r in range(ws)]}; restarted the pool for a clean group\n"
            )
        return [results[r][1] for r in range(ws)]

    def _format_failures(self, failures: dict[int, str], out: dict[int, str]) -> str:
        parts = [f"\n{_prefix(tb, f'[rank {r}]')}" for r, tb in sorted(failures.items())]
        return "".join(parts) + self._format_outputs(out, range(self.world_size))


# --------------------------------------------------------------------------
# session-wide cache
# --------------------------------------------------------------------------

_POOLS: dict[tuple[int, str], DistPool] = {}
_POOLS_LOCK = threading.Lock()
_LIVE_POOLS: weakref.WeakSet[DistPool] = weakref.WeakSet()


def _close_live_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()


# Registered after multiprocessing's own exit hook (imported above), so it runs
# first: that hook joins non-daemon children and would wait forever on the idle
# workers of a pool nobody closed.
atexit.register(_close_live_pools)


def get_pool(world_size: int, backend: str = "gloo") -> DistPool:
    """The shared pool for ``world_size`` ranks on ``backend``, started on first use."""
    with _POOLS_LOCK:
        pool = _POOLS.get((world_size, backend))
        if pool is None or pool.closed:
            timeout = float(os.environ.get("FSDP_WRAP_TEST_TIMEOUT", _DEFAULT_TIMEOUT))
            pool = DistPool(world_size, timeout=timeout, backend=backend)
            _POOLS[(world_size, backend)] = pool
        return pool


def close_all_pools() -> None:
    """Close every pool made by :func:`get_pool` (pytest session end / exit)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()
