"""Narrow formats on the wire (``gather_format``, ``reduce_format``): the formats alone, and the fused linear on
real gloo groups: every rank computes with bitwise the same decoded weight, a narrow gradient is rounded once per
contribution (not once per hop), error feedback carries what was lost into the next step."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from commfuse_dp import CommFuseConfig
from commfuse_dp.fused import attach_group, convert_linear, step_state
from commfuse_dp.ring import get_ring
from commfuse_dp.runtime.engine import Engine
from commfuse_dp.wire import RowFormat
from harness import run_ranks

# (out_features per member, in_features): padding rows over 2-4 ranks, and a q/k/v-like group with biases
MEMBERS, IN_FEATURES = (12, 7, 6), 10


@pytest.mark.parametrize("fmt,bound", [("bf16", 2 ** -8), ("fp8", 2 ** -3), ("int8", 1 / 127)])
def test_formats_round_within_their_step(fmt, bound):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5000, generator=gen) * torch.logspace(-3, 3, 5000)
    x[:64] = 0.0  # a block of zeros decodes to zeros
    row = RowFormat(fmt, torch.float32, 5000, [(0, 4990, True), (4990, 10, False)], block=256)
    wire = row.empty(None, x.device)
    row.encode(x, wire)
    y = row.decode(wire, torch.empty(5000))
    assert torch.equal(y[4990:], x[4990:])  # the 1-D segment travels as it is
    assert torch.equal(y[:64], x[:64])
    err = (y - x)[:4990].abs()
    if fmt == "bf16":
        assert (err <= bound * x[:4990].abs()).all()
    else:  # relative to each block's largest magnitude
        top = x[:4990 // 256 * 256].abs().view(-1, 256).amax(1).repeat_interleave(256)
        assert (err[:top.numel()] <= bound * top).all()
    assert err.max() > 0  # it is narrower: something was lost
    assert row.nbytes < 5000 * 4 * (0.6 if fmt == "bf16" else 0.3)


def _group(engine, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    refs = [nn.Linear(IN_FEATURES, out, dtype=dtype) for out in MEMBERS]
    mods = [nn.Linear(IN_FEATURES, out, dtype=dtype) for out in MEMBERS]
    for m, r in zip(mods, refs):
        m.load_state_dict(r.state_dict())
        convert_linear(m, engine, False)
    attach_group(step_state(engine), mods, [f"member{i}" for i in range(len(mods))])
    return mods, refs


def _engine(world_size, **config):
    mesh = init_device_mesh("cpu", (world_size,))
    return Engine(get_ring(), mesh, CommFuseConfig(schedule="fused", **config))


def _same_weight_worker(rank, world_size, fmt, lookahead):
    engine = _engine(world_size, gather_format=fmt, lookahead_mb=lookahead)
    mods, refs = _group(engine)
    x = torch.randn(4, IN_FEATURES, generator=torch.Generator().manual_seed(7))  # the same input on every rank
    outs = torch.cat([m(x) for m in mods], dim=1).detach()
    every = [torch.empty_like(outs) for _ in range(world_size)]
    dist.all_gather(every, outs)
    exact = torch.cat([r(x) for r in refs], dim=1).detach()
    return [torch.equal(every[0], o) for o in every], (outs - exact).abs().max().item()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8"])
@pytest.mark.slow
def test_every_rank_computes_with_the_same_decoded_weight(world_size, fmt):
    """The owner of a shard computes with its decoded row too, not its master: the outputs of one input agree bit
    for bit on every rank (each rank computes the columns of every shard), and differ from the exact ones."""
    for lookahead in ("auto", 0):  # the elastic (N, row) buffer and lockstep's two rows
        for same, err in run_ranks(_same_weight_worker, world_size, (fmt, lookahead)):
            assert all(same)
            assert 0 < err < 0.1


def _contributions(rank, world_size, mods, steps=1):
    """Each rank's own data; returns the fp32 contributions of every rank to each member's weight gradient."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(6, IN_FEATURES, generator=gen) * 3
    dys = [torch.randn(6, out, generator=gen) for out in MEMBERS]
    for _ in range(steps):
        outs = [m(x) for m in mods]
        sum((o * g).sum() for o, g in zip(outs, dys)).backward()
    local = torch.cat([(dy.t() @ x) for dy in dys])  # this rank's contribution to the whole weight gradient
    every = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(every, local)
    return torch.stack(every)


