"""The figures the docs quote equal the results files they name, where they can be read back.

- performance.md's multi-node tables ("NIC GB/s"): for each row, the peer's step (seconds, 3 decimals) against the
  file's ``fsdp2_hsdp`` record at that NIC rate, a rank's share of the NIC, each setting's ratio and its spread
  (``median [lowest-highest]``, 3 decimals) against the file's ``paired_peer`` entry, and the layout and schedule
  the defaults chose (``(flat, fused)``, ``(HSDP, fsdp2)``) against their record's ``chosen``. A table is tied to
  the results file named last before it.
- performance.md's one-machine tables ("GB/s", "ranks, GB/s"): step seconds, and every ratio recomputed round by
  round from the file's records (``bench.paired_ratios``).
- every "balanced rate" performance.md quotes, against the file its paragraph names.
- README's and docs/cli.md's ``commfuse-dp plan`` outputs, against what the command prints.

Every rate in the docs is in GB/s (4 significant digits); the files keep what ``tc`` shaped, Mbit/s. A figure
changed in a doc, or a file rerun without the doc, makes a test fail."""

import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "performance.md")
FILE = re.compile(r"benchmarks/results/(nodes-[\w-]+\.json)")
CELL = re.compile(r"^([0-9.]+) \[([0-9.]+)-([0-9.]+)\](?: \((flat|HSDP), (fused|fsdp2)\))?$")


def _tables(text: str):
    """(results file, header cells, rows of cells) of each table whose header starts with "NIC GB/s"."""
    lines = text.splitlines()
    named = None
    for i, line in enumerate(lines):
        for match in FILE.finditer(line):
            named = match.group(1)
        if line.startswith("| NIC GB/s"):
            header, rows = _table_at(lines, i)
            yield named, header, rows


def _table_at(lines: list[str], i: int) -> tuple[list[str], list[list[str]]]:
    """The header cells of the table whose header is ``lines[i]``, and its rows of cells."""
    rows = []
    for row in lines[i + 2:]:
        if not row.startswith("|"):
            break
        rows.append([c.strip() for c in row.strip("|").split("|")])
    return [c.strip() for c in lines[i].strip("|").split("|")], rows


def _rate(data: dict, quoted: str, named: str) -> float:
    """The file's rate (Mbit/s, as tc shaped it) that the doc quotes in GB/s (4 significant digits)."""
    rates = {r["rate_mbit"] for r in data["records"]}
    matches = [r for r in rates if f"{r / 8000:.4g}" == quoted]
    assert len(matches) == 1, (named, quoted, sorted(r / 8000 for r in rates))
    return matches[0]


def test_multi_node_tables_equal_their_results_files():
    tables = list(_tables(open(DOC).read()))
    assert len(tables) >= 3, "the multi-node tables were not found"
    checked = 0
    for named, header, rows in tables:
        assert named, f"no results file named before the table {header}"
        data = json.load(open(os.path.join(ROOT, "benchmarks", "results", named)))
        for cells in rows:
            rate = _rate(data, cells[0].split()[0], named)
            key = f"{rate:g}"
            records = {r["schedule"]: r for r in data["records"] if r["rate_mbit"] == rate}
            share = f"({records['fsdp2_hsdp']['inter_mbit_per_rank'] / 8000:.4g})"
            assert cells[0].split()[1] == share, (named, key, "a rank's share of the NIC")
            assert cells[1] == f"{records['fsdp2_hsdp']['step_s']:.3f}", (named, key, "peer's step")
            for column, cell in zip(header[2:], cells[2:]):
                variant = column.split(" ")[0]
                match = CELL.match(cell)
                assert match, (named, key, column, cell)
                ratio = data["paired_peer"][key][f"fsdp2_hsdp/{variant}"]
                quoted = tuple(match.group(i) for i in (1, 2, 3))
                assert quoted == tuple(f"{ratio[k]:.3f}" for k in ("median", "min", "max")), (named, key, variant)
                if variant == "defaults":
                    chosen = records["defaults"]["chosen"]
                    layout = "flat" if chosen.get("replicate") == 1 else "HSDP"
                    assert match.group(4, 5) == (layout, chosen["schedule"]), (named, key, chosen)
                checked += 1
    assert checked >= 40, checked


RANGE = re.compile(r"^([0-9.]+) \[([0-9.]+) - ([0-9.]+)\]$")
NAMES = {"no hints": "defaults_nohints", "fused (exact)": "fused"}  # a column's words -> the bench's variant
RESULTS = re.compile(r"(\d+ranks-[\w-]+\.json)")


