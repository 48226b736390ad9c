"""The planner, the benchmark's bookkeeping and plots, and one real (tiny) emulated-cluster run."""

import json
import re
import os
import shutil
import subprocess
import sys

import pytest

from commfuse_dp.planner import costs, plan, cli as plan_cli
from benchmarks.bench import balanced_rate, paired_ratios, records_from
from commfuse_dp.plots import sweep_png, timeline_png
from benchmarks.trace_waits import analyse as analyse_trace

SCHEDULES = plan.SCHEDULES


def _cluster(ranks=4, gbps=25.0, latency_us=10.0, tflops=300.0):
    return plan.Cluster(ranks, gbps * 1e9, latency_us * 1e-6, tflops * 1e12)


def test_planner_bounds():
    units = plan.units_for(*plan.KNOWN_MODELS["llama-7b"], tokens=4096, seq=4096)
    cl = _cluster()
    results = {s: plan.simulate(units, cl, s) for s in SCHEDULES}
    compute = results["fused"]["compute_s"]
    for s in SCHEDULES:
        assert results[s]["step_s"] >= compute * (1 - 1e-9), s  # nothing beats compute alone
    assert results["no_overlap"]["step_s"] > results["slicing"]["step_s"]
    assert results["no_overlap"]["step_s"] > results["fused"]["step_s"]
    # An infinitely fast link leaves compute alone, for every schedule.
    fast = plan.Cluster(4, 1e18, 0.0, cl.flops_per_s)
    for s in SCHEDULES:
        assert plan.simulate(units, fast, s)["step_s"] == pytest.approx(compute, rel=1e-6)
    # One rank: nothing to communicate.
    single = plan.Cluster(1, cl.bytes_per_s, cl.latency_s, cl.flops_per_s)
    assert plan.simulate(units, single, "no_overlap")["step_s"] == pytest.approx(compute, rel=1e-9)


