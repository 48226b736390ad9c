"""The names an option of ``commfuse-dp plan``, ``bench`` and ``demo`` also answers to.

Every option takes hyphens or underscores alike (``--link-gbps`` or ``--link_gbps``), as torchrun's do and as the
recipes' (``HfArgumentParser``) do. The ecosystem's names of the same things are accepted too: accelerate's and
torchrun's for the ranks and the machines (``--num_processes``, ``--num_machines``, ``--nnodes``,
``--nproc_per_node``), and ``CommFuseConfig``'s field names where an option sets what a field says
(``--ring_latency_us``, ``--tokens_per_rank``). ``spelled`` rewrites a command line into the names the parser
knows before it parses; anything after ``--`` is left as it is.
"""

from __future__ import annotations

import argparse

# other name (underscores) -> the option it stands for, per command
ALIASES = {
    "plan": {"--num_processes": "--ranks", "--world_size": "--ranks", "--num_machines": "--nodes",
             "--nnodes": "--nodes", "--ring_latency_us": "--latency-us", "--tokens_per_rank": "--tokens",
             "--nproc_per_node": "--ranks-per-node"},
    "bench": {"--num_processes": "--world-size", "--ranks": "--world-size", "--num_machines": "--nodes",
              "--nnodes": "--nodes"},
    "demo": {"--num_processes": "--nproc", "--nproc_per_node": "--nproc"},
}


def _key(option: str) -> str:
    return "--" + option[2:].replace("-", "_")


def spelled(argv: list[str], parser: argparse.ArgumentParser, command: str) -> list[str]:
    """``argv`` with every option the parser knows under another spelling or name (``ALIASES``) written as the
    parser spells it; values, positional arguments, unknown options and everything after ``--`` untouched."""
    known = {_key(s): s for action in parser._actions for s in action.option_strings if s.startswith("--")}
    aliases = {other: known[_key(target)] for other, target in ALIASES.get(command, {}).items()
               if _key(target) in known and other not in known}
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            out += argv[i:]
            break
        if not arg.startswith("--"):
            out.append(arg)
            continue
        name, eq, value = arg.partition("=")
        key = _key(name)
        target = known.get(key) or aliases.get(key)
        out.append((target or name) + eq + value)
    return out