def _one_machine_tables(text: str):
    """(files named in the paragraph before, header cells, rows of cells) of each table whose first header cell is
    "GB/s" or "ranks, GB/s" (the bench on one machine)."""
    lines = text.splitlines()
    since = 0
    for i, line in enumerate(lines):
        if line.startswith("| GB/s |") or line.startswith("| ranks, GB/s |"):
            named = RESULTS.findall("\n".join(lines[since:i]))
            header, rows = _table_at(lines, i)
            since = i + 2 + len(rows)
            yield named, header, rows


def _spread(ratio: dict) -> tuple[str, str, str]:
    return tuple(f"{ratio[k]:.3f}" for k in ("median", "min", "max"))


def test_one_machine_tables_equal_their_results_files():
    """Every table of the bench on one machine: a variant's step seconds (3 decimals) against its record at the row's
    rate; a ratio column "X / Y" against X's step over Y's paired by round (``bench.paired_ratios``: median [lowest -
    highest]); in the narrow-format tables (no "X / Y" column) each variant's cell is the peer's (``fsdp2_overlap``)
    step over the variant's, paired the same way. The row's rate is the file's (GB/s, 4 significant digits), and a
    "ranks, GB/s" row names the file of that many ranks among those named before the table."""
    from benchmarks.bench import paired_ratios

    tables = list(_one_machine_tables(open(DOC).read()))
    assert len(tables) >= 5, "the one-machine tables were not found"
    checked = 0
    for named, header, rows in tables:
        assert named, f"no results file named before the table {header}"
        files = {name: json.load(open(os.path.join(ROOT, "benchmarks", "results", name))) for name in named}
        narrow = not any(" / " in column for column in header)
        for cells in rows:
            label = cells[0]
            if header[0].startswith("ranks"):
                ranks, label = label.split(", ", 1)
                name = next(n for n, d in files.items() if d["world_size"] == int(ranks))
            else:
                name = named[-1]
            data = files[name]
            rate = _rate(data, label.split()[0], name)
            records = {r["schedule"]: r for r in data["records"] if r["rate_mbit"] == rate}
            key = f"{rate:g}"
            for column, cell in zip(header[1:], cells[1:]):
                cell = cell.replace("**", "")
                if not cell:
                    continue
                where = (name, label, column, cell)
                if " / " in column:
                    of, over = (NAMES.get(w, w) for w in column.split(" / "))
                    match = RANGE.match(cell)
                    assert match, where
                    paired = paired_ratios(data["records"], data["rounds"], of=of)[key][f"{of}/{over}"]
                    assert match.groups() == _spread(paired), (where, _spread(paired))
                elif narrow:
                    variant = NAMES.get(column, column)
                    match = RANGE.match(cell)
                    assert match, where
                    paired = paired_ratios(data["records"], data["rounds"], of="fsdp2_overlap")[key][
                        f"fsdp2_overlap/{variant}"]
                    assert match.groups() == _spread(paired), (where, _spread(paired))
                else:
                    variant = NAMES.get(column, column)
                    assert cell == f"{records[variant]['step_s']:.3f}", (where, records[variant]["step_s"])
                checked += 1
    assert checked >= 150, checked


PLAN_BLOCK = re.compile(r"```\n\$ (commfuse-dp plan [^\n]*)\n(.*?)```", re.S)


def test_the_plan_outputs_shown_are_what_plan_prints(capsys):
    """README's and docs/cli.md's ``$ commfuse-dp plan ...`` blocks: every line shown (``...`` marks lines left
    out) is what the command prints today, in the same order. The planner is deterministic for these commands."""
    import shlex

    from commfuse_dp import cli

    blocks = 0
    for doc in (os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "cli.md")):
        for command, shown in PLAN_BLOCK.findall(open(doc).read()):
            assert cli.main(shlex.split(command)[1:]) == 0, command
            printed = capsys.readouterr().out.splitlines()
            at = 0
            for line in shown.splitlines():
                if line.strip() in ("", "..."):
                    continue
                assert line in printed[at:], (doc, command, line)
                at = printed.index(line, at) + 1
            blocks += 1
    assert blocks >= 2, blocks


BALANCED = re.compile(r"balanced (?:rate |at )([0-9.]+)\s+GB/s")


def test_the_balanced_rates_quoted_are_their_files():
    """Each "balanced rate R GB/s" / "balanced at R GB/s" in a paragraph of performance.md is the balanced rate
    (``balanced_rate_mbit``) of a results file that paragraph names."""
    quoted = 0
    for paragraph in open(DOC).read().split("\n\n"):
        rates = BALANCED.findall(paragraph)
        if not rates:
            continue
        named = set(RESULTS.findall(paragraph)) | set(FILE.findall(paragraph))
        assert named, ("a balanced rate with no results file named", paragraph[:200])
        balanced = {f"{json.load(open(os.path.join(ROOT, 'benchmarks', 'results', n)))['balanced_rate_mbit'] / 8000:.4g}"
                    for n in named}
        for rate in rates:
            assert rate in balanced, (rate, sorted(named), balanced)
            quoted += 1
    assert quoted >= 6, quoted


