"""The ``nvtrain`` command: ``nvtrain plugins`` (table and --json), ``python -m nvtrain``,
the console script, and the subcommand registry."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nvtrain.plugins
from nvtrain import cli

PLUGIN_SOURCE = """
    from typing import ClassVar

    import attrs

    import nvtrain
    from nvtrain import TrainingStage


    @attrs.define
    class TableUpdateHook(nvtrain.TrainingUpdateHook):
        plugin_name: ClassVar[str] = "cli-good"
        stages: ClassVar[frozenset] = frozenset({TrainingStage.DO_BACKWARD})
        priority: int = 20


    class TableWrapper:
        @nvtrain.hookimpl(wrapper=True)
        def do_optimizer_step(self, ctx):
            return (yield)


    __nvtrain_hooks__ = (TableUpdateHook, TableWrapper)
"""


@pytest.fixture
def fake_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Puts ``nvtrain-cli-good 3.1`` (entry point cli-good) and ``nvtrain-cli-broken 0.9`` on sys.path."""
    monkeypatch.delenv(nvtrain.plugins.ALLOW_LIST_ENV, raising=False)
    monkeypatch.delenv(nvtrain.plugins.DISABLE_AUTOLOAD_ENV, raising=False)
    tag = f"nvt_cli_{os.getpid()}_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{tag}_good.py").write_text(textwrap.dedent(PLUGIN_SOURCE))
    (tmp_path / f"{tag}_broken.py").write_text("raise RuntimeError('cannot start')\n")
    for dist, version, name, module in [
        ("nvtrain-cli-good", "3.1", "cli-good", f"{tag}_good"),
        ("nvtrain-cli-broken", "0.9", "cli-broken", f"{tag}_broken"),
    ]:
        info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[nvtrain]\n{name} = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    nvtrain.plugins.refresh()
    yield tmp_path
    sys.modules.pop(f"{tag}_good", None)
    nvtrain.plugins.refresh()


