"""Every ``CommFuseConfig`` option resumes bit for bit, through both sharded-checkpoint paths.

A run of ``N_STEPS`` steps (real gloo ranks, a Llama-style decoder, AdamW) saves after step ``SAVE_AT`` with
``save_sharded`` and with ``AsyncSaver``, and goes on. New processes load each folder into a freshly sharded model
and train the remaining steps: their final weights must equal the uninterrupted run's exactly (max abs difference
0). Options that add training state (error feedback's residuals, ``feedback.py``, in either ``feedback_dtype``)
are covered, and for them a control resumes with the residuals thrown away, which must differ, or the comparison
proves nothing. A checkpoint with residuals read back at another world size is refused with one line on every rank;
one read back with the other ``feedback_dtype`` converts them.

The Trainer's and accelerate's checkpoint paths go through ``save_sharded`` / ``AsyncSaver`` / ``load_sharded``
too; tests/test_trainer_atomic.py resumes a ``CommFuseTrainer`` with error feedback the same way.
"""

import pytest
import torch

import commfuse_dp as cf
import harness
import hf_models
from commfuse_dp import checkpoint as ck
from commfuse_dp.feedback import residuals_of
from harness import run_ranks

harness._context().set_forkserver_preload(["torch", "torch.distributed", "harness", "hf_models", "commfuse_dp",
                                           "transformers.models.llama.modeling_llama"])

N_STEPS = 4
SAVE_AT = 2

# name -> (ranks, CommFuseConfig fields)
CASES = {
    "defaults (exact)": (2, {}),
    "schedule=slicing": (2, {"schedule": "slicing"}),
    "schedule=fsdp2": (2, {"schedule": "fsdp2"}),
    "gather int8, reduce bf16": (2, {"gather_format": "int8", "reduce_format": "bf16"}),
    "fused, reduce int8 + error_feedback": (2, {"schedule": "fused", "reduce_format": "int8",
                                                "error_feedback": True}),
    "fused, reduce int8 + error_feedback, bfloat16 residuals": (2, {"schedule": "fused", "reduce_format": "int8",
                                                                    "error_feedback": True,
                                                                    "feedback_dtype": "bfloat16"}),
    "fused, reduce int8 + error_feedback, float32 residuals": (2, {"schedule": "fused", "reduce_format": "int8",
                                                                   "error_feedback": True,
                                                                   "feedback_dtype": "float32"}),
    "fsdp2, reduce bf16 + error_feedback, bfloat16 residuals": (2, {"schedule": "fsdp2", "reduce_format": "bf16",
                                                                    "error_feedback": True,
                                                                    "feedback_dtype": "bfloat16"}),
    "auto, gather and reduce int8 + error_feedback": (2, {"gather_format": "int8", "reduce_format": "int8",
                                                          "error_feedback": True}),
    "fsdp2, reduce int8 + error_feedback": (2, {"schedule": "fsdp2", "reduce_format": "int8",
                                                "error_feedback": True}),
    "HSDP 2x2, reduce int8 + error_feedback": (4, {"replicate": 2, "reduce_format": "int8",
                                                   "error_feedback": True}),
    "HSDP 2x2, fsdp2, int8 both + error_feedback": (4, {"replicate": 2, "schedule": "fsdp2", "gather_format": "int8",
                                                       "reduce_format": "int8", "error_feedback": True}),
    "param_dtype=bf16": (2, {"param_dtype": torch.bfloat16}),
    "grad_divide=pre, piece_shards=2": (2, {"grad_divide": "pre", "piece_shards": 2}),
    "no prefetch, no ring embeddings": (2, {"prefetch_next": False, "ring_embeddings": False}),
    "nonfinite_grads=skip": (2, {"nonfinite_grads": "skip"}),
}


def _setup(fields: dict):
    torch.set_num_threads(1)
    model = hf_models.build("llama", seed=0)
    cf.shard(model, cf.CommFuseConfig(min_fuse_numel=0, **fields))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, rank: int, steps, at_save=None) -> None:
    for step in steps:
        model(**hf_models.batch(rank, step, size=3)).loss.backward()
        opt.step()
        opt.zero_grad()
        if step == SAVE_AT and at_save is not None:
            at_save(step)


def _final(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in ck.full_state_dict(model).items()}


