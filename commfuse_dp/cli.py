"""``commfuse-dp``: the command line (``HELP`` below is what ``commfuse-dp --help`` prints)."""

from __future__ import annotations

import os
import sys

HELP = """\
usage: commfuse-dp COMMAND [ARGS]     (commfuse-dp COMMAND --help explains each command)

Sharded data parallelism for Hugging Face fine-tuning, with the all-gather and reduce-scatter run as rings fused
with each layer's compute.

examples:
  commfuse-dp demo                                      fine-tune the embedded default on 2 CPU processes
  commfuse-dp launch --config_file accel.yaml train.py ARGS
                                                        accelerate launch with a commfuse: block: an unchanged
                                                        script's model is sharded
  commfuse-dp launch --config_file accel.yaml trl sft ARGS    (also accelerate launch ..., torchrun ...)
                                                        a launcher runs once; every worker it starts shards
  commfuse-dp plan --model llama3-8b                    predicted step time of the schedules on a real cluster
  commfuse-dp bench --quick                             the schedules compared on an emulated cluster (root)

options:
  -h, --help     this help
  --version      the installed version

A bad value or file is one line on stderr (exit status 2); COMMFUSE_TRACEBACK=1 shows where it was raised.
"""

COMMANDS = {
    "demo": ("commfuse_dp.demo", "fine-tune the embedded default model on 2 CPU processes, then a summary"),
    "bench": ("benchmarks.bench", "compare the schedules on the emulated cluster (root)"),
    "plan": ("commfuse_dp.planner.cli", "predict step time, exposed communication and MFU on a real cluster"),
    "launch": ("commfuse_dp.launch", "accelerate launch with a commfuse: config block (unchanged scripts)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--version":
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"commfuse-dp {version('commfuse_dp')}")
        except PackageNotFoundError:
            print("commfuse-dp (not installed: run from a checkout)")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP)
        print("commands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<6} {text}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"commfuse-dp: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    import importlib

    if command == "bench" and not _checkout_benchmarks():
        print("commfuse-dp bench: the bench lives in the repository's benchmarks/ folder, which is not installed with "
              "the package; run it from a checkout (git clone the repository, then pip install -e . in it)",
              file=sys.stderr)
        return 2
    run = importlib.import_module(COMMANDS[command][0]).main
    try:
        return run(rest)
    except (ValueError, OSError) as err:  # bad input (a value, a file): one line, never a traceback
        if os.environ.get("COMMFUSE_TRACEBACK"):
            raise
        print(f"commfuse-dp {command}: {_one_line(err)}", file=sys.stderr)
        return 2


def _checkout_benchmarks() -> bool:
    """Whether the repository's ``benchmarks/`` sits beside this package (a checkout): then it is importable, its
    folder put first on ``sys.path`` (and ``PYTHONPATH``, for the ranks the bench starts)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "benchmarks", "bench.py")):
        return False
    if root not in sys.path:
        sys.path.insert(0, root)
    return True


def _one_line(err: BaseException) -> str:
    """The error's message, prefixed with what kind it is where the message alone does not say (a missing file)."""
    text = " ".join(str(err).split())
    if isinstance(err, FileNotFoundError) and err.filename is not None:
        return f"no such file or folder: {err.filename}"
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.filename}: {err.strerror or text}"
    return text or type(err).__name__


if __name__ == "__main__":
    raise SystemExit(main())
