"""The README's Python quickstart is examples/quickstart.py, and it runs."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def readme_block() -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(r"## Quickstart: Python\n\n```python\n(.*?)```", readme, re.S)
    assert match is not None, "README.md lost its Python quickstart"
    return match.group(1)


def test_the_example_holds_the_readme_quickstart_as_written() -> None:
    example = (REPO / "examples" / "quickstart.py").read_text(encoding="utf-8")
    between = example.split("# --- README quickstart begins ---\n", 1)[1].split("# --- README quickstart ends ---", 1)[0]
    assert between == readme_block()


def test_the_quickstart_example_runs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("nvtrain_amp")
    pytest.importorskip("nvtrain_ema")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the README's code picks its device: CPU here
    runpy.run_path(str(REPO / "examples" / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "done: 18 optimizer steps over 3 epochs" in out  # 23 batches / 4 -> 6 steps an epoch
    printed = [line.split()[0] for line in out.splitlines() if re.fullmatch(r"\d+ \S+", line)]
    assert printed == ["5", "10", "15"]  # PrintLoss prints, as the README shows it would
