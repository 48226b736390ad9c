"""README.md's main-job line, verbatim, in a fresh virtual environment: install torch and the package with the
recipes extra, run ``commfuse-dp demo`` (a 2-process CPU fine-tune of the embedded default), then the generate
command the demo prints. The copy of the repository holds only what git tracks (or, without git, the working tree
less build outputs), so nothing installed for the test suite leaks in. Each step's wall time is printed.

This is the slowest job of the suite (pip install from the local cache, then the demo's 60 steps, about two minutes
on an idle 2-core machine); it runs the README's own line so that the line cannot go stale. conftest.py starts it
when the run begins, in the background at the lowest CPU priority, so that it runs on the core time the other tests
leave idle (they wait for timeouts, or run in one process), and ``readme_job`` waits for it. The run is shared with
tests/test_recipe_clm.py, which checks the demo's outputs and its saved model.
"""

import os
import re
import shutil
import shlex
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_lines() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no ```bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def _copy_repository(dest: str) -> None:
    if os.path.isdir(os.path.join(ROOT, ".git")) and shutil.which("git"):
        files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               check=True, capture_output=True).stdout.decode().split("\0")
        for name in filter(None, files):
            src = os.path.join(ROOT, name)
            if os.path.isfile(src):
                os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
                shutil.copy2(src, os.path.join(dest, name))
    else:
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns("runs", "*.egg-info", "__pycache__", ".venv*"))


# Started by conftest.py in the background at the lowest CPU priority (``SCHED_IDLE``): it runs on the core time
# the other tests leave idle, and ``stop_readme_job`` ends it if the run ends first.
_LOCK = threading.Lock()
_RUNNING: list[subprocess.Popen] = []
_STOPPED = threading.Event()
_IDLE = ("import os, sys\ntry:\n    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
         "except OSError:\n    pass  # not allowed here: it runs at the normal priority\n"
         "os.execvp('bash', ['bash', '-c', sys.argv[1]])")


def _run(command: str, cwd: str, env: dict, timeout: float, idle: bool) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", _IDLE, command] if idle else ["bash", "-c", command]
    with _LOCK:  # nothing starts once the job was stopped
        if _STOPPED.is_set():
            raise RuntimeError("README's main job was stopped: the test run ended before it")
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        _RUNNING.append(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end(proc)
        proc.communicate()
        raise
    finally:
        with _LOCK:
            _RUNNING.remove(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM to the command's process group (torchrun's agent then ends its workers, which it starts in process
    groups of their own), SIGKILL to what is left after 15 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_readme_job() -> None:
    """End the job: the test run ended before it did."""
    with _LOCK:
        _STOPPED.set()
        running = list(_RUNNING)
    for proc in running:
        _end(proc)


def run_readme_main_job(tmp_path, idle: bool = False, environ: dict | None = None) -> dict:
    """README's main-job line, each of its commands timed, in a fresh virtual environment over a copy of the
    repository; then the generate command the demo prints. Returns the folders, the outputs and the timings
    (``readme_job`` in conftest.py runs it once per pytest run: the recipe tests read the same run). ``idle``: each
    command at the lowest CPU priority; ``environ``: the environment to start from (default: this process's)."""
    main_line = _readme_lines()[0]
    assert main_line.endswith("commfuse-dp demo"), main_line
    repo, venv = str(tmp_path / "repo"), str(tmp_path / "venv")
    _copy_repository(repo)
    environ = dict(os.environ if environ is None else environ)
    made = _run(shlex.join([sys.executable, "-m", "venv", venv]), repo, environ, 300, idle)
    assert made.returncode == 0, made.stderr[-3000:]
    env = {k: v for k, v in environ.items() if not k.startswith(("PYTHON", "COMMFUSE_", "ACCELERATE_"))}
    env.update(VIRTUAL_ENV=venv, PATH=os.path.join(venv, "bin") + os.pathsep + env["PATH"], OMP_NUM_THREADS="1")
    timings = []
    outputs = []
    for command in main_line.split(" && "):  # the line's own commands, in order, each timed
        began = time.monotonic()
        proc = _run(command, repo, env, 1500, idle)
        timings.append((command, time.monotonic() - began))
        assert proc.returncode == 0, f"`{command}` failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        outputs.append(proc.stdout)
    summary = outputs[-1]
    generate = re.search(r"generate\s+(python -m commfuse_dp\.recipes\.generate .*)", summary)
    assert generate, summary
    began = time.monotonic()
    proc = _run(generate.group(1).strip(), repo, env, 600, idle)
    timings.append(("generate", time.monotonic() - began))
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-4000:]
    return {"repo": repo, "demo_out": os.path.join(repo, "runs", "demo"), "stdout": summary, "timings": timings,
            "idle": idle}


def test_readme_main_job_runs_in_a_fresh_virtualenv(readme_job, capsys):
    summary = readme_job["stdout"]
    loss = re.search(r"eval loss\s+([\d.]+) -> ([\d.]+)", summary)
    assert loss and float(loss.group(2)) < float(loss.group(1)), summary
    assert os.path.isfile(os.path.join(readme_job["demo_out"], "model", "config.json")), summary
    with capsys.disabled():
        where = " (in the background, at idle priority: slower than alone)" if readme_job["idle"] else ""
        print(f"\nREADME main job in a fresh venv{where}: "
              + ", ".join(f"`{c}` {s:.0f} s" for c, s in readme_job["timings"])
              + f"; eval loss {loss.group(1)} -> {loss.group(2)}")
