"""Every option of the ``commfuse-dp`` command line is documented in docs/*.md.

Each subcommand's parser is the one its ``main()`` builds (caught at ``parse_args``, nothing runs); each of its
option strings must appear in a docs/*.md section whose heading names ``commfuse-dp SUB``. The top-level options
(``--version``, ``--help``) must appear as ``commfuse-dp --version`` / ``commfuse-dp --help``. ``launch`` takes
accelerate's own options: those its ``--help`` names must be documented the same way."""

from __future__ import annotations

import argparse
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
GENERIC = {"-h", "--help"}   # argparse's own, on every parser


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _parser_of(main) -> argparse.ArgumentParser:
    """The parser ``main([])`` builds, caught when it parses (before anything runs)."""
    def catch(self, *args, **kwargs):
        raise _Caught(self)

    mp = pytest.MonkeyPatch()
    mp.setattr(argparse.ArgumentParser, "parse_args", catch)
    mp.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    try:
        main([])
    except _Caught as caught:
        return caught.parser
    finally:
        mp.undo()
    raise AssertionError(f"{main.__module__}.main built no argparse parser")


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")} - GENERIC)


def _subcommand_flags() -> dict[str, list[str]]:
    from commfuse_dp import demo
    from commfuse_dp.planner import cli as plan_cli
    from benchmarks import bench

    flags = {"demo": _flags(demo._parser()), "plan": _flags(_parser_of(plan_cli.main)),
             "bench": _flags(_parser_of(bench.main))}
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import launch_command_parser

    from commfuse_dp.launch import help_text

    accelerate_options = set(_flags(launch_command_parser()))
    named = set(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", help_text()))
    flags["launch"] = sorted(named & accelerate_options)
    return flags


def _sections() -> list[tuple[str, str]]:
    """(heading, text up to the next heading) of every docs/*.md, outside fenced code as well as inside."""
    sections = []
    for path in sorted(glob.glob(os.path.join(DOCS, "*.md"))):
        heading, lines = os.path.basename(path), []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if re.match(r"#{1,6} ", line):
                    sections.append((heading, "".join(lines)))
                    heading, lines = line.strip(), []
                else:
                    lines.append(line)
        sections.append((heading, "".join(lines)))
    return sections


def _mentions(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def undocumented(command: str, flags: list[str], sections: list[tuple[str, str]]) -> list[str]:
    """The flags of ``commfuse-dp command`` that no section headed ``commfuse-dp command`` mentions."""
    name = re.compile(rf"commfuse-dp {re.escape(command)}(?![\w-])")
    text = "\n".join(body for heading, body in sections if name.search(heading.replace("`", "")))
    return [flag for flag in flags if not _mentions(text, flag)]


def test_every_subcommand_flag_is_documented():
    sections = _sections()
    missing = {command: undocumented(command, flags, sections) for command, flags in _subcommand_flags().items()}
    missing = {command: flags for command, flags in missing.items() if flags}
    assert not missing, ("options of `commfuse-dp SUB --help` that no docs/*.md section headed `commfuse-dp SUB` "
                         f"mentions: {missing}")


def test_top_level_options_are_documented(capsys):
    from commfuse_dp import cli

    assert cli.main(["--help"]) == 0
    help_text = capsys.readouterr().out
    assert "\noptions:\n" in help_text
    # the options block (the examples above it are the subcommands' flags, checked above)
    block = help_text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    options = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", block))
    assert {"--version", "--help"} <= options
    text = "\n".join(body for _, body in _sections())
    assert [o for o in sorted(options) if f"commfuse-dp {o}" not in text] == []


def test_the_check_finds_what_is_missing():
    # the parsers are found and are not empty, and a flag absent from the docs is reported
    flags = _subcommand_flags()
    assert {"--quick", "--rounds"} <= set(flags["bench"]) and {"--against", "--num-machines"} <= set(flags["plan"])
    assert "--config_file" in flags["launch"] and "--max_steps" in flags["demo"]
    sections = [("## `commfuse-dp plan`", "`--ranks N`, and `--nodes-x` is another flag"), ("## Other", "--nodes")]
    assert undocumented("plan", ["--ranks", "--nodes"], sections) == ["--nodes"]
    assert undocumented("planner", ["--ranks"], sections) == ["--ranks"]
