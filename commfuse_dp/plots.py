"""PNG plots of benchmark results: the sweep (step time per schedule against link rate) and ring timelines."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"defaults": "#ff00ff", "fused": "#d62728", "slicing": "#1f77b4", "fsdp2": "#2ca02c", "deepspeed_zero3": "#9467bd",
          "ddp": "#8c564b", "compute_only": "#7f7f7f", "comm_only": "#bcbd22", "fused_noprefetch": "#ff9896",
          "fused_lockstep": "#e377c2", "concurrent": "#17becf", "hsdp_fused": "#ff7f0e", "hsdp_slicing": "#aec7e8",
          "fsdp2_hsdp": "#98df8a", "fused_ring": "#c5b0d5", "fused_bundles": "#8c6d31",
          "fsdp2_overlap": "#000000", "fsdp2_coarse": "#555555", "fsdp2_torch": "#aaaaaa", "defaults_nohints": "#ffa0ff",
          "fused_bf16": "#bcbd22", "fused_fp8": "#7f7f7f", "fused_int8": "#17a768", "fused_int8_int8": "#0b5d3a",
          "fsdp2_bf16": "#6b6b00", "fsdp2_int8": "#5fa8d3", "fsdp2_int8_int8": "#1b4f72",
          "hsdp_fused_bf16": "#ffbb78", "hsdp_fused_int8": "#e6550d", "hsdp_fused_int8_int8": "#a63603",
          "fsdp2_hsdp_bf16": "#74c476", "fsdp2_hsdp_int8": "#31a354", "fsdp2_hsdp_int8_int8": "#006d2c"}
LANES = {"compute": ("compute", "#4c72b0"), "device": ("emulated device busy", "#8172b3"),
         "ring": ("hops (fused)", "#dd8452"), "ring-thread": ("ring thread (async)", "#55a868"),
         "ring-thread-2": ("replicate ring thread (HSDP)", "#c44e52"),
         "waited": ("main thread waited on a hop", "#937860")}


def sweep_png(records: list[dict], path: str, title: str) -> None:
    """Step time against link rate, one line per schedule, the overlap limit dashed."""
    fig, ax = plt.subplots(figsize=(8, 5))
    order = list(COLORS)
    schedules = sorted({r["schedule"] for r in records}, key=lambda s: (order.index(s) if s in order else len(order), s))
    for schedule in schedules:
        rows = sorted((r for r in records if r["schedule"] == schedule), key=lambda r: r["rate_mbit"])
        style = ":" if schedule in ("compute_only", "comm_only", "concurrent") else "-"
        ax.plot([r["rate_mbit"] / 8000 for r in rows], [r["step_s"] for r in rows], style, marker="o",
                color=COLORS.get(schedule), label=schedule)
    limit = {}
    for r in records:
        if r["schedule"] in ("compute_only", "comm_only"):
            limit[r["rate_mbit"]] = max(limit.get(r["rate_mbit"], 0.0), r["step_s"])
    if limit:
        rates = sorted(limit)
        ax.plot([x / 8000 for x in rates], [limit[x] for x in rates], "--", color="black", linewidth=1,
                label="overlap limit max(compute, comm)")
    ax.set_xscale("log")
    ax.set_xlabel("link rate per rank (GB/s)")
    ax.set_ylabel("median step time (s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_png(per_rank: dict[str, list[list[dict]]], path: str, title: str) -> None:
    """One panel per schedule, one row per rank and lane: compute pieces and hops on a time axis."""
    schedules = [s for s in per_rank if any(per_rank[s])]
    fig, axes = plt.subplots(len(schedules), 1, figsize=(12, 1.2 + 1.6 * len(schedules) * max(
        (len(per_rank[s]) for s in schedules), default=1) / 2), squeeze=False)
    for ax, schedule in zip(axes[:, 0], schedules):
        ranks = per_rank[schedule]
        origin = min((e["t0"] for events in ranks for e in events), default=0.0)
        labels, y = [], 0
        for rank, events in enumerate(ranks):
            for lane, (lane_name, color) in LANES.items():
                spans = [(e["t0"] - origin, e["t1"] - e["t0"]) for e in events if e["lane"] == lane]
                if not spans:
                    continue
                ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=color, edgecolors="none")
                labels.append(f"rank {rank} {lane_name}")
                y += 1
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(f"{schedule}: one training step", fontsize=9)
        ax.set_xlabel("seconds")
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
