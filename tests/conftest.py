import os
import sys

# Distributed tests pickle module-level workers by name; the ranks import them from this folder.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def readme_job(tmp_path_factory):
    """README.md's main job (``commfuse-dp demo`` after a fresh install), run once per pytest run
    (tests/test_readme_demo.py; the demo's outputs are checked by tests/test_recipe_clm.py too)."""
    from test_readme_demo import run_readme_main_job

    return run_readme_main_job(tmp_path_factory.mktemp("readme"))
