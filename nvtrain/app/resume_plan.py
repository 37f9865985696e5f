"""Which checkpoint a run resumes from, and what the config changed since it was written."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nvtrain.errors import ResumeError

if TYPE_CHECKING:
    from nvtrain.app.building import Built
    from nvtrain.app.checking import Plan


def plan_resume(plan: Plan, built: Built, rank: int, world_size: int, fresh: Mapping[str, dict[str, Any]]) -> None:
    """Find the checkpoint the run will resume from and compare its config with this one."""
    from nvtrain.config import converter
    from nvtrain.resuming import REFUSED, ResumeAdjuster, config_changes, in_effect

    loaded = plan.loaded
    now = _plain(converter().unstructure(plan.config))
    built.effective_config = now
    # the checkpoint plugin's hooks (resume_checkpoint, read_manifest, run_config)
    hooks: list[Any] = [h for h in plan.hooks if callable(getattr(h, "resume_checkpoint", None))]
    for resumer in hooks:
        resumer.run_config = now  # stored in each manifest
    if not hooks:
        return
    hook = hooks[0]
    index = plan.hooks.index(hook)
    try:
        path = hook.resume_checkpoint(rank, world_size)
        manifest = hook.read_manifest(path) if path is not None else None
    except ResumeError as err:
        raise loaded.error(f"cannot resume: {err}", ("hooks", index, "resume")) from None
    if path is None or manifest is None:
        return
    step = int(manifest.get("step", 0))
    built.resume_from, built.resume_step = Path(path), step
    saved = manifest.get("run_config")
    if not isinstance(saved, dict):
        saved = _saved_config_file(plan.run_dir)
    if saved is None:
        return
    changes = config_changes(saved, now, derives_horizon=bool(plan.scheduler_total_steps))
    refused = [c for c in changes if c.effect == REFUSED]
    if refused:
        raise loaded.error(
            f"cannot resume from {path} with this config: "
            + "; ".join(c.describe() for c in refused)
            + ". Start a fresh run (another name, or the checkpoint hook's resume: never)",
            tuple(refused[0].key.replace("[", ".").replace("]", "").split(".")),
        )
    built.changes = changes
    built.effective_config = in_effect(saved, now, changes)
    adjust = [c for c in changes if c.effect != REFUSED]
    if adjust:
        built.strategy.register_hook(ResumeAdjuster(adjust, fresh, step))


def check_saved_weights(plan: Plan, built: Built, state: Mapping[str, Any] | None) -> None:
    """Weights that do not fit the models (a changed model config) are refused now, as the resume would refuse
    them at the start of training, so ``nvtrain validate`` says so too."""
    from nvtrain.state import check_model_fits

    weights = state.get("models") if state is not None else None
    if not isinstance(weights, Mapping):
        return
    try:
        for name, model in built.strategy.ctx.models.items():
            if name in weights:
                check_model_fits(name, model, weights[name])
    except ResumeError as err:
        raise plan.loaded.error(f"cannot resume: {with_model_changes(str(err), built)}", ("hooks",)) from None


def saved_state(plan: Plan, built: Built) -> Mapping[str, Any] | None:
    """The state of the checkpoint the run resumes from, mapped without its data (None: no resume, or a
    checkpoint hook that cannot say)."""
    if built.resume_from is None:
        return None
    readers = [getattr(h, "saved_state", None) for h in plan.hooks if callable(getattr(h, "resume_checkpoint", None))]
    read = readers[0] if readers else None
    state = read(built.resume_from) if callable(read) else None
    return state if isinstance(state, Mapping) else None


def with_model_changes(message: str, built: Built) -> str:
    """``message`` with the model config changes since the checkpoint, which usually explain a refusal."""
    model = [c.describe() for c in built.changes if c.key.startswith("model.")]
    return message + (f" (model config changed since the checkpoint: {'; '.join(model)})" if model else "")


def _plain(data: Any) -> Any:
    """JSON-compatible data (tuples to lists, other objects to str): what a manifest can hold."""
    import json

    return json.loads(json.dumps(data, default=str))


def _saved_config_file(run_dir: Path) -> dict[str, Any] | None:
    """The run directory's config.yaml, read as a config file is (it was written to be read back so)."""
    from nvtrain.config import ConfigError
    from nvtrain.config.source import parse_yaml

    path = run_dir / "config.yaml"
    try:
        data, _ = parse_yaml(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError, ConfigError):
        return None
    return _plain(data) if isinstance(data, dict) else None
