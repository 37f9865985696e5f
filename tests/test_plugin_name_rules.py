"""Names a plugin may not quietly take: a built-in hook's name (refused as ambiguous by configs and ``load()``
alike, and flagged by ``nvtrain plugins``), an entry point naming a class instead of a module, and a hook
setting called ``name``, which a config entry cannot give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import nvtrain.plugins
from nvtrain.app import EXIT_USAGE
from nvtrain.app.hook_stack import build_hooks
from nvtrain.cli import main
from nvtrain.config import ConfigError, load_config
from nvtrain.hooks import GradientClippingHook
from nvtrain.plugins import PluginLoadError, PluginNameError, PluginStatus
from tests.fake_plugin_site import FakePluginSite, write_job

MYCLIP = """
    import nvtrain


    class MyClip:
        plugin_name = "clip"

        def __init__(self, max_norm=1.0):
            self.max_norm = max_norm

        @nvtrain.hookimpl
        def after_batch(self, ctx):
            pass


    __nvtrain_hooks__ = (MyClip,)
"""

EPCLASS = """
    import nvtrain


    class EpClass:
        @nvtrain.hookimpl
        def after_batch(self, ctx):
            pass


    __nvtrain_hooks__ = (EpClass,)
"""

NAMED = """
    import nvtrain


    class Named:
        def __init__(self, name, every=1):
            self.name, self.every = name, every

        @nvtrain.hookimpl
        def after_batch(self, ctx):
            pass


    __nvtrain_hooks__ = (Named,)
"""

AMBIGUOUS = (
    "the name 'clip' is both plugin 'clip' (nvtrain-myclip 0.4.0) and nvtrain's built-in hook GradientClippingHook; "
    "pick one: clip:MyClip for the plugin's hook, nvtrain.hooks:GradientClippingHook for the built-in "
    "(in code: nvtrain.hooks.GradientClippingHook(...))"
)


@pytest.fixture
def myclip(site: FakePluginSite) -> str:
    """Installs ``nvtrain-myclip 0.4.0``, whose entry point is named ``clip`` like the built-in; returns its module."""
    module = site.module("myclip", MYCLIP)
    site.install("nvtrain-myclip", {"clip": module}, version="0.4.0")
    return module


def _hooks(tmp_path: Path, override: str) -> list[object]:
    loaded = load_config(write_job(tmp_path), [override])
    return build_hooks(loaded, [tmp_path])


# -- a plugin named like a built-in hook --------------------------------------------------------


def test_a_config_naming_a_built_in_that_a_plugin_shadows_is_refused_naming_both(
    myclip: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    override = "hooks=[{name: clip, max_norm: 2.0}]"
    assert main(["validate", str(write_job(tmp_path)), "--set", override]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == f"nvtrain validate: error: --set {override}: hooks[0]: {AMBIGUOUS}\n"


def test_name_colon_class_builds_the_plugin_and_the_import_path_the_built_in(myclip: str, tmp_path: Path) -> None:
    plugin, builtin = _hooks(
        tmp_path,
        "hooks=[{name: 'clip:MyClip', max_norm: 2.0}, {name: 'nvtrain.hooks:GradientClippingHook', max_norm: 1.0}]",
    )
    assert (type(plugin).__module__, type(plugin).__name__, plugin.max_norm) == (myclip, "MyClip", 2.0)
    assert type(builtin) is GradientClippingHook and builtin.max_norm == 1.0


def test_load_and_hook_class_refuse_the_bare_name_as_the_config_does(myclip: str) -> None:
    for refused in (lambda: nvtrain.plugins.load("clip", max_norm=2.0), lambda: nvtrain.plugins.hook_class("clip")):
        with pytest.raises(PluginNameError) as caught:
            refused()
        assert str(caught.value) == AMBIGUOUS
    hook = nvtrain.plugins.load("clip:MyClip", max_norm=2.0)
    assert (type(hook).__module__, hook.max_norm) == (myclip, 2.0)


def test_a_plugin_the_allow_list_hides_leaves_the_name_to_the_built_in(
    myclip: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(nvtrain.plugins.ALLOW_LIST_ENV, "ema")
    (hook,) = _hooks(tmp_path, "hooks=[{name: clip, max_norm: 2.0}]")
    assert type(hook) is GradientClippingHook and hook.max_norm == 2.0


def test_the_listing_flags_the_shadowing_plugin(
    myclip: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(nvtrain.plugins.ALLOW_LIST_ENV, "clip")  # list only it: no other plugin is imported
    note = "name collides with built-in hook GradientClippingHook: a bare 'clip' is refused, write clip:MyClip"
    (info,) = [info for info in nvtrain.plugins.available() if info.name == "clip"]
    assert (info.status, info.note) == (PluginStatus.OK, note)
    assert main(["plugins", "--json"]) == 0
    (listed,) = [entry for entry in json.loads(capsys.readouterr().out) if entry["name"] == "clip"]
    assert (listed["status"], listed["note"]) == ("ok", note)
    assert main(["plugins"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("clip ")]
    assert row.endswith(f"ok ({note})")


def test_the_listing_flags_it_from_metadata_when_autoload_is_off(myclip: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nvtrain.plugins.DISABLE_AUTOLOAD_ENV, "1")
    (info,) = [info for info in nvtrain.plugins.available() if info.name == "clip"]
    assert info.status is PluginStatus.NOT_LOADED
    assert info.note == (
        "name collides with built-in hook GradientClippingHook: a bare 'clip' is refused, write clip:ClassName"
    )


def test_other_plugins_carry_no_note(site: FakePluginSite) -> None:
    site.install("nvtrain-epok", {"epok": site.module("epok", EPCLASS)})
    (info,) = [info for info in nvtrain.plugins.available() if info.name == "epok"]
    assert (info.status, info.note, info.to_dict()["note"]) == (PluginStatus.OK, None, None)


# -- an entry point naming a class ------------------------------------------------------------


def test_an_entry_point_naming_a_class_says_to_name_the_module(site: FakePluginSite) -> None:
    module = site.module("epclass", EPCLASS)
    site.install("nvtrain-epclass", {"epclass": f"{module}:EpClass"}, version="0.3.0")
    expected = (
        "the entry point names class EpClass, not a module; point it at the module that lists the hook classes "
        f'in __nvtrain_hooks__: epclass = "{module}"'
    )
    (info,) = [info for info in nvtrain.plugins.available() if info.name == "epclass"]
    assert (info.status, info.error) == (PluginStatus.ERROR, expected)
    with pytest.raises(PluginLoadError) as caught:
        nvtrain.plugins.load("epclass")
    assert str(caught.value).startswith(f"plugin 'epclass' (nvtrain-epclass 0.3.0) cannot be used: {expected} (")


# -- a hook setting called `name` -------------------------------------------------------------


def test_a_hook_needing_a_setting_called_name_is_refused_by_a_config(site: FakePluginSite, tmp_path: Path) -> None:
    site.install("nvtrain-named", {"named": site.module("named", NAMED)})
    with pytest.raises(ConfigError) as caught:
        _hooks(tmp_path, "hooks=[{name: named, every: 2}]")
    assert caught.value.path == ("hooks", 0)
    assert caught.value.problem == (
        "hook 'named': Named needs a setting 'name', which a config entry cannot give "
        "(the entry's 'name' is the hook to build); build it in code, passing name=..."
    )
    assert nvtrain.plugins.load("named", name="in code").name == "in code"
