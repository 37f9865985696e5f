"""examples/plugin-template is a real distribution: pip builds and installs it (offline when
this environment's setuptools can build wheels), a fresh Python process discovers it
through nvtrain.plugins and trains with it, and its own tests pass against the installed copy."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parents[1] / "examples" / "plugin-template"

pytestmark = pytest.mark.slow

#: Run in a fresh process: discover, load, train three batches, then run the template's own tests
#: (in the same process, to pay for one interpreter start and one torch import).
SCRIPT = textwrap.dedent(
    """
    import functools
    import sys

    import pytest
    import torch

    import nvtrain
    import nvtrain.plugins

    info = {p.name: p for p in nvtrain.plugins.available()}["gradnorm"]
    print("found", info.name, info.distribution, info.version, info.status.value,
          [h.name for h in info.hooks], list(info.hooks[0].stages))
    hook = nvtrain.plugins.load("gradnorm", every=1)
    print("module", sys.modules[type(hook).__module__].__file__)

    torch.manual_seed(0)
    batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 1),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[hook],
        device="cpu",
    )
    with strategy:
        result = strategy.run(batches)
    print("steps", result.step_count, "metric", type(strategy.ctx.metrics["grad_norm"]).__name__, flush=True)
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", sys.argv[1], sys.argv[1] + "/tests"])
    print("template tests exit", int(code))
    """
)


def _offline_build_options() -> list[str]:
    """Build with this environment's setuptools when it can make wheels by itself (no network).

    setuptools >= 70.1 builds wheels alone; older ones need the ``wheel`` package. Without
    either, pip builds in an isolated environment, fetching setuptools from the package index.
    """
    try:
        import setuptools
    except ImportError:
        return []
    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    if (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None:
        return ["--no-build-isolation", "--no-index"]
    return []


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    """The template built from a copy (the source tree stays clean) and installed into a directory."""
    source, target = tmp_path / "source", tmp_path / "site"
    shutil.copytree(TEMPLATE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
    command += [*_offline_build_options(), "--target", str(target), str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (target / "nvtrain_gradnorm-0.1.0.dist-info" / "entry_points.txt").is_file()
    return target


def _env(site: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(site)}
    for name in ("NVTRAIN_PLUGINS", "NVTRAIN_DISABLE_PLUGIN_AUTOLOAD"):
        env.pop(name, None)
    return env


def test_a_fresh_process_discovers_the_installed_template_and_trains_with_it(installed: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    shutil.copytree(TEMPLATE / "tests", work / "tests")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(work)],
        cwd=work,
        env=_env(installed),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "found gradnorm nvtrain-gradnorm 0.1.0 ok ['GradNormMonitor'] ['after_optimizer_step']"
    assert Path(lines[1].removeprefix("module ")).is_relative_to(installed)  # the installed copy, not the source
    # the hook fired on each of the three steps, and left its metric as a tensor
    assert [line.split(":")[0] for line in lines if line.startswith("[gradnorm]")] == [
        "[gradnorm] step 1",
        "[gradnorm] step 2",
        "[gradnorm] step 3",
    ]
    assert "steps 3 metric Tensor" in lines
    # the template's own tests pass against the installed copy
    assert lines[-1] == "template tests exit 0", done.stdout
    assert any(line.startswith("3 passed") for line in lines), done.stdout
