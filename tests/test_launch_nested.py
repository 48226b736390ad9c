"""``commfuse-dp launch --config_file cfg.yaml LAUNCHER ...``: commands that start their own workers.

Real launchers, 2 CPU ranks (gloo), nothing mocked: ``trl sft`` (its own ``accelerate launch`` inside), ``torchrun
--nproc_per_node 2 script.py`` and ``accelerate launch script.py``. Each must end (a timeout turns a hang into a
failure), with every rank sharded and a world size of 2. Evidence per rank: tests/launch_probe/sitecustomize.py (on
PYTHONPATH: every Trainer worker writes ``rank<R>.json``) for ``trl sft`` and the torchrun Trainer script;
tests/launch_accelerate_script.py's per-rank files for ``accelerate launch``.

The console scripts run with this interpreter (``sys.executable``): when its own bin folder lacks ``trl``,
``accelerate`` or ``torchrun`` (a venv over the system site-packages), the test writes the same entry-point wrappers
pip would write there, into a temporary bin folder first on PATH.
"""

import importlib.metadata
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
pytest.importorskip("trl")

from commfuse_dp import launch

from harness import free_port  # noqa: E402  (tests/ is on sys.path: conftest)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROBE = os.path.join(HERE, "launch_probe")
TRAINER_SCRIPT = os.path.join(HERE, "launch_trainer_script.py")
ACCELERATE_SCRIPT = os.path.join(HERE, "launch_accelerate_script.py")
TIMEOUT = 420   # a hang fails the test after this many seconds (a run takes ~30-70 s on 2 shared cores)
CPU_CONFIG = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 2,
              "use_cpu": True, "mixed_precision": "no", "debug": False}
# Everything fused, ring embeddings on (the default), and the model's embeddings tied (sft_data): TRL 1.16's
# SFTTrainer patches the model with a fused LM head that reads lm_head.weight itself (add_fused_lm_head), which
# then gets the full table with its gradient summed over the ranks (commfuse_dp/fused/reads.py).
COMMFUSE = {"min_fuse_numel": 0}
WORDS = "the a cat dog sat ran on mat log fast slow red big small and then".split()


def _sft_args(data, out):
    return ["--model_name_or_path", str(data / "model"), "--dataset_name", str(data / "data"),
            "--output_dir", str(out), "--report_to", "none", "--use_cpu", "--bf16", "false", "--max_steps", "3",
            "--per_device_train_batch_size", "2", "--logging_steps", "1", "--save_strategy", "no", "--seed", "0",
            "--learning_rate", "1e-2", "--lr_scheduler_type", "constant", "--disable_tqdm", "true",
            "--dataloader_num_workers", "0"]


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    """A tiny Llama (tied embeddings) with a word-level tokenizer, and a local JSONL data set (text field)."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("sft")
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rng = random.Random(0)
    (root / "data").mkdir()
    with open(root / "data" / "train.jsonl", "w") as f:   # load_dataset(folder): the train split
        for _ in range(16):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))}) + "\n")
    return root


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory):
    """A folder for PATH holding this interpreter's console scripts trl, accelerate and torchrun."""
    own = os.path.dirname(sys.executable)
    out = tmp_path_factory.mktemp("bin")
    for ep in importlib.metadata.entry_points(group="console_scripts"):
        if ep.name in ("trl", "accelerate", "torchrun") and not os.path.exists(os.path.join(own, ep.name)):
            path = out / ep.name
            path.write_text(f"#!{sys.executable}\nimport sys\nfrom {ep.module} import {ep.attr.split('.')[0]}\n"
                            f"sys.exit({ep.attr}())\n")
            path.chmod(0o755)
    return f"{out}{os.pathsep}{own}"


def _env(bin_dir, probe_out=None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMFUSE_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PATH=bin_dir + os.pathsep + env.get("PATH", ""))
    if probe_out is not None:
        probe_out.mkdir(parents=True, exist_ok=True)
        env.update(LAUNCH_PROBE_OUT=str(probe_out), PYTHONPATH=PROBE + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _run(cmd, env, timeout=TIMEOUT) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; a hang kills the whole group and fails the test."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd[:6]))} ... hung (killed after {timeout} s):\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _config(tmp_path, **accelerate_keys) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**CPU_CONFIG, **accelerate_keys, "commfuse": COMMFUSE}))
    return str(path)


def _commfuse_launch(tmp_path, env, *command) -> subprocess.CompletedProcess:
    # `python -m commfuse_dp.cli` from the repository root: this checkout's commfuse_dp, with this interpreter.
    proc = _run([sys.executable, "-m", "commfuse_dp.cli", "launch", "--config_file", _config(tmp_path), *command],
                env)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _ranks(folder, pattern="rank{}.json") -> list[dict]:
    found = [folder / pattern.format(r) for r in range(2)]
    missing = [p.name for p in found if not p.exists()]
    assert not missing, f"no report from {missing} in {folder}: {sorted(p.name for p in folder.iterdir())}"
    return [json.loads(p.read_text()) for p in found]


# ---- trl sft: a console script whose own `accelerate launch` starts the workers ----------------------------------

@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory, sft_data, bin_dir):
    tmp = tmp_path_factory.mktemp("trl")
    _commfuse_launch(tmp, _env(bin_dir, tmp / "commfuse"), "trl", "sft", *_sft_args(sft_data, tmp / "out-cf"))
    # DDP reference: the same script started by torchrun directly (2 CPU ranks, as accelerate's CPU workers)
    ddp = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), "-m", "trl.scripts.sft", *_sft_args(sft_data, tmp / "out-ddp")],
               {**_env(bin_dir, tmp / "ddp"), "ACCELERATE_USE_CPU": "true", "LAUNCH_PROBE_EXIT_DRAIN": "1"})
    assert ddp.returncode == 0, ddp.stderr[-6000:]
    return {"commfuse": _ranks(tmp / "commfuse"), "ddp": _ranks(tmp / "ddp")}


