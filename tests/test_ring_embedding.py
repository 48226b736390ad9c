"""The ring embedding (fused/embedding.py) against nn.Embedding on the concatenated batch: outputs and table grads,
both exchanges (rows and table), uneven token counts per rank, uneven and empty shards, padding_idx, frozen tables,
and which embeddings shard() converts."""

import pytest
import torch
import torch.nn as nn

import commfuse_dp as cf
import hf_models
from commfuse_dp.fused.embedding import RingEmbedding
from commfuse_dp.ring.transport import observe_ring
from harness import run_ranks


def _build(vocab, hidden, padding_idx):
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(vocab, hidden, padding_idx=padding_idx), nn.Linear(hidden, 3))


def _ids(rank, tokens, vocab, padding_idx):
    ids = torch.randint(0, vocab, (tokens + rank % 2,), generator=torch.Generator().manual_seed(100 * tokens + rank))
    if padding_idx is not None:
        ids[::4] = padding_idx
    return ids


# (vocab, hidden, padding_idx, tokens of even ranks (odd ranks have one more), the exchange expected at 4 ranks);
# the fourth: more tokens than a shard has rows, but fewer rows to move than the table ring's
CASES = [(50, 8, 3, 4, "rows"), (50, 8, None, 40, "table"), (5, 4, None, 1, "rows"), (64, 16, None, 24, "rows"),
         (5, 4, 0, 9, "table")]


def _rows_is_cheaper(all_ids, vocab, hidden, world):
    """The documented choice (fused/embedding.py): rows while the busiest rank sends or receives no more bytes
    (fp32 rows, int64 ids) than the table ring moves."""
    chunk = -(-vocab // world)
    per = [[int((ids // chunk == s).sum()) for s in range(world)] for ids in all_ids]
    busiest = max(max(sum(per[p][s] for p in range(world) if p != s), sum(per[s][p] for p in range(world) if p != s))
                  for s in range(world))
    most = max(len(ids) for ids in all_ids)
    return busiest * hidden * 4 + (world - 1) * most * 8 <= (world - 1) * chunk * hidden * 4


def _step_against_reference(model, ref, all_ids, rank, world_size):
    """One forward and backward of the sharded model on this rank's ids and of ``ref`` on every rank's: the rows
    must be exact, the table gradient equal within rounding. Returns the ring ops started and the full gradient."""
    ops = []
    with observe_ring(lambda event, op, k: ops.append(op) if event == "start" else None):
        rows = model[0](all_ids[rank])
        model[1](rows).pow(2).sum().backward()
    start = sum(len(i) for i in all_ids[:rank])
    ref_rows = ref[0](torch.cat(all_ids))
    (ref[1](ref_rows).pow(2).sum() / world_size).backward()
    torch.testing.assert_close(rows, ref_rows[start:start + len(all_ids[rank])], rtol=0, atol=0)  # exact
    grad = model[0].weight.grad.full_tensor()
    torch.testing.assert_close(grad, ref[0].weight.grad, rtol=1e-5, atol=1e-6)
    return ops, grad


def _worker(rank, world_size):
    seen = []
    for vocab, hidden, padding_idx, tokens, _ in CASES:
        model, ref = _build(vocab, hidden, padding_idx), _build(vocab, hidden, padding_idx)
        cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
        assert isinstance(model[0], RingEmbedding) and isinstance(model[0], nn.Embedding)
        chunk = -(-vocab // world_size)
        assert model[0].weight.to_local().shape == (max(0, min(chunk, vocab - rank * chunk)), hidden)
        all_ids = [_ids(r, tokens, vocab, padding_idx) for r in range(world_size)]
        for step in range(2):  # the second step adds into the existing grads
            ops, grad = _step_against_reference(model, ref, all_ids, rank, world_size)
            if padding_idx is not None:
                assert torch.count_nonzero(grad[padding_idx]) == 0
        if world_size > 1:  # (one rank starts no hops)
            rows = "embedding ids" in ops
            assert rows == _rows_is_cheaper(all_ids, vocab, hidden, world_size), (vocab, tokens, ops)
            seen.append("rows" if rows else "table")
            assert "embedding backward" in ops
        with torch.no_grad():  # evaluation: forward only, same values
            torch.testing.assert_close(model(all_ids[rank]), ref(all_ids[rank]), rtol=1e-6, atol=1e-6)
        model[0].weight.requires_grad_(False)  # a frozen table: no gradient exchange, no grad
        ops.clear()
        with observe_ring(lambda event, op, k: ops.append(op) if event == "start" else None):
            model(all_ids[rank]).sum().backward()
        assert "embedding backward" not in ops and model[0].weight.grad is not None  # the old grad is kept
    return seen


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.slow
def test_ring_embedding_matches_nn_embedding(world_size):
    seen = run_ranks(_worker, world_size, timeout=300)
    assert all(s == seen[0] for s in seen)
    if world_size == 4:
        assert seen[0] == [case[-1] for case in CASES]


def _conversion_worker(rank, world_size):
    converted = {}
    for kind in ("gpt2", "llama", "bert"):
        model = cf.shard(hf_models.build(kind), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
        converted[kind] = sorted(n for n, m in model.named_modules() if isinstance(m, RingEmbedding))
    off = cf.shard(hf_models.build("llama"), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0,
                                                               ring_embeddings=False))
    converted["llama/off"] = [n for n, m in off.named_modules() if isinstance(m, RingEmbedding)]
    return converted


def test_which_embeddings_are_converted():
    converted = run_ranks(_conversion_worker, 2, timeout=300)[0]
    assert converted["gpt2"] == ["transformer.wpe", "transformer.wte"]  # wte: one table with the fused lm_head
    assert converted["llama"] == ["model.embed_tokens"]
    assert converted["bert"] == ["bert.embeddings.position_embeddings", "bert.embeddings.token_type_embeddings"]
    assert converted["llama/off"] == []


def _out_of_range_worker(rank, world_size):
    model = _build(50, 8, None)
    cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
    ids = torch.tensor([1, 2, 50 if rank == world_size - 1 else 3])
    with pytest.raises(IndexError, match=rf"out of range \[0, 50\) on rank\(s\) \[{world_size - 1}\]"):
        model(ids)
    return float(model(torch.tensor([1, 2, 3])).sum())  # the ring is still usable afterwards


def test_out_of_range_ids_raise_on_every_rank():
    sums = run_ranks(_out_of_range_worker, 3, timeout=120)
    assert all(s == sums[0] for s in sums)


def _skewed_worker(rank, world_size):
    # Every rank's ids fall in shard 0 (rank 0 sends every other rank all their rows; the rest send nothing), and
    # rank 1 has no tokens at all: still the rows exchange, still exact.
    model, ref = _build(64, 8, None), _build(64, 8, None)
    cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
    all_ids = [torch.randint(0, 16, (0 if r == 1 else 5 + r,), generator=torch.Generator().manual_seed(r))
               for r in range(world_size)]
    ops, _ = _step_against_reference(model, ref, all_ids, rank, world_size)
    return "embedding ids" in ops


def test_rows_exchange_with_every_id_in_one_shard_and_a_rank_without_tokens():
    assert run_ranks(_skewed_worker, 4, timeout=120) == [True] * 4
