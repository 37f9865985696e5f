"""nvtrain.plugins: entry-point discovery, loading with settings, env controls, broken plugins,
and the lazy plugin exports of nvtrain.hooks.

Plugins here are fake distributions: a ``*.dist-info`` directory (METADATA and
entry_points.txt) and modules in a temporary directory put on ``sys.path``, which
``importlib.metadata`` discovers like any installed distribution.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import nvtrain
import nvtrain.hooks
import nvtrain.plugins
from nvtrain.plugins import (
    PluginLoadError,
    PluginNotFoundError,
    PluginSettingsError,
    PluginStatus,
)

_serial = itertools.count()

GOOD_SOURCE = """
    from typing import Any, ClassVar

    import attrs

    import nvtrain
    from nvtrain import TrainingStage


    def _decay(instance: Any, attribute: Any, value: Any) -> None:
        if not 0.0 <= value < 1.0:
            raise ValueError(f"FakeUpdateHook.decay must be in [0.0, 1.0) (got {value!r})")


    @attrs.define
    class FakeUpdateHook(nvtrain.TrainingUpdateHook):
        plugin_name: ClassVar[str] = "fake-good"
        stages: ClassVar[frozenset] = frozenset({TrainingStage.DO_BACKWARD, TrainingStage.AFTER_OPTIMIZER_STEP})
        exclusive_key: ClassVar[str] = "fake"
        decay: float = attrs.field(default=0.9, validator=_decay)
        priority: int = 20
        seen: list = attrs.field(factory=list, init=False)

        def __call__(self, ctx, stage, will_skip):
            self.seen.append(stage)
            return True, ctx.loss

        @nvtrain.hookimpl
        def after_batch(self, ctx):
            self.seen.append("after_batch")


    class FakeObserver(nvtrain.Hook):
        plugin_name = "fake-good"
        stages = (TrainingStage.AFTER_BATCH, TrainingStage.BEFORE_TRAINING)
        priority = 70

        def __init__(self, every=1):
            self.every = every

        def __call__(self, ctx, stage):
            return None


    class FakeWrapper:
        plugin_name = "fake-good"

        def __init__(self):
            raise AssertionError("available() must not build hooks")

        @nvtrain.hookimpl(wrapper=True)
        def do_backward(self, ctx):
            return (yield)

        @nvtrain.hookimpl
        def after_loss(self, ctx):
            return None


    class NeedsPath:
        def __init__(self, path, *, verbose=False):
            self.path, self.verbose = path, verbose


    __nvtrain_hooks__ = (FakeUpdateHook, FakeObserver, FakeWrapper, NeedsPath)
"""


class FakeSite:
    """A directory on ``sys.path`` holding fake distributions and their modules."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.tag = f"{os.getpid()}_{next(_serial)}"
        self.modules: list[str] = []
        root.mkdir()
        monkeypatch.syspath_prepend(str(root))

    def module(self, stem: str, source: str) -> str:
        name = f"nvt_fake_{self.tag}_{stem}"
        (self.root / f"{name}.py").write_text(textwrap.dedent(source))
        self.modules.append(name)
        return name

    def dist(self, distribution: str, entry_points: dict[str, str], version: str = "0.1.0") -> None:
        info = self.root / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
        lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        (info / "entry_points.txt").write_text(f"[nvtrain]\n{lines}")
        nvtrain.plugins.refresh()

    def cleanup(self) -> None:
        for name in self.modules:
            sys.modules.pop(name, None)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSite]:
    monkeypatch.delenv(nvtrain.plugins.ALLOW_LIST_ENV, raising=False)
    monkeypatch.delenv(nvtrain.plugins.DISABLE_AUTOLOAD_ENV, raising=False)
    fake = FakeSite(tmp_path / "site", monkeypatch)
    nvtrain.plugins.refresh()
    yield fake
    fake.cleanup()
    nvtrain.plugins.refresh()


@pytest.fixture
def good(site: FakeSite) -> str:
    """Installs ``nvtrain-fake-good 1.2.3`` with the entry point ``fake-good``; returns its module name."""
    module = site.module("good", GOOD_SOURCE)
    site.dist("nvtrain-fake-good", {"fake-good": module}, version="1.2.3")
    return module


