"""Building a run from the config saved with a checkpoint, importing only what the caller trusts."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from nvtrain.app.building import Built, build
from nvtrain.app.checking import prepare
from nvtrain.app.hook_stack import builtin_hook_classes, installed_entry_points
from nvtrain.config import LoadedConfig
from nvtrain.errors import ResumeError

#: Top-level packages whose import paths a checkpoint's run config may always name.
TRUSTED_PACKAGES = ("torch", "nvtrain")


def config_import_paths(run_config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(config key, "module:attr")`` for every import path a resolved run config names; imports nothing.

    Built-in names (a schedule alias, a built-in metric) count as the path they stand
    for; a hook named by a built-in or installed plugin name is no import path.
    """
    from nvtrain.builtin.metrics import BUILTIN_METRICS
    from nvtrain.schedules import ALIASES

    def section(name: str) -> Mapping[str, Any]:
        value = run_config.get(name)
        return value if isinstance(value, Mapping) else {}

    found: list[tuple[str, str]] = []
    for key in ("model.factory", "model.forward_fn", "data.factory", "loss.function", "optimizer.factory"):
        part, _, field = key.partition(".")
        value = section(part).get(field)
        if isinstance(value, str):
            found.append((key, value))
    factory = section("lr_scheduler").get("factory")
    if isinstance(factory, str):
        found.append(("lr_scheduler.factory", ALIASES.get(factory, factory)))
    metrics = section("validation").get("metrics")
    for index, metric in enumerate(metrics if isinstance(metrics, list) else []):
        if isinstance(metric, str):
            found.append((f"validation.metrics[{index}]", BUILTIN_METRICS.get(metric, metric)))
    builtin = builtin_hook_classes()
    plugins = {record.name for record in installed_entry_points()}
    hooks = run_config.get("hooks")
    for index, entry in enumerate(hooks if isinstance(hooks, list) else []):
        name = entry.get("name") if isinstance(entry, Mapping) else entry
        if isinstance(name, str) and name not in builtin and name.partition(":")[0] not in plugins:
            found.append((f"hooks[{index}].name", name))
    return found


def trusted_packages(trust: Sequence[str] = ()) -> tuple[str, ...]:
    """``torch``, ``nvtrain``, the installed nvtrain plugins' top-level modules and ``trust``."""
    plugins = {record.value.partition(":")[0].split(".")[0].strip() for record in installed_entry_points()}
    return tuple(dict.fromkeys([*TRUSTED_PACKAGES, *sorted(p for p in plugins if p), *trust]))


def _is_trusted(spec: str, packages: Sequence[str]) -> bool:
    module = spec.partition(":")[0].strip()
    return any(module == package or module.startswith(f"{package}.") for package in packages)


def build_from_checkpoint(
    run_config: Mapping[str, Any],
    source: str,
    *,
    trust: Sequence[str] = (),
    strategy_cls: type | None = None,
    overrides: Mapping[str, Any] | None = None,
    extra_hooks: Sequence[object] = (),
) -> Built:
    """Build what ``nvtrain train`` builds from the run config saved with a checkpoint (``source``), with
    ``extra_hooks`` registered besides the config's (before SETUP, so theirs runs too).

    Every import path the config names is checked against :func:`trusted_packages`
    before anything is imported: a checkpoint is data, and its config must not run code
    the caller did not choose. Untrusted paths raise a :class:`~nvtrain.errors.ResumeError`
    listing them.
    """
    from nvtrain.config.structure import structure_config

    if isinstance(trust, str):
        trust = (trust,)
    packages = trusted_packages(trust)
    refused = [(key, spec) for key, spec in config_import_paths(run_config) if not _is_trusted(spec, packages)]
    if refused:
        listed = ", ".join(f"{key} = {spec!r}" for key, spec in refused)
        names = sorted({spec.partition(":")[0].split(".")[0] for _, spec in refused})
        raise ResumeError(
            f"the run config saved in {source} names import paths outside the trusted packages "
            f"({', '.join(packages)}): {listed}. Nothing was imported. A checkpoint is data; to let it "
            f"run that code, trust the package(s) by name: TrainingStrategy.load_checkpoint(path, trust={names!r})"
        )
    data = copy.deepcopy(dict(run_config))
    overrides = dict(overrides or {})
    for bound in ("max_steps", "num_epochs"):  # the run's bounds live in the config's trainer section
        if bound in overrides and isinstance(data.get("trainer"), dict):
            data["trainer"][bound] = overrides.pop(bound)
    loaded = LoadedConfig(config=None, source=f"the run config of {source}", directory=None)  # type: ignore[arg-type]
    loaded = attrs.evolve(loaded, config=structure_config(data, loaded.locate))
    return build(prepare(loaded), strategy_cls=strategy_cls, overrides=overrides, extra_hooks=extra_hooks)
