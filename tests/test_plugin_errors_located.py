"""A plugin hook that fails to build is one located line: a failing constructor names the plugin's distribution,
and a refusal by attrs' own validators is its message, placed at the setting's key."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvtrain.app import EXIT_USAGE
from nvtrain.app.hook_stack import build_hooks
from nvtrain.cli import main
from nvtrain.config import ConfigError, load_config
from tests.fake_plugin_site import FakePluginSite, write_job

BADCTOR = """
    import nvtrain


    class BadCtor:
        def __init__(self, path="x"):
            raise RuntimeError("cannot open device file")

        @nvtrain.hookimpl
        def after_batch(self, ctx):
            pass


    __nvtrain_hooks__ = (BadCtor,)
"""

STRICT = """
    import attrs

    import nvtrain
    from attrs import validators


    @attrs.define(eq=False)
    class Strict:
        tag: str = attrs.field(default="sc", validator=validators.instance_of(str))
        mode: str = attrs.field(default="min", validator=validators.in_(("min", "max")))
        every: int = attrs.field(default=1, validator=validators.ge(1))
        _limit: int = attrs.field(default=5, validator=validators.optional(validators.instance_of(int)))
        names: list = attrs.field(factory=list, validator=validators.max_len(2))
        on_step: object = attrs.field(default=print, validator=validators.is_callable())

        @nvtrain.hookimpl
        def after_batch(self, ctx):
            pass


    __nvtrain_hooks__ = (Strict,)
"""


def test_a_failing_constructor_names_the_plugins_distribution(
    site: FakePluginSite, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    site.install("nvtrain-badctor", {"badctor": site.module("badctor", BADCTOR)}, version="0.3.0")
    override = "hooks=[badctor]"
    assert main(["validate", str(write_job(tmp_path)), "--set", override]) == EXIT_USAGE
    assert capsys.readouterr().err == (
        f"nvtrain validate: error: --set {override}: hooks[0]: hook 'badctor' (nvtrain-badctor 0.3.0): "
        "building it raised RuntimeError: cannot open device file\n"
    )


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("tag", "3", "'tag' must be <class 'str'> (got 3 that is a <class 'int'>)."),
        ("mode", "mean", "'mode' must be in ('min', 'max') (got 'mean')"),
        ("every", "0", "'every' must be >= 1: 0"),
        ("limit", "x", "'_limit' must be <class 'int'> (got 'x' that is a <class 'str'>)."),
        ("names", "[a, b, c]", "Length of 'names' must be <= 2: 3"),
        ("on_step", "3", "'on_step' must be callable (got 3 that is a <class 'int'>)."),
    ],
)
def test_attrs_validators_are_their_message_at_the_settings_key(
    site: FakePluginSite, tmp_path: Path, setting: str, value: str, message: str
) -> None:
    site.install("nvtrain-strict", {"strict": site.module("strict", STRICT)})
    loaded = load_config(write_job(tmp_path), [f"hooks=[{{name: strict, {setting}: {value}}}]"])
    with pytest.raises(ConfigError) as caught:
        build_hooks(loaded, [tmp_path])
    assert (caught.value.path, caught.value.problem) == (("hooks", 0, setting), f"hook 'strict': {message}")
