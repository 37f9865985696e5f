"""The hooks a config names, built: built-in names, installed plugins, import paths, and the logging hooks.

Each is constructed through the plugin machinery, so an unknown or refused setting
becomes a located config error that names the hook and the setting.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from nvtrain.config import LoadedConfig, resolve_import_path
from nvtrain.config.errors import field_of, in_config_words
from nvtrain.validators import FieldProblem

#: Hook constructor parameters that name an output location, and where they default to in the run directory.
OUTPUT_PARAMETERS = {"checkpoint_dir": "checkpoints", "output_dir": None, "log_dir": None}


def output_parameters(cls: object) -> dict[str, str | None]:
    """The settings of hook class ``cls`` that name a file or folder it writes, each with its default name in the
    run directory (None: a folder named after the hook).

    Those of :data:`OUTPUT_PARAMETERS` it takes, plus what the class declares in its ``output_settings`` mapping
    (``{"output": "stage_timing.csv"}``), so a new hook places its outputs without a list here to extend.
    """
    parameters = signature_parameters(cls)
    found: dict[str, str | None] = {name: to for name, to in OUTPUT_PARAMETERS.items() if name in parameters}
    declared = getattr(cls, "output_settings", None)
    if isinstance(declared, Mapping):
        found.update((str(name), to) for name, to in declared.items() if name in parameters)
    return found


def signature_parameters(target: Any) -> Mapping[str, inspect.Parameter]:
    """``target``'s parameters by name; empty for a builtin without a signature (nothing to check)."""
    try:
        return inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return {}


def builtin_hook_classes() -> dict[str, type]:
    """Built-in hooks a config can name, by their ``plugin_name`` (``clip``, ``accumulate``...)."""
    from nvtrain.plugins import builtin_hooks

    return builtin_hooks()


def build_hooks(loaded: LoadedConfig, search: Sequence[Path]) -> list[object]:
    """Build each hook the config lists, importing only the plugins it names (installed ones are read from
    metadata).

    A name that is both a built-in hook's and a visible plugin's is refused at its entry (see
    :func:`nvtrain.plugins.hook_class`), so ``clip`` never silently means one of the two.
    """
    from nvtrain import plugins

    builtin = builtin_hook_classes()
    installed = {record.name for record in plugins.visible_records()}
    hooks = []
    for index, entry in enumerate(loaded.config.hooks):
        path = ("hooks", index)
        name, settings = entry.name, dict(entry.settings)
        plugin = name.partition(":")[0]
        if name in builtin and name not in installed:
            cls = builtin[name]
            settings = _default_outputs(cls, settings, loaded.config.run_dir, name)
            hooks.append(_construct(loaded, path, name, cls, functools.partial(plugins_build, cls, settings, name)))
        elif plugin in installed:
            hooks.append(load_plugin(loaded, name, settings, path))
        elif ":" in name:
            try:
                cls = resolve_import_path(name, search)
            except (ImportError, AttributeError) as err:
                raise loaded.error(str(err), (*path, "name")) from None
            settings = _default_outputs(cls, settings, loaded.config.run_dir, name.rpartition(":")[2])
            hooks.append(_construct(loaded, path, name, cls, functools.partial(plugins_build, cls, settings, name)))
        else:
            raise loaded.error(_unknown_hook(name, builtin, installed), (*path, "name"))
    return hooks


def _unknown_hook(name: str, builtin: Mapping[str, type], installed: set[str]) -> str:
    """Why ``name`` names no hook: a typo, or a plugin the ``NVTRAIN_PLUGINS`` allow-list hides (read from metadata:
    nothing is imported)."""
    from nvtrain.plugins import ALLOW_LIST_ENV, allow_list

    allowed = allow_list()
    everything = {record.name for record in installed_entry_points()}
    missing = sorted(set(allowed or ()) - everything)
    if allowed is not None and name in everything:
        return (
            f"hook {name!r} is an installed plugin that {ALLOW_LIST_ENV}={','.join(allowed)} does not allow "
            f"(add it to {ALLOW_LIST_ENV}, or unset it)"
        )
    known = sorted({*builtin, *installed})
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    not_installed = f"; named in {ALLOW_LIST_ENV} but not installed: {', '.join(missing)}" if missing else ""
    return (
        f"unknown hook {name!r}{hint} (installed plugins: {', '.join(sorted(installed)) or 'none'}{not_installed}; "
        f"built-in hooks: {', '.join(sorted(builtin))}; or an import path 'package.module:HookClass')"
    )


def installed_entry_points() -> Sequence[Any]:
    from nvtrain.plugins import entry_points

    return entry_points()


def plugins_build(cls: type, settings: Mapping[str, Any], name: str) -> Any:
    """Build a built-in or import-path hook the way plugins are built (unknown settings named)."""
    from nvtrain.plugins import build_hook

    return build_hook(cls, settings, label=f"hook {name!r}")


def load_plugin(
    loaded: LoadedConfig,
    name: str,
    settings: dict[str, Any],
    path: tuple[str | int, ...],
    for_what: str | None = None,
) -> Any:
    from nvtrain import plugins

    try:
        cls = plugins.hook_class(name)
    except plugins.PluginError as err:
        why = f"{for_what} needs plugin {name!r}: " if for_what else ""
        raise loaded.error(f"{why}{err}", path) from None
    plugin = name.partition(":")[0]
    settings = _default_outputs(cls, settings, loaded.config.run_dir, plugin)
    source = next((record.source for record in plugins.visible_records() if record.name == plugin), None)
    return _construct(loaded, path, name, cls, lambda: plugins.load(name, **settings), source=source)


