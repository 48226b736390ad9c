"""One step's timeline: when each hop and compute piece ran, per thread (``record_timeline``), and a Chrome /
Perfetto trace of several ranks' (``write_chrome_trace``). The recipes and the bench draw and save it."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.autograd.profiler import record_function

from .ring.transport import observe_ring, observe_sent

_NO_LABEL = contextlib.nullcontext()


def labelled(name: str) -> contextlib.AbstractContextManager:
    """A ``record_function`` range named ``name`` while torch's profiler records, else nothing (a range costs host
    time even when nobody records: a fused layer opens two a call)."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _NO_LABEL


@dataclass
class Timeline:
    """Intervals of one rank: ``{"lane", "op", "k", "t0", "t1"}`` (``k``: the hop's or piece's index in its
    ring), seconds from ``origin`` (a ``perf_counter()`` time, the start of the recording). Lanes (``LANES``):
    ``compute`` (the host's compute pieces), ``ring`` (hops the main thread waited for, fused), ``ring-thread``
    (the ring thread's work: the link's hops and async collectives), ``ring-thread-2`` (a second ring's thread:
    HSDP's replicate group), ``device`` (an emulated accelerator's busy time, added by the bench), ``waited`` (the
    main thread blocked on a hop: from its wait's start to its end; on CUDA the host does not block, so the lane
    stays empty)."""

    events: list[dict] = field(default_factory=list)
    origin: float = field(default_factory=time.perf_counter)
    # bytes this rank sent, per layer or unit and phase, and what was on the wire: {"layer op": [bytes, format]}
    sent: dict[str, list] = field(default_factory=dict)
    LANES = ("compute", "device", "ring", "ring-thread", "ring-thread-2", "waited")

    def chrome_trace(self, rank: int = 0) -> list[dict]:
        lanes = {lane: tid for tid, lane in enumerate(self.LANES)}
        trace = [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}}
                 for lane, tid in lanes.items()]
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for e in self.events:
            event = {"name": f"{e['op']} {e['k']}", "ph": "X", "pid": rank, "tid": lanes[e["lane"]],
                     "ts": e["t0"] * 1e6, "dur": max(e["t1"] - e["t0"], 0.0) * 1e6, "cat": e["lane"]}
            if "bytes" in e:
                event["args"] = {"layer": e["layer"], "bytes": e["bytes"], "format": e["format"]}
            trace.append(event)
        if self.sent:  # the step's bytes per layer and phase, and their format on the wire
            trace.append({"name": "bytes sent", "ph": "i", "s": "p", "pid": rank, "tid": lanes["ring"], "ts": 0,
                          "args": {what: f"{nbytes} B, {fmt}" for what, (nbytes, fmt) in self.sent.items()}})
        return trace


@contextlib.contextmanager
def record_timeline() -> Iterator[Timeline]:
    """Record the hops and compute pieces of everything run inside (cost: a clock read per event)."""
    timeline = Timeline()
    origin, main = timeline.origin, threading.get_ident()
    thread_lanes: dict[int, str] = {}  # ring threads by first appearance: a second one is HSDP's replicate ring
    open_hops: dict[tuple[int, str, int], float] = {}
    open_compute: dict[tuple[str, int], float] = {}
    open_waits: dict[tuple[str, int], float] = {}
    sending: dict[tuple[int, str, int], tuple[str, int, str]] = {}  # a requested hop's layer, bytes and format

    def on_sent(what: str, op: str, k: int, nbytes: int, fmt: str) -> None:
        sending[(threading.get_ident(), op, k)] = (what, nbytes, fmt)
        total = timeline.sent.setdefault(f"{what} {op}", [0, fmt])
        total[0] += nbytes
        if total[1] != fmt:
            total[1] = f"{total[1]}+{fmt}"

    def on_event(event: str, op: str, k: int) -> None:
        now, thread = time.perf_counter() - origin, threading.get_ident()
        if event in ("start", "issued"):  # issued/landed: a hop the link worked (on its thread)
            open_hops[(thread, op, k)] = now
        elif event == "wait" and thread == main:
            open_waits[(op, k)] = now
        elif event in ("done", "landed"):
            w0 = open_waits.pop((op, k), None) if thread == main else None
            if w0 is not None:
                timeline.events.append({"lane": "waited", "op": op, "k": k, "t0": w0, "t1": now})
            t0 = open_hops.pop((thread, op, k), None)
            if t0 is not None:
                lane = "ring" if thread == main else thread_lanes.setdefault(
                    thread, "ring-thread" if not thread_lanes else f"ring-thread-{len(thread_lanes) + 1}")
                interval = {"lane": lane, "op": op, "k": k, "t0": t0, "t1": now}
                said = sending.pop((thread, op, k), None)
                if said is not None:
                    interval.update(layer=said[0], bytes=said[1], format=said[2])
                timeline.events.append(interval)
        elif event == "compute_begin":
            open_compute[(op, k)] = now
        elif event == "compute":
            t0 = open_compute.pop((op, k), None)
            if t0 is not None:
                timeline.events.append({"lane": "compute", "op": op, "k": k, "t0": t0, "t1": now})

    with observe_ring(on_event), observe_sent(on_sent):
        yield timeline


def write_chrome_trace(path: str, per_rank: list[list[dict]]) -> None:
    """One Chrome / Perfetto trace file (open it in ui.perfetto.dev or chrome://tracing) for all ranks."""
    trace = []
    for rank, events in enumerate(per_rank):
        trace += Timeline(events).chrome_trace(rank)
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
