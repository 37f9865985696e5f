"""List the installed nvtrain plugins: entry-point name, distribution, version, hook
classes, their stages and priorities, and whether each plugin loads.

Listing activates nothing. NVTRAIN_PLUGINS=a,b shows only those plugins (and
reports listed names that are not installed); NVTRAIN_DISABLE_PLUGIN_AUTOLOAD=1
lists them from metadata without importing them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nvtrain.plugins import HookInfo, PluginInfo

__all__ = ["HELP", "add_arguments", "format_table", "run"]

HELP = "list installed plugins (a table, or --json)"

COLUMNS = ("name", "distribution", "version", "hooks", "stages", "priority", "status")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def run(args: argparse.Namespace) -> int:
    from nvtrain import plugins

    if args.json:  # a plugin that prints as it is imported must not break the document: its output goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            infos = plugins.available()
        print(json.dumps([info.to_dict() for info in infos], indent=2))
        return 0
    infos = plugins.available()
    if infos:
        print(format_table(COLUMNS, [row for info in infos for row in _rows(info)]))
    else:
        print(_nothing_listed())
    for note in _notes(plugins.ALLOW_LIST_ENV, plugins.DISABLE_AUTOLOAD_ENV):
        print(note)
    return 0


def _nothing_listed() -> str:
    """Why the table is empty: nothing installed, or an empty allow-list hiding what is."""
    from nvtrain import plugins

    hidden = sorted({record.name for record in plugins.entry_points()})
    if plugins.allow_list() is not None and hidden:
        return (
            f"No nvtrain plugin is visible: {plugins.ALLOW_LIST_ENV} is set but empty, which hides every installed "
            f"plugin ({', '.join(hidden)}); unset it, or list the plugins to allow."
        )
    return f"No nvtrain plugins installed (entry-point group {plugins.ENTRY_POINT_GROUP!r})."


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces, a rule under the header."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = [headers, ["-" * width for width in widths], *rows]
    return "\n".join(
        "  ".join(str(cell).ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def _rows(info: PluginInfo) -> list[list[str]]:
    status = info.status.value if info.error is None else f"{info.status.value}: {info.error}"
    status = status if info.note is None else f"{status} ({info.note})"
    head = [info.name, info.distribution or "-", info.version or "-"]
    if not info.hooks:
        return [[*head, "-", "-", "-", status]]
    rows = []
    for index, hook in enumerate(info.hooks):
        first = index == 0
        rows.append(
            [
                *(head if first else ["", "", ""]),
                _hook_name(info, hook),
                _stages(hook),
                "-" if hook.priority is None else str(hook.priority),
                status if first else "",
            ]
        )
    return rows


def _hook_name(info: PluginInfo, hook: HookInfo) -> str:
    return f"{hook.name} (default)" if hook.default and len(info.hooks) > 1 else hook.name


def _stages(hook: HookInfo) -> str:
    wrapped = set(hook.wrappers)
    return ", ".join(f"{stage} (wrapper)" if stage in wrapped else stage for stage in hook.stages) or "-"


def _notes(allow_env: str, autoload_env: str) -> list[str]:
    from nvtrain.plugins import allow_list, autoload_disabled

    notes = []
    allowed = allow_list()
    if allowed:  # set but empty: the headline already says so
        notes.append(f"{allow_env}={','.join(allowed)}: other installed plugins are hidden.")
    if autoload_disabled():
        notes.append(f"{autoload_env} is set: plugins were listed without importing them; load(name) still works.")
    return notes
