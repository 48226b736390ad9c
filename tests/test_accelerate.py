"""CommFuseAccelerator in real accelerate training loops: three torchrun launches (2 CPU ranks, gloo) of
tests/accelerate_worker.py on a BERT encoder -- commfuse (save_state after step 3, consolidated save at the end),
plain accelerate DDP, and a fresh commfuse run resumed from the step-3 state.

Tolerance against DDP: the per-step losses differ by at most ~1e-7 relative here (one fp32 ulp: the ring
reduce-scatter sums in ring order, DDP's all-reduce in its own), so rtol=1e-5 (1e-4 for the gradient norm, a
reduction over every gradient element) leaves room for other hardware while staying far below the loss's
step-to-step change (~3e-2). The resumed run repeats the uninterrupted run's arithmetic exactly (same ranks, same
ring order, the same optimizer state read back bit for bit), so its losses must be equal.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "accelerate_worker.py")
KIND = "bert"
sys.path.insert(0, HERE)

import hf_models  # noqa: E402
from harness import free_port  # noqa: E402


def _launch(out_dir, modes: tuple[str, ...]) -> dict:
    """One torchrun launch running ``modes`` one after another: {mode: what its rank 0 wrote}."""
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd = launcher + ["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                      WORKER, str(out_dir), ",".join(modes), KIND]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in [k for k in env if k.startswith(("ACCELERATE_", "COMMFUSE_"))]:
        env.pop(name)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, f"{modes} run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return {mode: json.loads((out_dir / f"{mode}.json").read_text()) for mode in modes}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate")
    result = _launch(out, ("commfuse", "ddp", "resume", "async", "asyncresume"))
    result["dir"] = out
    return result


@pytest.mark.slow
def test_prepare_shards_and_repoints_the_optimizer(runs):
    cf, ddp = runs["commfuse"], runs["ddp"]
    assert cf["world_size"] == ddp["world_size"] == 2
    assert cf["accelerator"] == "CommFuseAccelerator" and ddp["model_type"] == "DistributedDataParallel"
    assert cf["all_dtensor"], "prepare() should leave every parameter a DTensor shard"
    # The optimizer was built on the full parameters before prepare(); it must now hold the shards.
    assert cf["optimizer_is_model_params"] and cf["optimizer_state_dtensor"]


@pytest.mark.slow
def test_prepare_attaches_the_model_once(runs):
    """prepare() shards the model and Accelerator.prepare then calls prepare_model on it: the model reaches
    commfuse_dp.integrations.attach.attach once (recorded on the model by attach itself)."""
    for mode in ("commfuse", "resume"):
        assert runs[mode]["attachments"] == [["CommFuseAccelerator.prepare", "shard"]], mode
    assert runs["ddp"]["attachments"] == []


def test_losses_match_ddp(runs):
    cf, ddp = runs["commfuse"], runs["ddp"]
    assert len(cf["losses"]) == len(ddp["losses"]) == 6
    torch.testing.assert_close(torch.tensor(cf["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(cf["grad_norms"]), torch.tensor(ddp["grad_norms"]), rtol=1e-4, atol=0)
    assert max(ddp["grad_norms"]) > 1.0, "clipping (max norm 1.0) should be active in some steps"
    assert len(set(ddp["losses"])) > 1


def test_resume_from_save_state_matches_uninterrupted_run(runs):
    cf, resumed = runs["commfuse"], runs["resume"]
    assert cf["checkpoint_files"].count("commfuse") == 1, "the sharded state should be in <dir>/commfuse"
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(cf["checkpoint_files"]), "every rank's RNG"
    assert resumed["losses"] == cf["losses"][3:]
    assert resumed["grad_norms"] == cf["grad_norms"][3:]
    assert resumed["lr"] == cf["lr"], "the scheduler state should be restored"


def test_async_save_state_resumes_to_the_state_of_its_call(runs):
    """async_save: save_state after step 3 returns while the sharded state is written, steps 4..6 change every
    weight meanwhile, and a run resumed from that state repeats the uninterrupted run's steps 4..6 exactly."""
    cf, written, resumed = runs["commfuse"], runs["async"], runs["asyncresume"]
    assert written["losses"] == cf["losses"] and written["grad_norms"] == cf["grad_norms"]
    assert written["checkpoint_files"] == cf["checkpoint_files"]
    assert resumed["losses"] == cf["losses"][3:]
    assert resumed["grad_norms"] == cf["grad_norms"][3:]
    assert resumed["lr"] == cf["lr"]
    from commfuse_dp import checkpoint as ck

    assert ck.is_complete(runs["dir"] / "state-after-3-async" / "commfuse")


@pytest.mark.slow
def test_error_feedback_resumes_from_save_state_with_its_residuals(tmp_path):
    """int8 gradients with error feedback: save_state after step 3 carries each rank's residuals, and the resumed
    run repeats steps 4..6 exactly (the grad norms move with the residuals)."""
    runs = _launch(tmp_path, ("ef", "efresume"))
    full, resumed = runs["ef"], runs["efresume"]
    assert resumed["losses"] == full["losses"][3:]
    assert resumed["grad_norms"] == full["grad_norms"][3:]


def test_sharded_checkpoint_holds_every_ranks_optimizer_shard(runs):
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(runs["dir"] / "state-after-3" / "commfuse")).read_metadata()
    files = {item.relative_path for item in meta.storage_data.values()}
    assert len(files) == 2, f"both ranks should have written shards, got {files}"
    exp_avg = [k for k in meta.state_dict_metadata if k.startswith("optimizer_0.state.") and k.endswith("exp_avg")]
    assert exp_avg, "optimizer state missing from the checkpoint"
    model = hf_models.build(KIND)
    names = {n for n, _ in model.named_parameters()}
    saved = {k[len("optimizer_0.state."):-len(".exp_avg")] for k in exp_avg}
    assert saved == names, "optimizer state should be keyed by every parameter's name"


def test_consolidated_save_reloads_with_equal_logits(runs):
    from transformers import AutoModelForMaskedLM

    assert runs["commfuse"]["saved_files"] == ["config.json", "model.safetensors"]
    for folder in ("hf", "hf-save-model"):  # get_state_dict (gathered) and save_model (written in place)
        model = AutoModelForMaskedLM.from_pretrained(str(runs["dir"] / folder)).eval()
        with torch.no_grad():
            logits = model(**hf_models.batch(0, 99)).logits
        torch.testing.assert_close(logits, torch.tensor(runs["commfuse"]["logits"]), rtol=1e-5, atol=1e-6)


# ---- refusals (a subprocess each: Accelerator state is process-wide) -------------------------------------

_REFUSE = """
import sys
from commfuse_dp.integrations.accelerate import CommFuseAccelerator
from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
kwargs = {"ds": {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=3)},
          "fsdp": {"fsdp_plugin": FullyShardedDataParallelPlugin()}, "env": {}, "bad": {"commfuse": {"bucket_mbb": 1}}}
CommFuseAccelerator(**kwargs[sys.argv[1]])
"""


@pytest.mark.parametrize("case, env, word", [("ds", {}, "DeepSpeed only on GPUs"), ("fsdp", {}, "FSDP"),
                                             ("env", {"ACCELERATE_USE_FSDP": "true"}, "FSDP"),
                                             ("bad", {}, "bucket_mbb")])
@pytest.mark.slow
def test_refuses_other_sharding_and_bad_config(case, env, word):
    proc = subprocess.run([sys.executable, "-c", _REFUSE, case], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "Error" in last and word in last, proc.stderr[-2000:]
