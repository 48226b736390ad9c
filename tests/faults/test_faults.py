"""Fault injection: real 2-rank training runs under real launchers (torchrun, ``commfuse-dp launch``), each meeting
one fault, and the checks that it ended cleanly -- every rank exits within the ring timeout, non-zero, with an error
naming what went wrong (the rank, the hop, the file, the field), the launcher reports the failure and exits,
and no byte of an earlier complete checkpoint is lost. ``tests/faults/conftest.py`` prints the suite's line.

The faults are made for real by tests/faults/fault_worker.py (see there); the full disk is a tmpfs mounted with a
size limit smaller than two checkpoints (root only: the test is skipped, and not counted, without root).
"""

import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
from commfuse_dp import checkpoint as ck
from harness import free_port, run_ranks

import fault_worker

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "fault_worker.py")
RING_TIMEOUT_S = 4.0
# A survivor must notice a dead or silent peer within the ring timeout; this slack covers the scheduling of two
# ranks (and the launcher) on two shared cores.
SLACK_S = 8.0


def _launch(workdir, fault: str, *, launcher: str = "torchrun", env: dict | None = None, config: str | None = None):
    os.makedirs(workdir, exist_ok=True)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
               "127.0.0.1", "--master_port", str(free_port())]
    else:
        cmd = [sys.executable, "-m", "commfuse_dp.cli", "launch", "--config_file", config, "--main_process_port",
               str(free_port())]
    cmd += [WORKER, fault, str(workdir)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT_RING_TIMEOUT_S": str(RING_TIMEOUT_S), **(env or {})}
    began = time.monotonic()
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - began
    files = [os.path.join(workdir, f"rank{r}.json") for r in range(2)]
    ranks = [json.loads(open(file).read()) if os.path.exists(file) else {} for file in files]  # noqa: SIM115
    return proc, ranks, seconds


def _output(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def _launcher_reported_failure(proc) -> None:
    assert proc.returncode != 0, _output(proc)
    assert "ChildFailedError" in proc.stderr or "failed" in proc.stderr.lower(), _output(proc)


def _bytes_lost(folder: str) -> int:
    """Bytes of a complete checkpoint whose files no longer match the sizes and digests its marker recorded."""
    with open(os.path.join(folder, "commfuse_complete")) as f:
        files = json.load(f)["files"]
    lost = 0
    for name, (size, sha) in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or ck.markers._digest(path) != [size, sha]:
            lost += size
    return lost


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A clean run that writes a complete checkpoint (steps 2 and 3 into one folder): the faults on a checkpoint
    start from a copy of it."""
    workdir = tmp_path_factory.mktemp("saved")
    proc, ranks, _ = _launch(workdir, "save")
    assert proc.returncode == 0, _output(proc)
    assert ck.is_complete(workdir / "ckpt")
    return workdir, ranks


# ---- a rank dies or hangs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["kill_mid_ring_no_launcher", "hang_mid_ring_no_launcher", "hang_mid_ring",
                                  "hang_mid_ring_accelerate"])
@pytest.mark.slow
def test_survivors_name_the_silent_rank_and_hop(tmp_path, fault, name):
    """Without a launcher (ranks and process group started by tests/harness.py), under torchrun and under
    ``commfuse-dp launch`` (a CommFuseAccelerator): rank 0 raises RingCommError naming rank 1 and the hop
    within the ring timeout, and the launcher then ends rank 1 and exits non-zero."""
    workdir = tmp_path / "run"
    if name.endswith("_no_launcher"):
        workdir.mkdir()
        began = time.monotonic()
        results = run_ranks(fault_worker.in_process_group, 2, (name, str(workdir)), check=False,
                            timeout=RING_TIMEOUT_S + 60, env={"FAULT_RING_TIMEOUT_S": str(RING_TIMEOUT_S)})
        fault.seconds = time.monotonic() - began
        assert not results[0].ok and not results[0].hung, results[0].describe()
        ranks = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(2)]
    else:
        config = None
        if name.endswith("_accelerate"):
            config = tmp_path / "accel.yaml"
            config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nuse_cpu: true\n"
                              "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nmixed_precision: 'no'\n"
                              f"commfuse:\n  min_fuse_numel: 0\n  timeout_s: {RING_TIMEOUT_S}\n")
        proc, ranks, fault.seconds = _launch(workdir, name, launcher="commfuse-dp" if config else "torchrun",
                                             config=str(config) if config else None)
        _launcher_reported_failure(proc)
        if config:
            assert ranks[0].get("accelerator") == "CommFuseAccelerator", ranks
    victim, survivor = ranks[1], ranks[0]
    assert "fault_time" in victim, ranks  # the fault really happened, in a hop of step 2
    assert survivor.get("error_type") == "RingCommError", ranks
    assert "rank 1" in survivor["error"] and "hop" in survivor["error"], survivor["error"]
    waited = survivor["error_time"] - victim["fault_time"]
    assert waited < RING_TIMEOUT_S + SLACK_S, (waited, survivor["error"])
    fault.detail = f" (rank 0 raised {waited:.1f} s after the fault: {survivor['error'][:80]!r})"
    fault.clean = True


def test_launcher_ends_the_job_when_a_rank_is_killed_in_a_hop(tmp_path, fault):
    """Under torchrun a SIGKILLed rank is seen by the launcher first: it ends the other ranks and exits non-zero,
    naming the killed rank as the root cause."""
    fault.name = "kill_mid_ring"
    proc, ranks, fault.seconds = _launch(tmp_path / "run", "kill_mid_ring")
    _launcher_reported_failure(proc)
    assert "fault_time" in ranks[1] and "finished" not in ranks[0], ranks
    cause = proc.stderr[proc.stderr.index("Root Cause"):]
    assert "rank      : 1" in cause and "SIGKILL" in cause, _output(proc)
    fault.detail = " (torchrun: root cause rank 1, SIGKILL)"
    fault.clean = True


# ---- checkpoints -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_rank_killed_while_saving_keeps_the_previous_checkpoint(tmp_path, fault):
    fault.name = "kill_during_save"
    proc, ranks, fault.seconds = _launch(tmp_path / "run", "kill_during_save")
    _launcher_reported_failure(proc)
    ckpt = tmp_path / "run" / "ckpt"
    assert [s["step"] for s in ranks[0]["saved"]] == [2], ranks[0]  # the second save never completed
    fault.bytes_lost = _bytes_lost(ckpt)
    assert ck.is_complete(ckpt) and fault.bytes_lost == 0
    partial = str(ckpt) + ".partial"
    assert os.path.isdir(partial) and not ck.is_complete(partial)  # what the dead rank left is never complete
    with pytest.raises(FileNotFoundError, match="interrupted save_sharded.*no commfuse_complete marker"):
        ck.load_sharded(partial, [])
    # The previous checkpoint loads, at step 2's parameters, in a new job.
    proc, loaded, _ = _launch(tmp_path / "run", "load")
    assert proc.returncode == 0, _output(proc)
    assert loaded[0]["loaded"] == ranks[0]["saved"][0]["params"]
    fault.clean = True


@pytest.mark.parametrize("name", ["corrupt_shard", "truncate_shard"])
@pytest.mark.slow
def test_damaged_shard_file_is_refused_on_every_rank(tmp_path, saved, fault, name):
    workdir = tmp_path / "run"
    shutil.copytree(saved[0] / "ckpt", workdir / "ckpt")
    victim = max(p for p in os.listdir(workdir / "ckpt") if p.endswith(".distcp"))
    file = workdir / "ckpt" / victim
    data = bytearray(file.read_bytes())
    if name == "corrupt_shard":
        middle = len(data) // 2
        data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    else:
        data = data[:len(data) // 2]
    file.write_bytes(bytes(data))
    damaged = ck.markers._digest(str(file))
    proc, ranks, fault.seconds = _launch(workdir, name)
    _launcher_reported_failure(proc)
    word = "corrupted" if name == "corrupt_shard" else "truncated"
    for r in ranks:
        assert r.get("error_type") == "CheckpointError", _output(proc)
        assert victim in r["error"] and word in r["error"], r["error"]
    # The loader changed nothing: the other files still match the marker, the damaged one is as the fault left it.
    assert ck.markers._digest(str(file)) == damaged
    with open(workdir / "ckpt" / "commfuse_complete") as f:
        sizes = {k: v[0] for k, v in json.load(f)["files"].items()}
    fault.bytes_lost = _bytes_lost(workdir / "ckpt") - sizes[victim]
    assert fault.bytes_lost == 0
    fault.clean = True


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"),
                    reason="a size-limited tmpfs needs root (mount -t tmpfs -o size=...)")
@pytest.mark.slow
def test_full_disk_during_save_keeps_the_previous_checkpoint(tmp_path, saved, fault):
    fault.name = "full_disk"
    with open(saved[0] / "ckpt" / "commfuse_complete") as f:
        size = sum(v[0] for v in json.load(f)["files"].values())
    disk = tmp_path / "disk"
    disk.mkdir()
    limit = (size * 3 // 2 // 4096 + 1) * 4096  # room for one checkpoint, not for a second one beside it
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={limit}", "tmpfs", str(disk)], check=True)
    try:
        proc, ranks, fault.seconds = _launch(tmp_path / "run", "full_disk", env={"FAULT_CKPT_DIR": str(disk)})
        _launcher_reported_failure(proc)
        for r in ranks:
            assert r.get("error_type") == "CheckpointError", _output(proc)
            assert "disk is full" in r["error"] and "previous checkpoint" in r["error"], r["error"]
        assert [s["step"] for s in ranks[0]["saved"]] == [2]
        assert not os.path.exists(disk / "ckpt.partial")  # the failed save's files were removed
        fault.bytes_lost = _bytes_lost(disk / "ckpt")
        assert ck.is_complete(disk / "ckpt") and fault.bytes_lost == 0
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    fault.clean = True


# ---- ranks that disagree, bad data -----------------------------------------------------------------------------

@pytest.mark.parametrize("name,error_type,words", [
    ("mismatched_config", "ValueError", ["bucket_mb"]),
    ("mismatched_model", "ValueError", ["mlp", "bias"]),
    ("bad_token_ids", "IndexError", ["rank", "1", "out of range"]),
])
@pytest.mark.slow
def test_ranks_that_disagree_or_bad_data_fail_on_every_rank(tmp_path, fault, name, error_type, words):
    proc, ranks, fault.seconds = _launch(tmp_path / "run", name)
    _launcher_reported_failure(proc)
    for r in ranks:
        assert r.get("error_type") == error_type, _output(proc)
        for word in words:
            assert word in r["error"], r["error"]
    fault.detail = f" ({error_type}: {ranks[0]['error'][:90]!r})"
    fault.clean = True


@pytest.mark.slow
def test_nan_gradients_raise_on_every_rank(tmp_path, fault):
    fault.name = "nan_grads_raise"
    proc, ranks, fault.seconds = _launch(tmp_path / "run", "nan_grads_raise")
    _launcher_reported_failure(proc)
    for r in ranks:
        assert r.get("error_type") == "FloatingPointError", _output(proc)
        assert "step" in r["error"] and "nonfinite_grads" in r["error"], r["error"]
        assert len(r["losses"]) == 2, r  # steps 0 and 1 trained; step 2 (the bad batch on rank 1) raised
    fault.detail = f" (FloatingPointError: {ranks[0]['error'][:90]!r})"
    fault.clean = True


@pytest.mark.slow
def test_nan_gradients_skip_the_step_on_every_rank(tmp_path, fault):
    fault.name = "nan_grads_skip"
    proc, ranks, fault.seconds = _launch(tmp_path / "run", "nan_grads_skip")
    assert proc.returncode == 0, _output(proc)
    for r in ranks:
        assert r.get("finished") and r["skipped"] == 1 and len(r["losses"]) == 4, r
        assert all(map(math.isfinite, r["losses"][3:])), r  # training went on, with finite losses after the skip
    assert "skipped" in proc.stderr, _output(proc)  # the warning each skipped step logs
    fault.detail = " (every rank skipped step 2, logged it, and trained on)"
    fault.clean = True
