"""docs/stages.md cannot drift from the bus: one section per hookspec, with its signature."""

from __future__ import annotations

import re
from pathlib import Path

import pluggy
import pytest

from nvtrain import hookspecs
from nvtrain.stages import TrainingStage

DOC = Path(__file__).resolve().parents[1] / "docs" / "stages.md"
HEADING = re.compile(r"^##\s+`?([a-z_][a-z0-9_]*)`?\s*$")


def _stage_sections() -> list[tuple[str, str]]:
    """``(heading, body)`` for every level-2 heading that is a lowercase identifier (a hook name)."""
    sections: list[tuple[str, list[str]]] = []
    in_code = False
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("#"):
            match = HEADING.match(line)
            sections.append((match.group(1) if match else "", []))
            continue
        if sections:
            sections[-1][1].append(line)
    return [(name, "\n".join(body)) for name, body in sections if name]


def _spec_names() -> list[str]:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return [name for name, caller in vars(pm.hook).items() if isinstance(caller, pluggy.HookCaller)]


def test_one_section_per_stage_in_stage_order() -> None:
    headings = [name for name, _ in _stage_sections()]
    assert len(headings) == 18
    assert headings == [stage.hook_name for stage in TrainingStage]
    assert sorted(headings) == sorted(_spec_names())


@pytest.mark.parametrize("name", [stage.hook_name for stage in TrainingStage])
def test_each_section_shows_the_signature(name: str) -> None:
    sections = dict(_stage_sections())
    assert name in sections, f"docs/stages.md has no '## {name}' section"
    body = sections[name]
    assert re.search(rf"^{name}\(ctx\)( -> .+)?$", body, re.MULTILINE), f"section {name} lacks '{name}(ctx)'"
    assert "**When:**" in body and "**Returns:**" in body


def test_doc_opens_with_the_loop_picture() -> None:
    text = DOC.read_text(encoding="utf-8")
    first_section = text.index("\n## ")
    # the first fenced block, before any stage section
    start = text.index("```", 0, first_section)
    picture = text[start : text.index("```", start + 3)]
    assert "for epoch:" in picture and "for micro-batch in window:" in picture
    positions = [picture.find(stage.name) for stage in TrainingStage]
    assert all(p >= 0 for p in positions)
    assert positions == sorted(positions)


def test_doc_covers_ordering_wrappers_and_tracing() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert "priority" in text and "wrapper=True" in text and "NVTRAIN_TRACE" in text


def _diagram(text: str, indent: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("SETUP "))
    end = next(i for i, line in enumerate(lines) if "AFTER_VALIDATION" in line and i > start)
    return [line[len(indent):] if line.startswith(indent) else line for line in lines[start : end + 1]]


def test_the_docs_show_the_one_drawing_of_the_loop() -> None:
    assert hookspecs.__doc__ is not None
    assert _diagram(DOC.read_text(encoding="utf-8"), "") == _diagram(hookspecs.__doc__, "    ")
