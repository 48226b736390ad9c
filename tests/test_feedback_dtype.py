"""Error feedback's residuals kept in bfloat16 (``CommFuseConfig.feedback_dtype``) hold the loss as float32 ones do.

Two real gloo ranks train a tiny Llama (``hf_models``) on the same data from the same seed, ``STEPS`` steps of SGD
with momentum, under the exact reduce-scatter, int8 gradients without error feedback, and int8 with error feedback
keeping its residuals in float32 and in bfloat16. Each run's final loss (on a batch none of them trained on) and the
distance of its final weights from the exact run's (the largest absolute difference, and the L2 norm of the
difference) are printed. Error feedback must bring int8 closer to the exact run than no feedback does, and
bfloat16 residuals must stay within ``BF16_WITHIN`` of float32's distance.

SGD, not AdamW: SGD's weights follow the sum of the gradients applied, which is what error feedback keeps close to
the exact sum. AdamW divides each update by the gradient's running RMS, so on a model this small the runs part
from the exact one by more than what the exchange lost, with error feedback or without, and the comparison would
measure that instead.

``describe`` counts the residuals in their dtype (bfloat16: half float32's bytes), and they are kept in it; the
arithmetic on a bfloat16 residual is float32's, rounded once into it.
"""

import pytest
import torch
import torch.distributed as dist

import commfuse_dp as cf
import harness
import hf_models
from commfuse_dp import checkpoint as ck
from commfuse_dp.feedback import residuals_of
from commfuse_dp.wire import RowFormat
from harness import run_ranks

harness._context().set_forkserver_preload(["torch", "torch.distributed", "harness", "hf_models", "commfuse_dp",
                                           "transformers.models.llama.modeling_llama"])

STEPS = 30
LR = 0.05
MOMENTUM = 0.9
BF16_WITHIN = 1.5  # bfloat16 residuals' largest weight difference from exact, at most this times float32 residuals'
BF16_WITHIN_L2 = 1.1  # and the L2 norm of their difference (it averages over every weight: a tighter bound)
FED_BELOW = 0.5  # either error feedback's distances, at most this times those without feedback

RUNS = {
    "exact": {},
    "int8, no error feedback": {"reduce_format": "int8"},
    "int8 + error feedback, float32": {"reduce_format": "int8", "error_feedback": True, "feedback_dtype": "float32"},
    "int8 + error feedback, bfloat16": {"reduce_format": "int8", "error_feedback": True,
                                        "feedback_dtype": "bfloat16"},
}


def _batch(rank: int, step: int, size: int = 4) -> dict:
    """Rows counting up from a random token (mod the vocabulary): a pattern a tiny model learns in a few steps,
    so the loss falls well below chance and the runs' losses say something."""
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    start = torch.randint(0, hf_models.VOCAB, (size, 1), generator=gen)
    ids = (start + torch.arange(hf_models.SEQ)) % hf_models.VOCAB
    return {"input_ids": ids, "labels": ids.clone()}


def _worker(rank, world_size):
    torch.set_num_threads(1)
    out = {}
    for name, fields in RUNS.items():
        model = hf_models.build("llama", seed=0)
        cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=0, **fields))
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        for step in range(1, STEPS + 1):
            model(**_batch(rank, step)).loss.backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            loss = model(**_batch(rank, -1)).loss.detach().float()
        dist.all_reduce(loss)
        weights = {k: v.detach().float().clone() for k, v in ck.full_state_dict(model).items()}
        report = cf.describe(model)
        dtypes = sorted({str(t.dtype) for t in residuals_of(model).tensors.values()})
        out[name] = (loss.item() / world_size, weights, report.error_feedback_bytes, str(report), dtypes)
    return out


def _distances(a: dict, b: dict) -> tuple[float, float]:
    """The largest absolute difference of two state dicts, and the L2 norm of their whole difference."""
    assert sorted(a) == sorted(b)
    return (max(float((a[k] - b[k]).abs().max()) for k in a),
            sum(float((a[k] - b[k]).square().sum()) for k in a) ** 0.5)


@pytest.mark.slow
def test_bfloat16_residuals_hold_the_loss():
    runs = run_ranks(_worker, 2, timeout=300)[0]
    exact = runs["exact"][1]
    far = {name: _distances(run[1], exact) for name, run in runs.items()}
    for name, run in runs.items():
        print(f"FEEDBACK DTYPE | {name} | final loss {run[0]:.6f} | max abs weight diff from exact "
              f"{far[name][0]:.4g} | L2 {far[name][1]:.4g}")
    plain = far["int8, no error feedback"]
    fp32, bf16 = far["int8 + error feedback, float32"], far["int8 + error feedback, bfloat16"]
    print(f"FEEDBACK DTYPE | bfloat16 / float32 residuals: max abs {bf16[0] / fp32[0]:.3f}, "
          f"L2 {bf16[1] / fp32[1]:.3f}; float32 residuals / no feedback: max abs {fp32[0] / plain[0]:.3f}")
    assert plain[0] > 0 and fp32[0] > 0 and bf16[0] > 0, far  # int8 did change the gradients, in every run
    for i in (0, 1):
        assert fp32[i] < FED_BELOW * plain[i] and bf16[i] < FED_BELOW * plain[i], far
    assert bf16[0] <= BF16_WITHIN * fp32[0], far
    assert bf16[1] <= BF16_WITHIN_L2 * fp32[1], far
    # the residuals are kept, and counted, in their dtype
    fed32, fed16 = runs["int8 + error feedback, float32"], runs["int8 + error feedback, bfloat16"]
    assert fed32[4] == ["torch.float32"] and fed16[4] == ["torch.bfloat16"], (fed32[4], fed16[4])
    assert fed32[2] == 2 * fed16[2] > 0, (fed32[2], fed16[2])
    assert "of float32 residuals" in fed32[3] and "of bfloat16 residuals" in fed16[3], fed16[3]


def test_a_bfloat16_residual_is_fed_in_float32():
    """``encode_fed`` with a bfloat16 row and residual: the bytes sent and the new residual are float32's sum and
    loss, the residual rounded once (as a float32 row and residual would give, then rounded)."""
    gen = torch.Generator().manual_seed(0)
    n = 1000
    fmt = RowFormat("int8", torch.bfloat16, n, [(0, 990, True), (990, 10, False)], block=128)
    row = torch.randn(n, generator=gen).bfloat16()
    residual = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    fed = row.float() + residual.float()
    want_bytes = torch.zeros(fmt.nbytes, dtype=torch.uint8)  # (zeros: the alignment padding compares too)
    fmt.encode(fed, want_bytes)
    want_residual = (fed - fmt.decode(want_bytes, torch.empty(n))).bfloat16()
    got_bytes = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    fmt.encode_fed(row, got_bytes, residual)
    assert torch.equal(got_bytes, want_bytes) and residual.dtype == torch.bfloat16
    assert torch.equal(residual, want_residual) and residual.abs().sum() > 0
