"""docs/stages.md's NVTRAIN_TRACE paragraph says what tracing does: every stage call is traced."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvtrain.bus import HookBus
from nvtrain.stages import TrainingStage

DOC = Path(__file__).resolve().parents[1] / "docs" / "stages.md"


def test_tracing_reports_a_stage_nobody_implements_as_the_doc_says(capsys: pytest.CaptureFixture[str]) -> None:
    bus = HookBus(trace=True)
    assert bus.implementations(TrainingStage.BEFORE_FORWARD) == []
    bus.before_forward(None)
    err = capsys.readouterr().err
    assert "  before_forward [hook]\n" in err and "  finish before_forward --> [] [hook]\n" in err
    paragraph = DOC.read_text(encoding="utf-8").split("Set `NVTRAIN_TRACE=1`", 1)[1].split("```", 1)[0]
    assert "stay silent" not in paragraph
    assert "Stages nobody implements are traced too" in paragraph and "finish <stage> --> []" in paragraph
