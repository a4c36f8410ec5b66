"""The worker side of the test harness (:mod:`tests._dist`): what runs in each
rank's process.

A worker joins the pool's process group, then runs the tasks its pool sends
(a function by module and name, pickled arguments), each from the same reset
state, reporting results, exceptions and progress (:func:`progress`) back.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # noqa: F401  (registers its atexit hook before ours)
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

__all__ = ["progress", "silence_torch_noise"]

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)
_HOST = "127.0.0.1"

# Warnings raised *inside* torch about torch's own internals.  A FutureWarning
# attributed (via stacklevel) to our code is a real signal and stays visible.
TORCH_NOISE_MODULE = r"torch(\.|$)"


def silence_torch_noise() -> None:
    """Ignore FutureWarnings whose reported location is inside torch."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=TORCH_NOISE_MODULE)



# --------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------

_TASK_CONN: multiprocessing.connection.Connection | None = None  # set in workers


def progress() -> None:
    """Tell the pool this rank is still making progress (from inside a task).

    The pool's ``timeout`` then counts again from now.  A no-op outside a
    worker, so shared test code may call it anywhere.
    """
    if _TASK_CONN is not None:
        _TASK_CONN.send_bytes(pickle.dumps(("beat", None, None)))



def _resolve(module_name: str, qualname: str) -> Any:
    if module_name == "__main__" and "__mp_main__" in sys.modules:
        module_name = "__mp_main__"  # the parent's script, as spawn imports it
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _watch_parent(parent_pid: int) -> None:
    # A worker whose pool owner died must not linger (it may be stuck in gloo).
    # (With forkserver the OS parent is the fork server, so ask about the owner.)
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except OSError:
            pass


def _reset_task_state(torch: Any) -> None:
    import random

    random.seed(0)
    torch.manual_seed(0)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(0)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    get_default_device = getattr(torch, "get_default_device", None)
    if get_default_device is not None and get_default_device().type != "cpu":
        torch.set_default_device(None)


def _worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    conn: multiprocessing.connection.Connection,
    log_path: str,
    pg_timeout_s: float,
    parent_pid: int,
    preload: list[str],
    backend: str = "gloo",
) -> None:
    # 1. Everything this process writes, Python or C++, goes to its log.
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        except Exception:
            pass

    import faulthandler

    if hasattr(signal, "SIGINT"):  # Ctrl-C is the parent's business; it kills us
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    faulthandler.enable()
    if hasattr(signal, "SIGUSR1"):  # the parent asks for stacks before a kill
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()

    # 2. Environment, before torch is imported.
    os.environ.update(
        {
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": _HOST,
            "MASTER_PORT": str(store_port),
        }
    )
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        if any(name == "lo" for _, name in socket.if_nameindex()):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if _REPO_ROOT not in sys.path:
        sys.path.insert(0, _REPO_ROOT)
    if _TESTS_DIR not in sys.path:
        sys.path.append(_TESTS_DIR)
    silence_torch_noise()

    # 3. The process group.
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    timeout = timedelta(seconds=pg_timeout_s)
    store = dist.TCPStore(_HOST, store_port, is_master=False, timeout=timeout)
    if backend == "nccl":
        # NCCL needs a GPU per rank: rank r drives cuda:r.
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)

    def seq() -> int | None:
        if not dist.is_initialized():
            return None
        try:
            pg: Any = dist.distributed_c10d._get_default_group()
            return int(pg._get_sequence_number_for_group())
        except Exception:
            return None

    # Modules the pool's recent tasks came from: importing them is start-up
    # work, not something the next task's timeout should pay for.
    for name in preload:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: B036  (the task itself will report it)
            pass

    # What this process holds now (torch, the preloaded modules) lives as long
    # as it does: out of the collector's sight (gc.freeze), each full collection
    # (automatic, or a test's gc.collect()) walks only what the tasks make, not
    # some 170,000 objects more: a test's gc.collect() took 0.2-0.5 s.  No
    # collection first: it would cost every start (a restart after each
    # injected failure) 0.2 s a rank, for the few cycles that imports leave.
    # What tasks make is collected as before.
    gc.freeze()

    conn.send_bytes(pickle.dumps(("ready", os.getpid(), seq())))
    global _TASK_CONN
    _TASK_CONN = conn

    # 4. Serve tasks until told to stop (None) or the parent goes away.
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            break
        reply: Any
        try:
            task = pickle.loads(request)
            if task is None:
                break
            module_name, qualname, args, kwargs = task
            _reset_task_state(torch)
            fn = _resolve(module_name, qualname)
            value = fn(*args, **kwargs)
            reply = ("ok", value)
        except BaseException:  # noqa: BLE001  (SystemExit etc. are failures of the task too)
            reply = ("err", traceback.format_exc())
        task = args = kwargs = value = None
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            data = pickle.dumps((*reply, seq()), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # noqa: BLE001
            data = pickle.dumps(
                ("err", "return value could not be pickled:\n" + traceback.format_exc(), seq())
            )
        reply = None
        try:
            conn.send_bytes(data)
        except (EOFError, OSError):
            break
        # and what a task imported (transformers, PEFT: some 300,000 objects)
        # the same way, once the parent has its reply
        gc.collect()
        gc.freeze()

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