def _table(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    assert cli.main(["plugins", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_table_has_the_columns_and_one_row_per_hook_class(
    fake_plugins: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _table(capsys)
    assert lines[0].split() == ["name", "distribution", "version", "hooks", "stages", "priority", "status"]
    assert set(lines[1]) == {"-", " "}
    good = lines.index(next(line for line in lines if line.startswith("cli-good ")))
    assert lines[good].split() == [
        "cli-good",
        "nvtrain-cli-good",
        "3.1",
        "TableUpdateHook",
        "(default)",
        "do_backward",
        "20",
        "ok",
    ]
    # the second class: plugin columns left blank, the wrapper marked
    assert lines[good + 1].split() == ["TableWrapper", "do_optimizer_step", "(wrapper)", "50"]
    hooks_column = lines[0].index("hooks")
    assert lines[good + 1].index("TableWrapper") == hooks_column


def test_a_broken_plugin_row_shows_its_error(fake_plugins: Path, capsys: pytest.CaptureFixture[str]) -> None:
    row = next(line for line in _table(capsys) if line.startswith("cli-broken "))
    assert row.split()[:3] == ["cli-broken", "nvtrain-cli-broken", "0.9"]
    assert row.endswith("error: RuntimeError: cannot start")


def test_json_lists_every_plugin(fake_plugins: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads("\n".join(_table(capsys, "--json")))
    by_name = {entry["name"]: entry for entry in data}
    good = by_name["cli-good"]
    assert (good["distribution"], good["version"]) == ("nvtrain-cli-good", "3.1")
    assert (good["status"], good["error"]) == ("ok", None)
    assert [(h["name"], h["stages"], h["wrappers"], h["priority"]) for h in good["hooks"]] == [
        ("TableUpdateHook", ["do_backward"], [], 20),
        ("TableWrapper", ["do_optimizer_step"], ["do_optimizer_step"], 50),
    ]
    assert (by_name["cli-broken"]["status"], by_name["cli-broken"]["error"]) == ("error", "RuntimeError: cannot start")


def test_environment_controls_are_reported_under_the_table(
    fake_plugins: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NVTRAIN_PLUGINS", "cli-good,cli-absent")
    monkeypatch.setenv("NVTRAIN_DISABLE_PLUGIN_AUTOLOAD", "1")
    lines = _table(capsys)
    rows = {line.split()[0]: line for line in lines[2:] if line and not line.startswith("NVTRAIN_")}
    assert set(rows) == {"cli-good", "cli-absent"}
    assert rows["cli-good"].endswith("not loaded")
    assert "missing: named in NVTRAIN_PLUGINS but not installed" in rows["cli-absent"]
    assert "NVTRAIN_PLUGINS=cli-good,cli-absent: other installed plugins are hidden." in lines
    assert any(line.startswith("NVTRAIN_DISABLE_PLUGIN_AUTOLOAD is set") for line in lines)


def test_no_plugins_says_so(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVTRAIN_PLUGINS", raising=False)
    monkeypatch.setattr(nvtrain.plugins.REGISTRY, "records", lambda: ())  # nothing installed
    assert _table(capsys) == ["No nvtrain plugins installed (entry-point group 'nvtrain')."]
    assert json.loads("\n".join(_table(capsys, "--json"))) == []


def test_an_empty_allow_list_says_it_hides_the_installed_plugins(
    fake_plugins: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NVTRAIN_PLUGINS", "")
    lines = _table(capsys)
    assert lines[0].startswith("No nvtrain plugin is visible: NVTRAIN_PLUGINS is set but empty, which hides every ")
    assert "cli-broken" in lines[0] and "cli-good" in lines[0]
    assert not any("No nvtrain plugins installed" in line for line in lines)
    assert json.loads("\n".join(_table(capsys, "--json"))) == []


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: nvtrain")
    assert "list installed plugins" in err


def test_subcommands_come_from_the_registry(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = types.ModuleType("nvtrain_test_echo_command")
    module.HELP = "echo a word"
    module.add_arguments = lambda parser: parser.add_argument("word")
    module.run = lambda args: print(f"echo {args.word}") or 3
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli.COMMANDS, "echo", module.__name__)
    assert cli.main(["echo", "hi"]) == 3
    assert capsys.readouterr().out == "echo hi\n"
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "echo a word" in capsys.readouterr().out


def test_a_malformed_subcommand_module_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("nvtrain_test_bad_command")
    module.HELP = "no run"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli.COMMANDS, "bad", module.__name__)
    expected = r"subcommand 'bad': module nvtrain_test_bad_command does not define add_arguments"
    with pytest.raises(TypeError, match=expected):
        cli.build_parser()


def test_console_script_is_declared() -> None:
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert [ep.value for ep in scripts if ep.name == "nvtrain"] == ["nvtrain.cli:main"]


@pytest.mark.slow
def test_python_dash_m_nvtrain_runs_the_command(fake_plugins: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(fake_plugins)}
    env.pop("NVTRAIN_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, "-m", "nvtrain", "plugins", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    names = {entry["name"]: entry["status"] for entry in json.loads(done.stdout)}
    assert (names["cli-good"], names["cli-broken"]) == ("ok", "error")


def test_json_stays_a_document_when_a_plugin_prints_as_it_is_imported(
    site: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    module = site.module("chatty", 'print("hello from a chatty plugin")\n__nvtrain_hooks__ = ()\n')
    site.install("nvtrain-chatty", {"chatty": module})
    assert cli.main(["plugins", "--json"]) == 0
    captured = capsys.readouterr()
    assert "chatty" in [info["name"] for info in json.loads(captured.out)]
    assert "hello from a chatty plugin" in captured.err


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly() -> None:
    """``nvtrain plugins --json | head -c 10``: no traceback, the status a shell gives a process SIGPIPE ended."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: EPIPE at once
    try:
        done = subprocess.run(
            [sys.executable, "-m", "nvtrain", "plugins", "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.returncode == cli.EXIT_BROKEN_PIPE == 141
    assert done.stderr == ""