def _weight_grad(mods):
    return torch.cat([m.weight.grad.full_tensor() for m in mods])


def _bf16_grad_worker(rank, world_size):
    engine = _engine(world_size, reduce_format="bf16")
    mods, _ = _group(engine)
    contrib = _contributions(rank, world_size, mods)
    got = _weight_grad(mods) * world_size  # (the mean over ranks)
    exact = contrib.sum(0)
    # one bf16 rounding per contribution sent (a rank's own contribution for its shard is not sent at all)
    bound = (contrib - contrib.bfloat16().float()).abs().sum(0) + 1e-5 * contrib.abs().sum(0)
    return bool(((got - exact).abs() <= bound).all()), (got - exact).abs().max().item()


def test_bf16_reduce_scatter_rounds_each_contribution_once():
    for within, err in run_ranks(_bf16_grad_worker, 4):
        assert within
        assert err > 0  # the gradients did travel in bf16


def _feedback_worker(rank, world_size, feedback):
    engine = _engine(world_size, reduce_format="int8", error_feedback=feedback, format_block=16)
    mods, _ = _group(engine)
    errors = []
    total = None
    for step in range(3):
        contrib = _contributions(rank, world_size, mods)
        got = _weight_grad(mods) * world_size
        total = got if total is None else total + got
        errors.append((total - contrib.sum(0) * (step + 1)).norm().item())
        for m in mods:
            m.weight.grad = m.bias.grad = None
    kept = engine.scratch  # (touch: the engine is alive)
    residual = [s.residual for s in step_state(engine).states]
    return errors, [r is not None and r.abs().sum().item() > 0 for r in residual], kept is not None


def test_error_feedback_keeps_the_sum_of_steps_close():
    """Same data three steps running: without feedback the error of the summed gradients grows with the steps;
    with it, what one step lost is sent the next, and the summed error stays about one step's."""
    plain = run_ranks(_feedback_worker, 3, (False,))
    fed = run_ranks(_feedback_worker, 3, (True,))
    for (plain_err, plain_kept, _), (fed_err, fed_kept, _) in zip(plain, fed):
        assert not any(plain_kept) and all(fed_kept)
        assert plain_err[2] > 2.5 * plain_err[0]
        assert fed_err[2] < 0.7 * plain_err[2]


def _training_worker(rank, world_size, schedule, formats):
    import test_shard_parity as parity

    config = CommFuseConfig(schedule=schedule, min_fuse_numel=0, **formats)
    result = parity.run_case(rank, world_size, "llama", schedule, config=config)
    ours, ref = result["losses"]
    return (ours / ref - 1).abs().max().item()


@pytest.mark.parametrize("schedule", ["fused", "fsdp2"])
@pytest.mark.slow
def test_training_follows_the_updated_weights(schedule):
    """Five AdamW steps of a Llama with narrow gathers and gradients stay within 0.05 % of the exact losses on one
    process: every ring encodes the weights as the optimizer left them (a stale encoding drifts by 0.2 % in five
    steps)."""
    for formats in (dict(gather_format="bf16", reduce_format="bf16"),
                    dict(gather_format="int8", reduce_format="int8", error_feedback=True)):
        for drift in run_ranks(_training_worker, 2, (schedule, formats)):
            assert drift < 5e-4, (formats, drift)


def _collectives_worker(rank, world_size):
    from commfuse_dp.ring import ring_all_gather, ring_reduce_scatter

    n = 1000
    row = RowFormat("int8", torch.float32, n, [(0, 990, True), (990, 10, False)], block=128)
    gen = torch.Generator().manual_seed(rank)
    mine = torch.randn(n, generator=gen)
    out = torch.empty(world_size * n)
    ring_all_gather(out, mine.clone(), wire=row)
    every = [torch.empty_like(out) for _ in range(world_size)]
    dist.all_gather(every, out)
    same = all(torch.equal(every[0], o) for o in every)
    lost = (out[rank * n:(rank + 1) * n] - mine).abs().max().item()

    bf16 = RowFormat("bf16", torch.float32, n, [(0, n, True)])
    inp = torch.randn(world_size * n, generator=gen) * 10
    got = torch.empty(n)
    ring_reduce_scatter(got, inp, op="sum", wire=bf16)
    pieces = [torch.empty_like(inp) for _ in range(world_size)]
    dist.all_gather(pieces, inp)
    contrib = torch.stack([p[rank * n:(rank + 1) * n] for p in pieces])
    exact = contrib.sum(0)
    bound = (contrib - contrib.bfloat16().float()).abs().sum(0) + 1e-5 * contrib.abs().sum(0)
    return same, lost, bool(((got - exact).abs() <= bound).all()), (got - exact).abs().max().item()