def test_planner_ring_embedding_moves_the_smaller_of_rows_and_table():
    vocab, hidden = 128256, 4096
    units = plan.units_for(*plan.KNOWN_MODELS["llama3-8b"], tokens=4096, seq=4096)
    embedding = units[0]
    assert embedding.table == (vocab, hidden)
    # the rows other shards own travel, in one direct round (7/8 of them at 8 ranks); also at 64 ranks, where a
    # shard has 2004 rows, fewer than the tokens, but the table ring would move 63 of them
    assert embedding.exchange(8) == (1, 4096 * 7 // 8 * hidden)
    assert embedding.exchange(64) == (1, 4096 * 63 // 64 * hidden)
    # rows_ring (bench files without "embedding_rows"): a dense ring of every token's row, or the table beyond a
    # shard's rows
    assert embedding.exchange(8, rows_ring=True) == (7, 7 * 4096 * hidden)
    assert embedding.exchange(64, rows_ring=True) == (63, 63 * -(-vocab // 64) * hidden)
    # more tokens per rank than the table has rows: the table
    many = plan.Unit("embedding", 0, vocab * hidden, 0.0, tokens=2 * vocab, table=(vocab, hidden))
    assert many.exchange(8) == (7, 7 * -(-vocab // 8) * hidden)
    # Where rows travel, a slower link costs the fused schedule less than if the whole table had to travel.
    cl = _cluster(ranks=8, gbps=5.0)
    table_units = [plan.Unit("embedding", 0, vocab * hidden, 0.0)] + units[1:]
    assert plan.simulate(units, cl, "fused")["step_s"] < plan.simulate(table_units, cl, "fused")["step_s"]
    assert plan.simulate(units, cl, "slicing")["step_s"] < plan.simulate(table_units, cl, "slicing")["step_s"]
    # The peer (stock FSDP2) has no ring embedding: its root unit gathers the whole table either way.
    assert plan.simulate(units, cl, "fsdp2")["step_s"] == plan.simulate(table_units, cl, "fsdp2")["step_s"]


def test_balanced_rate_fits_a_fixed_part():
    # 0.1 s fixed + 600 s*Mbit/s: 0.7 s at 1000, 0.4 s at 2000; compute 0.5 s -> 600 / 0.4 = 1500 Mbit/s.
    assert balanced_rate(1000.0, 0.5, 0.7, 0.4) == 1500.0
    # Pure 1/rate scaling agrees with the one-point formula.
    assert balanced_rate(1000.0, 0.5, 0.8, 0.4) == 1600.0
    # Times that do not fit (noise: slower at the faster rate) fall back to 1/rate scaling.
    assert balanced_rate(1000.0, 0.5, 0.7, 0.75) == 1400.0


def test_planner_recommendations_grow_with_latency():
    low, high = plan.recommend(_cluster(latency_us=5)), plan.recommend(_cluster(latency_us=50))
    assert high["bucket_mb"] > low["bucket_mb"] and high["min_fuse_numel"] > low["min_fuse_numel"]


def test_plan_command(tmp_path, capsys):
    assert plan_cli.main(["--model", "gpt2", "--num-processes", "4", "--link-gbps", "10"]) == 0
    out = capsys.readouterr().out
    assert "no_overlap" in out and "fused" in out and "recommended: CommFuseConfig(" in out
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "vocab_size": 100}))
    assert plan_cli.main(["--model", str(config), "--num-processes", "2"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        plan_cli.main(["--model", "llama-3-8b"])  # a bad argument: exit 2, as argparse's, with the likely name
    assert exited.value.code == 2
    assert "neither a known shape" in (err := capsys.readouterr().err) and "did you mean 'llama3-8b'?" in err, err
    with pytest.raises(SystemExit):
        plan_cli.main(["--num-processes", "0"])
    with pytest.raises(SystemExit):
        plan_cli.main(["--tflops", "500", "--peak-tflops", "400"])  # achievable above the peak
    assert "above --peak-tflops" in capsys.readouterr().err


def test_plan_shows_fused_with_the_recommended_piece_shards(capsys):
    """The table is played with ``--piece-shards`` (default 1, the library's); when the recommendation differs, a
    ``fused, ps=B`` row shows what it gives (a new user's trial saw fused behind ``unit_slicing`` at the default and
    no word that the recommended config below it is ahead), equal to the ``fused`` row of ``--piece-shards B``."""
    def rows(*argv):
        assert plan_cli.main(["--model", "llama3-8b", "--num-processes", "8", *argv]) == 0
        out = capsys.readouterr().out
        table = {line[:12].strip(): float(line[12:].split()[0]) for line in out.splitlines()[2:]
                 if line[:12].strip() and line[12:].strip()[:1].isdigit()}
        return table, re.search(r"piece_shards=(\d+)\)", out).group(1)

    default, best = rows()
    assert best != "1" and f"fused, ps={best}" in default, default
    given, best_again = rows("--piece-shards", best)
    assert best_again == best and not any(name.startswith("fused, ps=") for name in given), given
    assert default[f"fused, ps={best}"] == given["fused"] < default["fused"]


def test_planner_plays_the_elastic_lookahead():
    from dataclasses import replace

    units = plan.units_for(*plan.KNOWN_MODELS["llama3-8b"], tokens=4096, seq=4096)
    cl = _cluster(ranks=8, gbps=25.0)
    lockstep = plan.simulate(units, cl, "lockstep")["step_s"]
    # A budget of 0 is lockstep; the default budget runs the link ahead and is faster here (8 ranks: lockstep
    # prefetches only 1/7 of each coming ring).
    assert plan.simulate(units, replace(cl, lookahead_bytes=0), "fused")["step_s"] == lockstep
    assert plan.simulate(units, cl, "fused")["step_s"] < lockstep
    # A budget smaller than any group requests nothing ahead: slower than the default.
    tiny = plan.simulate(units, replace(cl, lookahead_bytes=1.0), "fused")["step_s"]
    assert tiny > plan.simulate(units, cl, "fused")["step_s"]
    # Where latency bounds (256 ranks, 2048 tokens), a layer's four rings share their hops (a bundle per unit, per
    # phase, for weights and gradients): fused pays about one ring per layer like a per-layer gather, not four
    # (2.4x before). This library's slicing gathers per fused group, as it runs: four rings per layer.
    units = plan.units_for(*plan.KNOWN_MODELS["llama-7b"], tokens=2048, seq=2048)
    cl = _cluster(ranks=256, gbps=100.0)
    step = {s: plan.simulate(units, cl, s)["step_s"] for s in ("fused", "slicing", "unit_slicing")}
    assert step["fused"] / step["unit_slicing"] < 1.05, step
    assert step["fused"] < step["unit_slicing"] * 1.5 < step["slicing"], step
    # There "auto" bundles the forward too (255 x 33² hops); each forward ring alone would cost 1.37x.
    apart = plan.simulate(units, replace(cl, forward_bundles=False), "fused")["step_s"]
    assert step["fused"] == plan.simulate(units, replace(cl, forward_bundles=True), "fused")["step_s"]
    assert apart > 1.3 * step["fused"], (apart, step)
    # The bench's 4 layers at 8 ranks, where the link is as fast as compute (0.01 TFLOP/s, 255 Mbit/s): "auto"
    # sends each forward ring alone, and bundles would leave compute a layer's trailing groups behind the link.
    bench = plan.units_for(512, 1408, 4, 8, 8, 4096, tokens=512, seq=256)
    slow = replace(_cluster(ranks=8, gbps=255e6 / 8 / 1e9, latency_us=300, tflops=0.01), param_bytes=4, grad_bytes=4)
    together = plan.simulate(bench, replace(slow, forward_bundles=True), "fused")["step_s"]
    assert plan.simulate(bench, slow, "fused")["step_s"] == plan.simulate(
        bench, replace(slow, forward_bundles=False), "fused")["step_s"] < 0.97 * together


def test_plan_sweep(capsys):
    # --piece-fit none: the table's shape (the pieces' model is test_plan_models_the_gemm_pieces'; with it the
    # sweep tries every piece_shards in every cell, minutes instead of seconds)
    assert plan_cli.main(["--model", "gpt2", "--sweep", "--piece-fit", "none", "--host-fit", "none"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert len(rows) == len(plan_cli.SWEEP_RANKS) * len(plan_cli.SWEEP_LINKS_GBPS)
    # the defaults run fused where it is predicted faster than the peer, else the peer: never slower than it
    assert "gpt2: the defaults fuse in" in out and "are slower than fsdp2 in 0;" in out
    cells = [c for row in rows for c in row.split()[2:]]
    assert all(c[-1] in "f=?" for c in cells) and any(c.endswith("f") for c in cells), cells
    # with the host's time per fused group: every step is at least that (the host bounds the small model's steps)
    assert plan_cli.main(["--model", "gpt2", "--sweep", "--piece-fit", "none", "--host-fit", "h200"]) == 0
    hosted = capsys.readouterr().out
    assert "the host needs 1.7 + 0.3 N ms per fused group per step" in hosted
    assert [line for line in hosted.splitlines() if line.split() and line.split()[0].isdigit()] != rows


def test_mfu_is_against_the_peak():
    cl = _cluster(tflops=400.0)
    model = plan.KNOWN_MODELS["llama3-8b"]
    at_peak = plan.predict(model, cl, 4096, 4096, peak_flops_per_s=1000e12)
    for r in at_peak.values():
        assert r["mfu"] == pytest.approx(r["of_achievable"] * 400 / 1000)
        assert 0 < r["of_achievable"] <= 1.0 + 1e-9  # no schedule beats compute alone
    assert plan.predict(model, cl, 4096, 4096)["fused"]["mfu"] == pytest.approx(at_peak["fused"]["of_achievable"])


def test_records_and_plots(tmp_path):
    result = {"tokens_per_rank": 100, "variants": {
        "fused": {"step_s": 1.2, "steps_s": [1.2], "peak_mem_mb": 10.0},
        "compute_only": {"step_s": 1.0, "steps_s": [1.0], "peak_mem_mb": 12.0},
        "comm_only": {"step_s": 0.8, "steps_s": [0.8], "peak_mem_mb": 1.0}}}
    rows = {r["schedule"]: r for r in records_from(result, 500.0, 2)}
    assert rows["fused"]["exposed_s"] == pytest.approx(0.2) and rows["fused"]["ratio_to_limit"] == pytest.approx(1.2)
    assert rows["fused"]["ratio_to_floor"] is None  # the forward parts were not measured
    # The gather floor: the forward's gathers (0.45 s) before the backward and optimizer (1.0 - 0.3 s).
    result["variants"]["compute_only"]["forward_s"], result["variants"]["comm_only"]["forward_s"] = 0.3, 0.45
    floored = {r["schedule"]: r for r in records_from(result, 500.0, 2)}
    assert floored["fused"]["floor_s"] == pytest.approx(1.15)
    assert floored["fused"]["ratio_to_floor"] == pytest.approx(1.2 / 1.15)
    assert floored["comm_only"]["forward_s"] == 0.45 and floored["fused"]["forward_s"] is None
    result["variants"]["comm_only"]["forward_s"] = 0.2  # gathers shorter than the forward: the limit itself
    assert records_from(result, 500.0, 2)[0]["floor_s"] == pytest.approx(1.0)
    assert rows["fused"]["tokens_per_s"] == pytest.approx(200 / 1.2)
    assert rows["comm_only"]["exposed_s"] == 0.8 and rows["compute_only"]["exposed_s"] == 0.0
    sweep_png(list(rows.values()), str(tmp_path / "sweep.png"), "test")
    events = [{"lane": "compute", "op": "forward", "k": 0, "t0": 0.0, "t1": 0.1},
              {"lane": "ring", "op": "forward", "k": 0, "t0": 0.0, "t1": 0.05}]
    timeline_png({"fused": [events, events]}, str(tmp_path / "timeline.png"), "test")
    for name in ("sweep.png", "timeline.png"):
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_paired_ratios_pair_the_rounds():
    # Two rounds of two steps; the machine was 1.5x slower in the second round for both schedules: the ratio of the
    # run's medians (1.75 / 1.5 ≈ 1.17) mixes the rounds, the paired ratio is 1.2 and 1.2.
    records = [{"schedule": "fused", "rate_mbit": 500.0, "steps_s": [1.2, 1.2, 1.8, 1.8]},
               {"schedule": "concurrent", "rate_mbit": 500.0, "steps_s": [1.0, 1.0, 1.5, 1.5]},
               {"schedule": "slicing", "rate_mbit": 500.0, "steps_s": [2.4, 2.4, 2.0, 2.0]},
               {"schedule": "slicing", "rate_mbit": 250.0, "steps_s": [3.0, 3.0, 3.0, 3.0]}]  # fused not at 250
    paired = paired_ratios(records, 2)
    assert set(paired) == {"500"} and set(paired["500"]) == {"fused/concurrent", "fused/slicing"}
    assert paired["500"]["fused/concurrent"]["rounds"] == pytest.approx([1.2, 1.2])
    fs = paired["500"]["fused/slicing"]
    assert fs["rounds"] == pytest.approx([0.5, 0.9]) and (fs["min"], fs["max"]) == pytest.approx((0.5, 0.9))
    assert fs["median"] == pytest.approx(0.7)
    assert paired_ratios(records, 3) == {}  # four steps do not split into three rounds


def test_trace_waits_splits_a_ranks_waits_by_part_of_the_step():
    def event(cat, name, ts, dur, pid=0):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts * 1e3, "dur": dur * 1e3, "pid": pid, "tid": 0}

    # one rank: a wait before its first piece, one in the forward, one in the backward, one after its last piece;
    # its ring thread busy 0-10 and 30-40 ms (one 20 ms gap); another schedule's events are ignored
    trace = {"traceEvents": [
        event("waited", "fused:all_gather 0", 0, 2), event("compute", "fused:forward 0", 2, 10),
        event("waited", "fused:forward 0", 12, 3), event("compute", "fused:forward 1", 15, 5),
        event("compute", "fused:backward 0", 25, 10), event("waited", "fused:backward 0", 35, 4),
        event("compute", "fused:backward 1", 39, 6), event("waited", "fused:embedding backward 0", 45, 7),
        event("ring-thread", "fused:forward 0", 0, 10), event("ring-thread", "fused:backward 1", 30, 10),
        event("waited", "slicing:all_gather 0", 100, 50)]}
    (rank,) = analyse_trace(trace, gap_ms=1.0)
    assert rank["waited_ms"] == pytest.approx({"before the first piece": 2, "forward": 3,
                                               "between forward and backward": 0, "backward": 4,
                                               "after the last piece": 7})
    assert rank["last_piece_end_ms"] == pytest.approx(45) and rank["step_ms"] == pytest.approx(52)
    assert rank["longest"][0][:2] == ("fused:embedding backward 0", pytest.approx(7))
    assert rank["link_busy_ms"] == pytest.approx(20) and rank["link_gaps"] == [pytest.approx((10, 20))]
    with pytest.raises(ValueError, match="no 'ddp:' events"):
        analyse_trace(trace, "ddp")


needs_netns = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                 reason="the emulated cluster needs root and iproute2 (ip, tc)")


@needs_netns
@pytest.mark.slow
def test_bench_runs_end_to_end_on_the_emulated_cluster(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "commfuse_dp.cli", "bench", "--link-gbps", "0.5", "--rounds", "1", "--steps", "1",
           "--warmup", "1", "--variants", "fused,slicing,ddp,compute_only,comm_only", "--hidden", "64",
           "--intermediate", "128", "--layers", "2", "--heads", "4", "--vocab", "256", "--seq", "32", "--batch", "1",
           "--min-fuse-numel", "0",
           "--json", str(out), "--out-dir", str(tmp_path), "--timeout", "240"]
    namespaces = lambda: {line.split()[0] for line in subprocess.run(  # noqa: E731
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines() if line.strip()}
    before = namespaces()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["schedule"]: r for r in data["records"]}
    assert set(rows) == {"fused", "slicing", "ddp", "compute_only", "comm_only"}
    for r in data["records"]:
        assert {"schedule", "world_size", "rate_mbit", "step_s", "exposed_s", "tokens_per_s", "peak_mem_mb"} <= set(r)
        assert r["world_size"] == 2 and r["rate_mbit"] == 4000 and r["step_s"] > 0
        # per timed step: host CPU seconds, page faults, the garbage collector's seconds (diagnostics)
        assert len(r["steps_cpu_s"]) == len(r["steps_minor_faults"]) == len(r["steps_gc_s"]) == len(r["steps_s"])
        assert all(c > 0 for c in r["steps_cpu_s"]) and all(g >= 0 for g in r["steps_gc_s"])
        if r["schedule"] != "comm_only":  # measured at the (only, so balanced) rate, in a run of its own
            assert r["peak_mem_mb"] > 0, r
        if r["schedule"] in ("fused", "slicing"):  # blocked on hops: measured, within the step
            assert 0 <= r["waited_min_s"] <= r["waited_s"] <= r["step_s"]
            assert len(r["waited_ranks_s"]) == 2 and all(0 <= w <= r["step_s"] for w in r["waited_ranks_s"])
        else:
            assert r["waited_s"] is None and r["waited_min_s"] is None and r["waited_ranks_s"] is None
        # the gather floor, from compute alone's and communication alone's forward parts: at least their limit
        assert r["floor_s"] >= max(rows["compute_only"]["step_s"], rows["comm_only"]["step_s"]) - 1e-9
    assert data["balanced_rate_mbit"] == 4000
    assert set(data["paired"]["4000"]) == {f"fused/{n}" for n in ("slicing", "ddp", "compute_only", "comm_only")}
    for name in ("sweep.png", "timeline.png", "trace.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "ring" for e in trace) and any(e.get("cat") == "compute" for e in trace)
    waits = [e for e in trace if e.get("cat") == "waited"]  # where the compute thread was blocked: within its steps
    assert waits and all(e["dur"] >= 0 for e in waits)
    # benchmarks/trace_waits.py splits each rank's waits of the fused step; the parts add up to them
    ranks = analyse_trace({"traceEvents": trace})
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        fused_waits = sum(e["dur"] for e in waits if e["pid"] == r["rank"] and e["name"].startswith("fused:")) / 1e3
        assert sum(r["waited_ms"].values()) == pytest.approx(fused_waits) and r["link_busy_ms"] > 0
    # Torn down: no namespace of ours is left.
    left = namespaces() - before  # another run may hold namespaces of its own meanwhile
    assert not left, left


@pytest.mark.slow
def test_cuda_check_dry_run_on_cpu(tmp_path):
    """The GPU check script (benchmarks/cuda_check.py) runs its parts on the CPU too, so it does not rot between the
    machines that are lent a GPU; it must fail when a part fails or does not run (here: no time left for it)."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "cuda_check.py")
    run = lambda parts, *more: subprocess.run(  # noqa: E731
        [sys.executable, script, "--device", "cpu", "--quick", "--parts", parts, "--out", str(tmp_path), *more],
        capture_output=True, text=True, timeout=300)
    proc = run("linear,shard,gemm,fake,host")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "cuda_check.json").read_text())
    assert report["linear"]["result"]["cases"] == 8
    assert {"llama/fused", "llama/lockstep", "llama/slicing"} <= set(report["shard"]["result"])
    assert report["gemm"]["result"]["pieces"]["o 256x256"]["1"]["slowdown_vs_whole"] == 1.0
    # 4 ranks of a fake group on the CPU (nothing moves): every schedule, HSDP included, runs its steps
    assert {label: r["ran_steps"] for label, r in report["fake"]["result"].items()} == {
        "llama/fused": 3, "llama/lockstep": 3, "llama/slicing": 3, "llama/fused/replicate=2": 3}
    host = report["host"]["result"]
    assert set(host["median_step_ms"]) == {"unsharded", "fused", "slicing"} and host["fused_profile"]["top_own_ms_per_step"]
    failed = run("linear", "--budget-s", "1")
    assert failed.returncode == 1 and "not run" in failed.stdout, failed.stdout[-2000:]


def test_plan_models_the_gemm_pieces():
    """The fused and slicing schedules compute a layer's GEMMs in pieces (N / piece_shards), which a GPU runs slower
    than one GEMM (benchmarks/cuda_check.py's gemm part, fitted in costs.H200_PIECE_FIT); stock FSDP2's shape does
    not. On 8 ranks over NVLink the pieces cost more than the link exposes, and whole pieces remove that cost."""
    from dataclasses import replace

    from commfuse_dp.planner import costs, plan

    model = plan.KNOWN_MODELS["llama3-8b"]
    cl = costs.Cluster(8, 450e9, 15e-6, 400e12, 2, 2, piece_fit=costs.H200_PIECE_FIT)
    thin = plan.predict(model, cl, 16384, 8192)
    whole = plan.predict(model, replace(cl, piece_shards=8), 16384, 8192)
    assert thin["fused"]["pieces_s"] > 0.05 * thin["fused"]["compute_s"]
    assert thin["fused"]["step_s"] > thin["fsdp2"]["step_s"] and thin["fsdp2"]["pieces_s"] == 0
    assert whole["fused"]["pieces_s"] == 0 and whole["fused"]["step_s"] < thin["fused"]["step_s"]
    assert plan.best_piece_shards(model, cl, 16384, 8192) == 8
    free = plan.predict(model, replace(cl, piece_fit=None), 16384, 8192)
    assert all(r["pieces_s"] == 0 for r in free.values())
    assert free["fused"]["step_s"] == pytest.approx(whole["fused"]["step_s"], rel=1e-3)


def test_plan_adds_the_host_to_the_compute_on_one_cpu_thread():
    """Real compute on the CPU (``commfuse-dp bench --compute real``): one thread computes and issues the hops,
    so the host's time per fused group adds to the compute (``host_on_compute``) instead of bounding the step from
    below as a GPU's host does. On a link fast enough to hide every hop, each schedule's step grows by the
    host's time; with the host ahead it is the longer of the two."""
    from dataclasses import replace

    from commfuse_dp.planner import costs

    model = plan.KNOWN_MODELS["bench"]
    cl = costs.Cluster(2, 1e13, 0.0, 50e9, 4, 4, host_fit=(4e-3, 0.5e-3), host_on_compute=True)
    off = plan.predict(model, replace(cl, host_fit=None), 512, 256)
    on = plan.predict(model, cl, 512, 256)
    host = (4 * 4 + 1) * (4e-3 + 2 * 0.5e-3)  # 4 groups per layer and the lm_head
    for schedule in ("fused", "lockstep", "slicing"):
        assert on[schedule]["host_s"] == pytest.approx(host)
        assert on[schedule]["step_s"] == pytest.approx(off[schedule]["step_s"] + host, rel=1e-3)
    assert on["fsdp2"]["step_s"] == off["fsdp2"]["step_s"]
    ahead = plan.predict(model, replace(cl, host_on_compute=False), 512, 256)
    assert ahead["fused"]["step_s"] == pytest.approx(max(off["fused"]["step_s"], host))


def test_calibrate_adds_each_schedules_measured_overhead(tmp_path, capsys):
    """``plan --calibrate BENCH --overhead FILE`` (``step_overhead.py --bench-model real --json``): with real compute
    each schedule's own work adds to its compute, the file's figure instead of the planner's CPU model
    (``costs.CPU_HOST_FIT``), so where the file says more its predicted step grows; a schedule the file leaves out
    keeps the model; a file measured for another world size or compute is refused with what to run instead."""
    bench = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                         "2ranks-real-lockstep.json")

    def table(*extra):
        assert plan_cli.main(["--calibrate", bench, "--ring-latency-us", "300", *extra]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()]
        return {(row[0], row[3]): float(row[4]) for row in rows if len(row) == 7 and row[0][0].isdigit()}

    overhead = tmp_path / "overhead.json"
    modelled = 17 * (costs.CPU_HOST_FIT[0] + 2 * costs.CPU_HOST_FIT[1])  # the bench model's 17 groups at 2 ranks
    added = {"fused": modelled + 0.05, "slicing": modelled + 0.1}
    overhead.write_text(json.dumps({"model": "bench", "compute": "real", "device": "cpu",
                                    "extra_s": {"2": added}}))
    before, after = table(), table("--overhead", str(overhead))
    assert set(before) == set(after) and len(before) == 9
    grew = set()
    for (rate, schedule), predicted in before.items():
        grown = after[(rate, schedule)] - predicted
        if schedule == "lockstep":  # not in the file: unchanged
            assert grown == 0
        else:  # at most the added work (the link may hide part or all of it where it bounds)
            assert 0 <= grown <= added[schedule] - modelled + 1e-3
            grew |= {schedule} if grown > 0 else set()
    assert grew == {"fused", "slicing"}  # where compute bounds, it shows
    overhead.write_text(json.dumps({"model": "bench", "compute": "real", "extra_s": {"4": {"fused": 0.05}}}))
    with pytest.raises(SystemExit, match="--fake-worlds 2 --bench-model real"):
        plan_cli.main(["--calibrate", bench, "--overhead", str(overhead)])
    # An emulated run ("compute": "emulated at 0.01 TFLOP/s"): the host runs ahead of the device, and 50 ms is far
    # below its steps (about 5 s), so nothing changes.
    bench = bench.replace("2ranks-real-lockstep", "4ranks-emulated-lockstep")
    overhead.write_text(json.dumps({"model": "bench", "compute": "emulated", "extra_s": {"4": {"fused": 0.05}}}))
    assert table() == table("--overhead", str(overhead))


@pytest.mark.slow
def test_plan_models_the_host():
    """``--host-fit``: the host issues about 3 (N-1) hops and 2N pieces per fused group per step (measured with
    benchmarks/step_overhead.py --fake-worlds: costs.H200_HOST_FIT), so a step is at least that long. Llama-3-8B on
    8 ranks over NVLink keeps the device the longer; at 64 ranks the host is, and grows with the ranks; off, nothing
    changes."""
    from dataclasses import replace

    from commfuse_dp.planner import costs, plan

    model = plan.KNOWN_MODELS["llama3-8b"]
    cl = costs.Cluster(8, 450e9, 15e-6, 400e12, 2, 2, host_fit=costs.H200_HOST_FIT)
    off = plan.predict(model, replace(cl, host_fit=None), 8192, 4096)
    on = plan.predict(model, cl, 8192, 4096)
    groups = 32 * 4 + 1  # q/k/v, o, gate/up, down per layer, and the lm_head
    assert on["fused"]["host_s"] == pytest.approx(groups * (1.7e-3 + 8 * 0.30e-3))
    assert on["fused"]["step_s"] == off["fused"]["step_s"] > on["fused"]["host_s"]
    assert off["fused"]["host_s"] == 0 and on["fsdp2"]["host_s"] == 0
    wide = plan.predict(model, replace(cl, ranks=64), 8192, 4096)
    wider = plan.predict(model, replace(cl, ranks=128), 8192, 4096)
    for schedule in ("fused", "slicing", "lockstep"):
        assert wide[schedule]["step_s"] == wide[schedule]["host_s"] > wide["fsdp2"]["step_s"]
        assert wider[schedule]["step_s"] > wide[schedule]["step_s"]
    out = subprocess.run([sys.executable, "-m", "commfuse_dp.planner.cli", "--model", "llama3-8b", "--num-processes", "64",
                          "--host-fit", "h200"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "host s" in out.stdout, out.stderr
    bad = subprocess.run([sys.executable, "-m", "commfuse_dp.planner.cli", "--host-fit", "fast"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--host-fit 'fast'" in bad.stderr


@pytest.mark.slow
def test_optimizer_overhead_script_runs():
    """benchmarks/optimizer_overhead.py (a measurement, run by hand) still runs and prints both timings."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "optimizer_overhead.py")
    proc = subprocess.run([sys.executable, script, "--worlds", "2", "--steps", "2"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for impl in ("foreach", "fused"):
        assert f"world 2: AdamW ({impl}) over" in proc.stdout and "as plain tensors" in proc.stdout, proc.stdout


_PLACEMENT_SCRIPT = r"""
import json, sys
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
import commfuse_dp as cf
from benchmarks.step_overhead import fake_rank0

cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False)
every = {}
for world in map(int, sys.argv[1].split(",")):
    fake_rank0(world)  # rank 0 of a fake group: nothing moves, shard() decides as on a real one
    out = every[world] = {}
    for name, options in (("fused", {}), ("lockstep", {"lookahead_mb": 0}), ("slicing", {"schedule": "slicing"})):
        model = cf.shard(LlamaForCausalLM(cfg), cf.CommFuseConfig(**{"schedule": "fused", "min_fuse_numel": 4096,
                                                                     **options}))
        report = cf.describe(model)
        out[name] = {"groups": sorted(sum(s[0] * s[1] for s in g.weight_shapes) for g in report.fused_groups),
                     "tables": len(report.ring_embeddings),
                     "layer_units": sum(".layers." in u.module for u in report.fsdp_units)}
    dist.destroy_process_group()
print("RESULT " + json.dumps(every))
"""


@pytest.mark.slow
def test_planner_fuses_what_shard_fuses(tmp_path):
    """The planner plays the groups ``shard()`` fuses under ``min_fuse_numel`` (``costs.placed``), and knows where
    a decoder layer's unfused groups keep an FSDP2 unit of their own (``costs.own_collectives``, which it does not
    play): on a fake group of 2-32 ranks, a Llama whose groups fall below the threshold one after another as the
    ranks grow (o_proj first: fused alone at 4 ranks, only beside q/k/v under the elastic lookahead at 8; at 16
    slicing leaves three groups of a layer, enough for a unit of their own; nothing fused at 32)."""
    from commfuse_dp.planner import costs

    script = tmp_path / "placement.py"
    script.write_text(_PLACEMENT_SCRIPT)
    units = costs.units_for(128, 352, 2, 4, 4, 512, tokens=128, seq=64)
    seen = {}
    worlds = (2, 4, 8, 16, 32)  # one process, a fake group of each size in turn
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # benchmarks/
    proc = subprocess.run([sys.executable, str(script), ",".join(map(str, worlds))], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    every = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for world in worlds:
        ran = every[str(world)]
        cl = costs.Cluster(world, 1e9, 1e-5, 1e12, min_fuse_numel=4096)
        for name, elastic in (("fused", True), ("lockstep", False), ("slicing", False)):
            played = costs.placed(units, cl, elastic)
            assert sorted(g for u in played for g in u.groups) == ran[name]["groups"], (world, name)
            assert sum(u.table is not None for u in played) == ran[name]["tables"], (world, name)
            assert len(costs.own_collectives(played, cl)) == ran[name]["layer_units"], (world, name)
            seen[world, name] = len(ran[name]["groups"]), ran[name]["layer_units"]
    # the cases the test is for happened: all fused, o_proj riding only with the lookahead, nothing fused
    assert seen[2, "slicing"] == seen[4, "slicing"] == (9, 0) and seen[8, "fused"] == (9, 0)
    assert seen[8, "slicing"] == (7, 0) and seen[16, "fused"][1] == 0 and seen[16, "slicing"][1] == 2
    assert seen[32, "fused"][0] == seen[32, "slicing"][0] == 0


def test_plan_says_what_it_does_not_play(capsys):
    """Where a decoder layer's linears are all below min_fuse_numel but add up to an FSDP2 unit of their own while
    the lm_head is fused (Llama-3-8B at 2048 ranks), the elastic play does not model that unit: the planner says so
    rather than predict it as if played (slicing and lockstep play such units: gathered per layer, blocking)."""
    assert plan_cli.main(["--model", "llama3-8b", "--num-processes", "2048", "--piece-fit", "none"]) == 0
    out = capsys.readouterr().out
    assert "not played: under fused, 32 decoder layers" in out and "under slicing" not in out
    assert plan_cli.main(["--model", "llama3-8b", "--num-processes", "1024", "--piece-fit", "none"]) == 0
    assert "not played" not in capsys.readouterr().out


def test_calibrate_fits_the_fixed_cost_of_a_hop(tmp_path, capsys):
    """Without ``--ring-latency-us``, ``plan --calibrate`` fits what does not shrink with the link's rate from the bench's
    ``comm_only`` rows (a line ``A / rate + C``), spreads ``C`` over the planner's hops, and takes each rate's
    bandwidth from the rest; where nothing can be fitted (one rate, or communication alone that does not shrink as
    the rate grows) it plays with the default and says so. Against this version's stored runs the fitted
    predictions of fused and the peer hold within 10 %; a file from before the peer took torchtitan's units is
    compared with the coarse play its fsdp2_overlap ran."""
    rows = {rate: {"comm_only": {"step_s": 700.0 / rate + 0.06}} for rate in (490.0, 980.0, 1960.0)}
    assert plan_cli._fixed_cost(rows) == pytest.approx((700.0, 0.06))
    assert plan_cli._fixed_cost({490.0: rows[490.0]}) is None
    assert plan_cli._fixed_cost({rate: {"comm_only": {"step_s": 0.5}} for rate in rows}) is None  # latency-bound
    results = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
    for name in ("2ranks-real-torchtitan-peer", "4ranks-emulated-torchtitan-peer", "8ranks-emulated-torchtitan-peer",
                 "2ranks-real-all-variants"):
        assert plan_cli.main(["--calibrate", os.path.join(results, name + ".json")]) == 0
        out = capsys.readouterr().out
        assert "fitted (communication alone is" in out
        rows = [line.split() for line in out.splitlines() if line.split()[3:4] in (["fused"], ["fsdp2"])]
        assert {r[3] for r in rows} == ({"fused", "fsdp2"} if "torchtitan" in name else {"fused"}), (name, out)
        if "torchtitan" not in name:  # (its fsdp2_overlap ran the coarse units)
            assert any(line.split()[3:4] == ["fsdp2_coarse"] for line in out.splitlines()), out
        assert max(abs(float(r[6].rstrip("%"))) for r in rows) < 10.0, (name, out)
    with open(os.path.join(results, "2ranks-real-all-variants.json")) as f:
        bench = json.load(f)
    for flat in (False, True):  # one rate; every rate's communication alone as long as the first's
        records = [r for r in bench["records"] if r["rate_mbit"] == bench["records"][0]["rate_mbit"] or flat]
        if flat:
            first = next(r for r in records if r["schedule"] == "comm_only")["step_s"]
            records = [{**r, "step_s": first} if r["schedule"] == "comm_only" else r for r in records]
        one = tmp_path / f"bench-{flat}.json"
        one.write_text(json.dumps({**bench, "records": records}))
        assert plan_cli.main(["--calibrate", str(one)]) == 0
        out = capsys.readouterr().out
        assert "15 us, the default" in out and "worst error" in out, out


@pytest.mark.parametrize("argv", [
    ["--model", "llama-7b", "--num-processes", "256", "--link-gbps", "12.5", "--ring-latency-us", "50",
     "--tokens-per-rank", "2048", "--seq", "2048"],   # a larger min_fuse_numel predicts faster
    ["--model", "llama3-8b", "--num-processes", "8", "--link-gbps", "450", "--tokens-per-rank", "8192",
     "--seq", "8192"],                                 # the defaults as they are
])
def test_the_recommended_config_says_why_and_replaying_it_predicts_its_step(argv, capsys):
    """``plan``'s ``recommended:`` line names its predicted step and why; run again with what it recommends, the
    defaults' step is the one it gave, and the line then recommends nothing more."""
    from commfuse_dp.planner import cli as plan_cli

    assert plan_cli.main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("recommended: "))
    config, why = re.match(r"recommended: CommFuseConfig\((.*?)\): (.*)$", line).groups()
    step = float(re.search(r"the defaults choose[^:]*: ([0-9.]+) s a step", why).group(1))
    given = dict(kv.split("=") for kv in config.split(", "))
    replay = list(argv) + (["--min-fuse-numel", given["min_fuse_numel"]] if "min_fuse_numel" in given else [])
    assert plan_cli.main(replay) == 0
    again = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("recommended: "))
    assert again.startswith(f"recommended: CommFuseConfig({config.split(', min_fuse_numel')[0]}): what the defaults "
                            f"choose: {step:.3f} s a step"), (line, again)
    assert "no faster" in again or "min_fuse_numel" not in again.split(":")[2]