def _listed(name: str) -> nvtrain.plugins.PluginInfo:
    matches = [info for info in nvtrain.plugins.available() if info.name == name]
    assert len(matches) == 1, matches
    return matches[0]


# -- available() ---------------------------------------------------------------------------


def test_available_lists_name_distribution_version_and_hook_classes(good: str) -> None:
    info = _listed("fake-good")
    assert info.status is PluginStatus.OK and info.ok and info.error is None
    assert (info.distribution, info.version, info.entry_point) == ("nvtrain-fake-good", "1.2.3", good)
    assert [hook.name for hook in info.hooks] == ["FakeUpdateHook", "FakeObserver", "FakeWrapper", "NeedsPath"]
    assert [hook.default for hook in info.hooks] == [True, False, False, False]
    assert info.hooks[0].qualname == f"{good}:FakeUpdateHook"


def test_update_hook_stages_include_its_observer_methods_and_priority_comes_from_the_attrs_field(good: str) -> None:
    update = _listed("fake-good").hooks[0]
    assert update.kind == "update"
    assert update.stages == ("do_backward", "after_optimizer_step", "after_batch")
    # a slotted attrs class has no class attribute 'priority': the field default is read
    assert update.priority == 20
    assert update.exclusive_key == "fake"
    assert update.settings == ("decay", "priority")
    assert update.wrappers == ()


def test_seed_style_hook_and_pluggy_class_are_described_with_wrappers_marked(good: str) -> None:
    _, observer, wrapper, plain = _listed("fake-good").hooks
    assert (observer.kind, observer.stages, observer.priority) == ("observer", ("before_training", "after_batch"), 70)
    assert observer.exclusive_key is None and observer.settings == ("every",)
    assert (wrapper.kind, wrapper.stages) == ("pluggy", ("after_loss", "do_backward"))
    assert wrapper.wrappers == ("do_backward",)
    assert wrapper.priority == 50  # the default when the class says nothing
    assert (plain.kind, plain.stages, plain.settings) == ("pluggy", (), ("path", "verbose"))


SPECNAME_SOURCE = """
    import nvtrain


    class Renamed:
        @nvtrain.hookimpl(specname="after_batch")
        def log_batch(self, ctx):
            return None

        @nvtrain.hookimpl(specname="do_backward", wrapper=True)
        def time_backward(self, ctx):
            return (yield)


    __nvtrain_hooks__ = (Renamed,)
"""


def test_stages_implemented_through_specname_are_listed(site: FakeSite) -> None:
    site.dist("nvtrain-fake-specname", {"fake-specname": site.module("specname", SPECNAME_SOURCE)})
    (renamed,) = _listed("fake-specname").hooks
    assert (renamed.stages, renamed.wrappers) == (("do_backward", "after_batch"), ("do_backward",))


def test_available_builds_no_hook(good: str) -> None:
    # FakeWrapper.__init__ raises: listing must only read classes
    assert _listed("fake-good").ok


def test_to_dict_is_json_ready(good: str) -> None:
    data = _listed("fake-good").to_dict()
    assert data["status"] == "ok" and type(data["status"]) is str
    assert data["hooks"][0]["stages"] == ["do_backward", "after_optimizer_step", "after_batch"]
    assert data["hooks"][2]["wrappers"] == ["do_backward"]


# -- load() -------------------------------------------------------------------------------


def test_load_builds_the_default_class_with_settings_and_it_runs(good: str, make_strategy, batches) -> None:
    hook = nvtrain.plugins.load("fake-good", decay=0.5)
    assert type(hook).__name__ == "FakeUpdateHook" and type(hook).__module__ == good
    assert (hook.decay, hook.priority) == (0.5, 20)
    strategy = make_strategy([hook])
    with strategy:
        strategy.run(batches(2))
    assert hook.seen.count(nvtrain.TrainingStage.DO_BACKWARD) == 2
    assert hook.seen.count("after_batch") == 2