def test_narrow_bucketed_collectives():
    """FSDP2's units go through these: the gathered rows bitwise the same on every rank (the own row decoded too),
    and a bf16 reduce-scatter at 4 ranks within one rounding per contribution."""
    for same, lost, within, err in run_ranks(_collectives_worker, 4):
        assert same and 0 < lost < 0.05
        assert within and err > 0


def _describe_worker(rank, world_size, schedule):
    import commfuse_dp as cf
    import hf_models

    out = {}
    for name, formats in (("exact", {}), ("int8", dict(gather_format="int8", reduce_format="bf16")),
                          ("fed", dict(gather_format="int8", reduce_format="int8", error_feedback=True))):
        model = hf_models.build("llama")
        cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0, **formats))
        report = cf.describe(model)
        for step in range(2):
            model(**hf_models.batch(rank, step)).loss.backward()
        model(**hf_models.batch(rank, 2))  # (the second step is complete once the next forward begins)
        out[name] = (report.bytes_per_step(), report.error_feedback_bytes, cf.step_stats(model).sent_bytes,
                     str(report))
    return out


@pytest.mark.parametrize("schedule", ["fused", "fsdp2"])
def test_describe_and_step_stats_count_the_encoded_bytes(schedule):
    out = run_ranks(_describe_worker, 2, (schedule,))[0]
    exact, narrow, fed = out["exact"], out["int8"], out["fed"]
    part = "fused_linears" if schedule == "fused" else "fsdp_units"
    # int8 gathers (a quarter) and bf16 gradients (a half) of the 2-D weights
    assert 0.25 < narrow[0][part] / exact[0][part] < 0.45
    assert narrow[2] < 0.6 * exact[2]  # what the step statistics counted on the wire
    assert 0.1 < narrow[2] / narrow[0]["total"] < 10 and 0.1 < exact[2] / exact[0]["total"] < 10
    assert exact[1] == narrow[1] == 0 < fed[1]
    assert "on the wire: gathers int8, gradients bf16" in narrow[3] and "on the wire" not in exact[3]
    assert "error feedback keeps" in fed[3]


def _hsdp_worker(rank, world_size):
    import test_shard_parity as parity

    config = CommFuseConfig(schedule="fused", min_fuse_numel=0, replicate=2, gather_format="int8",
                            reduce_format="int8")
    ours, ref = parity.run_case(rank, world_size, "llama", "fused", config=config)["losses"]
    return (ours / ref - 1).abs().max().item()


