"""CommFuseCallback in a real ``transformers.Trainer``: one torchrun launch (2 CPU ranks, gloo) of
tests/trainer_worker.py on a Llama-style decoder running, one after another, a run sharded by the callback
(checkpoints every 3 steps, save_model at the end), a plain one (the Trainer wraps the model in DDP), a sharded run
resumed from the first one's step-3 checkpoint, one on the peer's schedule, then the first two in bf16, with the
same seeds and data. Per-step losses, gradient norms and eval_loss must agree with DDP; the resumed run's steps 4..6
must equal the uninterrupted run's (same arithmetic, state read back bit for bit); the saved model must reload with
from_pretrained in this (fresh, single) process with equal logits.

Tolerance: on this setup the two runs differ by at most ~1e-7 relative (loss, eval_loss; ~3e-7 for grad_norm),
i.e. one or two fp32 ulps from the ring reduce-scatter summing in ring order rather than DDP's all-reduce order.
rtol=1e-5 (1e-4 for the gradient norm) leaves two orders of magnitude for other hardware and thread counts while
still far below the step-to-step change of the loss (~1e-3 to 1e-2 here).
"""

import json
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402
from harness import free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "trainer_worker.py")


def _launch(tmp_path, modes: tuple[str, ...]) -> dict:
    """One torchrun launch running ``modes`` (MODE or MODE:PRECISION) one after another: {MODE-PRECISION: what its
    rank 0 wrote}."""
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd = launcher + ["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                      WORKER, str(tmp_path), ",".join(modes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ACCELERATE_USE_CPU", None)  # use_cpu=True in the TrainingArguments is what the worker relies on
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, f"{modes} run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    names = [m if ":" in m else m + ":fp32" for m in modes]
    return {n.replace(":", "-"): json.loads((tmp_path / f"{n.replace(':', '-')}.json").read_text()) for n in names}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("trainer")
    every = _launch(tmp_path, ("commfuse", "ddp", "resume", "peer", "commfuse:bf16", "ddp:bf16"))
    result = {mode: every[f"{mode}-fp32"] for mode in ("commfuse", "ddp", "resume", "peer")}
    result["bf16"] = {mode: every[f"{mode}-bf16"] for mode in ("commfuse", "ddp")}
    result["dir"] = tmp_path
    return result


@pytest.mark.slow
def test_trainer_sees_two_cpu_processes(runs):
    for run in (runs["commfuse"], runs["ddp"], runs["resume"]):
        assert run["world_size"] == 2
        assert run["distributed_type"] == "DistributedType.MULTI_CPU"
        assert run["parallel_mode"] == "ParallelMode.DISTRIBUTED"
    assert runs["ddp"]["model_type"] == "DistributedDataParallel"
    assert not runs["ddp"]["any_dtensor"]


@pytest.mark.slow
def test_callback_shards_model_and_optimizer_state(runs):
    run = runs["commfuse"]
    assert run["all_dtensor"], "every parameter should be a DTensor shard after on_init_end"
    assert run["model_type"] != "DistributedDataParallel", "accelerate must not wrap the sharded model in DDP"
    assert run["optimizer_state_dtensor"], "AdamW state should be built from the sharded parameters"


def test_the_callback_attaches_the_model_once(runs):
    """CommFuseTrainer's callback puts the model on the rings through commfuse_dp.integrations.attach.attach, once
    per model (recorded on the model by attach itself); the plain Trainer's model is never attached."""
    for mode in ("commfuse", "resume", "peer"):
        assert runs[mode]["attachments"] == [["CommFuseCallback", "shard"]], mode
    assert runs["bf16"]["commfuse"]["attachments"] == [["CommFuseCallback", "shard"]]
    assert runs["ddp"]["attachments"] == runs["bf16"]["ddp"]["attachments"] == []


def test_accumulation_enters_model_no_sync(runs):
    # 6 optimizer steps x 2 micro-batches: the first of each pair runs inside accelerator.no_sync(model), which
    # calls the sharded model's no_sync() (accelerate/accelerator.py, Accelerator.no_sync).
    assert runs["commfuse"]["no_sync_calls"] == 6


