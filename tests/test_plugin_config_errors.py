"""A hook a config names that the strategy would refuse, or whose constructor fails, is one
located line with exit status 2, from ``nvtrain validate`` and ``nvtrain train`` alike."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from nvtrain.app import EXIT_USAGE, prepare
from nvtrain.cli import main
from nvtrain.config import ConfigError, load_config

HOOKS = """\
import nvtrain


class WrongArgHook:
    @nvtrain.hookimpl
    def before_batch(self, context):
        pass


class KwOnlyHook:
    @nvtrain.hookimpl
    def after_batch(self, *, ctx):
        pass


class OptionalTypoHook:
    @nvtrain.hookimpl(optionalhook=True)
    def after_bach(self, ctx):
        pass


class RaisesHook:
    def __init__(self, path="x"):
        raise RuntimeError("cannot open device file")
"""

MODULE = "plugin_config_error_hooks"


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small digits job whose second hook comes from a module beside it; returns the config path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{MODULE}.py").write_text(HOOKS, encoding="utf-8")
    config = tmp_path / "job.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            output_dir: {tmp_path / "out"}
            device: cpu
            model: {{factory: nvtrain.builtin.digits:make_classifier, kwargs: {{hidden: 16, depth: 1}}}}
            data: {{factory: nvtrain.builtin.digits:make_loaders, kwargs: {{batch_size: 64}}}}
            trainer: {{max_steps: 2}}
            logging: {{tensorboard: false, plot: false, progress_bar: false, csv: false}}
            """
        ),
        encoding="utf-8",
    )
    return config


def _hooks(name: str) -> str:
    return f"hooks=[{{name: clip, max_norm: 1.0}}, {{name: '{MODULE}:{name}'}}]"


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        ("WrongArgHook", "plugin WrongArgHook: before_batch(context) cannot be called as stage 'before_batch'"),
        ("KwOnlyHook", "plugin KwOnlyHook: after_batch(*, ctx) cannot be called as stage 'after_batch'"),
        ("OptionalTypoHook", "plugin OptionalTypoHook: unknown hook 'after_bach' is not a stage"),
        ("RaisesHook", "building it raised RuntimeError: cannot open device file"),
    ],
)
@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_refused_or_failing_hook_is_one_line_at_its_index(
    job: Path, capsys: pytest.CaptureFixture[str], command: str, hook: str, message: str
) -> None:
    override = _hooks(hook)
    assert main([command, str(job), "--set", override]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"nvtrain {command}: error: --set {override}: hooks[1]: hook '{MODULE}:{hook}': "), err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (job.parent / "out").exists()


def test_a_failing_constructor_keeps_its_error_as_the_cause(job: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        prepare(load_config(str(job), [_hooks("RaisesHook")]), world_size=1)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert str(caught.value.__cause__) == "cannot open device file"
