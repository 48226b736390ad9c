"""The ring's worker thread on CPU: runs the functions submitted to it one at a time, in the order submitted.

What a one-worker ``ThreadPoolExecutor`` does, with less host work per function (a fused layer submits one per
hop, hundreds per training step): no ``Future`` (a condition and a lock each) and no executor lock per
submit. A submitted function's ``Job`` answers ``done()`` and ``result()`` as a future does.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable


class Job:
    """One submitted function: ``result()`` blocks until it ran, then returns its value or raises its error."""

    __slots__ = ("fn", "finished", "value", "error", "worker")

    def __init__(self, fn: Callable[[], object], worker: RingWorker) -> None:
        self.fn, self.worker = fn, worker
        self.finished = False
        self.value: object = None
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.finished

    def result(self) -> object:
        if not self.finished:
            self.worker.wait_for(self)
        if self.error is not None:
            raise self.error
        return self.value


class RingWorker:
    """One thread working a queue of ``Job``s in order. It ends when its owner is collected (``owner``: the
    ``Ring``; the thread holds no reference to it) or, after the jobs queued before, when the interpreter exits
    (before it finalizes, as an executor's workers do: a thread still inside gloo then would abort the process)."""

    def __init__(self, owner: object, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition(threading.Lock())
        self._waiting = 0
        self.queued = 0  # jobs submitted and not finished (0: the thread is idle, nothing waits in its queue)
        threading.Thread(target=_work, args=(self._jobs, self._done), name=name).start()
        weakref.finalize(owner, self._jobs.put, None)
        _LIVE.add(self)

    def stop(self) -> None:
        """End the thread after the jobs submitted so far."""
        self._jobs.put(None)

    def submit(self, fn: Callable[[], object]) -> Job:
        job = Job(fn, self)
        with self._done:  # (the thread lowers it under the same lock)
            self.queued += 1
        self._jobs.put(job)
        return job

    def wait_for(self, job: Job) -> None:
        with self._done:
            self._waiting += 1
            try:
                while not job.finished:
                    self._done.wait()
            finally:
                self._waiting -= 1


_LIVE: weakref.WeakSet[RingWorker] = weakref.WeakSet()


def _stop_all() -> None:
    for worker in list(_LIVE):
        worker.stop()


threading._register_atexit(_stop_all)  # before threading joins its threads at exit (what executors use)


def _work(jobs: queue.SimpleQueue, done: threading.Condition) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            job.value = job.fn()
        except BaseException as err:  # noqa: BLE001 - re-raised by result(), on the thread that waits
            job.error = err
        job.fn = None
        with done:
            job.finished = True
            job.worker.queued -= 1
            if job.worker._waiting:
                done.notify_all()
        del job
