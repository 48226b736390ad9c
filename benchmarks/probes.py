"""What a bench rank measures besides step time: the peak memory of a step above what it held before
(``peak_step_bytes``, under the allocator settings of ``MMAP_ENV``), the parameter shards and optimizer state it
holds between steps (``resident_bytes``), and the seconds Python's garbage collector ran (``CollectorClock``)."""

from __future__ import annotations

import gc
import os
import time

import torch

MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def peak_step_bytes(fn) -> int:
    """Peak resident memory of this process while ``fn`` runs, above what it held just before.

    Needs the allocator settings of ``MMAP_ENV`` at process start (``--memory`` runs are started with them): every
    allocation of 64 KiB or more is then its own mapping and goes back to the system when freed, on whichever thread
    frees it, so the resident size follows the live tensors. (The profiler's per-op allocation events miss frees
    made on gloo's threads, and overstated the schedules that keep hops in flight.) Sampled every 0.2 ms."""
    import gc
    import threading

    page = os.sysconf("SC_PAGE_SIZE")

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    gc.collect()
    base = resident()
    peak, done = [base], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident())
            done.wait(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], resident()) - base


def resident_bytes(runner) -> int:
    """Bytes this rank holds for a variant (``worker.Runner``) between steps: parameter shards and optimizer state."""
    if runner.model is None:
        return 0
    seen, total = set(), 0
    for p in runner.model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.data_ptr() not in seen:
            seen.add(local.data_ptr())
            total += local.numel() * local.element_size()
    opt = getattr(runner.opt, "optimizer", runner.opt)
    for state in getattr(opt, "state", {}).values():
        for v in state.values():
            if torch.is_tensor(v):
                local = v.to_local() if hasattr(v, "to_local") else v
                total += local.numel() * local.element_size()
    return total


class CollectorClock:
    """Seconds Python's garbage collector ran in this process since the last ``take()`` (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.total, self._began = 0.0, 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._began

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total
