"""tools/structure.py: the package has no import circles and no long functions, and the check finds both."""

import importlib.util
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "structure.py")

_spec = importlib.util.spec_from_file_location("structure_check", SCRIPT)
structure = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = structure  # its dataclasses look their module up there
_spec.loader.exec_module(structure)


def _write(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_check_finds_circles_and_long_functions(tmp_path):
    long_body = "".join(f"    x{i} = {i}\n" for i in range(structure.MAX_LINES))
    _write(tmp_path, {
        "commfuse_dp/__init__.py": "",
        # a circle through an import inside a function and a relative import
        "commfuse_dp/a.py": "def f():\n    from . import b\n",
        "commfuse_dp/b.py": "import commfuse_dp.a.x\n",
        # not a circle: c imports d, d imports nothing of the package
        "commfuse_dp/c.py": "from commfuse_dp.d import thing\n",
        "commfuse_dp/d.py": "import os\nthing = 1\n",
        # a circle through a subpackage, two levels up
        "commfuse_dp/integrations/__init__.py": "",
        "commfuse_dp/integrations/sub/__init__.py": "",
        "commfuse_dp/integrations/sub/e.py": "from ...launch import go\n",
        # a circle through importlib.import_module with a constant name
        "commfuse_dp/f.py": "import importlib\ndef load():\n    return importlib.import_module('commfuse_dp.g')\n",
        "commfuse_dp/g.py": "from commfuse_dp import f\n",
        # a folder of code that is not a package at its path
        "scripts/run.py": "print(1)\n",
        "commfuse_dp/launch/__init__.py": "class L:\n    def go(self):\n        from commfuse_dp.integrations.sub import e\n",
        "commfuse_dp/long.py": "class K:\n    def method(self):\n" + "    " + long_body.replace("\n    ", "\n        ")
                               + "def short():\n    pass\n",
        "commfuse_dp/launch/help.py": "def help_text():\n" + long_body,
    })
    graph = structure.import_graph(str(tmp_path))
    assert graph["commfuse_dp.b"] == {"commfuse_dp.a"}
    assert graph["commfuse_dp.integrations.sub.e"] == {"commfuse_dp.launch"}
    assert structure.circles(graph) == [["commfuse_dp.a", "commfuse_dp.b"], ["commfuse_dp.f", "commfuse_dp.g"],
                                        ["commfuse_dp.integrations.sub.e", "commfuse_dp.launch"]]
    assert structure.stray_folders(str(tmp_path)) == [
        "scripts/ has no __init__.py, so scripts/*.py is not importable at its path"]
    long = {f.name: f.lines for f in structure.long_functions(str(tmp_path))}
    assert long == {"commfuse_dp.long.K.method": structure.MAX_LINES + 1,
                    "commfuse_dp.launch.help.help_text": structure.MAX_LINES + 1}

    run = subprocess.run([sys.executable, SCRIPT, "--root", str(tmp_path)], check=False, capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "circles: 3" in run.stdout and "folders that are not the package at their path: 1" in run.stdout
    assert "functions over 60 lines: 1 (allowed: 1)" in run.stdout

    (tmp_path / "commfuse_dp" / "b.py").write_text("")
    (tmp_path / "commfuse_dp" / "integrations" / "sub" / "e.py").write_text("")
    (tmp_path / "commfuse_dp" / "g.py").write_text("")
    (tmp_path / "scripts" / "__init__.py").write_text("")
    (tmp_path / "commfuse_dp" / "long.py").write_text("")
    run = subprocess.run([sys.executable, SCRIPT, "--root", str(tmp_path)], check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "circles: 0" in run.stdout


def test_the_package_has_no_import_circles():
    found = structure.circles(structure.import_graph(ROOT))
    assert found == [], f"modules that import each other (python tools/structure.py): {found}"


def test_the_package_has_no_long_functions():
    long = {f.name: f"{f.path}:{f.line} ({f.lines} lines)" for f in structure.long_functions(ROOT)
            if f.name not in structure.ALLOWED}
    assert not long, f"functions over {structure.MAX_LINES} lines (python tools/structure.py): {long}"


def test_every_folder_of_code_is_its_package():
    """No ``package-dir`` mapping, and every folder holding code is a package at its path (``benchmarks/`` is the
    ``benchmarks`` package of a checkout, not installed; ``commfuse_dp/integrations`` is
    ``commfuse_dp.integrations``)."""
    assert structure.stray_folders(ROOT) == []


def test_the_piece_loop_lives_in_one_place():
    """Every ring fused with compute pieces runs ``LayerCall.run`` (runtime/layer_call.py): no other module
    requests a piece's hops itself, and the schedules' hooks beside a piece are the calls' own."""
    import ast

    callers = []
    for folder, _, names in os.walk(os.path.join(ROOT, "commfuse_dp")):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    called = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                    if called in ("piece_hops", "before_piece", "after_piece"):
                        callers.append(os.path.relpath(path, ROOT))
    assert set(callers) == {os.path.join("commfuse_dp", "runtime", "layer_call.py")}, callers
