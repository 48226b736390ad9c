"""Past one machine: the launch's nodes read off the launcher and checked on every rank (``node_layout.py``), the
defaults choosing HSDP or one flat ring from the two tiers measured at ``shard()`` (``choose_nodes.py``) and staying
exact, and the planner's model of nodes that share their NICs (``nodes.py``, ``commfuse-dp plan --num-machines``)."""

from __future__ import annotations

import os

import pytest

import commfuse_dp as cf
from commfuse_dp.planner import nodes, plan, cli as plan_cli
from commfuse_dp.planner.costs import Cluster, units_for
from harness import run_ranks
from test_shard_parity import assert_parity, run_case
from commfuse_dp.handle import handle_of


def _launched(rank: int, per_node: int) -> None:
    """What torchrun tells a rank of a launch over nodes of ``per_node`` ranks."""
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    os.environ["GROUP_RANK"] = str(rank // per_node)
    os.environ["LOCAL_RANK"] = str(rank % per_node)


def _defaults_worker(rank, world_size, per_node, replicate):
    _launched(rank, per_node)
    config = cf.CommFuseConfig(min_fuse_numel=0, replicate=replicate, tokens_per_rank=64)
    result = run_case(rank, world_size, "llama", "auto", config=config)
    assert_parity(result, label=f"{world_size // per_node}x{per_node}, replicate={replicate}")
    model = result["model"]
    choice = handle_of(model).choice
    engine = handle_of(model).engine
    copies = engine.replicas.size if engine.replicas is not None else 1
    return choice.as_dict(), copies, engine.ring.size, cf.describe(model).choice


@pytest.mark.parametrize("world_size,per_node", [(4, 2), (6, 2), (8, 4)], ids=["2x2", "3x2", "2x4"])
@pytest.mark.slow
def test_defaults_on_a_multi_node_launch_choose_a_layout_and_stay_exact(world_size, per_node):
    nodes_ = world_size // per_node
    for choice, copies, ring, described in run_ranks(_defaults_worker, world_size, (per_node, "auto"), timeout=600):
        assert choice["replicate"] in (1, nodes_) and copies == choice["replicate"]
        assert ring == (per_node if copies == nodes_ else world_size)
        assert "hsdp/fsdp2" in str(choice["predicted_s"]) and "flat/" in str(choice["predicted_s"])
        assert "between nodes" in choice["machine"] and "measured" in choice["machine"]
        assert described == choice


@pytest.mark.slow
def test_hsdp_given_on_a_multi_node_launch_plays_the_schedules():
    for choice, copies, ring, _ in run_ranks(_defaults_worker, 4, (2, 2), timeout=600):
        assert copies == 2 and ring == 2 and choice["replicate"] == 2
        assert choice["schedule"] in ("fused", "fsdp2") and "flat/" not in str(choice["predicted_s"])


def _bad_layout_worker(rank, world_size, told):
    per_node, node = told[rank]
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    os.environ["GROUP_RANK"] = str(node)
    import hf_models

    try:
        cf.shard(hf_models.build("llama"), cf.CommFuseConfig(min_fuse_numel=0))
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("told,match", [
    ([(2, 0), (2, 0), (2, 1), (1, 1)], "told different numbers of ranks per node"),
    ([(3, 0), (3, 0), (3, 0), (3, 1)], "does not divide the 4 ranks"),
    ([(2, 0), (2, 1), (2, 0), (2, 1)], "must be consecutive"),
], ids=["disagree", "unequal", "not-consecutive"])
def test_a_bad_launch_layout_is_one_clear_line_on_every_rank(told, match):
    errors = run_ranks(_bad_layout_worker, 4, (told,), timeout=300)
    assert all(e is not None and match in e for e in errors), errors
    assert len(set(errors)) == 1  # the same line on every rank


def test_machines_share_their_nics():
    m = nodes.Machines.of_nics(2, 8, 12.5e9)  # 8 GPUs on one 100 Gb NIC
    assert m.share == pytest.approx(12.5e9 / 8) and m.flow_bytes_per_s == 12.5e9
    assert nodes.Machines.of_nics(2, 8, 50e9, 8).share == pytest.approx(50e9)  # a 400 Gb NIC per GPU
    assert nodes.Machines.of_nics(2, 8, 25e9, 2).share == pytest.approx(25e9 / 4)
    for bad in (dict(nic_bytes_per_s=0.0), dict(nics=3), dict(nics=0)):
        with pytest.raises(ValueError):
            nodes.Machines.of_nics(**{"nodes": 2, "per_node": 8, "nic_bytes_per_s": 12.5e9, **bad})


def test_the_exchange_between_nodes_is_the_limit_of_a_slow_nic():
    """A slower NIC lengthens HSDP's tail; landing-time exchanges leave less tail than exchanges at the backward's
    end; narrower gradients shorten it; the defaults never run slower than FSDP2's HSDP."""
    units = units_for(*plan.KNOWN_MODELS["llama3-8b"], tokens=8192, seq=8192)
    intra = Cluster(8, 450e9, 15e-6, 400e12, 2, 2, peer_nccl=True)
    tails = [nodes.exchange_tail(units, intra, nodes.Machines.of_nics(2, 8, gb * 1e9), 2) for gb in (6.25, 12.5, 50)]
    assert tails[0] > tails[1] > tails[2] >= 0
    m = nodes.Machines.of_nics(4, 8, 12.5e9)
    assert nodes.exchange_tail(units, intra, m, 2) < nodes.exchange_tail(units, intra, m, 2, at_landing=False)
    assert nodes.exchange_tail(units, intra, m, 1) < nodes.exchange_tail(units, intra, m, 2)
    assert nodes.exchange_tail(units, intra, nodes.Machines.of_nics(1, 8, 12.5e9), 2) == 0.0
    for gb, nics in ((3.125, 1), (12.5, 1), (50, 8)):
        chosen, steps = nodes.decide(units, intra, nodes.Machines.of_nics(4, 8, gb * 1e9, nics))
        assert steps[chosen] <= steps[nodes.PEER]
    rows = nodes.formats(units, intra, m, 2, {"bf16": 0.0, "fp8": 0.0, "int8": 0.0})
    assert rows["int8/int8"]["over_peer"] > 1.2  # half the gradient bytes across a slow NIC


def test_the_defaults_take_hpz_where_it_wins():
    """Where one NIC a node is the limit at many nodes, hpZ (a flat shard whose backward gathers stay in the node)
    beats FSDP2's HSDP by more than the margin and the defaults take it; without it as a candidate they do not, and
    ``plan --num-machines`` says ``hpz_size``."""
    units = units_for(*plan.KNOWN_MODELS["llama3-8b"], tokens=8192, seq=8192)
    intra = Cluster(8, 450e9, 15e-6, 400e12, 2, 2, peer_nccl=True)
    machines = nodes.Machines.of_nics(16, 8, 25e9)
    chosen, steps = nodes.decide(units, intra, machines)
    assert chosen == "hpz/fsdp2" and steps[chosen] <= (1 - plan.MARGIN) * steps[nodes.PEER]
    assert nodes.decide(units, intra, machines, hpz=False)[0] != "hpz/fsdp2"
    assert nodes.decide(units, intra, nodes.Machines.of_nics(2, 8, 12.5e9))[0] == nodes.PEER


def test_plan_nodes_prints_the_rate_per_rank_and_the_defaults(capsys):
    assert plan_cli.main(["--model", "llama3-8b", "--num-processes", "16", "--num-machines", "2", "--link-gbps", "450",
                          "--nic-gbps", "12.5", "--tokens-per-rank", "8192", "--seq", "8192", "--formats", "--codec-ns",
                          "0.002"]) == 0
    out = capsys.readouterr().out
    assert "1.56 GB/s a rank when all of a node's ranks cross at once" in out
    assert "CommFuseConfig()'s defaults on this cluster: replicate=2 (HSDP)" in out
    assert "int8/int8" in out and "   hsdp    fsdp2" in out and "   flat    fused" in out
    for argv, match in ((["--num-machines", "3", "--num-processes", "16"], "must divide"),
                        (["--num-machines", "2", "--num-processes", "16", "--nic-gbps", "0"], "must be > 0"),
                        (["--num-machines", "2", "--num-processes", "16", "--nics-per-node", "3"], "divide the 8 ranks")):
        with pytest.raises(SystemExit):
            plan_cli.main(argv)
        assert match in capsys.readouterr().err


@pytest.mark.slow
def test_plan_sweeps_nodes_and_nics(tmp_path, capsys):
    path = tmp_path / "sweep.json"
    assert plan_cli.main(["--model", "gpt2", "--sweep", "nodes", "--codec-ns", "0.002", "--piece-fit", "none",
                          "--host-fit", "none", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    import json

    records = json.loads(path.read_text())["records"]
    assert len(records) == len(plan_cli.NODE_SWEEP_NODES) * len(plan_cli.NODE_SWEEP_NIC_GBIT) * len(
        plan_cli.NODE_SWEEP_NICS)
    assert all(r["exact"]["over_peer"] >= 1.0 - 1e-9 for r in records)  # the defaults: never slower than the peer
    assert "int8/int8:" in out


def test_calibrate_reads_a_nodes_bench_file(tmp_path, capsys):
    """``plan --calibrate`` on a ``bench --num-machines --nic-gbps`` file plays each rate on the figures it ran on (the
    defaults' recorded tiers, the NIC's shaping); a slower NIC predicts a slower peer."""
    import json

    played = {"ranks": 2, "link_gbps": 0.8, "latency_us": 2000.0, "tflops": 0.05, "element_bytes": 4, "tokens": 512,
              "between_nodes": {"nodes": 2, "per_node": 2, "share_gbps": 0.03, "flow_gbps": 0.06, "latency_us": 1300.0,
                                "measured": True}}
    records = []
    for rate, peer in ((1060.0, 1.24), (265.0, 2.55)):
        chosen = {"schedule": "fused", "piece_shards": 1, "replicate": 2, "played": played}
        records += [{"schedule": "compute_only", "rate_mbit": rate, "step_s": 1.02},
                    {"schedule": "fsdp2_hsdp", "rate_mbit": rate, "step_s": peer},
                    {"schedule": "hsdp_fused_int8_int8", "rate_mbit": rate, "step_s": peer / 2},
                    {"schedule": "defaults", "rate_mbit": rate, "step_s": peer, "chosen": chosen}]
    model = {"hidden": 512, "intermediate": 1408, "layers": 4, "heads": 8, "kv_heads": 8, "vocab": 4096, "seq": 256,
             "batch": 2, "min_fuse_numel": 65536, "direct_kb": 1024, "embedding_rows": "direct",
             "peer_units": "torchtitan"}
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps({"records": records, "world_size": 4, "nodes": 2, "ranks_per_node": 2,
                                "nics_per_node": 1, "nic_mbit": [1060.0, 265.0], "compute": "emulated at 0.05 TFLOP/s",
                                "model": model}))
    assert plan_cli.main(["--calibrate", str(path)]) == 0
    out = capsys.readouterr().out
    peer = {round(float(line.split()[0]) * 8000): float(line.split()[4]) for line in out.splitlines()
            if " fsdp2_hsdp " in line and "hsdp/fsdp2" in line}
    assert set(peer) == {1060.0, 265.0} and peer[265.0] > peer[1060.0] > 1.02
    assert "hsdp_fused_int8_int8" in out and "worst error of the defaults and the peer" in out


def test_the_choice_across_nodes_is_the_one_playing_everything_makes():
    """``nodes.decide`` bounds the fused candidates and plays only those that could be chosen; on a grid of
    clusters and both cost models it chooses what the full plays (``nodes.layouts``) make with the same rule, and
    never a fused layout whose layers would not fuse."""
    from commfuse_dp.planner.costs import CPU_HOST_FIT, H200_HOST_FIT, H200_PIECE_FIT

    models = {"cuda": Cluster(8, 450e9, 15e-6, 400e12, 2, 2, piece_fit=H200_PIECE_FIT, host_fit=H200_HOST_FIT,
                              peer_nccl=True),
              "cpu": Cluster(2, 0.8e9, 2e-3, 0.05e12, 4, 4, host_fit=CPU_HOST_FIT)}
    checked = 0
    for name in ("llama3-8b", "gpt2"):
        units = units_for(*plan.KNOWN_MODELS[name], tokens=8192, seq=2048)
        for kind, intra in models.items():
            for k in (2, 4, 16, 64):
                for gb, nics in ((1.5, 1), (12.5, 1), (50, 8)):
                    machines = nodes.Machines.of_nics(k, intra.ranks, gb * 1e9, min(nics, intra.ranks))
                    chosen, steps = nodes.decide(units, intra, machines)
                    full = nodes.layouts(units, intra, machines)
                    if k > 1 and intra.ranks > 1:
                        full["hpz/fsdp2"] = nodes.hpz_step(units, intra, machines)
                    best = min(full, key=full.get)
                    expected = best if best != nodes.PEER and full[best] <= 0.98 * full[nodes.PEER] else nodes.PEER
                    assert chosen == expected, (name, kind, k, gb, nics, steps, full)
                    for key, bound in steps.items():
                        if key.endswith(nodes.NOT_PLAYED):
                            assert bound <= full[key.removesuffix(nodes.NOT_PLAYED)] + 1e-9
                    checked += 1
    assert checked == 48