def test_load_name_colon_class_picks_another_class(good: str) -> None:
    observer = nvtrain.plugins.load("fake-good:FakeObserver", every=3)
    assert (type(observer).__name__, observer.every) == ("FakeObserver", 3)
    assert nvtrain.plugins.hook_class("fake-good:NeedsPath").__name__ == "NeedsPath"
    with pytest.raises(PluginNotFoundError, match=r"no hook class 'FakeObserve'; did you mean 'FakeObserver'\?"):
        nvtrain.plugins.load("fake-good:FakeObserve")


def test_unknown_setting_names_the_accepted_ones_and_the_closest(good: str) -> None:
    with pytest.raises(PluginSettingsError) as caught:
        nvtrain.plugins.load("fake-good", decya=0.5)
    message = str(caught.value)
    assert "plugin 'fake-good' (nvtrain-fake-good 1.2.3)" in message
    assert "FakeUpdateHook has no setting 'decya' (did you mean 'decay'?)" in message
    assert message.endswith("FakeUpdateHook accepts: decay, priority")
    assert isinstance(caught.value, TypeError)
    # a non-attrs class: its constructor signature says what it accepts
    with pytest.raises(PluginSettingsError, match=r"NeedsPath has no setting 'verbos' \(did you mean 'verbose'\?\)"):
        nvtrain.plugins.load("fake-good:NeedsPath", path="x", verbos=True)


def test_missing_required_setting_is_named(good: str) -> None:
    with pytest.raises(PluginSettingsError, match=r"NeedsPath needs the setting\(s\) 'path'"):
        nvtrain.plugins.load("fake-good:NeedsPath")
    assert nvtrain.plugins.load("fake-good:NeedsPath", path="p", verbose=True).verbose is True


def test_setting_values_are_checked_by_the_class_validators(good: str) -> None:
    with pytest.raises(ValueError, match=r"FakeUpdateHook.decay must be in \[0.0, 1.0\) \(got 1.5\)") as caught:
        nvtrain.plugins.load("fake-good", decay=1.5)
    assert any("plugin 'fake-good'" in note for note in getattr(caught.value, "__notes__", []))


def test_load_all_builds_one_hook_per_config_entry(good: str) -> None:
    hooks = nvtrain.plugins.load_all({"fake-good": {"decay": 0.25}, "fake-good:FakeObserver": None})
    assert [type(h).__name__ for h in hooks] == ["FakeUpdateHook", "FakeObserver"]
    assert hooks[0].decay == 0.25


def test_unknown_plugin_suggests_the_closest_name(good: str) -> None:
    with pytest.raises(PluginNotFoundError, match=r"no plugin named 'fake-god'.*did you mean 'fake-good'\?"):
        nvtrain.plugins.load("fake-god")


# -- broken plugins ---------------------------------------------------------------------------


@pytest.fixture
def broken(site: FakeSite, good: str) -> dict[str, str]:
    """Five broken entry points in ``nvtrain-fake-broken 0.2``, beside the good plugin."""
    raises = site.module("raises", "raise RuntimeError('boom at import')\n")
    no_hooks = site.module("nohooks", "VALUE = 1\n")
    empty = site.module("empty", "__nvtrain_hooks__ = ()\n")
    entry_points = {
        "fake-raises": raises,
        "fake-missing-module": f"nvt_fake_{site.tag}_does_not_exist",
        "fake-missing-attr": f"{good}:NotThere",
        "fake-no-hooks": no_hooks,
        "fake-empty-hooks": empty,
    }
    site.dist("nvtrain-fake-broken", entry_points, version="0.2")
    return entry_points


def test_broken_plugins_are_reported_and_the_others_still_listed(broken: dict[str, str]) -> None:
    infos = {info.name: info for info in nvtrain.plugins.available()}
    assert infos["fake-good"].ok
    for name in broken:
        info = infos[name]
        assert info.status is PluginStatus.ERROR and info.hooks == (), name
        assert (info.distribution, info.version) == ("nvtrain-fake-broken", "0.2")
    assert infos["fake-raises"].error == "RuntimeError: boom at import"
    assert infos["fake-missing-module"].error.startswith("ModuleNotFoundError: No module named")
    assert infos["fake-missing-attr"].error.startswith("AttributeError:")
    assert "does not declare __nvtrain_hooks__" in infos["fake-no-hooks"].error
    assert "declares __nvtrain_hooks__ = ()" in infos["fake-empty-hooks"].error


