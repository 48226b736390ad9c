"""The fault-injection suite's report: one line at the end of the test run,
``faults: N tried, M ended cleanly, R completed after restart (final weights equal to an uninterrupted run's: max abs
diff D in fp32), B bytes of checkpoint lost``, and one line per fault with its wall time."""

import os
import sys
from dataclasses import dataclass

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: harness, hf_models

_TRIED: list["Fault"] = []


@dataclass
class Fault:
    name: str
    clean: bool = False  # set by the test once every check of a clean ending has passed
    seconds: float = 0.0  # wall time of the launch that met the fault
    bytes_lost: int = 0  # bytes of an earlier complete checkpoint that the fault made unreadable
    detail: str = ""
    completed: bool = False  # a restarted run that finished (tests/faults/test_restarts.py)
    max_diff: float | None = None  # its final weights against an uninterrupted run's, max abs difference


@pytest.fixture
def fault(request) -> Fault:
    record = Fault(request.node.callspec.params.get("name", request.node.name)
                   if hasattr(request.node, "callspec") else request.node.name)
    _TRIED.append(record)
    return record


def pytest_terminal_summary(terminalreporter) -> None:
    if not _TRIED:
        return
    write = terminalreporter.write_line
    write("")
    for f in _TRIED:
        state = "completed after restart" if f.completed else "ended cleanly" if f.clean else "NOT clean"
        write(f"fault {f.name}: {state} in {f.seconds:.1f} s, {f.bytes_lost} bytes lost{f.detail}")
    clean = sum(f.clean for f in _TRIED)
    lost = sum(f.bytes_lost for f in _TRIED)
    restarted = [f for f in _TRIED if f.max_diff is not None]
    completed = sum(f.completed for f in restarted)
    weights = ""
    if restarted:
        diff = max(f.max_diff for f in restarted)
        weights = (f" (final weights {'equal to' if diff == 0 else 'differ from'} an uninterrupted run's: max abs "
                   f"diff {diff:g} in fp32)")
    write(f"faults: {len(_TRIED)} tried, {clean} ended cleanly, {completed} completed after restart{weights}, "
          f"{lost} bytes of checkpoint lost")
