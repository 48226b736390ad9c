"""``generate()`` on a tensor-parallel model: ``logits_to_keep`` gives every rank the whole vocabulary's logits of
the last positions (``TPLMHead``), so greedy decoding with and without the KV cache (each rank caching its own
heads; a one-token step leaves some TP ranks no rows of the sequence) yields one process's tokens, for a Llama and
a tied Gemma whose vocabulary (97) does not divide over 4 ranks, at TP 2 x FSDP 2 and TP 4."""

import pytest
import torch

from harness import run_ranks
from test_tp_checkpoint import _model


def _generate(model, cache: bool) -> list:
    ids = torch.tensor([[5, 9, 17, 3, 44, 21, 8], [7, 7, 30, 2, 61, 11, 90]])
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                              do_sample=False, use_cache=cache, pad_token_id=0).tolist()


def _worker(rank, world, tp, family):
    import commfuse_dp as cf

    model = cf.shard(_model(family), cf.CommFuseConfig(tp_size=tp, min_fuse_numel=0))
    ids = torch.tensor([[5, 9, 17, 3]])
    with pytest.raises(ValueError, match="logits_to_keep is for generation, without grad"):
        model(input_ids=ids, logits_to_keep=1)
    return _generate(model, True), _generate(model, False)


@pytest.mark.parametrize("family,tp", [("llama", 2), pytest.param("gemma", 4, marks=pytest.mark.slow)])
def test_greedy_generation_under_tp_is_one_process_s(family, tp):
    want = _generate(_model(family), True)
    assert len(want[0]) == 13
    for cached, uncached in run_ranks(_worker, 4, args=(tp, family), timeout=300):
        assert cached == want and uncached == want
