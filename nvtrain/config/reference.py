"""The config reference of ``docs/cli.md``, generated from the schema's attrs classes and their help.

A test (``tests/test_config.py``) keeps the document and :func:`reference_markdown` equal.
"""

from __future__ import annotations

import re
import typing
from typing import Any

import attrs

from nvtrain.config.schema import SECTIONS, TRAINER_HELP

__all__ = ["reference_markdown"]


def _type_label(annotation: Any) -> str:
    """A YAML-minded name of a field type: ``list[str]``, ``int | null``, ``section``."""
    if attrs.has(annotation):
        return "section"
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = text.replace("typing.", "").replace("NoneType", "null").replace("None", "null")
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    text = re.sub(r"\b[\w.]+\.(\w+Config)\b", r"\1", text)
    text = re.sub(r"tuple\[(.+), \.\.\.\]", r"list[\1]", text)
    text = text.replace("Union[Literal[True, False, 'auto'], str]", "true | false | auto | state_key")
    text = text.replace("dict[str, Any]", "mapping").replace("Literal[True, False, 'auto']", "true | false | auto")
    text = re.sub(r"Literal\[([^\]]+)\]", lambda m: " | ".join(v.strip(" '") for v in m.group(1).split(",")), text)
    text = re.sub(r"Optional\[(.+)\]", r"\1 | null", text)
    text = text.replace("list[HookConfig]", "list of hooks")
    for _, cls in SECTIONS:
        text = text.replace(cls.__name__, "section")
    return text.replace("|", "\\|")


def _default_label(field: attrs.Attribute[Any]) -> str:
    default = field.default
    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        value = default.factory()  # type: ignore[attr-defined,union-attr]
        if attrs.has(type(value)):
            return "see below"
        default = value
    if default is None:
        return "`null`"
    if default is True or default is False:
        return f"`{str(default).lower()}`"
    if isinstance(default, (tuple, list)):
        return "`[]`" if not default else f"`{list(default)}`"
    if isinstance(default, dict):
        return "`{}`" if not default else f"`{default}`"
    return f"`{default}`"


def reference_markdown() -> str:
    """The config reference tables of ``docs/cli.md``, generated from the attrs classes."""
    lines: list[str] = []
    types = typing.get_type_hints
    for section, cls in SECTIONS:
        hints = types(cls)
        title = f"`{section}`" if section else "top level"
        lines += [f"#### {title}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for field in attrs.fields(cls):
            help_text = field.metadata.get("help") or (TRAINER_HELP.get(field.name, "") if section == "trainer" else "")
            lines.append(
                f"| `{field.name}` | {_type_label(hints[field.name])} | {_default_label(field)} | {help_text} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
