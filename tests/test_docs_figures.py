"""The figures docs/performance.md quotes equal the results files they name, where a table can be read back.

Checked today: every table of the multi-node runs ("HSDP against FSDP2's HSDP"): for each row, the peer's step
(seconds, 3 decimals) against the file's ``fsdp2_hsdp`` record at that NIC rate, each setting's ratio and its
spread (``median [lowest-highest]``, 3 decimals) against the file's ``paired_peer`` entry, and the layout and
schedule the defaults chose (``(flat, fused)``, ``(HSDP, fsdp2)``) against their record's ``chosen``. A table is
tied to the results file named last before it. A figure changed in the doc or a file rerun without the doc
makes it fail."""

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
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip("|").split("|")])
            yield named, header, rows


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
