"""``nvtrain validate`` and ``train`` import only the plugins a config names: installed ones are read from their
metadata, so a plugin that is merely installed (a slow one, a broken one) runs no code."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvtrain.app import EXIT_USAGE
from nvtrain.app.hook_stack import build_hooks
from nvtrain.cli import main
from nvtrain.config import ConfigError, load_config
from tests.fake_plugin_site import FakePluginSite, write_job

#: A plugin whose import leaves a mark in ``{marker}`` and then fails.
MARKING = """
    from pathlib import Path

    Path({marker!r}).write_text("imported")
    raise RuntimeError("this plugin must not be imported")
"""

QUIET = """
    import nvtrain


    class Quiet:
        @nvtrain.hookimpl
        def after_batch(self, ctx):
            pass


    __nvtrain_hooks__ = (Quiet,)
"""


@pytest.fixture
def marker(site: FakePluginSite, tmp_path: Path) -> Path:
    """Installs ``nvtrain-marking`` (entry point ``marking``), whose import writes the returned file."""
    path = tmp_path / "imported.txt"
    site.install("nvtrain-marking", {"marking": site.module("marking", MARKING.format(marker=str(path)))})
    return path


def test_validate_without_hooks_imports_no_plugin(marker: Path, tmp_path: Path) -> None:
    assert main(["validate", str(write_job(tmp_path)), "--set", "hooks=[]", "--no-batch-check"]) == 0
    assert not marker.exists()


def test_a_config_naming_another_plugin_imports_only_that_one(
    site: FakePluginSite, marker: Path, tmp_path: Path
) -> None:
    module = site.module("quiet", QUIET)
    site.install("nvtrain-quiet", {"quiet": module})
    (hook,) = build_hooks(load_config(write_job(tmp_path), ["hooks=[quiet]"]), [tmp_path])
    assert type(hook).__module__ == module
    assert not marker.exists()


def test_an_unknown_hook_lists_the_installed_plugins_from_metadata(marker: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        build_hooks(load_config(write_job(tmp_path), ["hooks=[markin]"]), [tmp_path])
    assert caught.value.path == ("hooks", 0, "name")
    assert "unknown hook 'markin'; did you mean 'marking'?" in caught.value.problem
    assert not marker.exists()


def test_naming_the_plugin_imports_it_and_reports_its_failure(
    marker: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", str(write_job(tmp_path)), "--set", "hooks=[marking]"]) == EXIT_USAGE
    assert marker.read_text() == "imported"
    assert "RuntimeError: this plugin must not be imported" in capsys.readouterr().err


def test_bench_imports_only_the_plugins_its_hooks_name(
    site: FakePluginSite, marker: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = site.module("quiet", QUIET)
    site.install("nvtrain-quiet", {"quiet": module})
    assert main(["bench", "dispatch", "--hooks", "clip,quiet", "--steps", "3", "--rounds", "1"]) == 0, capsys.readouterr()
    assert not marker.exists()
