"""Import paths ``package.module:attr.sub``, resolved also from the config file's folder."""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nvtrain.errors import one_line

__all__ = ["resolve_import_path"]


def resolve_import_path(spec: str, search_dirs: Sequence[Path] = ()) -> Any:
    """Import ``package.module:attr.sub``; ``search_dirs`` are tried for modules not installed.

    Raises ImportError/AttributeError with a message naming ``spec``. A module that
    raises while it is imported (a ``SyntaxError``, a ``RuntimeError``, a ``sys.exit()``)
    raises ImportError too, naming the module and its error: a config that names
    broken code is a bad config, to be reported in one line like a misspelt one.
    """
    module_name, _, attr_path = spec.partition(":")
    try:
        module = _import_module(module_name, search_dirs)
    except ModuleNotFoundError as err:
        if err.name and not module_name.startswith(err.name) and err.name != module_name:
            raise ImportError(f"importing {module_name!r} for {spec!r} failed: {err}") from err
        folders = list(dict.fromkeys(str(d) for d in search_dirs))  # the config's folder may be the working one
        where = f" (also looked in {', '.join(folders)})" if folders else ""
        raise ImportError(f"cannot import module {module_name!r} for {spec!r}{where}") from None
    except ImportError:
        raise
    except (Exception, SystemExit) as err:
        raise ImportError(f"importing module {module_name!r} for {spec!r} raised {one_line(err)}") from err
    target: Any = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            names = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise AttributeError(f"{module_name!r} has no attribute {attr_path!r} ({spec!r}){hint}") from None
    return target


def _import_module(name: str, search_dirs: Sequence[Path]) -> Any:
    """Import ``name``, the search folders first; they stay on ``sys.path`` afterwards, last, so a module found
    there can import its siblings when its functions run (as under ``python -m``), without shadowing anything
    installed for the rest of the process."""
    added = [str(d) for d in search_dirs if str(d) not in sys.path]
    sys.path[:0] = added
    try:
        return importlib.import_module(name)
    finally:
        for entry in added:
            if entry in sys.path:
                sys.path.remove(entry)
                sys.path.append(entry)
