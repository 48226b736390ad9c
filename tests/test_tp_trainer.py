"""Tensor parallelism through ``CommFuseTrainer`` (``CommFuseConfig(tp_size=2)``): 4 CPU ranks as TP 2 x data 2
against the plain Trainer on 2 ranks (data 2) with the same batches: each step's loss and gradient norm (clipped at
0.5), the eval loss, and the consolidated save (``save_model``) loaded by ``from_pretrained`` in one process; an
accelerate loop under ``commfuse-dp launch`` with accelerate's ``parallelism_config``; the Trainer's sharded
checkpoint at step 5 resumed bit for bit; the accelerate recipe's ``save_state`` under TP resumed bit for bit, and
what stock accelerate does with the same ``parallelism_config``; the bare callback refusing TP, and a forward that
computes the lm_head itself refused, on every rank."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from harness import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "tp_trainer_worker.py")
RECIPE = os.path.join(ROOT, "commfuse_dp", "recipes", "train_accelerate.py")
SMALL = ["--block_size", "32", "--logging_steps", "1", "--timeline_step", "2"]  # (the embedded model: 4 heads)
PARALLELISM = {"parallelism_config_tp_size": 2, "parallelism_config_dp_shard_size": 2}


def _launch(tmp_path, mode: str, ranks: int) -> dict:
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd = launcher + ["--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1", "--master_port",
                      str(free_port()), WORKER, str(tmp_path), mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ACCELERATE_USE_CPU", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{mode} run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads((tmp_path / f"{mode}.json").read_text())


@pytest.mark.slow
def test_tp_two_by_data_two_matches_the_plain_trainer(tmp_path):
    tp, ddp = _launch(tmp_path, "tp", 4), _launch(tmp_path, "ddp", 2)
    assert tp["tp_size"] == 2 and tp["steps"] == ddp["steps"] == 10
    assert len(tp["losses"]) == len(ddp["losses"]) == 10
    for key in ("losses", "grad_norms"):
        for step, (ours, theirs) in enumerate(zip(tp[key], ddp[key])):
            assert abs(ours - theirs) <= 1e-5 * max(1.0, abs(theirs)), (key, step, ours, theirs)
    assert max(ddp["grad_norms"]) > 0.5  # the clipping acted
    assert tp["tokens_seen"] == ddp["tokens_seen"] == 10 * 2 * 2 * 2 * 12  # a TP group's batch counts once
    assert abs(tp["eval_loss"] - ddp["eval_loss"]) <= 1e-5 * abs(ddp["eval_loss"])
    assert abs(tp["probe_loss"] - ddp["probe_loss"]) <= 1e-5 * abs(ddp["probe_loss"])
    # the consolidated save loads in one process with from_pretrained, as the trained model
    import torch
    from transformers import LlamaForCausalLM

    import hf_models

    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "final")).eval()
    with torch.no_grad():
        loss = loaded(**hf_models.batch(0, 99)).loss.item()
    assert abs(loss - tp["probe_loss"]) <= 1e-5 * abs(tp["probe_loss"]), (loss, tp["probe_loss"])
    # the run saved its sharded state at step 5 (TP 2 x data 2); a run resumed from there is the same run
    resumed = _launch(tmp_path, "resume", 4)
    assert resumed["steps"] == 10
    for key in ("losses", "grad_norms", "eval_loss", "probe_loss"):
        assert resumed[key] == tp[key], (key, resumed[key], tp[key])


def test_bare_callback_refuses_tensor_parallelism():
    import types

    import torch

    from commfuse_dp import CommFuseConfig
    from commfuse_dp.integrations.trainer_callback import CommFuseCallback

    cb = CommFuseCallback(CommFuseConfig(tp_size=2))
    args = types.SimpleNamespace(fsdp=[], deepspeed=None, save_strategy="no")
    with pytest.raises(ValueError, match="tp_size=2 .*need that Trainer.*CommFuseTrainer"):
        cb.on_init_end(args, None, None, model=torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_launch_with_accelerate_s_tp_size_matches_ddp(tmp_path):
    """``commfuse-dp launch`` with an accelerate YAML whose ``parallelism_config:`` asks for TP 2 x data 2 runs a
    plain accelerate loop (tests/launch_accelerate_script.py, Llama) on 4 CPU ranks: each TP group's losses and the
    clipped gradient norms are those of DDP on 2 ranks with the same batches."""
    import yaml

    from test_launch import ACCELERATE_SCRIPT, CPU_CONFIG, _env, _plain_launch

    config = tmp_path / "tp.yaml"
    config.write_text(yaml.safe_dump({**CPU_CONFIG, "num_processes": 4, "commfuse": {"min_fuse_numel": 0},
                                      "parallelism_config": {"parallelism_config_tp_size": 2,
                                                             "parallelism_config_dp_shard_size": 2}}))
    ours, theirs = tmp_path / "tp.json", tmp_path / "ddp.json"
    proc = subprocess.run([sys.executable, "-m", "commfuse_dp.cli", "launch", "--config_file", str(config),
                           ACCELERATE_SCRIPT, str(ours), "llama"], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    proc = _plain_launch(ACCELERATE_SCRIPT, theirs, "llama")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    tp, ddp = json.loads(ours.read_text()), json.loads(theirs.read_text())
    assert tp["num_processes"] == 4 and ddp["num_processes"] == 2
    assert tp["accelerator_class"] == "CommFuseAccelerator" and len(tp["grad_norms"]) == 4
    for rank, losses in enumerate(tp["losses"]):  # ranks 0, 1 read data rank 0's batches; 2, 3 data rank 1's
        for ours_, theirs_ in zip(losses, ddp["losses"][rank // 2]):
            assert abs(ours_ - theirs_) <= 1e-5 * abs(theirs_), (rank, tp["losses"], ddp["losses"])
    for ours_, theirs_ in zip(tp["grad_norms"], ddp["grad_norms"]):
        assert abs(ours_ - theirs_) <= 1e-5 * theirs_, (tp["grad_norms"], ddp["grad_norms"])


def _recipe(tmp_path, out, *args: str, config: str = "tp.yaml") -> subprocess.CompletedProcess:
    from test_launch import _env

    return subprocess.run([sys.executable, "-m", "commfuse_dp.cli", "launch", "--config_file", str(tmp_path / config),
                           RECIPE, "--output_dir", str(out), *SMALL, *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=400)


@pytest.mark.slow
def test_accelerate_save_state_at_tp_resumes_bit_for_bit(tmp_path):
    """``accelerator.save_state`` / ``load_state`` of a TP 2 x data 2 model: the accelerate recipe under
    ``commfuse-dp launch`` with a ``parallelism_config:`` block saves at step 3 of 6; a run resumed from that state
    logs the uninterrupted run's losses of steps 4-6 and ends at its eval loss, bit for bit."""
    import yaml

    from test_launch import CPU_CONFIG

    (tmp_path / "tp.yaml").write_text(yaml.safe_dump({**CPU_CONFIG, "num_processes": 4, "parallelism_config": PARALLELISM,
                                                      "commfuse": {"min_fuse_numel": 0}}))
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    proc = _recipe(tmp_path, whole, "--max_steps", "6", "--save_steps", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    proc = _recipe(tmp_path, resumed, "--max_steps", "6", "--resume_from", str(whole / "state-3"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    first, second = (json.loads((out / "summary.json").read_text()) for out in (whole, resumed))
    assert first["world_size"] == 4 and first["sharded"] and first["accelerator"] == "CommFuseAccelerator"
    assert len(first["train_losses"]) == 6 and len(second["train_losses"]) == 3
    assert second["train_losses"] == first["train_losses"][3:], (first["train_losses"], second["train_losses"])
    assert second["eval_loss_after"] == first["eval_loss_after"]
    assert first["eval_loss_after"] < first["eval_loss_before"]


def test_stock_accelerate_cannot_run_tp_with_fsdp2(tmp_path):
    """What the same ``parallelism_config`` gives without commfuse (accelerate 1.15, transformers 5.x). On GPUs,
    accelerate's TP + FSDP2 preparation (``Accelerator._prepare_tp``) imports ``ReplicateParallel`` from
    ``transformers.integrations.tensor_parallel``, which transformers no longer has: an ImportError. On CPU ranks
    stock ``accelerate launch`` refuses the FSDP2 YAML before that (FSDP is a GPU distributed type to it), and
    ``commfuse-dp launch`` refuses it too, naming the YAML it runs (MULTI_CPU with the same block: the test above)."""
    import inspect

    import yaml
    from accelerate import Accelerator

    assert "from transformers.integrations.tensor_parallel import ReplicateParallel" in inspect.getsource(
        Accelerator._prepare_tp)
    with pytest.raises(ImportError, match="ReplicateParallel"):
        from transformers.integrations.tensor_parallel import ReplicateParallel  # noqa: F401
    from test_launch import CPU_CONFIG, _env

    fsdp = {**CPU_CONFIG, "distributed_type": "FSDP", "num_processes": 4, "parallelism_config": PARALLELISM,
            "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}}
    (tmp_path / "fsdp.yaml").write_text(yaml.safe_dump(fsdp))
    stock = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                            str(tmp_path / "fsdp.yaml"), RECIPE, "--output_dir", str(tmp_path / "stock"), *SMALL,
                            "--max_steps", "2"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert stock.returncode != 0 and "ParallelismConfig is only compatible" in stock.stderr, stock.stderr[-4000:]
    ours = _recipe(tmp_path, tmp_path / "ours", "--max_steps", "2", config="fsdp.yaml")
    assert ours.returncode == 2 and "use distributed_type MULTI_GPU (GPUs) or MULTI_CPU" in ours.stderr, ours.stderr


def _own_head_worker(rank, world_size):
    import types

    import hf_models
    import torch

    import commfuse_dp as cf

    model = cf.shard(hf_models.build("llama"), cf.CommFuseConfig(tp_size=2, min_fuse_numel=0))

    def forward(self, input_ids=None, **kwargs):  # what a library's fused LM head does: the head's weight itself
        weight = self.lm_head.weight
        weight = weight.to_local() if hasattr(weight, "to_local") else weight  # (FSDP2's gathered or sharded)
        return self.model(input_ids=input_ids).last_hidden_state @ weight.T

    with torch.no_grad():
        model(**hf_models.batch(0, 0))  # a forward as it should be first: the check is made anew each forward
    model.forward = types.MethodType(forward, model)
    with pytest.raises(ValueError, match="forward was replaced by one that projects .* lm_head.weight itself"):
        model(**hf_models.batch(0, 0))
    return True


def _fused_head_worker(rank, world_size):
    import hf_models

    import commfuse_dp as cf

    model = cf.shard(hf_models.build("llama"), cf.CommFuseConfig(tp_size=2, min_fuse_numel=0))
    with pytest.raises(ValueError, match="fused_lm_head=True, in its KTO, GRPO and RLOO"):
        model(**hf_models.batch(0, 0), fused_lm_head=True)  # (outside commfuse_trainer(SFTTrainer))
    return True


def test_trl_s_fused_head_is_refused_outside_the_sft_trainer():
    from harness import run_ranks

    assert all(run_ranks(_fused_head_worker, 2, timeout=300))


def test_a_forward_that_computes_the_head_itself_is_refused_on_every_rank():
    """Shapes that happen to fit (this rank's sequence rows times this rank's vocabulary rows) must not pass as
    logits: the root's forward ends with a check that its TP lm_head ran."""
    from harness import run_ranks

    assert all(run_ranks(_own_head_worker, 2, timeout=300))