def test_a_plugin_exiting_at_import_is_reported_as_broken_and_hides_nothing(
    site: FakeSite, good: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from nvtrain.cli import main

    exiter = site.module("exiter", "import sys\nsys.exit('plugin refuses')\n")
    site.dist("nvtrain-fake-exiter", {"fake-exiter": exiter})
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "fake-good" in out and "error: SystemExit: plugin refuses" in out
    with pytest.raises(PluginLoadError, match=r"plugin 'fake-exiter' .*cannot be used: SystemExit: plugin refuses"):
        nvtrain.plugins.load("fake-exiter")


def test_loading_a_broken_plugin_raises_plugin_load_error_with_the_cause(broken: dict[str, str]) -> None:
    with pytest.raises(PluginLoadError) as caught:
        nvtrain.plugins.load("fake-raises")
    err = caught.value
    assert isinstance(err, ImportError)
    assert (err.plugin, err.distribution) == ("fake-raises", "nvtrain-fake-broken")
    assert err.error == "RuntimeError: boom at import"
    assert str(err).startswith("plugin 'fake-raises' (nvtrain-fake-broken 0.2) cannot be used: RuntimeError: boom")
    assert isinstance(err.__cause__, RuntimeError)
    with pytest.raises(PluginLoadError, match=r"plugin 'fake-missing-module' .*ModuleNotFoundError"):
        nvtrain.plugins.load("fake-missing-module")
    with pytest.raises(PluginLoadError, match=r"plugin 'fake-no-hooks' .*does not declare __nvtrain_hooks__"):
        nvtrain.plugins.load("fake-no-hooks")


def test_a_failed_import_is_cached_until_refresh(site: FakeSite) -> None:
    counter = site.root / "imports.txt"
    module = site.module("counted", f"open({str(counter)!r}, 'a').write('x')\nraise RuntimeError('boom')\n")
    site.dist("nvtrain-fake-counted", {"fake-counted": module})
    for _ in range(2):
        assert _listed("fake-counted").status is PluginStatus.ERROR
        with pytest.raises(PluginLoadError):
            nvtrain.plugins.load("fake-counted")
    assert counter.read_text() == "x"
    nvtrain.plugins.refresh()
    assert _listed("fake-counted").status is PluginStatus.ERROR
    assert counter.read_text() == "xx"


def test_the_entry_point_scan_is_cached_until_refresh(site: FakeSite, good: str) -> None:
    assert _listed("fake-good").ok
    module = site.module("late", "__nvtrain_hooks__ = (object,)\n")
    info = site.root / "nvtrain_fake_late-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvtrain-fake-late\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[nvtrain]\nfake-late = {module}\n")
    assert "fake-late" not in {i.name for i in nvtrain.plugins.available()}
    nvtrain.plugins.refresh()
    assert _listed("fake-late").ok


def test_two_distributions_claiming_one_name_conflict(site: FakeSite, good: str) -> None:
    site.dist("nvtrain-fake-rival", {"fake-good": good})
    infos = [info for info in nvtrain.plugins.available() if info.name == "fake-good"]
    assert sorted(info.distribution for info in infos) == ["nvtrain-fake-good", "nvtrain-fake-rival"]
    assert all(info.status is PluginStatus.ERROR for info in infos)
    assert "also declared by nvtrain-fake-rival" in infos[0].error
    with pytest.raises(PluginLoadError, match=r"'fake-good' is also declared by"):
        nvtrain.plugins.load("fake-good")


# -- environment controls -------------------------------------------------------------------


