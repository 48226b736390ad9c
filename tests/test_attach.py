"""``commfuse_dp.integrations.attach``: the one path every integration takes onto the rings.

The real runs of each entry point check that it reaches ``attach`` once per model (the ``attachments`` record that
``attach`` itself keeps on the model): test_trainer_callback.py (``CommFuseCallback``), test_accelerate.py
(``CommFuseAccelerator``), test_launch.py (``commfuse-dp launch``), test_deepspeed_rings.py (the callback with
DeepSpeed, ``enable_ring_collectives``), test_fsdp_integration.py (``use_ring_collectives``). Here: a model another
library shards already is refused with one message whichever entry point it is given to, before anything changes,
and the decisions ``attach`` owns (backend, config) on their own.
"""

import types

import pytest
import torch
import torch.nn as nn

from commfuse_dp import CommFuseConfig
from commfuse_dp.integrations.attach import Attachment, attach, attachments, resolve_config
from harness import run_ranks
from commfuse_dp.handle import handle_of


def _foreign_models(world_size: int) -> dict[str, nn.Module]:
    """A model FSDP2 sharded, and one whose parameters DeepSpeed ZeRO-3 partitioned (the attributes ZeRO-3 sets)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    fsdp = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(fsdp[0], mesh=init_device_mesh("cpu", (world_size,)))
    zero3 = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    zero3[1].weight.ds_id = 1
    return {"fsdp2": fsdp, "zero3": zero3}


def _refusal_worker(rank, world_size):
    from commfuse_dp import shard
    from commfuse_dp.integrations.accelerate import CommFuseAccelerator
    from commfuse_dp.integrations.transformers import CommFuseCallback

    cfg = CommFuseConfig(schedule="fused", timeout_s=60)
    accelerator = CommFuseAccelerator(cpu=True, commfuse=cfg)
    args = types.SimpleNamespace(fsdp=[], deepspeed=None, save_strategy="no", process_index=rank)
    entries = {
        "shard": lambda m: shard(m, cfg),
        "attach": lambda m: attach(m, cfg, who="a test"),
        "CommFuseCallback": lambda m: CommFuseCallback(cfg).on_init_end(args, None, None, model=m),
        "CommFuseAccelerator.prepare": lambda m: accelerator.prepare(m),
        "CommFuseAccelerator.prepare_model": lambda m: accelerator.prepare_model(m),
    }
    seen = {}
    for kind in ("fsdp2", "zero3"):
        for entry, call in entries.items():
            model = _foreign_models(world_size)[kind]
            before = [p.detach().clone() for p in model.parameters()]
            try:
                call(model)
            except ValueError as err:
                seen[f"{kind} {entry}"] = str(err)
            else:
                seen[f"{kind} {entry}"] = "accepted"
            assert attachments(model) == [], (kind, entry)
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), (kind, entry)
    return seen


def test_a_model_another_library_sharded_is_refused_alike_by_every_entry_point():
    seen = run_ranks(_refusal_worker, 2, timeout=180)[0]
    for kind, what_to_do in (("fsdp2", "use_ring_collectives(model)"), ("zero3", "enable_ring_collectives(engine)")):
        messages = {entry: text for entry, text in seen.items() if entry.startswith(kind)}
        assert len(set(messages.values())) == 1, messages
        message = next(iter(messages.values()))
        assert what_to_do in message, message
    assert "FSDP2 fully_shard" in seen["fsdp2 attach"]
    assert "partitioned by DeepSpeed ZeRO-3" in seen["zero3 attach"]


def _attached_once_worker(rank, world_size):
    """A model the accelerator attached, then handed to prepare_model again and to a CommFuseCallback: attach is
    reached by the callback (recorded) but shards nothing twice."""
    from commfuse_dp.integrations.accelerate import CommFuseAccelerator
    from commfuse_dp.integrations.transformers import CommFuseCallback

    cfg = CommFuseConfig(schedule="fused", min_fuse_numel=0, timeout_s=60)
    accelerator = CommFuseAccelerator(cpu=True, commfuse=cfg)
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)))
    after_prepare = attachments(model)
    engine = handle_of(model).engine
    accelerator.prepare_model(model)
    args = types.SimpleNamespace(fsdp=[], deepspeed=None, save_strategy="no", process_index=rank)
    CommFuseCallback(CommFuseConfig(schedule="slicing")).on_init_end(args, None, None, model=model)
    return {"after_prepare": after_prepare, "after_all": attachments(model),
            "same_engine": handle_of(model).engine is engine, "schedule": handle_of(model).engine.config.schedule}


def test_each_entry_point_is_recorded_and_nothing_is_sharded_twice():
    result = run_ranks(_attached_once_worker, 2, timeout=180)[0]
    assert result["after_prepare"] == [("CommFuseAccelerator.prepare", "shard")]
    assert result["after_all"] == [("CommFuseAccelerator.prepare", "shard"), ("CommFuseCallback", "shard")]
    assert result["same_engine"] and result["schedule"] == "fused"


# ---- without a process group ---------------------------------------------------------------------------------

def test_config_resolution(monkeypatch):
    monkeypatch.setenv("COMMFUSE_BUCKET_MB", "5")
    assert resolve_config(None).bucket_mb == 5.0
    assert resolve_config({"bucket_mb": 3}).bucket_mb == 3.0
    cfg = CommFuseConfig(bucket_mb=7)
    assert resolve_config(cfg) is cfg
    with pytest.raises(TypeError, match="commfuse= takes a CommFuseConfig"):
        resolve_config("fused")


def test_unknown_backend_and_start_of_a_shard_attachment():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="backend='fsdp'; one of"):
        attach(model, who="a test", backend="fsdp")
    assert attachments(model) == []
    with pytest.raises(ValueError, match="starts at attach"):
        Attachment("a test", "shard", CommFuseConfig(), "a test").start(model, None)


def test_deepspeed_backend_decides_the_ring_config_without_an_engine():
    """The callback's DeepSpeed path: the DeepSpeed config's section wins over the callback's config, which must
    not contradict it; nothing starts before the engine exists."""
    pytest.importorskip("deepspeed")
    section = {"commfuse": {"bucket_mb": 2}}
    model = nn.Linear(2, 2)
    done = attach(model, CommFuseConfig(), who="CommFuseCallback", backend="deepspeed", ds_config=section,
                  own_wins=False)
    assert (done.config.bucket_mb, done.source, done.rings) == (2.0, "the DeepSpeed config", None)
    assert attachments(model) == [("CommFuseCallback", "deepspeed")]
    with pytest.raises(ValueError, match="disagree"):
        attach(nn.Linear(2, 2), CommFuseConfig(bucket_mb=3), who="CommFuseCallback", backend="deepspeed",
               ds_config=section, own_wins=False)
    mine = attach(nn.Linear(2, 2), CommFuseConfig(bucket_mb=3), who="x", backend="deepspeed", ds_config=section)
    assert (mine.config.bucket_mb, mine.source) == (3.0, "cfg")
