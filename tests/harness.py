"""Multi-process harness for every distributed test: N ranks, gloo, a TCP store on loopback, a hard timeout.

    from harness import run_ranks
    values = run_ranks(worker, world_size=3, args=(...,))   # worker(rank, world_size, *args) -> picklable

- Ranks are separate processes started from a fork server that has torch, the library and transformers' model
  classes preloaded (``PRELOAD``: a rank starts in ~0.1 s instead of importing them for seconds). ``worker`` must be a module-level function of an importable module.
- The parent hosts the TCP store on 127.0.0.1 (a free port chosen by the OS), so ports never collide between
  tests; each rank joins it and calls ``init_process_group`` before ``worker`` runs.
- Each rank computes on one thread (``torch.set_num_threads(1)``), as under torchrun.
- Each rank's stdout/stderr (C++ included) goes to a log file. A rank that raises, dies or is still running at
  ``timeout`` fails the call (hung ranks are killed) with every failed rank's error, traceback and log tail.
- ``check=False`` returns a ``RankResult`` per rank instead, for tests that make ranks fail on purpose.
- A rank that returns normally exits through the normal interpreter shutdown, so a crash at exit still shows up
  as a non-zero exit code and fails the test.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

_CTX = None
# Imported once by the fork server, so that each rank starts with them loaded: torch alone is ~2.5 s a process
# here, the library's engine (its modules named here: they pull in FSDP2, DTensor and dynamo; the package alone
# loads them on first use) 1.6 s more, transformers' model classes ~3 s more.
# Nothing here reads the environment at import time that a test's ``env`` would change.
PRELOAD = ["torch", "torch.distributed", "harness", "hf_models", "commfuse_dp", "commfuse_dp.shard",
           "commfuse_dp.describe", "commfuse_dp.tp", "commfuse_dp.ring",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.bert.modeling_bert"]
_LOG_TAIL = 4000


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


@dataclass
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    hung: bool = False
    log: str = ""

    def describe(self) -> str:
        if self.hung:
            head = "still running at the timeout (killed)"
        elif self.error_type:
            head = f"raised {self.error_type}: {self.error}\n{self.traceback}"
        else:
            head = f"exited with code {self.exitcode} without a result"
        return f"--- rank {self.rank}: {head}\n--- rank {self.rank} log (tail):\n{self.log[-_LOG_TAIL:]}"


def run_ranks(worker: Callable[..., Any], world_size: int, args: tuple = (), *, timeout: float = 120.0,
              backend: str = "gloo", pg_timeout: float = 60.0, check: bool = True,
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` fresh processes in one process group."""
    from torch.distributed import TCPStore

    ctx = _context()
    store = TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout))
    with tempfile.TemporaryDirectory(prefix="commfuse-ranks-") as tmp:
        procs = [ctx.Process(target=_rank_main, name=f"rank{r}",
                             args=(r, world_size, store.port, worker, args, tmp, backend, pg_timeout, env or {}))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            time.sleep(0.02)
        hung = [p.is_alive() for p in procs]
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
        results = [_collect(r, procs[r].exitcode, hung[r], tmp) for r in range(world_size)]
    del store
    if not check:
        return results
    failed = [res for res in results if not res.ok]
    if failed:
        raise AssertionError(f"{len(failed)} of {world_size} ranks failed running {worker.__name__}:\n"
                             + "\n".join(res.describe() for res in failed))
    return [res.value for res in results]


def _collect(rank: int, exitcode: int | None, hung: bool, tmp: str) -> RankResult:
    log = ""
    log_path = os.path.join(tmp, f"rank{rank}.log")
    if os.path.exists(log_path):
        with open(log_path, errors="replace") as f:
            log = f.read()
    result_path = os.path.join(tmp, f"rank{rank}.result")
    payload = None
    if os.path.exists(result_path):
        with open(result_path, "rb") as f:
            payload = pickle.load(f)
    res = RankResult(rank=rank, ok=False, exitcode=exitcode, hung=hung, log=log)
    if payload is not None and payload[0] == "ok":
        res.value = payload[1]
        res.ok = exitcode == 0 and not hung
    elif payload is not None:
        res.error_type, res.error, res.traceback = payload[1:]
    return res


def _rank_main(rank: int, world_size: int, port: int, worker: Callable[..., Any], args: tuple, tmp: str,
               backend: str, pg_timeout: float, env: dict[str, str]) -> None:
    log_fd = os.open(os.path.join(tmp, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # One compute thread per rank, as torchrun gives its workers (OMP_NUM_THREADS=1): with more ranks than cores,
    # each rank's OpenMP threads spin waiting for work and starve the others (3 ranks of tiny Llama on 2 cores:
    # 7.2 s for 5 steps with 2 threads each, 1.2 s with one).
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result_path = os.path.join(tmp, f"rank{rank}.result")
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=pg_timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        value = worker(rank, world_size, *args)
        _write(result_path, ("ok", value))
    except BaseException as err:  # reported to the parent; the group may be broken, so leave at once
        _write(result_path, ("error", type(err).__name__, str(err), traceback.format_exc()))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS just handed out (for a launcher's --master_port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_messages(name: str = "commfuse_dp", level: int = 20) -> list[str]:
    """Collect the messages of logger ``name`` at ``level`` (INFO) and above from now on, in a list."""
    import logging

    messages: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(level)
    return messages


def _write(path: str, payload: tuple) -> None:
    tmp_path = path + ".tmp"
    with open(tmp_path, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp_path, path)
