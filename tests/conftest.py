import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Distributed tests pickle module-level workers by name; the ranks import them from this folder. The checkout's root
# holds benchmarks/, which is not installed with the package.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


import pytest  # noqa: E402


class _Background:
    """README.md's main job on a thread of its own, at the lowest CPU priority (tests/test_readme_demo.py)."""

    def __init__(self) -> None:
        from test_readme_demo import run_readme_main_job

        self.folder = Path(tempfile.mkdtemp(prefix="commfuse-readme-"))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="readme-job")
        # the environment as it is now, before any test changes it
        self.job = self._pool.submit(run_readme_main_job, self.folder, idle=True, environ=dict(os.environ))

    def wait(self) -> dict:
        return self.job.result()  # (the job's error, if it failed)

    def close(self) -> None:
        from test_readme_demo import stop_readme_job

        if not self.job.done():
            stop_readme_job()
            self.job.exception()  # its command ended: nothing writes into the folder any more
        self._pool.shutdown()
        shutil.rmtree(self.folder, ignore_errors=True)


_README_JOB: _Background | None = None


def pytest_collection_modifyitems(config, items) -> None:
    """A test that needs README's main job (a fresh install and the demo, minutes) is slow wherever it is."""
    for item in items:
        if "readme_job" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session) -> None:
    """Start README's main job as soon as the run is known to need it."""
    global _README_JOB
    if session.config.option.collectonly or session.testsfailed or not hasattr(os, "SCHED_IDLE"):
        return  # (testsfailed: collection errors, after which the run stops)
    if any("readme_job" in getattr(item, "fixturenames", ()) for item in session.items):
        _README_JOB = _Background()


def pytest_sessionfinish(session) -> None:
    if _README_JOB is not None:
        _README_JOB.close()


@pytest.fixture(scope="session")
def readme_job(tmp_path_factory):
    """README.md's main job (``commfuse-dp demo`` after a fresh install), run once per pytest run
    (tests/test_readme_demo.py; the demo's outputs are checked by tests/test_recipe_clm.py too): started in the
    background when the run began, or here where the platform has no idle CPU priority."""
    if _README_JOB is not None:
        return _README_JOB.wait()
    from test_readme_demo import run_readme_main_job

    return run_readme_main_job(tmp_path_factory.mktemp("readme"))