def test_readme_s_demo_output_is_its_results_file():
    """README's demo lines are the median round's of ``benchmarks/results/demo-2cpu.json`` (made by
    ``benchmarks/demo_rounds.py``), and the time and throughput it quotes over the rounds are the file's median
    [lowest-highest]."""
    text = open(os.path.join(ROOT, "README.md")).read()
    data = json.load(open(os.path.join(ROOT, "benchmarks", "results", "demo-2cpu.json")))
    intro = text.index("benchmarks/results/demo-2cpu.json")
    block = re.search(r"```\n(.*?)```", text[intro:], re.S).group(1)
    assert block.splitlines() == data["shown"]
    spread = data["spread"]
    quoted = re.search(r"the demo took (\d+) s \[(\d+)-(\d+)\] at (\d+) tokens/s \[(\d+)-(\d+)\]", text[intro:])
    assert quoted, "README quotes no time and throughput over the rounds"
    assert quoted.groups() == tuple(f"{spread[k][m]:.0f}" for k in ("demo_s", "tokens_per_s")
                                    for m in ("median", "min", "max"))
    assert len(data["rounds"]) >= 3
    chose = data["rounds"][0]["chose"]["schedule"]
    assert f"(here {chose})" in text, chose


def _tp_table(header: str, results: str) -> tuple[list[list[str]], list[dict]]:
    """The cells of performance.md's table whose header starts with ``header``, and the runs of ``results``."""
    with open(DOC, encoding="utf-8") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    with open(os.path.join(ROOT, "benchmarks", "results", results)) as f:
        return rows, json.load(f)["runs"]


def test_tensor_parallel_table_equals_its_results_file():
    """performance.md's TP table ("| TP | link GB/s"): each row's rate, every step's median and range (fused,
    DTensor's, transformers', DTensor's schedule on the rings, the limits) and the paired ratios against
    ``tp-emulated.json``."""
    rows, runs = _tp_table("| TP | link GB/s", "tp-emulated.json")
    assert len(rows) == len(runs)
    cell = lambda v: f"{v['median_s']:.3f} ({v['spread_s'][0]:.3f}-{v['spread_s'][1]:.3f})"  # noqa: E731
    ratio = lambda r: f"{r['median']:.2f}x ({r['spread'][0]:.2f}-{r['spread'][1]:.2f})"  # noqa: E731
    for row, run in zip(rows, runs):
        v = run["variants"]
        want = [str(run["tp"]), f"{run['fraction']:g}x ({run['rate_mbit'] / 8000:.4g})", cell(v["fused"]),
                cell(v["dtensor"]), cell(v["hf_tp"]), cell(v["unfused"]), f"{v['compute_only']['median_s']:.3f}",
                f"{v['comm_only']['median_s']:.3f}", ratio(run["dtensor_over_fused"]),
                ratio(run["hf_tp_over_fused"]), ratio(run["unfused_over_fused"]),
                f"{run['fused_over_limit']['median']:.2f}"]
        assert row == want


def test_tensor_parallel_beside_data_parallel_table_equals_its_results_file():
    """performance.md's table of TP beside data parallelism ("| mesh | link GB/s", mesh "DP x TP") against
    ``tp-emulated-2x2.json`` (DP 2 x TP 2) and then ``tp-emulated-4x2.json`` (DP 2 x TP 4)."""
    rows, runs = _tp_table("| mesh | link GB/s", "tp-emulated-2x2.json")
    runs = runs + _tp_table("| mesh | link GB/s", "tp-emulated-4x2.json")[1]
    assert {(run["dp"], run["tp"]) for run in runs} == {(2, 2), (2, 4)}
    assert len(rows) == len(runs)
    cell = lambda v: f"{v['median_s']:.3f} ({v['spread_s'][0]:.3f}-{v['spread_s'][1]:.3f})"  # noqa: E731
    for row, run in zip(rows, runs):
        v, r = run["variants"], run["dtensor_over_fused"]
        assert row == [f"{run['dp']} x {run['tp']}", f"{run['fraction']:g}x ({run['rate_mbit'] / 8000:.4g})",
                       cell(v["fused"]), cell(v["dtensor"]), f"{v['compute_only']['median_s']:.3f}",
                       f"{v['comm_only']['median_s']:.3f}",
                       f"{r['median']:.2f}x ({r['spread'][0]:.2f}-{r['spread'][1]:.2f})",
                       f"{run['fused_over_limit']['median']:.2f}"]
