"""Where a step's waits are, per rank, from the timeline the bench writes (``bench-out/trace.json``).

    python benchmarks/trace_waits.py bench-out/trace.json            # the fused step
    python benchmarks/trace_waits.py bench-out/trace.json --schedule slicing

For each rank: the time its compute thread waited on hops, split at its first fused compute piece, the end
of its forward, the start of its backward and the end of its last piece (a wait after the last piece is the step's
tail: the last hops, or the other rank still computing); the longest waits; and the idle gaps of its ring thread
longer than ``--gap-ms`` (a link that idles while the step is link-bound is time lost). The bench's table gives the
waits of many steps; this reads the one step of the timeline.
"""

from __future__ import annotations

import argparse
import json


def _merged(spans: list[tuple[float, float]]) -> list[list[float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def analyse(trace: dict, schedule: str = "fused", gap_ms: float = 1.0) -> list[dict]:
    """Per rank (``pid``): milliseconds waited in each part of the step, the longest waits, and the ring thread's
    busy time and idle gaps. Times are from the first event of the schedule's step."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"].startswith(schedule + ":")]
    if not events:
        raise ValueError(f"no '{schedule}:' events in the trace (schedules there: "
                         f"{sorted({e['name'].split(':')[0] for e in trace['traceEvents'] if e.get('ph') == 'X'})})")
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    ranks = []
    for pid in sorted({e["pid"] for e in events}):
        mine = [e for e in events if e["pid"] == pid]
        pieces = [e for e in mine if e["cat"] == "compute"]
        if not pieces:
            continue
        first = min(e["ts"] for e in pieces)
        last = max(e["ts"] + e["dur"] for e in pieces)
        forward = [e["ts"] + e["dur"] for e in pieces if ":forward" in e["name"]]
        backward = [e["ts"] for e in pieces if ":backward" in e["name"]]
        fwd_end = max(forward) if forward else first
        bwd_start = min(backward) if backward else last
        bounds = {"before the first piece": (t0, first), "forward": (first, fwd_end),
                  "between forward and backward": (fwd_end, bwd_start), "backward": (bwd_start, last),
                  "after the last piece": (last, t1 + 1)}
        waits = [e for e in mine if e["cat"] == "waited"]
        parts = {name: sum(e["dur"] for e in waits if a <= e["ts"] < b) / 1e3 for name, (a, b) in bounds.items()}
        link = _merged([(e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"].startswith("ring-thread")])
        gaps = [((link[i][1] - t0) / 1e3, (link[i + 1][0] - link[i][1]) / 1e3) for i in range(len(link) - 1)]
        ranks.append({
            "rank": pid, "step_ms": (t1 - t0) / 1e3, "last_piece_end_ms": (last - t0) / 1e3, "waited_ms": parts,
            "longest": [(e["name"], e["dur"] / 1e3, (e["ts"] - t0) / 1e3)
                        for e in sorted(waits, key=lambda e: -e["dur"])[:5]],
            "link_busy_ms": sum(b - a for a, b in link) / 1e3,
            "link_gaps": [(at, ms) for at, ms in gaps if ms > gap_ms],
        })
    return ranks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="a bench timeline (bench-out/trace.json)")
    parser.add_argument("--schedule", default="fused", help="whose step: fused (default) or slicing")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="ring thread idle gaps longer than this")
    args = parser.parse_args(argv)
    with open(args.trace) as f:
        ranks = analyse(json.load(f), args.schedule, args.gap_ms)
    for r in ranks:
        total = sum(r["waited_ms"].values())
        print(f"rank {r['rank']}: step {r['step_ms']:.1f} ms, last piece ended at {r['last_piece_end_ms']:.1f}, "
              f"waited {total:.1f} ms: " + ", ".join(f"{name} {ms:.1f}" for name, ms in r["waited_ms"].items()))
        print("  longest waits: " + ", ".join(f"{name} {ms:.1f} ms at {at:.0f}" for name, ms, at in r["longest"]))
        gaps = r["link_gaps"]
        print(f"  ring thread busy {r['link_busy_ms']:.1f} ms; idle gaps over {args.gap_ms:g} ms: "
              f"{sum(ms for _, ms in gaps):.1f} ms in {len(gaps)}"
              + "".join(f"\n    at {at:.1f} for {ms:.1f} ms" for at, ms in gaps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
