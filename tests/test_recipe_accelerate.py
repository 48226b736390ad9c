"""commfuse_dp/recipes/train_accelerate.py, the unchanged accelerate loop, launched by `commfuse-dp launch` with the shipped
config (commfuse_dp/recipes/configs/accelerate_cpu_commfuse.yaml, 2 CPU processes): it must come out sharded, the loss must
fall, and the consolidated model must reload in this process."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SMALL = ["--hidden_size", "64", "--num_layers", "2", "--vocab_size", "512", "--block_size", "32",
         "--logging_steps", "2", "--timeline_step", "2", "--max_steps", "6", "--save_steps", "3"]


@pytest.mark.slow
def test_unchanged_loop_under_commfuse_launch(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name in [k for k in env if k.startswith(("ACCELERATE_", "COMMFUSE_"))]:
        env.pop(name)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "commfuse_dp.cli", "launch", "--config_file",
           os.path.join(ROOT, "commfuse_dp", "recipes", "configs", "accelerate_cpu_commfuse.yaml"),
           os.path.join(ROOT, "commfuse_dp", "recipes", "train_accelerate.py"), "--output_dir", str(out), *SMALL]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accelerator"] == "CommFuseAccelerator" and summary["sharded"] and summary["world_size"] == 2
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert summary["exposed_comm_s"] is not None and summary["tokens_per_s"] > 0
    for name in ("loss.png", "timeline.png", "state-3/commfuse", "state-6/commfuse", "model/model.safetensors"):
        assert (out / name).exists(), name
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out / "model")).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out / "model"))
    with torch.no_grad():
        logits = model(**tokenizer("The assert statement", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()


@pytest.mark.slow
def test_auto_resume_carries_on_from_the_newest_complete_state(tmp_path):
    """With --async_save: the states' sharded parts are written in the background, and a state whose step.json
    was written but whose background write never finished is passed over, as is one cut short before step.json."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name in [k for k in env if k.startswith(("ACCELERATE_", "COMMFUSE_"))]:
        env.pop(name)
    out = tmp_path / "run"
    small = [a for a in SMALL if a not in ("--max_steps", "6")]

    def launch(steps: int):
        cmd = [sys.executable, "-m", "commfuse_dp.cli", "launch", "--config_file",
               os.path.join(ROOT, "commfuse_dp", "recipes", "configs", "accelerate_cpu_commfuse.yaml"),
               os.path.join(ROOT, "commfuse_dp", "recipes", "train_accelerate.py"), "--output_dir", str(out), *small,
               "--max_steps", str(steps), "--auto_resume", "--async_save"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
        return proc.stdout + proc.stderr

    from commfuse_dp import checkpoint as ck

    assert f"no complete state in {out}; starting at step 0" in launch(3)
    assert ck.is_complete(out / "state-3" / "commfuse")
    assert json.loads((out / "state-3" / "step.json").read_text()) == {"step": 3, "sharded": True}
    (out / "state-6").mkdir()  # a state whose save was cut short: no step.json
    (out / "state-5" / "commfuse.partial").mkdir(parents=True)  # killed during the background write
    (out / "state-5" / "step.json").write_text(json.dumps({"step": 5, "sharded": True}))
    said = launch(6)
    assert f"resuming from {out / 'state-3'} (step 3)" in said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["async_save"] and (out / "state-6" / "step.json").exists()
    assert ck.is_complete(out / "state-6" / "commfuse"), "the last background write must finish before the end"


@pytest.mark.parametrize("case, word", [("missing", "does not exist"), ("empty", "no text"),
                                        ("outdir", "not empty"), ("resume", "is not a folder"),
                                        ("config", "bucket_mbb"), ("async", "--async_save"),
                                        ("auto", "--save_steps 0")])
def test_bad_input_one_line_and_nothing_written(tmp_path, monkeypatch, capsys, case, word):
    # main() in this process: every check runs before any process group or Accelerator exists.
    from commfuse_dp.recipes import train_accelerate

    out = tmp_path / "out"
    args = ["--output_dir", str(out), "--hidden_size", "64", "--num_layers", "2", "--vocab_size", "512",
            "--block_size", "32"]
    if case == "missing":
        args += ["--dataset_name", str(tmp_path / "nope.txt")]
    elif case == "empty":
        (tmp_path / "empty.txt").write_text("  \n\n")
        args += ["--dataset_name", str(tmp_path / "empty.txt")]
    elif case == "outdir":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "resume":
        args += ["--resume_from", str(tmp_path / "no-state")]
    elif case == "async":
        args += ["--async_save"]
    elif case == "auto":
        args += ["--auto_resume"]
    elif case == "config":
        (tmp_path / "cf.yaml").write_text("commfuse:\n  bucket_mbb: 4\n")
        args += ["--commfuse", "--commfuse_config", str(tmp_path / "cf.yaml")]
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    with pytest.raises(SystemExit) as exc:
        train_accelerate.main(args)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert exc.value.code == 2 and len(lines) == 1 and word in lines[0], lines
    if case == "outdir":
        assert os.listdir(out) == ["keep.txt"]
    else:
        assert not out.exists(), "nothing may be written for bad input"