def test_losses_match_ddp(runs):
    cf, ddp = runs["commfuse"], runs["ddp"]
    assert cf["steps"] == ddp["steps"] == [1, 2, 3, 4, 5, 6]
    torch.testing.assert_close(torch.tensor(cf["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(cf["grad_norms"]), torch.tensor(ddp["grad_norms"]), rtol=1e-4, atol=0)
    # Clipping is active in some steps (max_grad_norm=1.0), so the norm over the DTensor gradients is exercised.
    assert max(ddp["grad_norms"]) > 1.0
    # The model actually trains: the loss is not constant.
    assert len(set(ddp["losses"])) > 1


def test_peer_schedule_matches_ddp(runs):
    """CommFuseConfig(schedule="fsdp2"), what the defaults run where fusing cannot win: its asynchronous gathers
    and deferred reduce-scatters under the Trainer's accumulation (no_sync) and clipping, against DDP."""
    peer, ddp = runs["peer"], runs["ddp"]
    assert peer["all_dtensor"] and peer["optimizer_state_dtensor"] and peer["steps"] == ddp["steps"]
    torch.testing.assert_close(torch.tensor(peer["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(peer["grad_norms"]), torch.tensor(ddp["grad_norms"]), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(peer["eval_loss"]), torch.tensor(ddp["eval_loss"]), rtol=1e-5, atol=0)
    assert all(entry["commfuse/hops"] > 0 for entry in peer["logs"])
    # the plan's tokens per rank: read off a batch of the Trainer's first examples (2 examples of 12 tokens)
    assert "24 tokens per rank (the Trainer's first 2 examples, 2 x 12)" in peer["machine"], peer["machine"]


def test_eval_loss_matches_ddp_with_short_last_batch(runs):
    # even_batches=False: accelerate does not pad rank 1's last batch, so the ranks run forwards of different
    # sizes (the sharded model's collectives must not care) -- but the same number of them.
    for run in (runs["commfuse"], runs["ddp"]):
        assert run["eval_batch_sizes"] == [[2, 2, 2], [2, 2, 1]]
    torch.testing.assert_close(torch.tensor(runs["commfuse"]["eval_loss"]), torch.tensor(runs["ddp"]["eval_loss"]),
                               rtol=1e-5, atol=0)


def test_logs_carry_commfuse_figures(runs):
    for entry in runs["commfuse"]["logs"]:
        assert entry["commfuse/hops"] > 0
        for key in ("exposed_comm_s", "comm_s", "compute_s", "wall_s"):
            assert entry[f"commfuse/{key}"] >= 0.0
        assert entry["commfuse/exposed_comm_s"] <= entry["commfuse/comm_s"] + 1e-9
    assert not any(k.startswith("commfuse/") for entry in runs["ddp"]["logs"] for k in entry)


@pytest.fixture(scope="module")
def bf16_runs(runs):
    return runs["bf16"]  # the same launch, after the fp32 modes


def test_bf16_autocast_applies_to_the_sharded_model(runs, bf16_runs):
    """bf16=True: the Trainer's autocast must reach the sharded model (accelerate applies it in prepare_model,
    which the callback's prepared flag would skip). The first step's forward is the same bf16 arithmetic as DDP's
    (equal loss) and differs from fp32; afterwards the runs drift apart by bf16 rounding of gradients computed in
    other piece shapes and orders (observed <= 5e-4 relative over 6 steps), so rtol=2e-3 there."""
    cf, ddp = bf16_runs["commfuse"], bf16_runs["ddp"]
    assert cf["losses"][0] == ddp["losses"][0]
    assert cf["losses"][0] != runs["commfuse"]["losses"][0], "bf16=True left the sharded model in fp32"
    torch.testing.assert_close(torch.tensor(cf["losses"]), torch.tensor(ddp["losses"]), rtol=2e-3, atol=0)
    torch.testing.assert_close(torch.tensor(cf["eval_loss"]), torch.tensor(ddp["eval_loss"]), rtol=2e-3, atol=0)


def test_resume_matches_uninterrupted_run(runs):
    full, resumed = runs["commfuse"], runs["resume"]
    after = [i for i, step in enumerate(resumed["steps"]) if step > 3]
    assert [resumed["steps"][i] for i in after] == [4, 5, 6]
    assert [resumed["losses"][i] for i in after] == full["losses"][3:]
    assert [resumed["grad_norms"][i] for i in after] == full["grad_norms"][3:]
    assert resumed["eval_loss"] == full["eval_loss"]


def test_checkpoint_holds_every_ranks_shards(runs):
    import torch.distributed.checkpoint as dcp

    files = runs["commfuse"]["checkpoint_files"]
    assert "optimizer.pt" not in files, "rank 0's optimizer shard alone must never be written"
    assert {"commfuse", "model.safetensors", "config.json", "scheduler.pt", "trainer_state.json",
            "rng_state_0.pth", "rng_state_1.pth"} <= set(files)
    meta = dcp.FileSystemReader(str(runs["dir"] / "run-commfuse" / "checkpoint-3" / "commfuse")).read_metadata()
    assert len({item.relative_path for item in meta.storage_data.values()}) == 2, "both ranks should write shards"
    names = {n for n, _ in hf_models.build("llama").named_parameters()}
    for key in ("exp_avg", "exp_avg_sq"):
        saved = {k[len("optimizer_0.state."):-len(key) - 1] for k in meta.state_dict_metadata
                 if k.startswith("optimizer_0.state.") and k.endswith("." + key)}
        assert saved == names, f"optimizer {key} should be saved for every parameter"


@pytest.mark.parametrize("folder", ["final", "checkpoint-3"])
def test_saved_model_reloads_in_one_process(runs, folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(runs["dir"] / "run-commfuse" / folder)).eval()
    if folder == "final":
        with torch.no_grad():
            logits = model(**hf_models.batch(0, 99)).logits
        torch.testing.assert_close(logits, torch.tensor(runs["commfuse"]["logits"]), rtol=1e-5, atol=1e-6)
    else:   # the step-3 weights differ from the final ones
        final = AutoModelForCausalLM.from_pretrained(str(runs["dir"] / "run-commfuse" / "final"))
        assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), final.parameters()))


# ---- refusals (in-process, no launch) ----------------------------------------------------------------------

def _integration():
    from commfuse_dp.integrations.transformers import CommFuseCallback

    return CommFuseCallback


def _args(**kw):
    return types.SimpleNamespace(**{"fsdp": [], "deepspeed": None, "save_strategy": "no", **kw})


@pytest.mark.parametrize("kw, word", [({"fsdp": ["full_shard"]}, "fsdp"),
                                      ({"save_strategy": "steps"}, "not called by a Trainer")])
def test_refuses_fsdp_and_saving_without_a_trainer(kw, word):
    from commfuse_dp import CommFuseConfig

    cb = _integration()(CommFuseConfig(schedule="fused"))
    with pytest.raises(ValueError, match=word):
        cb.on_init_end(_args(**kw), None, None, model=torch.nn.Linear(2, 2))


@pytest.mark.parametrize("field", ["auto_resume", "async_save"])
def test_bare_callback_refuses_resuming_and_async_saves(field):
    from commfuse_dp import CommFuseConfig

    cb = _integration()(CommFuseConfig(schedule="fused", **{field: True}))
    with pytest.raises(ValueError, match=f"CommFuseConfig.{field}=True need that Trainer.*CommFuseTrainer"):
        cb.on_init_end(_args(), None, None, model=torch.nn.Linear(2, 2))


def test_refuses_without_process_group():
    import torch.distributed as dist

    from commfuse_dp import CommFuseConfig

    assert not dist.is_initialized(), "the test process itself must have no process group"
    cb = _integration()(CommFuseConfig(schedule="fused"))
    with pytest.raises(RuntimeError, match="torchrun"):
        cb.on_init_end(_args(), None, None, model=torch.nn.Linear(2, 2))


def test_two_callbacks_on_one_trainer_only_one_acts():
    """commfuse-dp launch adds a CommFuseCallback() to every Trainer; a script's own CommFuseCallback(cfg) wins."""
    from commfuse_dp import CommFuseConfig

    cls = _integration()
    default, explicit = cls(), cls(CommFuseConfig(schedule="fused", bucket_mb=5))
    trainer = types.SimpleNamespace(callback_handler=types.SimpleNamespace(callbacks=[object(), default, explicit]))
    assert default._defer(trainer) and not explicit._defer(trainer)
    first, second = cls(CommFuseConfig(schedule="fused")), cls(CommFuseConfig(schedule="fused"))
    trainer.callback_handler.callbacks = [first, second]
    assert not first._defer(trainer) and second._defer(trainer)
    assert not cls()._defer(None)


@pytest.mark.parametrize("sizes, replicate, error", [
    ({"dp_replicate_size": 2, "dp_shard_size": 2}, 2, None),
    ({"dp_replicate_size": 1, "dp_shard_size": 4}, 1, None),
    ({"dp_shard_size": 2, "cp_size": 2}, None, "no context or sequence parallelism"),
    ({"dp_replicate_size": 4, "dp_shard_size": 1, "cfg_replicate": 2}, None, "disagrees with the callback's"),
])
def test_trainer_parallelism_config_becomes_replicate(sizes, replicate, error):
    """TrainingArguments(parallelism_config=ParallelismConfig(dp_replicate_size=R, ...)) asks the callback for HSDP
    (tests/test_multinode.py runs it at 2 x 2 against DDP); context parallel sizes and a disagreeing config are
    refused."""
    from accelerate.parallelism_config import ParallelismConfig

    from commfuse_dp import CommFuseConfig

    cfg = CommFuseConfig(schedule="fused", replicate=sizes.pop("cfg_replicate", 1))
    cb = _integration()(cfg)
    pc = ParallelismConfig(**sizes)
    if error:
        with pytest.raises(ValueError, match=error):
            cb._with_parallelism(_args(parallelism_config=pc))
        return
    assert cb._with_parallelism(_args(parallelism_config=pc)).replicate == replicate
    assert cb._with_parallelism(_args()).replicate == 1  # no parallelism_config: the config as given


def test_trainer_parallelism_config_tp_size_becomes_tp_size():
    from accelerate.parallelism_config import ParallelismConfig

    from commfuse_dp import CommFuseConfig

    pc = ParallelismConfig(dp_shard_size=2, tp_size=2)
    assert _integration()(CommFuseConfig())._with_parallelism(_args(parallelism_config=pc)).tp_size == 2
    with pytest.raises(ValueError, match="disagrees with the callback's CommFuseConfig tp_size=4"):
        _integration()(CommFuseConfig(tp_size=4))._with_parallelism(_args(parallelism_config=pc))


# ---- CommFuseCallback on a plain Trainer, and the Trainer mixin (in-process, no process group) -----------------

def _plain_args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], disable_tqdm=True, **kw)


@pytest.mark.parametrize("kw, what", [({}, "save_strategy='steps'"),   # the Trainer's default save_strategy
                                      ({"save_strategy": "epoch"}, "save_strategy='epoch'"),
                                      ({"save_strategy": "no", "bf16": True}, "bf16=True")])
def test_plain_trainer_with_the_callback_alone_says_what_to_write(tmp_path, kw, what):
    """A plain transformers.Trainer hands its callbacks no reference to itself: with checkpoints (or bf16) the
    callback cannot do its part, and says, before anything is sharded, to write CommFuseTrainer instead."""
    from transformers import Trainer

    from commfuse_dp import CommFuseConfig

    model = hf_models.build("llama", seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as err:
        Trainer(model=model, args=_plain_args(tmp_path, **kw), train_dataset=hf_models.Synthetic(4, seed=1),
                callbacks=[_integration()(CommFuseConfig(schedule="fused"))])
    message = str(err.value)
    assert what in message and "not called by a Trainer" in message
    assert "CommFuseTrainer(...) instead of Trainer(...)" in message
    assert "from commfuse_dp.integrations.transformers import CommFuseTrainer" in message
    assert "commfuse_trainer(SFTTrainer)" in message
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "nothing sharded before the error"


def test_commfuse_trainer_binds_its_callback_and_keeps_the_callers_arguments(tmp_path):
    """CommFuseTrainer hands the callback passed in callbacks= (or one it makes) its Trainer before the Trainer's
    __init__ runs; it keeps save_total_limit itself (its Trainer's copy of the arguments has none) and leaves the
    caller's TrainingArguments unchanged. Here no process group exists, so on_init_end stops at that check."""
    from commfuse_dp import CommFuseConfig
    from commfuse_dp.integrations.transformers import CommFuseCallback, CommFuseTrainer

    args = _plain_args(tmp_path, save_strategy="steps", save_steps=2, save_total_limit=1)
    cb = CommFuseCallback(CommFuseConfig(schedule="fused"))
    seen = {}

    class Probe(CommFuseTrainer):
        def create_accelerator_and_postprocess(self):   # runs inside Trainer.__init__, before on_init_end
            seen["bound"] = cb.trainer is self
            seen["limit"] = (self.commfuse_save_total_limit, self.args.save_total_limit)
            return super().create_accelerator_and_postprocess()

    with pytest.raises(RuntimeError, match="torchrun"):
        Probe(model=hf_models.build("llama", seed=0), args=args, train_dataset=hf_models.Synthetic(4, seed=1),
              callbacks=[cb])
    assert seen == {"bound": True, "limit": (1, None)}
    assert args.save_total_limit == 1
    with pytest.raises(ValueError, match="pass the CommFuseConfig once"):
        CommFuseTrainer(model=hf_models.build("llama", seed=0), args=args, callbacks=[cb],
                        commfuse=CommFuseConfig(schedule="fused"))


def test_commfuse_trainer_for_any_trainer_class():
    from transformers import Trainer

    from commfuse_dp.integrations.transformers import CommFuseTrainer, CommFuseTrainerMixin, commfuse_trainer

    SFTTrainer = pytest.importorskip("trl").SFTTrainer

    assert commfuse_trainer(Trainer) is CommFuseTrainer
    assert CommFuseTrainer.__mro__[1:3] == (CommFuseTrainerMixin, Trainer)
    sft = commfuse_trainer(SFTTrainer)
    assert sft.__name__ == "CommFuseSFTTrainer" and sft.__mro__[1:3] == (CommFuseTrainerMixin, SFTTrainer)
    assert commfuse_trainer(SFTTrainer) is sft and commfuse_trainer(sft) is sft   # made once, never twice
    with pytest.raises(TypeError, match="not a transformers.Trainer class"):
        commfuse_trainer(object)