@pytest.mark.slow
def test_trl_sft_is_sharded_on_every_rank(trl_runs):
    for rank, report in enumerate(trl_runs["commfuse"]):
        assert report["rank"] == rank and report["world_size"] == report["dist_world_size"] == 2, report
        assert report["param_types"] == ["DTensor"], report
        assert report["callbacks"].count("CommFuseCallback") == 1, report
        assert report["steps"] == [1, 2, 3] and all(n and n > 0 for n in report["hops"]), report
    for report in trl_runs["ddp"]:
        assert report["world_size"] == 2 and report["param_types"] == ["Tensor"], report


@pytest.mark.slow
def test_trl_sft_losses_match_ddp(trl_runs):
    # fp32 (--bf16 false), the tied table fused in the lm_head and the ring embedding (see COMMFUSE); the rings sum
    # in ring order rather than DDP's all-reduce order, so an fp32 ulp or two: rtol 1e-5 as in test_launch.py.
    cf, ddp = trl_runs["commfuse"][0], trl_runs["ddp"][0]
    assert cf["steps"] == ddp["steps"] == [1, 2, 3]
    torch.testing.assert_close(torch.tensor(cf["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(cf["grad_norms"]), torch.tensor(ddp["grad_norms"]), rtol=1e-4, atol=0)


# ---- torchrun and accelerate launch as the command ---------------------------------------------------------------

@pytest.mark.slow
def test_torchrun_command_is_sharded_on_every_rank(tmp_path, bin_dir):
    _commfuse_launch(tmp_path, _env(bin_dir, tmp_path / "probe"), "torchrun", "--nproc_per_node", "2",
                     "--master_addr", "127.0.0.1", "--master_port", str(free_port()), TRAINER_SCRIPT,
                     str(tmp_path / "out.json"))
    for rank, report in enumerate(_ranks(tmp_path / "probe")):
        assert report["rank"] == rank and report["world_size"] == report["dist_world_size"] == 2, report
        assert report["param_types"] == ["DTensor"] and report["callbacks"].count("CommFuseCallback") == 1, report
    assert json.loads((tmp_path / "out.json").read_text())["distributed_type"] == "DistributedType.MULTI_CPU"


@pytest.mark.slow
def test_accelerate_launch_command_is_sharded_on_every_rank(tmp_path, bin_dir):
    _commfuse_launch(tmp_path, _env(bin_dir), "accelerate", "launch", ACCELERATE_SCRIPT, str(tmp_path / "out.json"))
    for rank, report in enumerate(_ranks(tmp_path, "out.json.rank{}")):
        assert report["rank"] == rank and report["num_processes"] == 2, report
        assert report["accelerator_class"] == "CommFuseAccelerator" and report["param_types"] == ["DTensor"], report


# ---- what cannot work: one line, exit 2 --------------------------------------------------------------------------

@pytest.mark.slow
def test_launcher_inside_a_rank_is_refused_not_a_hang(tmp_path, bin_dir):
    # A Python script that each rank runs and that starts a launcher of its own (what `trl` given as a file path,
    # or a wrapper script around `trl sft`, does): its workers could never join the run.
    script = tmp_path / "wraps_a_launcher.py"
    script.write_text("import sys\nimport torch.distributed.run as r\n"
                      "r.main(['--nproc_per_node', '2', '-m', 'json.tool', '--help'])\n")
    proc = _run([sys.executable, "-m", "commfuse_dp.cli", "launch", "--config_file", _config(tmp_path),
                 str(script)], _env(bin_dir), timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    refusals = [line for line in proc.stderr.splitlines() if line.startswith("commfuse-dp launch:")]
    assert refusals and all("was started inside rank" in line and "runs it once" in line for line in refusals), \
        proc.stderr[-3000:]


@pytest.mark.parametrize("command,fragment", [
    (["torchrun", "--nproc_per_node", "3", "x.py"], "says num_processes: 2 but the torchrun command starts 3"),
    (["torchrun", "x.py"], "starts 1 workers"),
    (["--num_processes", "2", "trl", "sft"], "--num_processes before the launcher trl"),
    (["no-such-command-xyz"], "no command of that name on PATH"),
    (["/bin/sh", "-c", "true"], "is not a Python script"),
])
def test_wrong_launcher_uses_are_one_line_exit_2(tmp_path, capsys, monkeypatch, bin_dir, command, fragment):
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ.get("PATH", ""))
    argv = ["--config_file", _config(tmp_path)]
    argv = argv + command if not command[0].startswith("--") else command[:2] + argv + command[2:]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("commfuse-dp launch: ") and fragment in err, err


def test_help_says_what_runs_once(capsys):
    assert launch.main(["--help"]) == 0
    text = capsys.readouterr().out
    for fragment in ("LAUNCHER", "run ONCE", "sitecustomize.py", "trl sft --accelerate_config FILE",
                     "commfuse-dp launch --config_file FILE trl sft", "refused with exit status 2"):
        assert fragment in text, fragment
