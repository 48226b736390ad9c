"""One vocabulary on every command line. Every option of ``plan``, ``bench`` and ``demo`` takes hyphens or
underscores, the ranks and machines are named as accelerate's launcher names them (``--num-processes``,
``--num-machines``; torchrun's ``--nnodes`` / ``--nproc-per-node`` too), options that set a config field bear its
name (``--ring-latency-us``, ``--tokens-per-rank``), and every link rate is in GB/s. The deprecated aliases still
parse to the same arguments, each with one warning line naming its replacement, and the Mbit/s ones converted."""

import argparse

import pytest

from commfuse_dp import cli
from commfuse_dp.cli_names import ALIASES, DEPRECATED, spelled


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
    (["--num-processes", "16", "--link-gbps", "25", "--ring-latency-us", "20", "--tokens-per-rank", "4096",
      "--num-machines", "2", "--nic-gbps", "12.5"],
     ["--num_processes", "16", "--link_gbps", "25", "--ring_latency_us", "20", "--tokens_per_rank", "4096",
      "--nnodes=2", "--nic_gbps=12.5"]),
    (["--num-machines", "2", "--nproc-per-node", "4", "--sweep", "nodes"],
     ["--num_machines", "2", "--nproc_per_node=4", "--sweep", "nodes"]),
])
def test_plan_takes_both_spellings_and_the_ecosystem_names(ours, theirs, capsys):
    from commfuse_dp.planner import cli as plan_cli

    assert _parsed(plan_cli.main, ours) == _parsed(plan_cli.main, theirs)
    assert "deprecated" not in capsys.readouterr().err


@pytest.mark.parametrize("command,old,new", [
    ("plan", ["--ranks", "16", "--nodes", "2", "--latency-us", "20", "--tokens", "4096", "--ranks-per-node", "4"],
     ["--num-processes", "16", "--num-machines", "2", "--ring-latency-us", "20", "--tokens-per-rank", "4096",
      "--nproc-per-node", "4"]),
    ("plan", ["--world-size=8"], ["--num-processes", "8"]),
    ("bench", ["--world-size", "4", "--nodes", "2", "--nic-mbit", "800,400", "--intra-mbit=4000"],
     ["--num-processes", "4", "--num-machines", "2", "--nic-gbps", "0.1,0.05", "--intra-gbps", "0.5"]),
    ("bench", ["--ranks", "4", "--nodes", "2", "--nic-mbit", "balanced", "--reference-rate", "1000"],
     ["--num-processes", "4", "--num-machines", "2", "--nic-gbps", "balanced", "--reference-gbps", "0.125"]),
    ("bench", ["--rates=310,620"], ["--link-gbps", "0.03875,0.0775"]),
    ("demo", ["--nproc", "3"], ["--num_processes", "3"]),
])
def test_the_deprecated_aliases_still_work_and_say_their_replacement(command, old, new, capsys):
    from commfuse_dp import demo
    from commfuse_dp.planner import cli as plan_cli
    from benchmarks import bench

    main = {"plan": plan_cli.main, "bench": bench.main, "demo": demo.main}[command]
    assert _parsed(main, old) == _parsed(main, new)
    err = capsys.readouterr().err
    for name in (a.partition("=")[0] for a in old if a.startswith("--")):
        line = next(line for line in err.splitlines() if f" {name} is deprecated" in line)
        assert line.startswith(f"commfuse-dp {command}: warning:") and "; use --" in line
    assert err.count("deprecated") == sum(a.startswith("--") for a in old)


def test_plan_prints_the_same_either_way(capsys):
    base = ["--model", "llama3-8b", "--link-gbps", "450", "--tokens-per-rank", "8192", "--seq", "8192"]
    cli.main(["plan", "--num-processes", "16", *base])
    ours = capsys.readouterr().out
    cli.main(["plan", "--ranks", "16", *["--" + a[2:].replace("-", "_") if a.startswith("--") else a for a in base]])
    assert ours and capsys.readouterr().out == ours


def test_bench_and_demo_names():
    from commfuse_dp import demo
    from benchmarks import bench

    assert _parsed(bench.main, ["--num-processes", "4", "--num-machines", "2", "--nic-gbps", "0.1"]) == \
        _parsed(bench.main, ["--num_processes", "4", "--nnodes", "2", "--nic_gbps", "0.1"])
    assert _parsed(demo.main, ["--num_processes", "3", "--max_steps", "5"]) == \
        _parsed(demo.main, ["--nproc_per_node", "3", "--max-steps", "5"])


def test_the_recipes_take_the_transformers_examples_names(capsys):
    from commfuse_dp.recipes import finetune_clm

    ours = finetune_clm.parse(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o"])
    assert "deprecated" not in capsys.readouterr().err
    old = finetune_clm.parse(["--model", "m", "--data=d", "--output_dir", "o"])
    assert (old[0].model_name_or_path, old[0].dataset_name) == (ours[0].model_name_or_path, ours[0].dataset_name) \
        == ("m", "d")
    err = capsys.readouterr().err
    assert "--model is deprecated; use --model_name_or_path" in err and "--data is deprecated; use --dataset_name" in err


def test_what_follows_a_double_dash_is_left_alone():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_steps")
    assert spelled(["--max-steps", "3", "--", "--max-steps", "4"], parser, "demo") == \
        ["--max_steps", "3", "--", "--max-steps", "4"]


def test_every_alias_names_a_real_option():
    from commfuse_dp import demo
    from commfuse_dp.planner import cli as plan_cli
    from benchmarks import bench
    from test_docs_cover_cli import _flags, _parser_of

    import importlib

    flags = {"plan": _flags(_parser_of(plan_cli.main)), "bench": _flags(_parser_of(bench.main)),
             "demo": _flags(demo._parser())}
    for script in set(DEPRECATED) - set(flags):  # the benchmark scripts
        flags[script] = _flags(_parser_of(importlib.import_module(f"benchmarks.{script}").main))
    for command, aliases in ALIASES.items():
        for other, target in aliases.items():
            assert target in flags[command], (command, other, target)
            assert other not in flags[command], (command, other)
    for command, renamed in DEPRECATED.items():
        for old, (target, _) in renamed.items():
            assert target in flags[command], (command, old, target)
            assert old.replace("_", "-") not in flags[command] and old not in flags[command], (command, old)
