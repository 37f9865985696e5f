"""docs/writing-plugins.md shows the plugin template's pyproject.toml as it is."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_pyproject_block_is_the_template_file() -> None:
    doc = (REPO / "docs" / "writing-plugins.md").read_text(encoding="utf-8")
    section = doc.split("## 2. `pyproject.toml`: the entry point", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```toml\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 1, "section 2 of docs/writing-plugins.md should show one toml block"
    template = (REPO / "examples" / "plugin-template" / "pyproject.toml").read_text(encoding="utf-8")
    assert blocks[0] == template  # torch>=2.13 (the tested floor of docs/install.md), not an older pin
