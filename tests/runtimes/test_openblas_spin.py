"""Importing the package (the CLI, the Python API, the server) limits OpenBLAS's idle spinning before numpy loads it
(``luminal_recipes/openblas_spin.py``) and keeps a value the user set."""

import os
import subprocess
import sys

import pytest

from luminal_recipes.openblas_spin import SPIN_EXPONENT, limit_openblas_spin

PROBE = ("import os, luminal_recipes.cli, numpy; "
         "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'), 'numpy' in __import__('sys').modules)")


API_PROBE = ("import os, luminal_recipes, numpy; from luminal_recipes import Pipeline; "
             "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))")


def _probe(env_value: str | None, probe: str = PROBE) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if env_value is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = env_value
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          check=True).stdout.split()[0]


def test_cli_sets_the_spin_before_numpy_loads():
    assert _probe(None) == str(SPIN_EXPONENT)


def test_the_python_api_sets_it_too():
    assert _probe(None, API_PROBE) == str(SPIN_EXPONENT)


def test_a_user_value_is_kept():
    assert _probe("20") == "20"


def test_too_late_once_numpy_is_loaded(monkeypatch):
    pytest.importorskip("numpy")
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    assert limit_openblas_spin() is False  # this test process imported numpy long ago: nothing is set
    assert "OPENBLAS_THREAD_TIMEOUT" not in os.environ
