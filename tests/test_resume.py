"""Resuming bit for bit in a plain training loop (same world size, real 2-rank gloo groups): a run that stops after
step ``STOP_AT``, saves with :func:`commfuse_dp.checkpoint.save_sharded` (model + AdamW + the step number + each
rank's RNG state in ``extra``), and is continued by *new* processes that :func:`load_sharded` the folder, gives the
same losses on every rank, exactly (``==``), as a run that never stopped.

The model uses attention dropout, so each step draws from the torch RNG of its rank: the continuation only
matches if the RNG states come back too (the test checks that a fresh process starts from another state). Each
rank's state goes under its own key (``rng_rank{r}``): DCP keeps one copy of entries that have the same key on
every rank, which would hand every rank rank 0's state.
"""

import pytest
import torch

import commfuse_dp as cf
import harness
import hf_models
from commfuse_dp import checkpoint as ck
from harness import run_ranks

harness._context().set_forkserver_preload(["torch", "torch.distributed", "harness", "hf_models", "commfuse_dp",
                                           "transformers.models.llama.modeling_llama"])

N_STEPS = 5
STOP_AT = 2


def _setup(rank, schedule):
    torch.set_num_threads(1)
    model = hf_models.build("llama", seed=0, attention_dropout=0.2)
    cf.shard(model, cf.CommFuseConfig(min_fuse_numel=0, schedule=schedule))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1234 + rank)          # each rank its own dropout masks
    return model, opt


def _worker(rank, world_size, schedule, path, mode):
    """mode: "full" (steps 1..N, no save), "stop" (steps 1..STOP_AT, save, exit), "resume" (load, STOP_AT+1..N),
    "resume-without-rng" (the same, leaving the fresh process's RNG as it is: the control)."""
    model, opt = _setup(rank, schedule)
    first, last = 1, N_STEPS if mode != "stop" else STOP_AT
    rng_differs = None
    if mode.startswith("resume"):
        fresh_rng = torch.get_rng_state()
        extra = {"step": -1, f"rng_rank{rank}": torch.zeros_like(fresh_rng)}
        ck.load_sharded(path, [model], [(model, opt)], extra=extra)
        first = int(extra["step"]) + 1
        rng_differs = not torch.equal(fresh_rng, extra[f"rng_rank{rank}"])
        if mode == "resume":
            torch.set_rng_state(extra[f"rng_rank{rank}"])
    losses = {}
    for step in range(first, last + 1):
        loss = model(**hf_models.batch(rank, step, size=3)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[step] = loss.item()
    if mode == "stop":
        ck.save_sharded(path, [model], [(model, opt)],
                        extra={"step": last, f"rng_rank{rank}": torch.get_rng_state()})
    return losses, rng_differs


@pytest.mark.parametrize("schedule", ["fused", "slicing"])
def test_resume_in_new_processes_is_bit_for_bit(tmp_path, schedule):
    path = str(tmp_path / "state")
    full = run_ranks(_worker, 2, (schedule, path, "full"), timeout=180)
    stopped = run_ranks(_worker, 2, (schedule, path, "stop"), timeout=180)
    resumed = run_ranks(_worker, 2, (schedule, path, "resume"), timeout=180)
    for rank in range(2):
        full_losses, _ = full[rank]
        stop_losses, _ = stopped[rank]
        resumed_losses, rng_differs = resumed[rank]
        assert sorted(resumed_losses) == list(range(STOP_AT + 1, N_STEPS + 1))
        assert rng_differs, "a fresh process must start from another RNG state, or the test proves nothing"
        assert stop_losses == {s: full_losses[s] for s in range(1, STOP_AT + 1)}
        assert resumed_losses == {s: full_losses[s] for s in range(STOP_AT + 1, N_STEPS + 1)}, (rank, schedule)
    assert len(set(full[0][0].values())) == N_STEPS, "the model should train"
    if schedule == "fused":   # the control: without its RNG state the continuation differs (dropout is live)
        control = run_ranks(_worker, 2, (schedule, path, "resume-without-rng"), timeout=180)
        for rank in range(2):
            assert control[rank][0][STOP_AT + 1] != full[rank][0][STOP_AT + 1]