def test_allow_list_hides_other_plugins_and_reports_missing_names(
    broken: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NVTRAIN_PLUGINS", " fake-good , fake-not-installed ")
    infos = {info.name: info for info in nvtrain.plugins.available()}
    assert set(infos) == {"fake-good", "fake-not-installed"}
    assert infos["fake-good"].ok
    missing = infos["fake-not-installed"]
    assert (missing.status, missing.distribution) == (PluginStatus.MISSING, None)
    assert "NVTRAIN_PLUGINS" in missing.error
    with pytest.raises(
        PluginNotFoundError,
        match=r"plugin 'fake-raises' is installed \(nvtrain-fake-broken 0.2\) "
        r"but not listed in NVTRAIN_PLUGINS=fake-good,fake-not-installed",
    ):
        nvtrain.plugins.load("fake-raises")
    assert nvtrain.plugins.load("fake-good").decay == 0.9


def test_empty_allow_list_allows_nothing(good: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVTRAIN_PLUGINS", "")
    assert nvtrain.plugins.available() == []
    with pytest.raises(PluginNotFoundError, match="NVTRAIN_PLUGINS"):
        nvtrain.plugins.load("fake-good")


def test_disabled_autoload_lists_metadata_without_importing(
    broken: dict[str, str], good: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NVTRAIN_DISABLE_PLUGIN_AUTOLOAD", "1")
    infos = {info.name: info for info in nvtrain.plugins.available()}
    for name in ["fake-good", *broken]:
        assert infos[name].status is PluginStatus.NOT_LOADED and infos[name].hooks == ()
    assert infos["fake-good"].version == "1.2.3"
    assert good not in sys.modules
    # naming a plugin is explicit activation: load() works, and the listing then shows it
    assert nvtrain.plugins.load("fake-good", decay=0.1).decay == 0.1
    assert good in sys.modules
    assert _listed("fake-good").ok
    assert _listed("fake-raises").status is PluginStatus.NOT_LOADED


@pytest.mark.parametrize("value", ["0", "false", "no", ""])
def test_autoload_stays_on_for_false_values(good: str, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NVTRAIN_DISABLE_PLUGIN_AUTOLOAD", value)
    assert _listed("fake-good").ok


# -- nvtrain.hooks exports ------------------------------------------------------------------


def test_shipped_hook_classes_map_to_their_distributions() -> None:
    assert nvtrain.hooks.PLUGIN_HOOK_CLASSES == {
        "MixedPrecisionHook": ("nvtrain-amp", "nvtrain_amp"),
        "EMAHook": ("nvtrain-ema", "nvtrain_ema"),
        "TorchProfilerHook": ("nvtrain-profiler", "nvtrain_profiler"),
        "CheckpointHook": ("nvtrain-checkpoint", "nvtrain_checkpoint"),
        "DDPHook": ("nvtrain-ddp", "nvtrain_ddp"),
        "FSDPHook": ("nvtrain-fsdp", "nvtrain_fsdp"),
    }


def test_a_known_class_whose_distribution_is_missing_names_what_to_install(
    site: FakeSite, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(nvtrain.hooks.PLUGIN_HOOK_CLASSES, "AbsentHook", ("nvtrain-absent", "nvtrain_absent"))
    expected = (
        r"AbsentHook is provided by the nvtrain-absent distribution \(module nvtrain_absent\), "
        r"which is not installed; install it with: pip install nvtrain-absent"
    )
    with pytest.raises(ImportError, match=expected):
        from nvtrain.hooks import AbsentHook  # noqa: F401


def test_a_known_class_resolves_from_its_distribution(good: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(nvtrain.hooks.PLUGIN_HOOK_CLASSES, "FakeObserver", ("nvtrain_fake.good", good))
    from nvtrain.hooks import FakeObserver

    assert FakeObserver is nvtrain.plugins.hook_class("fake-good:FakeObserver")
    monkeypatch.setenv("NVTRAIN_PLUGINS", "other")
    with pytest.raises(ImportError, match=r"NVTRAIN_PLUGINS=other does not list; add 'fake-good' there to use FakeObserver"):
        nvtrain.hooks.FakeObserver  # noqa: B018


def test_a_third_party_class_the_allow_list_hides_names_the_variable(
    good: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NVTRAIN_PLUGINS", "other")
    expected = (
        r"FakeObserver is provided by plugin 'fake-good' \(nvtrain-fake-good 1.2.3\), "
        r"which NVTRAIN_PLUGINS=other does not list; add 'fake-good' there"
    )
    with pytest.raises(ImportError, match=expected):
        from nvtrain.hooks import FakeObserver  # noqa: F401
    with pytest.raises(ImportError, match="cannot import name 'NoSuchHook'"):
        from nvtrain.hooks import NoSuchHook  # noqa: F401


def test_any_installed_plugin_class_is_exported_lazily(good: str) -> None:
    from nvtrain.hooks import FakeUpdateHook

    assert FakeUpdateHook is nvtrain.plugins.hook_class("fake-good")
    with pytest.raises(ImportError, match="cannot import name 'NoSuchHook'"):
        from nvtrain.hooks import NoSuchHook  # noqa: F401


def test_only_class_like_names_are_looked_up_among_plugins(broken: dict[str, str], good: str) -> None:
    # lower-case names (submodules, dunders) must not import plugins to answer
    for name in ("__wrapped__", "_private", "some_submodule"):
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'$"):
            getattr(nvtrain.hooks, name)
    assert good not in sys.modules
    with pytest.raises(AttributeError, match="failed to load"):
        nvtrain.hooks.SomeHook  # noqa: B018
    assert good in sys.modules


def test_a_missing_export_mentions_plugins_that_failed_to_load(broken: dict[str, str]) -> None:
    with pytest.raises(AttributeError, match=r"plugin 'fake-raises' \(nvtrain-fake-broken 0.2\): RuntimeError: boom"):
        nvtrain.hooks.NoSuchHook  # noqa: B018


def test_a_known_class_from_a_broken_plugin_raises_plugin_load_error(
    broken: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(nvtrain.hooks.PLUGIN_HOOK_CLASSES, "RaisingHook", ("nvtrain-fake-broken", "x"))
    with pytest.raises(PluginLoadError, match=r"plugin '.*' \(nvtrain-fake-broken 0.2\) cannot be used"):
        nvtrain.hooks.RaisingHook  # noqa: B018


def test_a_class_name_two_plugins_provide_is_ambiguous(site: FakeSite, good: str) -> None:
    site.dist("nvtrain-fake-twin", {"fake-twin": good})
    with pytest.raises(ImportError, match=r"FakeObserver is provided by several plugins"):
        nvtrain.hooks.FakeObserver  # noqa: B018


def test_subpackages_and_plugin_classes_are_reachable_after_a_plain_import_nvtrain() -> None:
    """The docs write ``import nvtrain; nvtrain.plugins.load(...)``: the subpackage loads on first use, not before."""
    code = (
        "import sys, nvtrain\n"
        "assert 'nvtrain.plugins' not in sys.modules\n"
        "assert callable(nvtrain.plugins.load) and nvtrain.hooks.GradientClippingHook\n"
        "from nvtrain.hooks import CheckpointableHook, Hook, TrainingUpdateHook\n"
        "assert TrainingUpdateHook is nvtrain.TrainingUpdateHook and Hook is nvtrain.Hook\n"
        "assert CheckpointableHook is nvtrain.CheckpointableHook\n"
        "from nvtrain import CheckpointHook\n"  # a shipped plugin's class, as the reference imports it
        "assert CheckpointHook is nvtrain.hooks.CheckpointHook\n"
        "try:\n"
        "    nvtrain.no_such_name\n"
        "except AttributeError as err:\n"
        "    assert 'no_such_name' in str(err)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_plugin_template_declares_the_floors_of_docs_install_md() -> None:
    """A plugin started from the template must not claim a Python or torch nvtrain does not support."""
    import re
    import tomllib

    root = Path(__file__).resolve().parents[1]
    install = (root / "docs" / "install.md").read_text(encoding="utf-8")
    python = re.search(r"^\| Python \| ([\d.]+) \|", install, re.MULTILINE)
    torch_floor = re.search(r"^\| torch \| ([\d.]+) \|", install, re.MULTILINE)
    assert python and torch_floor
    with (root / "examples" / "plugin-template" / "pyproject.toml").open("rb") as file:
        project = tomllib.load(file)["project"]
    assert project["requires-python"] == f">={python.group(1)}"
    declared = {re.split(r"[<>=!~ ]", dep, maxsplit=1)[0]: dep for dep in project["dependencies"]}
    floor = re.sub(r"(\.0)+$", "", torch_floor.group(1))  # 2.13.0 and 2.13 are the same floor
    assert re.sub(r"(\.0)+$", "", declared["torch"].removeprefix("torch>=")) == floor
