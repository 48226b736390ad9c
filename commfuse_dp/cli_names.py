"""The names of ``commfuse-dp plan``, ``bench`` and ``demo``'s options: one vocabulary, the ecosystem's.

The ranks and the machines are named as ``accelerate launch`` (which ``commfuse-dp launch`` runs) names them:
``--num-processes`` (all ranks) and ``--num-machines``; ranks per machine as torchrun does, ``--nproc-per-node``
(and torchrun's ``--nnodes`` is taken for ``--num-machines``). An option that sets what a ``CommFuseConfig`` field
says bears the field's name (``--link-gbps``, ``--ring-latency-us``, ``--tokens-per-rank``). Every link rate is in
GB/s (bytes per second, as ``CommFuseConfig.link_gbps`` and NCCL's tests give it; a 100 Gb/s NIC is 12.5 GB/s).
Every option takes hyphens or underscores alike (``--link-gbps`` or ``--link_gbps``), as torchrun's and the
recipes' (``HfArgumentParser``) do.

Deprecated aliases still work: each prints one warning line naming its replacement, and one
that took Mbit/s has its value converted to GB/s (``--nic-mbit 800`` is ``--nic-gbps 0.1``). ``spelled`` rewrites a
command line into the names the parser knows before it parses; anything after ``--`` is left as it is.
"""

from __future__ import annotations

import argparse
import sys

# another accepted name (underscores) -> the option it stands for, per command
ALIASES = {
    "plan": {"--nnodes": "--num-machines", "--model_name_or_path": "--model"},
    "bench": {"--nnodes": "--num-machines"},
    "demo": {"--nproc_per_node": "--num_processes"},
}

MBIT_PER_GBPS = 8000.0  # 1 GB/s = 8000 Mbit/s

# a deprecated name (underscores) -> (the option it stands for, the factor its value in the old unit is divided by)
DEPRECATED = {
    "plan": {"--ranks": ("--num-processes", None), "--world_size": ("--num-processes", None),
             "--nodes": ("--num-machines", None), "--ranks_per_node": ("--nproc-per-node", None),
             "--latency_us": ("--ring-latency-us", None), "--tokens": ("--tokens-per-rank", None)},
    "bench": {"--world_size": ("--num-processes", None), "--ranks": ("--num-processes", None),
              "--nodes": ("--num-machines", None), "--rates": ("--link-gbps", MBIT_PER_GBPS),
              "--reference_rate": ("--reference-gbps", MBIT_PER_GBPS), "--nic_mbit": ("--nic-gbps", MBIT_PER_GBPS),
              "--intra_mbit": ("--intra-gbps", MBIT_PER_GBPS)},
    "demo": {"--nproc": ("--num_processes", None)},
    # the benchmark scripts (python -m benchmarks.NAME)
    "frozen_memory": {"--ranks": ("--num-processes", None)},
    "ring_micro": {"--world_size": ("--num-processes", None)},
    "step_overhead": {"--world_size": ("--num-processes", None)},
    "startup": {"--ranks": ("--num-processes", None), "--latency_us": ("--ring-latency-us", None),
                "--tokens": ("--tokens-per-rank", None)},
    "wire_accuracy": {"--nproc": ("--num_processes", None)},
}


def _key(option: str) -> str:
    return "--" + option[2:].replace("-", "_")


def mbit_to_gbps(text: str) -> str:
    """``text``'s comma-separated Mbit/s as GB/s, each word that is no number (``balanced``) left as it is."""
    out = []
    for word in text.split(","):
        try:
            out.append(f"{float(word) / MBIT_PER_GBPS:.10g}")
        except ValueError:
            out.append(word)
    return ",".join(out)


def spelled(argv: list[str], parser: argparse.ArgumentParser, command: str) -> list[str]:
    """``argv`` with every option the parser knows under another spelling or name (``ALIASES``, ``DEPRECATED``)
    written as the parser spells it, a deprecated name's value converted to the option's unit and one warning
    line on stderr for it; values, positional arguments, unknown options and everything after ``--`` untouched."""
    known = {_key(s): s for action in parser._actions for s in action.option_strings if s.startswith("--")}
    aliases = {other: known[_key(target)] for other, target in ALIASES.get(command, {}).items()
               if _key(target) in known and other not in known}
    deprecated = {old: (known[_key(target)], factor) for old, (target, factor) in DEPRECATED.get(command, {}).items()
                  if _key(target) in known and old not in known}
    out = []
    convert = None  # the factor the next word (a deprecated option's value) is divided by
    for i, arg in enumerate(argv):
        if convert is not None:
            out.append(mbit_to_gbps(arg))
            convert = None
            continue
        if arg == "--":
            out += argv[i:]
            break
        if not arg.startswith("--"):
            out.append(arg)
            continue
        name, eq, value = arg.partition("=")
        key = _key(name)
        target = known.get(key) or aliases.get(key)
        if target is None and key in deprecated:
            target, factor = deprecated[key]
            unit = " (GB/s: the value in Mbit/s / 8000, converted)" if factor else ""
            print(f"{parser.prog}: warning: {name} is deprecated; use {target}{unit}", file=sys.stderr)
            if factor:
                if eq:
                    value = mbit_to_gbps(value)
                else:
                    convert = factor
        out.append((target or name) + eq + value)
    return out


def gbps_to_mbit(gbps: float) -> float:
    """A rate in GB/s as the Mbit/s that ``tc`` shapes, rounded so that 0.03875 GB/s is 310 Mbit/s again."""
    return round(gbps * MBIT_PER_GBPS, 6)


def show_gbps(mbit: float) -> str:
    """A rate kept in Mbit/s (as ``tc`` shapes it), written in GB/s for people."""
    return f"{mbit / MBIT_PER_GBPS:.4g}"
