"""Runs that carry on after a fault: real 2-rank training under ``torchrun --max-restarts 1``, a checkpoint after
every step written off the training thread, and a worker that resumes from the newest complete checkpoint
(tests/faults/restart_worker.py). Each restarted case must finish with final weights equal to those of an
uninterrupted run with the same data order (max abs diff 0 in fp32), having lost at most the steps since its last
complete checkpoint; the full disk must end with a clear error on every rank and the previous checkpoint intact.
``tests/faults/conftest.py`` prints the suite's line."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from commfuse_dp import checkpoint as ck

import restart_worker
from test_faults import RING_TIMEOUT_S, _bytes_lost, _launcher_reported_failure, _output

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "restart_worker.py")


def _launch(workdir, fault: str, *, restarts: int = 1, env: dict | None = None, launcher: str = "torchrun"):
    os.makedirs(workdir, exist_ok=True)
    # A restarted worker group needs a store of its own: torchrun's static rendezvous, and the c10d one sharing its
    # store with the workers, keep the first attempt's keys, and the second attempt's init_process_group may read
    # a dead rank's address from them (pytorch/pytorch#135712). --standalone (c10d) with the store not shared.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
           str(restarts), WORKER, fault, str(workdir)]
    if launcher == "commfuse-dp":  # it does the same by itself when given --max_restarts (on one machine)
        config = workdir / "accel.yaml"
        config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nuse_cpu: true\n"
                          "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nmixed_precision: 'no'\n")
        cmd = [sys.executable, "-m", "commfuse_dp.cli", "launch", "--config_file", str(config), "--max_restarts",
               str(restarts), WORKER, fault, str(workdir)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT_RING_TIMEOUT_S": str(RING_TIMEOUT_S), **(env or {})}
    if launcher == "torchrun":
        full_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    began = time.monotonic()
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=400)
    seconds = time.monotonic() - began
    ranks = [json.loads((workdir / f"rank{r}.json").read_text()) if (workdir / f"rank{r}.json").exists() else {}
             for r in range(2)]
    return proc, ranks, seconds


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same run without a fault: its final weights are what every restarted run must end with."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    proc, ranks, _ = _launch(workdir, "none", restarts=0)
    assert proc.returncode == 0, _output(proc)
    assert [a["start"] for a in ranks[0]["attempts"]] == [0]
    with open(workdir / "ckpt" / "commfuse_complete") as f:
        size = sum(v[0] for v in json.load(f)["files"].values())  # one checkpoint's bytes
    return torch.load(workdir / "final.pt", weights_only=True), size


def _max_diff(final: dict, expected: dict) -> float:
    assert final.keys() == expected.keys()
    return max((final[n].float() - expected[n].float()).abs().max().item() for n in expected)


@pytest.mark.parametrize("name,resumed,launcher", [
    ("kill_mid_ring_restart", None, "torchrun"),  # the newest complete checkpoint: step 1 or 2 (2's may be writing)
    ("hang_mid_ring_restart", None, "torchrun"),
    ("kill_during_async_save", 2, "torchrun"),    # step 3's write was cut: step 2's is the newest complete one
    ("kill_mid_ring_restart", None, "commfuse-dp"),
])
@pytest.mark.slow
def test_restarted_run_completes_with_the_weights_of_an_uninterrupted_one(tmp_path, uninterrupted, fault, name,
                                                                         resumed, launcher):
    workdir = tmp_path / "run"
    if launcher != "torchrun":
        fault.name = f"{name} ({launcher} launch)"
    proc, ranks, fault.seconds = _launch(workdir, name, launcher=launcher)
    assert proc.returncode == 0, _output(proc)
    victim = ranks[restart_worker.VICTIM]
    assert "fault_time" in victim, ranks  # the fault really happened, in the first attempt
    starts = [a["start"] for a in victim["attempts"]]
    assert len(starts) == 2 and starts[0] == 0, ranks  # one restart
    assert starts[1] <= restart_worker.FAULT_STEP and (resumed is None or starts[1] == resumed + 1), ranks
    assert starts[1] >= 1, ranks  # it did resume: a checkpoint written before the fault was complete
    assert f"resumed from {workdir / 'ckpt'} (step {starts[1] - 1})" in proc.stdout, _output(proc)
    assert all(r.get("finished") for r in ranks), ranks
    fault.max_diff = _max_diff(torch.load(workdir / "final.pt", weights_only=True), uninterrupted[0])
    assert fault.max_diff == 0.0
    fault.bytes_lost = _bytes_lost(workdir / "ckpt")
    assert ck.is_complete(workdir / "ckpt") and fault.bytes_lost == 0
    fault.detail = f" (restarted once, resumed at step {starts[1]} of {restart_worker.STEPS})"
    fault.completed = fault.clean = True


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"),
                    reason="a size-limited tmpfs needs root (mount -t tmpfs -o size=...)")
@pytest.mark.slow
def test_full_disk_during_async_save_raises_and_keeps_the_previous_checkpoint(tmp_path, uninterrupted, fault):
    fault.name = "full_disk_async"
    size = uninterrupted[1]
    disk = tmp_path / "disk"
    disk.mkdir()
    limit = (size * 3 // 2 // 4096 + 1) * 4096  # room for one checkpoint, not for a second one beside it
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={limit}", "tmpfs", str(disk)], check=True)
    try:
        proc, ranks, fault.seconds = _launch(tmp_path / "run", "none", restarts=0, env={"FAULT_CKPT_DIR": str(disk)})
        _launcher_reported_failure(proc)
        for r in ranks:
            assert r.get("error_type") == "CheckpointError", _output(proc)
            assert "disk is full" in r["error"] and "previous checkpoint" in r["error"], r["error"]
        assert ranks[0]["saved"][:1] == [0], ranks  # the first save was complete before the second one failed
        assert not os.path.exists(disk / "ckpt.partial")  # the failed write's files were removed
        fault.bytes_lost = _bytes_lost(disk / "ckpt")
        assert ck.is_complete(disk / "ckpt") and fault.bytes_lost == 0
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    fault.detail = f" (CheckpointError on every rank: {ranks[0]['error'][:70]!r})"
    fault.clean = True