def _construct(
    loaded: LoadedConfig,
    path: tuple[str | int, ...],
    name: str,
    cls: type,
    build: Callable[[], Any],
    *,
    source: str | None = None,
) -> Any:
    """Build the hook at ``path`` and check it as the strategy will register it, so a refusal names this entry.

    ``source`` is the plugin's distribution and version: a constructor that fails otherwise than on a setting
    (a device, a file) is reported with it, so the line says whose hook failed.
    """
    from nvtrain.config import ConfigError
    from nvtrain.plugins import PluginError, PluginSettingsError
    from nvtrain.registry import check_registration

    _refuse_a_required_name_setting(loaded, path, name, cls)
    try:
        hook = build()
        check_registration(hook)
        return hook
    except ConfigError:
        raise
    except PluginError as err:
        unknown = err.unknown if isinstance(err, PluginSettingsError) else ()
        raise loaded.error(str(err), (*path, unknown[0]) if unknown else path) from None
    except FieldProblem as err:  # the hook's own validators and converters say which field refused what
        message = in_config_words(err, name_the_field=True)
        raise loaded.error(f"hook {name!r}: {message}", (*path, err.field) if err.field else path) from None
    except (TypeError, ValueError) as err:  # a hook from elsewhere whose checks raise plain errors (or attrs' own)
        message, field = _attrs_refusal(cls, err) or (str(err), field_of(err))
        raise loaded.error(f"hook {name!r}: {message}", (*path, field) if field else path) from None
    except Exception as err:  # its constructor failed otherwise (a device, a file): still one located line
        owner = f"hook {name!r} ({source})" if source else f"hook {name!r}"
        raise loaded.error(f"{owner}: building it raised {type(err).__name__}: {err}", path) from err


def _attrs_refusal(cls: type, err: BaseException) -> tuple[str, str | None] | None:
    """The message of a refusal by one of attrs' own validators, and the setting it is about; None for other errors.

    ``instance_of``, ``in_``, ``matches_re``... raise ``(message, Attribute, expected, value)``, whose ``str()`` is
    that tuple; ``ge``/``le``/``max_len``... raise a message opening with the quoted attribute name (``'every' must
    be >= 1: 0``). The setting is the field's alias (``limit`` for a private ``_limit``).
    """
    args = err.args
    if not args or not isinstance(args[0], str):
        return None
    fields = attrs.fields(cls) if attrs.has(cls) else ()
    if len(args) > 1 and isinstance(args[1], attrs.Attribute):
        return args[0], next((f.alias for f in fields if f == args[1] and f.init), None)
    if len(args) == 1 or isinstance(err, attrs.exceptions.NotCallableError):
        quoted = _ATTRS_MESSAGE.match(args[0])
        named = next((f for f in fields if quoted and f.name == quoted.group(1) and f.init), None)
        if named is not None:
            return args[0], named.alias
    return None


#: How attrs' validators that raise a bare message open it: ``'every' must be``, ``Length of 'tags' must be``.
_ATTRS_MESSAGE = re.compile(r"(?:Length of )?'([A-Za-z_][A-Za-z0-9_]*)' must ")


def _refuse_a_required_name_setting(loaded: LoadedConfig, path: tuple[str | int, ...], name: str, cls: type) -> None:
    """A config entry's ``name`` names the hook, so it can never give the hook a setting called ``name``: refuse a
    class that needs one, instead of reporting a missing setting the entry seems to give."""
    from nvtrain.plugins._describe import required_settings

    if "name" in required_settings(cls):
        raise loaded.error(
            f"hook {name!r}: {cls.__qualname__} needs a setting 'name', which a config entry cannot give (the "
            f"entry's 'name' is the hook to build); build it in code, passing name=...",
            path,
        )


def _default_outputs(cls: type, settings: dict[str, Any], run_dir: Path, name: str) -> dict[str, Any]:
    """Output locations a hook takes but the config leaves out go inside the run directory."""
    for parameter, default in output_parameters(cls).items():
        if parameter not in settings:
            settings[parameter] = str(run_dir / (default or name))
    return settings


def run_logging_hooks(loaded: LoadedConfig) -> list[object]:
    from nvtrain.logging_hooks import CSVLoggerHook, ProgressBarHook, TensorBoardHook, tensorboard_available

    section = loaded.config.logging
    run_dir = loaded.config.run_dir
    every = section.log_every_n_steps
    hooks: list[object] = []
    if section.progress_bar:
        hooks.append(ProgressBarHook(log_every_n_steps=every))
    if section.csv:
        try:  # the run directory's metrics.csv: a folder of that name is this config's problem
            hooks.append(CSVLoggerHook(run_dir / "metrics.csv", log_every_n_steps=every))
        except FieldProblem as err:
            raise loaded.error(str(err), ("logging", "csv")) from None
    elif section.plot:
        raise loaded.error("plot needs the metrics file: set logging.csv to true or plot to false", ("logging", "plot"))
    if section.plot and importlib.util.find_spec("matplotlib") is None:
        raise loaded.error(
            "plot needs matplotlib, which is not installed: pip install 'nvtrain[cli]', or set logging.plot to false",
            ("logging", "plot"),
        )
    if section.tensorboard is True or (section.tensorboard == "auto" and tensorboard_available()):
        try:
            hooks.append(TensorBoardHook(run_dir / "tensorboard"))  # the step scheduler's log_remote_every_steps
        except (ImportError, FieldProblem) as err:
            raise loaded.error(str(err), ("logging", "tensorboard")) from None
    return hooks
