"""Trainer checkpoints with CommFuseCallback are atomic: three torchrun launches (2 CPU ranks, gloo) of
tests/trainer_crash_worker.py (checkpoints every 2 steps, save_total_limit=1, 6 steps).

A run whose rank 1 is killed while checkpoint-4 is being written (after rank 0 wrote trainer_state.json, the point
where a plain Trainer would delete checkpoint-2) leaves checkpoint-2 complete and checkpoint-4 without its
``commfuse_complete`` marker. transformers' own ``get_last_checkpoint`` would pick that checkpoint-4; a fresh run
refuses it when named, and with ``resume_from_checkpoint=True`` resumes from checkpoint-2 and repeats the
uninterrupted run's steps 3..6 exactly (same world size, same arithmetic, state read back bit for bit).

With ``CommFuseConfig(auto_resume=True, async_save=True)`` (a fourth launch), checkpoints are written in the
background, and a second Trainer on the same output folder, given nothing to resume from, resumes from the newest
complete checkpoint by itself and repeats the uninterrupted (asynchronously saving) run's last steps exactly. A
run relaunched at 3 ranks on a 2-rank run's output folder resumes by itself too, with the same weights and
optimizer moments (DCP reshards).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "trainer_crash_worker.py")
sys.path.insert(0, HERE)

from harness import free_port  # noqa: E402


def _launch(out_dir, mode: str, nproc: int = 2) -> subprocess.CompletedProcess:
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd = launcher + ["--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                      WORKER, str(out_dir), mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name in [k for k in env if k.startswith(("ACCELERATE_", "COMMFUSE_"))]:
        env.pop(name)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("atomic")
    result = {"dir": out}
    result["crash_proc"] = _launch(out, "crash")
    crash = out / "run-crash"
    # what the crash left, before the resumed run changes it
    result["after_crash"] = {name: sorted(os.listdir(crash / name)) for name in os.listdir(crash)}
    from transformers.trainer_utils import get_last_checkpoint

    result["transformers_pick"] = os.path.basename(get_last_checkpoint(str(crash)))
    result["full_proc"] = result["resume_proc"] = _launch(out, "full,resume")  # one launch, one after the other
    for mode in ("full", "resume"):
        proc = result[mode + "_proc"]
        assert proc.returncode == 0, f"{mode} run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        result[mode] = json.loads((out / f"{mode}.json").read_text())
    return result


@pytest.mark.slow
def test_killed_rank_leaves_previous_checkpoint_complete(runs):
    proc = runs["crash_proc"]
    assert proc.returncode != 0, "the crash run should fail: one of its ranks died"
    assert "exitcode  : 3" in proc.stderr or "exit code 3" in proc.stderr or "exitcode: 3" in proc.stderr, \
        proc.stderr[-4000:]
    left = runs["after_crash"]
    assert sorted(left) == ["checkpoint-2", "checkpoint-4"], "save_total_limit=1 must not delete checkpoint-2 " \
                                                            "before checkpoint-4 is complete"
    assert "commfuse_complete" in left["checkpoint-2"]
    assert {"model.safetensors", "commfuse", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth",
            "scheduler.pt"} <= set(left["checkpoint-2"])
    # checkpoint-4 got as far as trainer_state.json (a plain Trainer would call it done) but has no marker
    assert "trainer_state.json" in left["checkpoint-4"] and "rng_state_1.pth" not in left["checkpoint-4"]
    assert "commfuse_complete" not in left["checkpoint-4"]
    assert runs["transformers_pick"] == "checkpoint-4", "transformers' get_last_checkpoint takes the partial one"


@pytest.mark.slow
def test_partial_checkpoint_named_explicitly_is_refused(runs):
    message = runs["resume"]["explicit"]
    assert message is not None, "resume_from_checkpoint=<partial checkpoint-4> should have been refused"
    assert "checkpoint-4 is not a complete checkpoint" in message
    assert "checkpoint-2" in message and "resume_from_checkpoint=True" in message


def test_resume_true_takes_last_complete_checkpoint_and_matches(runs):
    full, resumed = runs["full"], runs["resume"]
    assert sorted(full["losses"], key=int) == [str(s) for s in range(1, 7)]
    assert resumed["steps_run"] == [3, 4, 5, 6], "should resume after step 2"
    assert full["steps_run"] == [1, 2, 3, 4, 5, 6]
    for step in map(str, resumed["steps_run"]):
        assert resumed["losses"][step] == full["losses"][step], step
        assert resumed["grad_norms"][step] == full["grad_norms"][step], step
    assert "checkpoint-4 in" in runs["resume_proc"].stderr and "incomplete" in runs["resume_proc"].stderr


def test_rotation_still_keeps_save_total_limit(runs):
    # the resumed run rewrote checkpoint-4 over the partial one, then rotated checkpoint-2 and -4 away
    assert runs["full"]["checkpoints"] == ["checkpoint-6"]
    assert runs["resume"]["checkpoints"] == ["checkpoint-6"]
    assert os.path.isfile(runs["dir"] / "run-crash" / "checkpoint-6" / "commfuse_complete")


def _folders(root, complete, partial):
    from commfuse_dp import checkpoint as ck

    for step in complete + partial:
        folder = root / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text("{}")
        if step in complete:
            ck.mark_complete(folder)


def test_rotation_counts_complete_checkpoints_only(tmp_path):
    """In-process, on folders: a partial checkpoint-8 left by an earlier killed run, a complete checkpoint-2, and
    checkpoint-4 just written by a run resumed from checkpoint-2, with save_total_limit=1. transformers' rotation
    (its mtime order falls back to step numbers when the folders are less than a second apart) keeps the partial
    checkpoint-8 as "the most recent" and deletes the good checkpoint-4; the callback's keeps checkpoint-4."""
    from transformers.trainer_utils import rotate_checkpoints

    from commfuse_dp import checkpoint as ck
    from commfuse_dp.integrations.trainer_checkpoints import rotate_complete

    plain, ours = tmp_path / "plain", tmp_path / "ours"
    for root in (plain, ours):
        root.mkdir()
        _folders(root, complete=[2, 4], partial=[8])
    rotate_checkpoints(str(plain), save_total_limit=1, use_mtime=True)
    assert sorted(os.listdir(plain)) == ["checkpoint-8"]
    rotate_complete(str(ours), 1, None, str(ours / "checkpoint-4"))
    assert sorted(os.listdir(ours)) == ["checkpoint-4", "checkpoint-8"]
    assert ck.latest_complete(ours) == str(ours / "checkpoint-4")
    assert ck.latest_complete(tmp_path / "missing") is None