def _hsdp_copies_worker(rank, world_size):
    import hf_models

    import commfuse_dp as cf

    config = CommFuseConfig(schedule="fused", min_fuse_numel=0, replicate=2, gather_format="int8",
                            reduce_format="int8")
    model = cf.shard(hf_models.build("llama"), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        model(**hf_models.batch(rank, step)).loss.backward()
        opt.step()
        opt.zero_grad()
    local = torch.cat([p.to_local().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(every, local)
    copies = world_size // 2
    return all(torch.equal(every[r], every[r + copies]) for r in range(copies))


@pytest.mark.slow
def test_hsdp_copies_stay_identical_with_narrow_gradients():
    """HSDP's exchange across the copies in int8: each part's sum is encoded once by its owner, so after three
    steps both copies hold bitwise the same weights; and training stays within 0.05 % of one process."""
    assert all(run_ranks(_hsdp_copies_worker, 4))
    for drift in run_ranks(_hsdp_worker, 4):
        assert drift < 5e-4


def test_planner_plays_the_formats():
    """Fewer bytes a step where the link is the limit, and the codec's compute paid for: a dearer codec, a longer
    step."""
    from commfuse_dp.planner import plan
    from commfuse_dp.planner.costs import Cluster, units_for

    units = units_for(*plan.KNOWN_MODELS["llama3-8b"], tokens=8192, seq=4096)
    slow = Cluster(64, 12.5e9, 15e-6, 400e12, 2, 2, peer_nccl=True)
    cheap = plan.formats_table(units, slow, 2, {"bf16": 2e-12, "fp8": 2e-12, "int8": 2e-12})
    assert cheap["exact"]["gain"] == 1.0
    assert cheap["int8"]["param_bytes"] < 1.01 and cheap["int8"]["grad_bytes"] == 2
    assert cheap["int8/int8"]["gain"] > cheap["int8"]["gain"] > 1.1
    dear = plan.formats_table(units, slow, 2, {"bf16": 1e-9, "fp8": 1e-9, "int8": 1e-9})
    assert dear["int8"]["best_s"] > cheap["int8"]["best_s"] + 0.5  # each rank decodes all 8e9 weights twice a step


def test_plan_command_prints_a_row_per_format(capsys):
    from commfuse_dp.planner.cli import main

    assert main(["--model", "llama3-8b", "--num-processes", "16", "--link-gbps", "12.5", "--formats", "--codec-ns",
                 "0.002"]) == 0
    out = capsys.readouterr().out
    for name in ("exact", "bf16", "fp8", "int8", "int8/int8"):
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name


def _checkpoint_worker(rank, world_size, path):
    import hf_models

    import commfuse_dp as cf
    from commfuse_dp import checkpoint as ck

    narrow = CommFuseConfig(schedule="fused", min_fuse_numel=0, gather_format="int8", reduce_format="int8",
                            error_feedback=True)
    model = cf.shard(hf_models.build("llama", seed=0), narrow)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        model(**hf_models.batch(rank, step)).loss.backward()
        opt.step()
        opt.zero_grad()
    saved = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    ck.save_sharded(path, [model], [(model, opt)])
    back = cf.shard(hf_models.build("llama", seed=1), narrow)
    back_opt = torch.optim.AdamW(back.parameters(), lr=1e-2)
    ck.load_sharded(path, [back], [(back, back_opt)])
    loaded = {n: p.full_tensor() for n, p in back.named_parameters()}
    return all(torch.equal(saved[n], loaded[n]) for n in saved)


def test_checkpoints_save_the_masters_exactly(tmp_path):
    """The narrow formats live only on the wire: a sharded checkpoint holds the fp32 masters, bit for bit."""
    assert all(run_ranks(_checkpoint_worker, 2, (str(tmp_path / "ck"),)))


def test_launch_block_carries_the_formats(monkeypatch):
    """``commfuse-dp launch``'s ``commfuse:`` block: the formats reach the workers through the environment, and a
    wrong one is refused naming what is allowed."""
    from commfuse_dp.launch import config as launch_config

    for name in [k for k in __import__("os").environ if k.startswith("COMMFUSE_")]:
        monkeypatch.delenv(name)
    block = {"gather_format": "int8", "reduce_format": "int8", "error_feedback": True, "format_block": 1024}
    cfg = launch_config.commfuse_config("c.yaml", block)
    env = launch_config.worker_env(cfg)
    assert env["COMMFUSE_GATHER_FORMAT"] == "int8" and CommFuseConfig.from_env(env) == cfg
    with pytest.raises(launch_config.LaunchError, match="reduce_format='fp8'.*allowed values"):
        launch_config.commfuse_config("c.yaml", {"reduce_format": "fp8"})


def _timeline_worker(rank, world_size):
    import hf_models

    import commfuse_dp as cf
    from commfuse_dp.timeline import record_timeline

    out = {}
    for name, formats in (("exact", {}), ("int8", dict(gather_format="int8", reduce_format="bf16"))):
        model = cf.shard(hf_models.build("llama"), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0, **formats))
        model(**hf_models.batch(rank, 0)).loss.backward()  # (the second step has the recorded layer order)
        with record_timeline() as timeline:
            model(**hf_models.batch(rank, 1)).loss.backward()
        trace = timeline.chrome_trace(rank)
        out[name] = (timeline.sent, [e for e in trace if e.get("args", {}).get("bytes")])
    return out


def test_timeline_shows_bytes_per_layer_and_format():
    out = run_ranks(_timeline_worker, 2)[0]
    (exact, _), (narrow, narrow_hops) = out["exact"], out["int8"]
    q = [k for k in exact if "q_proj" in k and k.endswith("forward")]
    assert q and exact[q[0]][1] == "float32" and narrow[q[0]][1] == "encoded"
    assert 0.2 < narrow[q[0]][0] / exact[q[0]][0] < 0.3  # int8 with a scale per block, against fp32
    assert narrow_hops and all({"layer", "bytes", "format"} <= set(e["args"]) for e in narrow_hops)