def _worker(rank, world_size, fields, folder, mode):
    """``full``: steps 1..N, saving after SAVE_AT into ``folder``/sync and ``folder``/async; returns the final
    weights and the residuals kept. ``resume``: from each folder, and (with residuals) from sync with them thrown
    away; returns the final weights of each."""
    if mode == "full":
        model, opt = _setup(fields)
        saver = ck.AsyncSaver()

        def save(step):
            ck.save_sharded(f"{folder}/sync", [model], [(model, opt)], extra={"step": step})
            saver.save(f"{folder}/async", [model], [(model, opt)], extra={"step": step})

        _train(model, opt, rank, range(1, N_STEPS + 1), save)
        saver.close()
        kept = residuals_of(model).state()
        return _final(model), {n: (t.numel(), str(t.dtype).removeprefix("torch.")) for n, t in kept.items()}
    finals = {}
    for source, drop in (("sync", False), ("async", False), ("sync", True)):
        if drop and not fields.get("error_feedback"):
            continue
        model, opt = _setup(fields)
        extra = {"step": -1}
        ck.load_sharded(f"{folder}/{source}", [model], [(model, opt)], extra=extra)
        assert extra["step"] == SAVE_AT
        if drop:
            residuals_of(model).restore({})
        _train(model, opt, rank, range(SAVE_AT + 1, N_STEPS + 1))
        finals[source + (" without residuals" if drop else "")] = _final(model)
    return finals


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_resume_is_bit_for_bit(tmp_path, case):
    ranks, fields = CASES[case]
    folder = str(tmp_path)
    full = run_ranks(_worker, ranks, (fields, folder, "full"), timeout=300)
    reference, kept = full[0]
    assert all(r[1] == kept for r in full), "every rank keeps the same residuals"
    assert bool(kept) == bool(fields.get("error_feedback")), kept
    dtype = cf.CommFuseConfig(**fields).feedback_dtype
    assert all(d == dtype for _, d in kept.values()), (dtype, kept)  # kept, and saved, in feedback_dtype
    print(f"RESIDUALS | {case} | {', '.join(sorted(kept))}")
    resumed = run_ranks(_worker, ranks, (fields, folder, "resume"), timeout=300)[0]
    rows = {source: _max_diff(final, reference) for source, final in resumed.items()}
    for source, diff in rows.items():
        print(f"RESUME | {case} | {source} | max abs diff of the final weights {diff:.3g}")
    assert rows["sync"] == 0.0 and rows["async"] == 0.0, rows
    if fields.get("error_feedback"):
        assert rows["sync without residuals"] > 0.0, "the control must differ, or the residuals carry nothing"


def _other_world_worker(rank, world_size, fields, folder):
    model, opt = _setup(fields)
    try:
        ck.load_sharded(f"{folder}/sync", [model], [(model, opt)], extra={"step": -1})
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.slow
def test_residuals_at_another_world_size_are_refused_on_every_rank(tmp_path):
    fields = {"reduce_format": "int8", "error_feedback": True}
    run_ranks(_worker, 2, (fields, str(tmp_path), "full"), timeout=300)
    errors = run_ranks(_other_world_worker, 3, (fields, str(tmp_path)), timeout=300)
    assert all(e and "saved at 2 ranks; this run has 3 ranks" in e for e in errors), errors
    assert len(set(errors)) == 1
    # without error feedback the same folder reshards as any other
    assert run_ranks(_other_world_worker, 3, ({"reduce_format": "int8"}, str(tmp_path)), timeout=300) == [None] * 3


def _other_dtype_worker(rank, world_size, fields, folder):
    """This rank's residuals as read back from ``folder``/sync with the saved run's ``feedback_dtype`` and with the
    other one."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        model, opt = _setup({**fields, "feedback_dtype": dtype})
        ck.load_sharded(f"{folder}/sync", [model], [(model, opt)], extra={"step": -1})
        out[dtype] = residuals_of(model).state()
    return out


def test_residuals_saved_in_another_dtype_are_converted(tmp_path):
    """A run resumed with the other ``feedback_dtype`` (say, to halve the residuals' memory) keeps them: float32
    ones are rounded to bfloat16 once, as each step's new residual is."""
    fields = {"schedule": "fused", "reduce_format": "int8", "error_feedback": True, "feedback_dtype": "float32"}
    run_ranks(_worker, 2, (fields, str(tmp_path), "full"), timeout=300)
    for back in run_ranks(_other_dtype_worker, 2, (fields, str(tmp_path)), timeout=300):
        saved, narrowed = back["float32"], back["bfloat16"]
        assert saved and sorted(saved) == sorted(narrowed)
        for name, tensor in saved.items():
            assert tensor.dtype == torch.float32 and narrowed[name].dtype == torch.bfloat16, name
            assert tensor.abs().sum() > 0 and torch.equal(narrowed[name], tensor.to(torch.bfloat16)), name


def _other_schedule_worker(rank, world_size, folder):
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("commfuse_dp.checkpoint").addHandler(handler)
    model, opt = _setup({"schedule": "fsdp2"})
    ck.load_sharded(f"{folder}/sync", [model], [(model, opt)], extra={"step": -1})
    return seen


def test_a_resume_that_chose_another_schedule_says_so():
    """The checkpoint records what the "auto" settings ran as; a run that resumes it on another schedule (here
    given, as a machine measured again could choose) warns on every rank that it is no longer bit for bit."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        run_ranks(_worker, 2, ({"schedule": "fused"}, folder, "full"), timeout=300)
        seen = run_ranks(_other_schedule_worker, 2, (folder,), timeout=300)
    for messages in seen:
        assert len(messages) == 1 and "ran schedule='fused'" in messages[0], messages
        assert "this run's chose schedule='fsdp2'" in messages[0] and "not bit for bit" in messages[0], messages
