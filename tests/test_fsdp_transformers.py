"""use_ring_collectives on a model transformers sharded itself at load time
(``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))``, FSDP2 with its ``_fsdp_plan``).

Launches (tests/fsdp_hf_worker.py): one torchrun with 2 CPU ranks (gloo) trains the saved Llama four times --
stock FSDP2 collectives and rings, each in fp32 and with ``fsdp_mixed_precision`` -- from the same weights and
batches, saves the fp32 ring run with ``save_pretrained`` on every rank and makes the wrong calls; one fresh
single process reloads the folder; one torchrun with 4 ranks does HSDP (``dp_replicate_size=2, fsdp_size=2``)
and the same Llama sharded by its own ``fully_shard`` calls with ``reshard_after_forward=2``.

Tolerance: with 2 ranks per shard group the ring's reduce-scatter adds the same two partials gloo adds, and the
all-gather copies bytes, so the runs came out bitwise equal here (losses, gradient norms, in fp32, bf16-mixed and
HSDP alike). rtol=1e-5 still leaves room for ring-order rounding (a few fp32 ulps, ~1e-7 relative, at other
group sizes and thread counts) while staying far below what a lost or mis-scaled gradient shard does (the
step-to-step change of the loss is ~1e-2, and a wrong average would scale the gradient norm by 2). The reload
compares logits computed in two processes from the same fp32 weights: bitwise equal here; atol=1e-6 is ~16 ulps at
the logits' scale (~0.8) for a different BLAS blocking.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "fsdp_hf_worker.py")

import hf_models  # noqa: E402
from harness import free_port  # noqa: E402


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # the reload must be a plain process
    return env


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def _torchrun(nproc: int, *args: str) -> None:
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    _run(launcher + ["--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port",
                     str(free_port()), WORKER, *args], f"torchrun --nproc_per_node {nproc} {args[-1]}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "model"
    hf_models.build("llama", seed=0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def fsdp(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    _torchrun(2, model_dir, str(out), "fsdp")
    return out, json.loads((out / "fsdp.json").read_text())


@pytest.fixture(scope="module")
def reload(fsdp):
    out, _ = fsdp
    _run([sys.executable, WORKER, "-", str(out), "reload"], "reload in a fresh process")
    return json.loads((out / "reload.json").read_text())


@pytest.fixture(scope="module")
def hsdp(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("hsdp")
    _torchrun(4, model_dir, str(out), "hsdp")
    return json.loads((out / "hsdp.json").read_text())


def _check_calls(run: dict, steps: int) -> None:
    """Every unit's ring all-gather ran once per forward, plus once per backward when FSDP2 resharded it after
    the forward; its ring reduce-scatter once per backward. Nothing else called the adapters."""
    expected = {}
    for unit, info in run["units"].items():
        expected[f"{unit} (all-gather)"] = steps * (2 if info["reshard"] else 1)
        expected[f"{unit} (reduce-scatter)"] = steps
    assert run["calls"] == expected
    assert run["ring_events"] > 0


def _check_same_training(stock: dict, rings: dict) -> None:
    assert len(stock["per_rank"]) == len(rings["per_rank"])
    for s, r in zip(stock["per_rank"], rings["per_rank"], strict=True):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(s["losses"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(s["grad_norms"]), rtol=1e-5, atol=0)
    assert len(set(stock["losses"])) > 1, "the loss did not change: the comparison would prove nothing"


@pytest.mark.slow
def test_transformers_sharded_the_model_with_fsdp2(fsdp):
    _, result = fsdp
    for name in ("stock_fp32", "rings_fp32", "stock_mixed", "rings_mixed"):
        run = result[name]
        assert run["is_distributed_loading_by_transformers"]
        assert run["all_dtensor"], f"{name}: every parameter should be a DTensor shard"
        assert run["placements"] == ["(Shard(dim=0),)"]
        assert run["mesh"] == [[["fsdp"], [2]]]
        for param, (local, rows) in run["local_rows"].items():
            assert local <= math.ceil(rows / 2) and local < rows, (name, param, local, rows)
        assert run["optimizer_state_dtensor"], f"{name}: AdamW state should be sharded like the parameters"
        # transformers' plan: the embedding and each decoder layer are units resharded after forward; the final
        # norm and the untied lm_head are ONE unit (fully_shard([norm, lm_head])) kept unsharded until backward.
        assert {u: i["reshard"] for u, i in run["units"].items()} == {
            "FSDP2 unit model.embed_tokens": True, "FSDP2 unit model.layers.0": True,
            "FSDP2 unit model.layers.1": True, "FSDP2 unit model.norm+lm_head": False}
        dtype = "torch.bfloat16" if name.endswith("mixed") else "None"
        assert {i["param_dtype"] for i in run["units"].values()} == {dtype}


@pytest.mark.slow
def test_ring_adapters_were_called(fsdp):
    _, result = fsdp
    for precision in ("fp32", "mixed"):
        stock, rings = result[f"stock_{precision}"], result[f"rings_{precision}"]
        assert stock["calls"] == {} and stock["ring_events"] == 0, "stock FSDP2 must not go through the rings"
        _check_calls(rings, result["steps"])


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_losses_match_stock_fsdp2(fsdp, precision):
    _, result = fsdp
    _check_same_training(result[f"stock_{precision}"], result[f"rings_{precision}"])
    # the mixed-precision runs really computed in bf16: their losses differ from fp32 after the first step
    assert result["stock_mixed"]["losses"][1:] != result["stock_fp32"]["losses"][1:]


@pytest.mark.slow
def test_save_pretrained_on_every_rank_reloads_in_a_fresh_process(fsdp, reload):
    _, result = fsdp
    after = result["rings_fp32"]["after_training"]
    # FSDP2 keeps the reshard_after_forward=False unit (norm + lm_head) unsharded after an eval forward; the
    # state-dict hook of save_pretrained reshards it.
    assert not after["sharded_after_eval"] and after["sharded_after_save"]
    assert not reload["dist_initialized"] and not reload["is_distributed_loading_by_transformers"]
    assert not reload["distributed_in_config"] and reload["architectures"] == ["LlamaForCausalLM"]
    assert "model.safetensors" in reload["files"]
    assert reload["missing"] == []
    assert reload["params_equal"] and all(reload["params_equal"].values()), reload["params_equal"]
    assert reload["moved"] > 1e-3, "training did not move the parameters: the reload check would prove nothing"
    for rank in range(result["world_size"]):
        assert reload["diffs"][f"logits_rank{rank}"] <= 1e-6, reload["diffs"]


def test_wrong_calls_are_refused(fsdp):
    _, result = fsdp
    wrong = result["wrong_calls"]
    errors = wrong["errors"]
    assert errors["not_sharded"].startswith("ValueError: use_ring_collectives: no module of this model was sharded")
    assert "DistributedConfig(fsdp_size=N)" in errors["not_sharded"]
    assert errors["shard_model"].startswith("ValueError: use_ring_collectives: this model was sharded by "
                                            "commfuse_dp.shard()")
    assert "FSDP2 unit 'layers.0' was sharded by commfuse_dp.shard()" in errors["shard_submodule"]
    assert errors["foreign_comm"].startswith("ValueError: use_ring_collectives: FSDP2 unit 'model.layers.1' already "
                                             "has a custom all-gather (OwnAllGather")
    assert errors["shard_on_fsdp_model"].startswith("ValueError: shard: this model is sharded already (FSDP2")
    assert "use_ring_collectives(model)" in errors["shard_on_fsdp_model"]
    # refusals change nothing: shard()'s rings stay and still train; the other units keep FSDP2's collective
    assert wrong["shard_comm_types"] == ["RingAllGather"] and wrong["shard_model_still_trains"]
    assert wrong["layer0_comm_after_refusal"] == "DefaultAllGather"


@pytest.mark.slow
def test_hsdp_reduce_scatters_on_the_shard_group(hsdp):
    assert hsdp["world_size"] == 4
    for name in ("stock_fp32", "rings_fp32"):
        run = hsdp[name]
        assert run["mesh"] == [[["dp_replicate", "fsdp"], [2, 2]]]
        assert run["placements"] == ["(Replicate(), Shard(dim=0))"]
        assert run["all_dtensor"] and run["optimizer_state_dtensor"]
    _check_same_training(hsdp["stock_fp32"], hsdp["rings_fp32"])
    _check_calls(hsdp["rings_fp32"], hsdp["steps"])
    # the rings ran on the fsdp dimension (2 ranks); the all-reduce across the 2 replicas stayed torch's
    assert {k.rsplit(" on ", 1)[1] for k in hsdp["rings_fp32"]["group_sizes"]} == {"2 ranks"}
    # every rank trained on its own batch, and the gradients were averaged over all 4 (replica all-reduce)
    per_rank = hsdp["rings_fp32"]["per_rank"]
    assert len({tuple(r["losses"]) for r in per_rank}) == 4
    assert len({tuple(r["grad_norms"]) for r in per_rank}) == 1


@pytest.mark.slow
def test_own_fully_shard_with_reshard_to_a_smaller_group(hsdp):
    """Own fully_shard code on 4 ranks, decoder layers with reshard_after_forward=2: FSDP2 keeps each layer
    sharded over 2 ranks between forward and backward, and its backward all-gather runs on that group."""
    steps = hsdp["steps"]
    for name in ("own_stock", "own_rings"):
        assert hsdp[name]["placements"] == ["(Shard(dim=0),)"] and hsdp[name]["mesh"] == [[[], [4]]]
    _check_same_training(hsdp["own_stock"], hsdp["own_rings"])
    rings = hsdp["own_rings"]
    _check_calls(rings, steps)
    layers = [u for u in rings["units"] if ".layers." in u]
    assert len(layers) == 2 and all(rings["units"][u]["reshard"] for u in layers)
    expected = {}
    for unit in rings["units"]:
        if unit in layers:
            expected[f"{unit} (all-gather) on 4 ranks"] = steps   # forward: from the 4-rank shards
            expected[f"{unit} (all-gather) on 2 ranks"] = steps   # backward: from the post-forward 2-rank shards
        else:
            expected[f"{unit} (all-gather) on 4 ranks"] = steps   # the root keeps its parameters until backward
        expected[f"{unit} (reduce-scatter) on 4 ranks"] = steps
    assert rings["group_sizes"] == expected


# ---- refusals that need no process group (in-process) -------------------------------------------------------

def test_refuses_a_model_without_fsdp2_units():
    from commfuse_dp.integrations.fsdp import use_ring_collectives

    with pytest.raises(ValueError, match="no module of this model was sharded with fully_shard"):
        use_ring_collectives(hf_models.build("llama", 0))


def test_refuses_what_is_not_a_model():
    from commfuse_dp.integrations.fsdp import use_ring_collectives

    with pytest.raises(TypeError, match="expected the model"):
        use_ring_collectives([torch.nn.Linear(2, 2)])
