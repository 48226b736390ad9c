"""``commfuse-dp launch``: validation before anything starts, ``--help``, the worker bootstrap, and real launches of
unchanged scripts at 2 CPU ranks (gloo) compared with the same scripts launched plainly with torchrun (DDP).

The launches (tests/launch_trainer_script.py: a plain ``transformers.Trainer``; tests/launch_accelerate_script.py:
a plain ``Accelerator()`` loop) use the same seeds and data both ways. Tolerance as in test_trainer_callback.py:
the ring reduce-scatter sums in ring order rather than DDP's all-reduce order (an fp32 ulp or two); rtol=1e-5 on
losses (1e-4 on gradient norms) is far below their step-to-step change (~1e-3 to 1e-2 here).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from commfuse_dp import CommFuseConfig, launch
from commfuse_dp.launch import config as launch_config

import hf_models  # noqa: E402  (tests/ is on sys.path: conftest)
from harness import free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAINER_SCRIPT = os.path.join(HERE, "launch_trainer_script.py")
ACCELERATE_SCRIPT = os.path.join(HERE, "launch_accelerate_script.py")

CPU_CONFIG = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 2,
              "use_cpu": True, "mixed_precision": "no", "debug": False}


def _write_config(tmp_path, commfuse=None, name="accel.yaml", **accelerate_keys):
    data = {**CPU_CONFIG, **accelerate_keys}
    if commfuse is not None:
        data["commfuse"] = commfuse
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture
def marker_script(tmp_path):
    """A script that leaves a file behind if any worker ever runs it."""
    marker = tmp_path / "started"
    script = tmp_path / "would_start.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    return str(script), marker


def _clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("COMMFUSE_"):
            monkeypatch.delenv(key)


# ---- refused before anything starts (in-process: launch.main returns before any launcher runs) -----------------

@pytest.mark.parametrize("block,fragments", [
    ({"schedul": "fused"}, ["unknown key 'schedul'", "did you mean 'schedule'?"]),
    ({"bucket_mb": -1}, ["bucket_mb=-1", "must be a number of MiB > 0"]),
    ({"param_dtype": "int8"}, ["param_dtype='int8'", "allowed values are"]),
    ({"stats": "maybe"}, ["stats='maybe'", "true or false"]),
    ("fused", ["must be a mapping of CommFuseConfig fields", "got str 'fused'"]),
])
def test_bad_commfuse_block_is_one_line_exit_2(tmp_path, capsys, monkeypatch, marker_script, block, fragments):
    _clean_env(monkeypatch)
    script, marker = marker_script
    path = _write_config(tmp_path, commfuse=block)
    assert launch.main(["--config_file", path, script]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"commfuse-dp launch: {path}: commfuse:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not marker.exists(), "a worker ran although the config was refused"


def test_stray_commfuse_variable_refused_before_start(tmp_path, capsys, monkeypatch, marker_script):
    _clean_env(monkeypatch)
    monkeypatch.setenv("COMMFUSE_BUCKET_MBB", "4")   # every worker's CommFuseConfig.from_env() would fail on it
    script, marker = marker_script
    assert launch.main(["--config_file", _write_config(tmp_path, commfuse={}), script]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "COMMFUSE_BUCKET_MBB" in err and "COMMFUSE_BUCKET_MB?" in err, err
    assert not marker.exists()


@pytest.mark.parametrize("accelerate_keys,argv_extra,fragment", [
    ({"unknown_accelerate_key": 1}, [], "(the accelerate part)"),
    ({"distributed_type": "FSDP"}, [], "asks for FSDP"),
    ({"distributed_type": "DEEPSPEED"}, [], "runs DeepSpeed only on GPUs"),
    ({}, ["--no_python"], "--no_python"),
    ({"num_processes": "two"}, [], "accelerate refused the launch options (the accelerate part of"),
])
def test_other_wrong_uses_exit_2(tmp_path, capsys, monkeypatch, marker_script, accelerate_keys, argv_extra,
                                 fragment):
    _clean_env(monkeypatch)
    script, marker = marker_script
    path = _write_config(tmp_path, commfuse={"schedule": "slicing"}, **accelerate_keys)
    assert launch.main(["--config_file", path, *argv_extra, script]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err, err
    assert not marker.exists()


def test_shipped_deepspeed_config_is_valid_and_refused_on_cpu(capsys, monkeypatch, marker_script):
    # The DeepSpeed variant of the recipes' config: its commfuse: block and its accelerate part pass validation;
    # on this CPU machine accelerate cannot run DeepSpeed, so it stops with one line before any worker starts.
    _clean_env(monkeypatch)
    script, marker = marker_script
    path = os.path.join(ROOT, "commfuse_dp", "recipes", "configs", "accelerate_deepspeed_commfuse.yaml")
    accel, block = launch_config.load_config_file(path)
    assert accel["distributed_type"] == "DEEPSPEED" and launch_config.commfuse_config(path, block).bucket_mb == 25
    assert launch.main(["--config_file", path, script]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "runs DeepSpeed only on GPUs" in err, err
    assert not marker.exists()


def test_missing_config_file(tmp_path, capsys, marker_script):
    script, marker = marker_script
    assert launch.main(["--config_file", str(tmp_path / "nope.yaml"), script]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not marker.exists()


def test_worker_environment_round_trips(monkeypatch):
    _clean_env(monkeypatch)
    cfg = CommFuseConfig(schedule="slicing", bucket_mb=4, param_dtype="bf16", exclude=("lm_head", "*.mlp"),
                         stats=False, min_fuse_numel=0)
    env = launch_config.worker_env(cfg)
    assert env["COMMFUSE_ENABLE"] == "1"
    assert CommFuseConfig.from_env(env) == cfg


# ---- --help ------------------------------------------------------------------------------------------------------

def test_help_explains_the_command(capsys):
    from commfuse_dp import cli

    assert cli.main(["launch", "--help"]) == 0
    text = capsys.readouterr().out
    for field in CommFuseConfig.__dataclass_fields__:
        assert f"\n  {field} [" in text, f"--help does not list the commfuse: key {field}"
    for fragment in ("commfuse:", "--config_file", "accelerate launch", "exits with status 2",
                     "use_cpu: true", "torch.distributed.run", "ACCELERATE_USE_CPU=true", "Example accel.yaml"):
        assert fragment in text, fragment
    # the example in the help is a valid config: its commfuse block passes the same validation
    example = yaml.safe_load(launch._EXAMPLE)
    CommFuseConfig.from_dict(example.pop("commfuse"))
    assert cli.main(["launch"]) == 2 and "commfuse-dp launch --help explains" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    top = capsys.readouterr().out
    assert top.startswith("usage: commfuse-dp COMMAND") and "commfuse-dp demo" in top and "``" not in top, top
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.startswith("commfuse-dp ")


def test_help_after_the_script_belongs_to_the_script():
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    assert launch._wants_help(["--num_processes", "2", "--help"], parser)
    assert launch._wants_help(["--config_file=a.yaml", "--cpu", "-h"], parser)
    assert not launch._wants_help(["--num_processes", "2", "train.py", "--help"], parser)
    assert not launch._wants_help(["-m", "pkg.train", "-h"], parser)  # -m takes no value: pkg.train is the target
    assert not launch._wants_help(["--config_file", "--help.yaml", "train.py"], parser)


# ---- the worker bootstrap, without a launcher --------------------------------------------------------------------

PROBE = """\
import json, os, sys
import accelerate, accelerate.accelerator
import transformers.trainer
print(json.dumps({
    "name": __name__, "argv": sys.argv, "path0": sys.path[0],
    "accelerator": accelerate.Accelerator.__name__,
    "accelerator_module": accelerate.accelerator.Accelerator.__name__,
    "trainer_accelerator": transformers.trainer.Accelerator.__name__,
    "default_callbacks": [c.__name__ for c in transformers.trainer.DEFAULT_CALLBACKS],
    "trainer": transformers.trainer.Trainer.__name__, "package_trainer": transformers.Trainer.__name__,
    "trainer_mro": [c.__name__ for c in transformers.trainer.Trainer.__mro__],
}))
"""


def _bootstrap(tmp_path, env_extra, *target):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMFUSE_")}
    env.update(env_extra)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "commfuse_dp.launch.worker", *target], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_bootstrap_hooks_only_when_enabled(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    on = _bootstrap(tmp_path, {"COMMFUSE_ENABLE": "1", "COMMFUSE_SCHEDULE": "slicing"}, str(probe), "a", "--b")
    assert on.returncode == 0, on.stderr[-3000:]
    seen = json.loads(on.stdout.strip().splitlines()[-1])
    assert seen["name"] == "__main__" and seen["argv"] == [str(probe), "a", "--b"]
    assert seen["path0"] == str(tmp_path)
    assert seen["accelerator"] == seen["accelerator_module"] == "CommFuseAccelerator"
    # the Trainer keeps accelerate's own Accelerator and is sharded by its CommFuseCallback instead: the Trainer is
    # CommFuseTrainer (which binds a CommFuseCallback to each instance), not a Trainer with a default callback
    assert seen["trainer_accelerator"] == "Accelerator"
    assert seen["default_callbacks"] == ["DefaultFlowCallback"]
    assert seen["trainer"] == seen["package_trainer"] == "CommFuseTrainer"
    assert seen["trainer_mro"][:3] == ["CommFuseTrainer", "CommFuseTrainerMixin", "Trainer"]

    off = _bootstrap(tmp_path, {}, str(probe))
    assert off.returncode == 0, off.stderr[-3000:]
    seen = json.loads(off.stdout.strip().splitlines()[-1])
    assert seen["accelerator"] == seen["trainer_accelerator"] == "Accelerator"
    assert seen["default_callbacks"] == ["DefaultFlowCallback"]
    assert seen["trainer"] == seen["package_trainer"] == "Trainer"


@pytest.mark.slow
def test_bootstrap_runs_a_module_and_refuses_a_bad_environment(tmp_path):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    env = {"COMMFUSE_ENABLE": "1", "PYTHONPATH": str(tmp_path)}
    ran = _bootstrap(tmp_path, env, "-m", "probe_mod", "x")
    assert ran.returncode == 0, ran.stderr[-3000:]
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    assert seen["name"] == "__main__" and seen["argv"][1:] == ["x"] and seen["argv"][0].endswith("probe_mod.py")
    assert seen["trainer"] == "CommFuseTrainer"

    bad = _bootstrap(tmp_path, {"COMMFUSE_ENABLE": "1", "COMMFUSE_TIMEOUT_S": "-1"}, str(tmp_path / "probe_mod.py"))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("commfuse_dp bootstrap: CommFuseConfig.timeout_s=-1")


# ---- real launches: 2 CPU ranks ----------------------------------------------------------------------------------

def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMFUSE_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _commfuse_launch(tmp_path, script: str, out, *, commfuse=None, timeout=240) -> subprocess.CompletedProcess:
    config = _write_config(tmp_path, commfuse={"min_fuse_numel": 0} if commfuse is None else commfuse,
                           name=f"{os.path.basename(script)}.yaml")
    # `python -m commfuse_dp.cli` from the repository root: this checkout's commfuse_dp in the launcher and
    # (cwd is inherited) in the workers' `python -m commfuse_dp.launch.worker`.
    return subprocess.run([sys.executable, "-m", "commfuse_dp.cli", "launch", "--config_file", config, script,
                           str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _plain_launch(script: str, out, *script_args: str) -> subprocess.CompletedProcess:
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    env = {**_env(), "ACCELERATE_USE_CPU": "true"}   # what accelerate's launcher would give a CPU worker
    return subprocess.run(launcher + ["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                                      str(free_port()), script, str(out), *script_args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def _run_pair(tmp_path, script: str) -> dict:
    results = {"dir": tmp_path}
    for mode, run in (("commfuse", lambda out: _commfuse_launch(tmp_path, script, out)),
                      ("plain", lambda out: _plain_launch(script, out))):
        out = tmp_path / f"{mode}.json"
        proc = run(out)
        assert proc.returncode == 0, f"{mode} launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        # the worker entry runs the bootstrap module once (not a second copy as __main__: runpy would warn)
        assert "found in sys.modules" not in proc.stderr, proc.stderr[-3000:]
        results[mode] = json.loads(out.read_text())
    return results


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    return _run_pair(tmp_path_factory.mktemp("launch-trainer"), TRAINER_SCRIPT)


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory):
    return _run_pair(tmp_path_factory.mktemp("launch-accelerate"), ACCELERATE_SCRIPT)


@pytest.mark.slow
def test_unchanged_trainer_script_is_sharded(trainer_runs):
    cf, plain = trainer_runs["commfuse"], trainer_runs["plain"]
    for run in (cf, plain):
        assert run["world_size"] == 2 and run["distributed_type"] == "DistributedType.MULTI_CPU"
    # the Trainer's own Accelerator (not a CommFuseAccelerator: the callback shards the model), which the callback
    # made shard the models the Trainer prepares for evaluation (commfuse_dp/integrations/accelerate.py, FrozenModels)
    assert cf["accelerator_class"] == "FrozenModelsAccelerator" and plain["accelerator_class"] == "Accelerator"
    assert cf["callbacks"].count("CommFuseCallback") == 1 and "CommFuseCallback" not in plain["callbacks"]
    assert cf["param_types"] == ["DTensor"] and cf["optimizer_state_types"] == ["DTensor"]
    assert cf["model_type"] != "DistributedDataParallel"
    assert plain["param_types"] == ["Tensor"] and plain["model_type"] == "DistributedDataParallel"
    # the callback's step figures reached the Trainer's logs
    assert all(e["commfuse/hops"] > 0 for e in cf["logs"])


@pytest.mark.slow
def test_unchanged_trainer_script_losses_match_ddp(trainer_runs):
    cf, plain = trainer_runs["commfuse"], trainer_runs["plain"]
    assert cf["steps"] == plain["steps"] == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor(cf["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(cf["grad_norms"]), torch.tensor(plain["grad_norms"]), rtol=1e-4, atol=0)


def test_unchanged_trainer_script_saves_a_model_that_reloads(trainer_runs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(trainer_runs["dir"] / "commfuse.json.model")).eval()
    with torch.no_grad():
        logits = model(**hf_models.batch(0, 99)).logits
    torch.testing.assert_close(logits, torch.tensor(trainer_runs["commfuse"]["logits"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, torch.tensor(trainer_runs["plain"]["logits"]), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_unchanged_accelerate_script_is_sharded(accelerate_runs):
    cf, plain = accelerate_runs["commfuse"], accelerate_runs["plain"]
    for run in (cf, plain):
        assert run["num_processes"] == 2 and run["distributed_type"] == "DistributedType.MULTI_CPU"
    assert cf["accelerator_class"] == "CommFuseAccelerator" and plain["accelerator_class"] == "Accelerator"
    assert cf["param_types"] == cf["optimizer_param_types"] == cf["optimizer_state_types"] == ["DTensor"]
    assert plain["param_types"] == ["Tensor"] and plain["model_type"] == "DistributedDataParallel"


@pytest.mark.slow
def test_the_launcher_attaches_each_model_once_through_the_shared_path(trainer_runs, accelerate_runs):
    """commfuse-dp launch has no attach code of its own: the Trainer it swaps in attaches its model through its
    CommFuseCallback, the Accelerator through CommFuseAccelerator.prepare, each once (the Trainer's own Accelerator
    stays accelerate's, so it does not attach the model a second time); a plain launch attaches nothing."""
    assert trainer_runs["commfuse"]["attachments"] == [["CommFuseCallback", "shard"]]
    assert accelerate_runs["commfuse"]["attachments"] == [["CommFuseAccelerator.prepare", "shard"]]
    assert trainer_runs["plain"]["attachments"] == accelerate_runs["plain"]["attachments"] == []


def test_unchanged_accelerate_script_losses_match_ddp(accelerate_runs):
    cf, plain = accelerate_runs["commfuse"], accelerate_runs["plain"]
    assert len(cf["losses"]) == 2 and len(cf["losses"][0]) == 8 and len(cf["grad_norms"]) == 4
    torch.testing.assert_close(torch.tensor(cf["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(cf["grad_norms"]), torch.tensor(plain["grad_norms"]), rtol=1e-4, atol=0)


@pytest.mark.slow
def test_exit_status_is_the_workers(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    proc = _commfuse_launch(tmp_path, str(script), tmp_path / "unused", commfuse={})
    assert proc.returncode == 3, proc.stderr[-3000:]


def test_usage_docs_config_passes_the_checks_and_a_missing_distributed_type_says_what_to_add(tmp_path, monkeypatch):
    """docs/usage.md's ``accel.yaml``, as a user copies it: its ``commfuse:`` block and its accelerate part pass the
    checks ``commfuse-dp launch`` makes before anything starts (a new user's trial found it without
    ``distributed_type``, which accelerate refuses). Without that key the one-line error says what to add."""
    import re
    import tempfile

    _clean_env(monkeypatch)
    with open(os.path.join(ROOT, "docs", "usage.md"), encoding="utf-8") as f:
        blocks = [b for b in re.findall(r"```yaml\n(.*?)```", f.read(), re.S) if "commfuse:" in b]
    assert blocks, "docs/usage.md has no yaml block with a commfuse: section"
    for i, block in enumerate(blocks):
        path = tmp_path / f"usage{i}.yaml"
        path.write_text(block)
        accel, cfg, _ = launch_config.read_config(str(path))
        with tempfile.TemporaryDirectory() as tmp:
            launch_config.accelerate_part_file(str(path), accel, tmp)
    data = yaml.safe_load(blocks[0])
    del data["distributed_type"]
    path = tmp_path / "no_type.yaml"
    path.write_text(yaml.safe_dump(data))
    accel, _, _ = launch_config.read_config(str(path))
    with tempfile.TemporaryDirectory() as tmp, pytest.raises(launch_config.LaunchError, match="distributed_type: MULTI_CPU"):
        launch_config.accelerate_part_file(str(path), accel, tmp)