@pytest.mark.slow
def test_auto_resume_takes_the_newest_async_checkpoint_and_matches(tmp_path):
    proc = _launch(tmp_path, "asyncfull,auto")
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    full, auto = (json.loads((tmp_path / f"{mode}.json").read_text()) for mode in ("asyncfull", "auto"))
    assert auto["first_checkpoints"] == ["checkpoint-4"]  # complete (marked) once train() returned; -2 rotated
    assert auto["steps_run"] == [5, 6], "should resume after step 4 by itself"
    message = f"auto_resume: resuming from {tmp_path / 'run-auto' / 'checkpoint-4'} (step 4)"
    assert message in proc.stderr, proc.stderr[-4000:]
    for step in map(str, auto["steps_run"]):
        assert auto["losses"][step] == full["losses"][step], step
        assert auto["grad_norms"][step] == full["grad_norms"][step], step
    assert auto["checkpoints"] == full["checkpoints"] == ["checkpoint-6"]
    assert os.path.isfile(tmp_path / "run-auto" / "checkpoint-6" / "commfuse_complete")
    assert not os.path.exists(tmp_path / "run-auto" / "checkpoint-6" / "model.safetensors")  # sharded state only


@pytest.mark.slow
def test_error_feedback_resumes_with_its_residuals(tmp_path):
    """int8 gradients with error feedback: the resumed Trainer's grad norm at step 5 (which the residuals shift)
    and its losses equal the uninterrupted run's, bit for bit."""
    proc = _launch(tmp_path, "effull,efauto")
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    full, auto = (json.loads((tmp_path / f"{mode}.json").read_text()) for mode in ("effull", "efauto"))
    assert auto["steps_run"] == [5, 6]
    for step in map(str, auto["steps_run"]):
        assert auto["losses"][step] == full["losses"][step], step
        assert auto["grad_norms"][step] == full["grad_norms"][step], step


@pytest.mark.slow
def test_auto_resume_at_another_world_size_reshards(tmp_path):
    first = _launch(tmp_path, "grow")
    assert first.returncode == 0, f"{first.stdout[-4000:]}\n{first.stderr[-8000:]}"
    second = _launch(tmp_path, "grown", nproc=3)
    assert second.returncode == 0, f"{second.stdout[-4000:]}\n{second.stderr[-8000:]}"
    grown = json.loads((tmp_path / "grown.json").read_text())
    assert grown["world_size"] == 3
    message = f"auto_resume: resuming from {tmp_path / 'run-grow' / 'checkpoint-4'} (step 4)"
    assert message in second.stderr, second.stderr[-4000:]
    assert grown["steps_run"] == [5, 6], "should resume after step 4 by itself"
    assert grown["keys"], "the resumed state should hold the same weights and optimizer moments"
    assert grown["max_abs_diff"] == 0.0, "the weights and moments read back at 3 ranks differ from those saved at 2"
    assert grown["checkpoints"] == ["checkpoint-6"]
