"""The planner's tensor-parallel play (``commfuse-dp plan --tp N``, planner/tp.py)."""

import subprocess
import sys

import pytest

from commfuse_dp.planner.plan import KNOWN_MODELS
from commfuse_dp.planner.tp import TPCluster, play

SHAPE = KNOWN_MODELS["llama3-8b"]


def _cluster(gbps=450.0, latency_us=15.0, tflops=400.0, tp=8):
    return TPCluster(tp, gbps * 1e9, latency_us * 1e-6, tflops * 1e12, 2)


def test_fused_is_compute_alone_when_links_are_free_and_communication_alone_without_compute():
    free = play(SHAPE, 8192, 8192, _cluster(gbps=1e12, latency_us=0))
    assert free["fused_s"] == pytest.approx(free["compute_s"], rel=1e-6)
    assert free["waiting_s"] == pytest.approx(free["compute_s"], rel=1e-6)
    idle = play(SHAPE, 8192, 8192, _cluster(tflops=1e12))
    # every hop exposed, and the last piece of each operation too small to count
    assert idle["fused_s"] == pytest.approx(idle["comm_s"], rel=1e-3)


@pytest.mark.parametrize("gbps", [25.0, 50.0, 450.0])
def test_fused_never_slower_than_waiting_and_never_faster_than_its_limit(gbps):
    r = play(SHAPE, 8192, 8192, _cluster(gbps=gbps))
    assert max(r["compute_s"], r["comm_s"]) <= r["fused_s"] <= r["waiting_s"]
    assert r["gain"] == pytest.approx(r["waiting_s"] / r["fused_s"])


def test_plan_tp_prints_both_clusters_and_refuses_heads_that_do_not_divide():
    run = [sys.executable, "-m", "commfuse_dp.cli", "plan", "--model", "llama3-8b", "--seq", "8192"]
    out = subprocess.run(run + ["--tp", "8"], capture_output=True, text=True, check=True).stdout
    assert "NVLink (450 GB/s a rank): fused" in out and "PCIe (25 GB/s a rank): fused" in out
    assert "async TP's published 1.10x" in out
    bad = subprocess.run(run + ["--tp", "3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "8 key/value heads" in bad.stderr
