"""accelerate's own test scripts (``accelerate/test_utils/scripts/test_script.py`` and ``test_sync.py``), unchanged,
under ``commfuse-dp launch`` at 2 CPU ranks. Their ``RegressionModel`` has two 0-d parameters (``a``, ``b``), which
torch's ``fully_shard`` refuses; commfuse_dp keeps them replicated (commfuse_dp/scalars.py).

Each script runs through tests/accelerate_scripts_wrapper.py, which lets ``torch.testing.assert_close`` and
``torch.allclose`` compare a DTensor by its full value and prints each place it did so. Without it,
test_script.py stops at its first training check, ``assert_close(old_model.a, model.a)``: a parameter of the
unwrapped (still sharded) model against one of an unsharded copy, "Comparing a DTensor to a non-DTensor is
ambiguous" -- as it does under stock FSDP2. The tests check that such comparisons happen only in the training
checks (test_script.py) and that every other check of both scripts passes as written.
"""

import ast
import os
import re
import subprocess
import sys

import pytest
import yaml

accelerate = pytest.importorskip("accelerate")

from harness import free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WRAPPER = os.path.join(HERE, "accelerate_scripts_wrapper.py")
SCRIPTS = os.path.join(os.path.dirname(accelerate.__file__), "test_utils", "scripts")
CONFIG = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 2,
          "use_cpu": True, "mixed_precision": "no", "debug": False, "commfuse": {}}


def _launch(tmp_path, script: str, wrapped: bool = True) -> subprocess.CompletedProcess:
    config = tmp_path / "accel.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    cmd = [sys.executable, "-m", "commfuse_dp.cli", "launch", "--config_file", str(config), "--main_process_port",
           str(free_port())] + ([WRAPPER] if wrapped else []) + [os.path.join(SCRIPTS, script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)


def _output(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def _functions_at(script: str, lines: set[int]) -> set[str]:
    tree = ast.parse(open(os.path.join(SCRIPTS, script)).read())  # noqa: SIM115
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            and any(node.lineno <= line <= node.end_lineno for line in lines)
            and not any(isinstance(inner, ast.FunctionDef) and inner is not node
                        and any(inner.lineno <= line <= inner.end_lineno for line in lines)
                        for inner in ast.walk(node))}


def _marked(proc, marker: str, script: str) -> set[int]:
    return {int(n) for n in re.findall(rf"{marker} {re.escape(script)}:(\d+)", proc.stdout)}  # ranks interleave


@pytest.mark.slow
def test_accelerate_test_script_passes_but_its_sharded_vs_plain_checks(tmp_path):
    proc = _launch(tmp_path, "test_script.py")
    assert proc.returncode == 0, _output(proc)
    for section in ("**Training integration test**", "**Breakpoint trigger test**", "**Test reinstantiated state**"):
        assert section in proc.stdout, _output(proc)
    lines = _marked(proc, "DTENSOR-VS-PLAIN", "test_script.py")
    assert lines, "the training checks should compare sharded parameters with plain ones"
    assert _functions_at("test_script.py", lines) == {"training_check"}, sorted(lines)


@pytest.mark.slow
def test_accelerate_test_script_unwrapped_stops_at_the_sharded_vs_plain_check(tmp_path):
    proc = _launch(tmp_path, "test_script.py", wrapped=False)
    assert proc.returncode != 0
    assert "Comparing a DTensor to a non-DTensor is ambiguous" in proc.stderr, _output(proc)
    assert "**Training integration test**" in proc.stdout and "scalar parameters" not in proc.stderr


@pytest.mark.slow
def test_accelerate_test_sync_passes(tmp_path):
    proc = _launch(tmp_path, "test_sync.py")
    assert proc.returncode == 0, _output(proc)
    for section in ("**Test Distributed `no_sync` context manager**",
                    "**Test `accumulate` gradient accumulation with optimizer and scheduler"):
        assert section in proc.stdout, _output(proc)
    lines = _marked(proc, "DTENSOR-ALLCLOSE", "test_sync.py")
    print("allclose on DTensors at test_sync.py lines", sorted(lines))
