"""Bad input on the command line: every subcommand answers each with a line saying what was wrong and an exit
status of 2, never a traceback. Each case calls ``commfuse_dp.cli.main`` as the ``commfuse-dp`` console script does
(an exception escaping it is what would print a traceback); the first line of stderr is printed (``-s`` shows the
list)."""

import json
import os
import re
import sys
import traceback

from commfuse_dp.cli_names import DEPRECATED


def _cases(tmp):
    not_json = os.path.join(tmp, "notes.txt")
    with open(not_json, "w") as f:
        f.write("not json\n")
    wrong_json = os.path.join(tmp, "other.json")
    with open(wrong_json, "w") as f:
        json.dump({"hello": 1}, f)
    empty_dir = os.path.join(tmp, "empty-model")
    os.makedirs(empty_dir, exist_ok=True)
    missing = os.path.join(tmp, "nonexistent.json")
    script = os.path.join(tmp, "train.py")
    with open(script, "w") as f:
        f.write("print('never run')\n")
    return [
        ("plan", ["--calibrate", missing]),
        ("plan", ["--calibrate", not_json]),
        ("plan", ["--calibrate", wrong_json]),
        ("plan", ["--model", "no-such-model"]),
        ("plan", ["--model", empty_dir]),
        ("plan", ["--num-processes", "0"]),
        ("plan", ["--num-processes", "-8"]),
        ("plan", ["--num-processes", "many"]),
        ("plan", ["--link-gbps", "0"]),
        ("plan", ["--tokens-per-rank", "0"]),
        ("plan", ["--num-processes", "16", "--num-machines", "3"]),
        ("plan", ["--num-processes", "16", "--num-machines", "2", "--nic-gbps", "0"]),
        ("plan", ["--num-processes", "16", "--num-machines", "2", "--nics-per-node", "0"]),
        ("plan", ["--formats", "int4"]),
        ("plan", ["--overhead", missing]),
        ("plan", ["--no-such-flag"]),
        ("bench", ["--num-processes", "0"]),
        ("bench", ["--num-processes", "4", "--num-machines", "3"]),
        ("bench", ["--rounds", "0"]),
        ("bench", ["--variants", "no_such_variant"]),
        ("bench", ["--num-processes", "4", "--num-machines", "2", "--nic-gbps", "0"]),
        ("bench", ["--link-gbps", "fast"]),
        ("demo", ["--num_processes", "0"]),
        ("demo", ["--max_steps", "-3"]),
        ("launch", ["--config_file", os.path.join(tmp, "nonexistent.yaml"), script]),
        ("launch", ["--config_file", not_json, script]),
        ("launch", ["--config_file", wrong_json, script]),
        ("launch", []),
        ("no-such-command", []),
    ]


def _run(command, args, capsys) -> tuple[int | None, str, str]:
    """``commfuse-dp COMMAND ARGS`` in this process, as the console script calls it: (exit status, stderr, what
    escaped it: an exception that would have printed a traceback)."""
    from commfuse_dp import cli

    capsys.readouterr()
    escaped = ""
    try:
        status = cli.main([command, *args])
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
        if not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
    except BaseException as err:  # noqa: BLE001 - the failure this test exists for
        status, escaped = None, "".join(traceback.format_exception(err))
    return status, capsys.readouterr().err, escaped


def test_bad_input_is_one_line_never_a_traceback(tmp_path, capsys, monkeypatch, request):
    for name in [k for k in os.environ if k.startswith(("COMMFUSE_", "ACCELERATE_"))]:
        monkeypatch.delenv(name)
    failures, rows = [], []
    for command, args in _cases(str(tmp_path)):
        status, err, escaped = _run(command, args, capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        first = next((line for line in lines if not line.startswith("usage:") and not line.startswith(" ")),
                     lines[0] if lines else "")
        rows.append(f"BAD INPUT | commfuse-dp {command} {' '.join(args)} | exit {status} | {first}")
        if status != 2 or escaped or "Traceback" in err or not first:
            failures.append(f"commfuse-dp {command} {' '.join(args)}: exit {status}\n{escaped or err[-2000:]}")
        old = {name.replace("_", "-") for name in DEPRECATED.get(command, {})} | set(DEPRECATED.get(command, {}))
        named = set(re.findall(r"--[\w-]+", first)) & old
        if named:  # the line names the option as the user may write it today, never a deprecated alias
            failures.append(f"commfuse-dp {command} {' '.join(args)}: {first!r} names {sorted(named)}")
    if request.config.getoption("capture") == "no":  # (-s: the list of inputs and the first line of each)
        with capsys.disabled():
            print("\n" + "\n".join(rows))
    assert not failures, "\n\n".join(failures)
