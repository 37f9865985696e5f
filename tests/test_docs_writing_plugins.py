"""docs/writing-plugins.md shows the plugin template's pyproject.toml as it is."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TEMPLATE_HOOK = REPO / "examples" / "plugin-template" / "nvtrain_gradnorm" / "__init__.py"


def test_the_pyproject_block_is_the_template_file() -> None:
    doc = (REPO / "docs" / "writing-plugins.md").read_text(encoding="utf-8")
    section = doc.split("## 2. `pyproject.toml`: the entry point", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```toml\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 1, "section 2 of docs/writing-plugins.md should show one toml block"
    template = (REPO / "examples" / "plugin-template" / "pyproject.toml").read_text(encoding="utf-8")
    assert blocks[0] == template  # torch>=2.13 (the tested floor of docs/install.md), not an older pin


def _template_module() -> ModuleType:
    """The template's hook module, imported from its source under a name of its own."""
    spec = importlib.util.spec_from_file_location("docs_writing_plugins_gradnorm", TEMPLATE_HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_hook_class_block_is_an_excerpt_of_the_template() -> None:
    doc = (REPO / "docs" / "writing-plugins.md").read_text(encoding="utf-8")
    section = doc.split("## 3. The hook class", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    template = iter(TEMPLATE_HOOK.read_text(encoding="utf-8").splitlines())
    # every line but the shortened docstring appears in the template, in this order
    for line in block.splitlines():
        if line.strip() and not line.strip().startswith('"""'):
            assert line in template, f"not in the template (or out of order): {line!r}"


def test_the_template_hook_compares_by_identity_so_two_with_equal_settings_register(make_strategy: Any) -> None:
    monitor = _template_module().GradNormMonitor
    first, second = monitor(every=10), monitor(every=10)
    assert first != second  # pluggy tells plugins apart with ==
    strategy = make_strategy([first, second])
    assert strategy.registry.hooks() == [first, second]
