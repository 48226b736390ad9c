"""Sequence-parallel TP on rings (tp/rings.py): a column-parallel then a row-parallel linear, their activation rings
run by the layer call loop beside the GEMM pieces, give one process's outputs and gradients."""

import pytest
import torch

from harness import run_ranks

TOKENS, HIDDEN, INNER = 12, 8, 16


def _full(seed=0):
    # float64: what is compared is the order of the sums, not float32's rounding of them
    gen = torch.Generator().manual_seed(seed)
    shapes = ((TOKENS, HIDDEN), (INNER, HIDDEN), (INNER,), (HIDDEN, INNER), (HIDDEN,), (TOKENS, HIDDEN))
    return tuple(torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in shapes)


def _reference():
    x, w1, b1, w2, b2, target = _full()
    leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    x, w1, b1, w2, b2 = leaves
    out = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1)), w2, b2)
    ((out - target) ** 2).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _tp_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from commfuse_dp import CommFuseConfig
    from commfuse_dp.tp.rings import ColumnParallelFn, RowParallelFn, TPState
    from commfuse_dp.ring import get_ring, observe_ring
    from commfuse_dp.runtime.engine import Engine
    from commfuse_dp.runtime.schedule import FusedSchedule
    from commfuse_dp.runtime.step import StepState

    mesh = init_device_mesh("cpu", (world_size,))
    engine = Engine(get_ring(mesh.get_group(0), caller="test"), mesh, CommFuseConfig(schedule="fused"))
    steps = StepState(engine, FusedSchedule)
    column, row = TPState(steps, "mlp.up (tp)"), TPState(steps, "mlp.down (tp)")
    x, w1, b1, w2, b2, target = _full()
    rows, cols = TOKENS // world_size, INNER // world_size
    mine = slice(rank * rows, (rank + 1) * rows)
    feats = slice(rank * cols, (rank + 1) * cols)
    leaves = [t.clone().requires_grad_() for t in (x[mine], w1[feats], b1[feats], w2[:, feats], b2)]
    x_l, w1_l, b1_l, w2_l, b2_l = leaves
    events = []
    with observe_ring(lambda event, op, k: events.append(event)):
        hidden = torch.nn.functional.gelu(ColumnParallelFn.apply(x_l[None], column, TOKENS, w1_l, b1_l)[0])
        out = RowParallelFn.apply(hidden, row, w2_l, b2_l)[0]
        ((out - target[mine]) ** 2).sum().backward()
    # (the replicated bias: every rank's gradient is the sum over the whole sequence, gathered)
    return out.detach(), [t.grad for t in leaves], events.count("compute")


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_column_then_row_parallel_match_one_process(world_size):
    out, grads = _reference()
    x, w1, b1, w2, b2 = grads
    rows, cols = TOKENS // world_size, INNER // world_size
    for rank, (got, got_grads, pieces) in enumerate(run_ranks(_tp_worker, world_size)):
        mine, feats = slice(rank * rows, (rank + 1) * rows), slice(rank * cols, (rank + 1) * cols)
        want = [x[mine], w1[feats], b1[feats], w2[:, feats], b2]
        torch.testing.assert_close(got, out[mine], rtol=1e-12, atol=1e-12)
        for g, w in zip(got_grads, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        assert pieces == 4 * world_size  # every hop beside a piece of its GEMM: four rings of N pieces


def _llama_mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INNER, hidden_act="silu",
                                    num_attention_heads=2, num_key_value_heads=2)).double()


def _mlp_worker(rank, world_size, batch):
    from torch.distributed.device_mesh import init_device_mesh

    from commfuse_dp import CommFuseConfig
    from commfuse_dp.tp.rings import ColumnParallelFn, RowParallelFn, TPState
    from commfuse_dp.ring import get_ring
    from commfuse_dp.runtime.engine import Engine
    from commfuse_dp.runtime.schedule import FusedSchedule
    from commfuse_dp.runtime.step import StepState

    mesh = init_device_mesh("cpu", (world_size,))
    steps = StepState(Engine(get_ring(mesh.get_group(0), caller="test"), mesh, CommFuseConfig(schedule="fused")),
                      FusedSchedule)
    gate_up, down = TPState(steps, "mlp.gate_up (tp)"), TPState(steps, "mlp.down (tp)")
    mlp = _llama_mlp()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    target = torch.randn(batch, TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    rows, cols = TOKENS // world_size, INNER // world_size
    mine, feats = slice(rank * rows, (rank + 1) * rows), slice(rank * cols, (rank + 1) * cols)
    leaves = [t.detach().clone().requires_grad_() for t in
              (x[:, mine], mlp.gate_proj.weight[feats], mlp.up_proj.weight[feats], mlp.down_proj.weight[:, feats])]
    x_l, gate_l, up_l, down_l = leaves
    gate, up = ColumnParallelFn.apply(x_l, gate_up, TOKENS, gate_l, None, up_l, None)  # one gather for both
    out = RowParallelFn.apply(mlp.act_fn(gate) * up, down, down_l, None)
    ((out - target[:, mine]) ** 2).sum().backward()
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("world_size,batch", [(2, 2), pytest.param(4, 1, marks=pytest.mark.slow)])
def test_llama_mlp_on_tp_rings_matches_one_process(world_size, batch):
    """transformers' LlamaMLP at TP 2 (batch 2) and 4 (batch 1): gate and up column-parallel on one ring,
    down row-parallel, the sequence sharded in and out; outputs and gradients as one process's."""
    mlp = _llama_mlp()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, TOKENS, HIDDEN, generator=gen, dtype=torch.float64).requires_grad_()
    target = torch.randn(batch, TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    out = mlp(x)
    ((out - target) ** 2).sum().backward()
    rows, cols = TOKENS // world_size, INNER // world_size
    for rank, (got, grads) in enumerate(run_ranks(_mlp_worker, world_size, (batch,))):
        mine, feats = slice(rank * rows, (rank + 1) * rows), slice(rank * cols, (rank + 1) * cols)
        torch.testing.assert_close(got, out.detach()[:, mine], rtol=1e-12, atol=1e-12)
        want = [x.grad[:, mine], mlp.gate_proj.weight.grad[feats], mlp.up_proj.weight.grad[feats],
                mlp.down_proj.weight.grad[:, feats]]
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
