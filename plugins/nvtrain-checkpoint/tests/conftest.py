"""Fixtures of the checkpoint tests: the shared training set-ups and a way to run them in a fresh process."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

DRIVER = Path(__file__).with_name("driver.py")


def _load_driver() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nvtrain_checkpoint_test_driver", DRIVER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_DRIVER_MODULE = _load_driver()


@pytest.fixture(scope="session")
def driver() -> ModuleType:
    """``tests/driver.py``: set-ups (``strategy_kwargs``, ``make_loader``, ``straight``) and ``assert_same``."""
    return _DRIVER_MODULE


def _popen(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(DRIVER), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture(scope="session")
def start_driver() -> Callable[..., subprocess.Popen[str]]:
    """Start ``python driver.py ARGS...`` without waiting (output captured)."""
    return _popen


@pytest.fixture(scope="session")
def run_driver() -> Callable[..., str]:
    """Run ``python driver.py ARGS...`` to completion (120 s at most); fail with its output if it fails."""

    def run(*args: str, timeout: float = 120) -> str:
        process = _popen(*args)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
            pytest.fail(f"driver {args} timed out after {timeout} s:\n{output}")
        if process.returncode != 0:
            pytest.fail(f"driver {args} exited with {process.returncode}:\n{output}")
        return output

    return run

