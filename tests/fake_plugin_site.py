"""Installs fake nvtrain plugins for a test: a ``*.dist-info`` folder (METADATA and entry_points.txt) and the
plugin's module in a temporary folder put on ``sys.path``, which ``importlib.metadata`` finds like any installed
distribution. Module names carry a per-test tag, so a module one test imported never answers for another's.
"""

from __future__ import annotations

import itertools
import os
import sys
import textwrap
from pathlib import Path

import pytest

import nvtrain.plugins

_serial = itertools.count()

#: A small digits job on the CPU: the tests add its hooks with ``--set``.
JOB = """\
device: cpu
model: {factory: nvtrain.builtin.digits:make_classifier, kwargs: {hidden: 16, depth: 1}}
data: {factory: nvtrain.builtin.digits:make_loaders, kwargs: {batch_size: 64}}
trainer: {max_steps: 2}
logging: {tensorboard: false, plot: false, progress_bar: false, csv: false}
"""


class FakePluginSite:
    """A folder on ``sys.path`` holding fake distributions; forgets them (and their modules) on :meth:`close`."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.tag = f"{os.getpid()}_{next(_serial)}"
        self.modules: list[str] = []
        root.mkdir()
        monkeypatch.delenv(nvtrain.plugins.ALLOW_LIST_ENV, raising=False)
        monkeypatch.delenv(nvtrain.plugins.DISABLE_AUTOLOAD_ENV, raising=False)
        monkeypatch.syspath_prepend(str(root))
        nvtrain.plugins.refresh()

    def module(self, stem: str, source: str) -> str:
        """Writes module ``source``; returns its (tagged) name."""
        name = f"nvt_site_{self.tag}_{stem}"
        (self.root / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        self.modules.append(name)
        return name

    def install(self, distribution: str, entry_points: dict[str, str], version: str = "0.1.0") -> None:
        """Declares ``distribution`` with ``{entry-point name: value}`` in the group ``nvtrain``."""
        info = self.root / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
        lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        (info / "entry_points.txt").write_text(f"[nvtrain]\n{lines}")
        nvtrain.plugins.refresh()

    def close(self) -> None:
        for name in self.modules:
            sys.modules.pop(name, None)
        nvtrain.plugins.refresh()


def write_job(folder: Path) -> Path:
    """The config of a small CPU job that writes under ``folder/out``; returns its path."""
    config = folder / "job.yaml"
    config.write_text(f"output_dir: {folder / 'out'}\n{JOB}", encoding="utf-8")
    return config
