"""Every option of ``plan``, ``bench`` and ``demo`` takes hyphens or underscores, and the ecosystem's names of the
same things (accelerate's ``--num_processes`` / ``--num_machines``, torchrun's ``--nnodes`` / ``--nproc_per_node``,
the config's ``--ring_latency_us`` / ``--tokens_per_rank``): the same command line parsed either way gives the
same arguments, and ``plan`` prints the same prediction."""

import argparse

import pytest

from commfuse_dp import cli
from commfuse_dp.cli_names import ALIASES, spelled


def _parsed(module_main, argv):
    """The Namespace ``module_main(argv)`` parses (nothing runs)."""
    seen = {}

    def catch(self, args=None, namespace=None):
        seen["args"] = argparse.ArgumentParser.parse_known_args(self, args, namespace)[0]
        raise SystemExit(0)

    mp = pytest.MonkeyPatch()
    mp.setattr(argparse.ArgumentParser, "parse_args", catch)
    try:
        module_main(argv)
    except SystemExit:
        pass
    finally:
        mp.undo()
    return vars(seen["args"])


@pytest.mark.parametrize("ours,theirs", [
    (["--ranks", "16", "--link-gbps", "25", "--latency-us", "20", "--tokens", "4096", "--nodes", "2",
      "--nic-gbps", "12.5"],
     ["--num_processes", "16", "--link_gbps", "25", "--ring_latency_us", "20", "--tokens_per_rank", "4096",
      "--num_machines", "2", "--nic_gbps=12.5"]),
    (["--ranks", "8", "--nodes", "2"], ["--world_size", "8", "--nnodes=2"]),
])
def test_plan_takes_both_spellings_and_the_ecosystem_names(ours, theirs):
    from commfuse_dp import plan_cli

    assert _parsed(plan_cli.main, ours) == _parsed(plan_cli.main, theirs)


def test_plan_prints_the_same_either_way(capsys):
    base = ["--model", "llama3-8b", "--link-gbps", "450", "--tokens", "8192", "--seq", "8192"]
    cli.main(["plan", "--ranks", "16", *base])
    ours = capsys.readouterr().out
    cli.main(["plan", "--num_processes", "16", *["--" + a[2:].replace("-", "_") if a.startswith("--") else a for a in base]])
    assert ours and capsys.readouterr().out == ours


def test_bench_and_demo_names():
    from commfuse_dp import demo
    from commfuse_dp.benchmarks import bench

    assert _parsed(bench.main, ["--world-size", "4", "--nodes", "2", "--nic-mbit", "100"]) == \
        _parsed(bench.main, ["--num_processes", "4", "--num_machines", "2", "--nic_mbit", "100"])
    assert _parsed(demo.main, ["--nproc", "3", "--max_steps", "5"]) == \
        _parsed(demo.main, ["--nproc_per_node", "3", "--max-steps", "5"])


def test_what_follows_a_double_dash_is_left_alone():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_steps")
    assert spelled(["--max-steps", "3", "--", "--max-steps", "4"], parser, "demo") == \
        ["--max_steps", "3", "--", "--max-steps", "4"]


def test_every_alias_names_a_real_option():
    from commfuse_dp import demo, plan_cli
    from commfuse_dp.benchmarks import bench
    from test_docs_cover_cli import _flags, _parser_of

    flags = {"plan": _flags(_parser_of(plan_cli.main)), "bench": _flags(_parser_of(bench.main)),
             "demo": _flags(demo._parser())}
    for command, aliases in ALIASES.items():
        for other, target in aliases.items():
            assert target in flags[command], (command, other, target)
            assert other not in flags[command], (command, other)
