"""The run config: YAML -> attrs through cattrs, --set overrides, and located, one-line errors."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import attrs
import pytest

from nvtrain import config as cfg
from nvtrain.app import prepare
from nvtrain.builtin import default_config_text
from nvtrain.config import ConfigError, load_config
from nvtrain.step_scheduler import StepSchedulerConfig

REPO = Path(__file__).resolve().parents[1]

MINIMAL = """\
model:
  factory: nvtrain.builtin.digits:make_classifier
data:
  factory: nvtrain.builtin.digits:make_loaders
"""


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(path: Path | None, *overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value


def prepare_error(path: Path | None, *overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        prepare(load_config(path, overrides), world_size=1)
    return info.value


# -- the built-in config ------------------------------------------------------------------------


def test_builtin_config_is_the_digits_job() -> None:
    loaded = load_config(None)
    config = loaded.config
    assert loaded.source == cfg.BUILTIN_SOURCE
    assert config.name == "digits" and config.run_dir == Path("runs/digits")
    assert config.model.factory == "nvtrain.builtin.digits:make_classifier"
    assert config.data.kwargs["batch_size"] == 64
    assert [h.name for h in config.hooks] == ["amp", "ema", "checkpoint"]
    assert config.hooks[0].settings == {"precision": "auto"}
    assert config.hooks[2].settings["resume"] == "auto"
    assert isinstance(config.trainer, StepSchedulerConfig) and config.trainer.num_epochs == 15
    assert config.validation.metrics == ("accuracy",)


def test_examples_default_config_is_the_builtin_one() -> None:
    assert (REPO / "examples" / "configs" / "default.yaml").read_text(encoding="utf-8") == default_config_text()


def test_dumped_config_loads_back_equal(tmp_path: Path) -> None:
    config = load_config(None).config
    again = load_config(write(tmp_path, cfg.dump_config(config))).config
    assert again == config


def test_name_defaults_to_the_file_stem(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, MINIMAL, "my-job.yaml")).config.run_dir == Path("runs/my-job")


def test_sections_left_out_take_their_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL)).config
    assert config.optimizer == cfg.OptimizerConfig()
    assert config.trainer == StepSchedulerConfig()
    assert config.hooks == () and config.lr_scheduler is None


def test_exponent_without_dot_is_a_float(tmp_path: Path) -> None:
    # YAML 1.1 would read 1e-3 as the string "1e-3" and hand it to the optimizer.
    path = write(tmp_path, MINIMAL + "optimizer:\n  kwargs: {lr: 1e-3, eps: 5E-8}\n")
    kwargs = load_config(path).config.optimizer.kwargs
    assert kwargs == {"lr": 1e-3, "eps": 5e-8} and isinstance(kwargs["lr"], float)


def test_hook_entries_are_names_or_mappings(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "hooks:\n  - amp\n  - {name: ema, decay: 0.9}\n")
    hooks = load_config(path).config.hooks
    assert hooks == (cfg.HookConfig("amp"), cfg.HookConfig("ema", {"decay": 0.9}))
    assert cfg.converter().unstructure(hooks[1]) == {"name": "ema", "decay": 0.9}


def test_preemption_signal_list_is_kept(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "trainer: {preemption_signal: [SIGTERM, SIGUSR1]}\n")
    assert load_config(path).config.trainer.preemption_signal == ("SIGTERM", "SIGUSR1")


# -- --set ---------------------------------------------------------------------------------------


def test_set_overrides_fields_with_yaml_values(tmp_path: Path) -> None:
    loaded = load_config(
        write(tmp_path, MINIMAL + "hooks: [amp, {name: ema, decay: 0.9}]\n"),
        [
            "trainer.max_steps=200",
            "trainer.num_epochs=null",
            "hooks.ema.decay=0.5",
            "hooks.0.precision=bf16",
            "validation.metrics=[accuracy]",
            "lr_scheduler.factory=torch.optim.lr_scheduler:StepLR",
            "lr_scheduler.kwargs={step_size: 10}",
            "name=override",
        ],
    )
    config = loaded.config
    assert config.trainer.max_steps == 200 and config.trainer.num_epochs is None
    assert config.hooks[1].settings == {"decay": 0.5}
    assert config.hooks[0].settings == {"precision": "bf16"}
    assert config.validation.metrics == ("accuracy",)
    assert config.lr_scheduler == cfg.LRSchedulerConfig("torch.optim.lr_scheduler:StepLR", {"step_size": 10})
    assert config.name == "override"
    assert loaded.locate(("trainer", "max_steps")) == "--set trainer.max_steps=200"


def test_later_set_wins() -> None:
    config = load_config(None, ["seed=1", "seed=7"]).config
    assert config.seed == 7


@pytest.mark.parametrize(
    ("overrides", "got"),
    [
        ("trainer.max_steps=3", ", not a bare str (got 'trainer.max_steps=3')"),  # not one override per character
        (3, " (got 3)"),
        (["seed=1", 2], " (got 2 at index 1)"),
    ],
)
def test_overrides_must_be_a_list_of_strings(overrides: Any, got: str) -> None:
    expected = "a list of 'key.sub=value' strings, e.g. ['trainer.max_steps=3']"
    with pytest.raises(TypeError) as info:
        load_config(None, overrides)
    assert str(info.value) == f"load_config() overrides must be {expected}{got}"
    with pytest.raises(TypeError, match=r"^apply_overrides\(\) overrides must be a list"):
        cfg.apply_overrides({}, overrides, {})
    assert load_config(None, ("seed=7",)).config.seed == 7  # any sequence of str


# -- errors: one line, the field, the place ------------------------------------------------------


def test_unknown_key_names_line_and_closest_key(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "trainer:\n  max_step: 3\n")
    err = error_of(path)
    assert str(err) == (
        f"{path}:6:3: trainer.max_step: unknown key 'max_step' in section 'trainer'; did you mean 'max_steps'?"
    )
    assert "\n" not in str(err)


def test_an_unknown_key_does_not_hide_the_values_its_section_refuses(tmp_path: Path) -> None:
    """cattrs refuses the key before it builds the section; the section is looked at again without it."""
    path = write(tmp_path, MINIMAL + "trainer:\n  max_step: 3\n  num_epochs: -1\n")
    err = str(error_of(path))
    assert err.startswith(f"{path}:6:3: trainer.max_step: unknown key 'max_step' in section 'trainer'")
    assert f"(and 1 more: {path}:7:3: trainer.num_epochs: must be an integer >= 1 or null (got -1)" in err


def test_unknown_top_level_key_lists_valid_keys(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, MINIMAL + "colour: blue\n"))
    assert err.path == ("colour",) and "valid keys: name, output_dir" in str(err)
    assert str(err).startswith(f"{tmp_path / 'run.yaml'}:5:1: colour: unknown key 'colour' in the top level")


def test_typo_in_set_points_at_the_argument() -> None:
    err = error_of(None, "trainer.max_stps=3")
    assert str(err) == (
        "--set trainer.max_stps=3: trainer.max_stps: unknown key 'max_stps' in section 'trainer'; "
        "did you mean 'max_steps'?"
    )


def test_set_by_a_name_two_hooks_share_is_refused_with_their_indexes(tmp_path: Path) -> None:
    """Two EMA hooks (one per model): setting the first alone would pass for setting the one named."""
    hooks = "hooks: [{name: ema, model_key: main}, amp, {name: ema, model_key: teacher}]\n"
    path = write(tmp_path, MINIMAL + hooks)
    err = error_of(path, "hooks.ema.decay=0.5")
    assert str(err) == (
        "--set hooks.ema.decay=0.5: hooks: 2 items are named 'ema' (items 0, 2); name one by its index (hooks.0...)"
    )
    loaded = load_config(path, ["hooks.2.decay=0.5"])
    assert [hook.settings for hook in loaded.config.hooks] == [
        {"model_key": "main"},
        {},
        {"model_key": "teacher", "decay": 0.5},
    ]


def test_a_section_an_override_creates_is_located_at_the_argument(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    err = error_of(path, "hooks.ema.decay=0.9")
    assert str(err) == "--set hooks.ema.decay=0.9: hooks: expected a list, got a mapping"
    # a hook named in the file keeps its file location when an override adds a setting to it
    path = write(tmp_path, MINIMAL + "hooks: [emma]\n", name="named.yaml")
    loaded = load_config(path, ["hooks.0.decay=0.9"])
    assert loaded.locate(("hooks", 0)) == f"{path}:5:9"
    assert loaded.locate(("hooks", 0, "decay")) == "--set hooks.0.decay=0.9"


@pytest.mark.parametrize(
    ("override", "path", "message"),
    [
        ("trainer.max_steps=abc", ("trainer", "max_steps"), "expected an integer, got str 'abc'"),
        ("seed=1.5", ("seed",), "expected an integer, got float 1.5"),
        ("logging.csv=3", ("logging", "csv"), "expected true or false, got int 3"),
        ("logging.tensorboard=maybe", ("logging", "tensorboard"), "expected one of true, false, 'auto', got str"),
        ("trainer=3", ("trainer",), "expected a mapping of the section's keys, got int 3"),
        ("hooks=amp", ("hooks",), "expected a list, got str 'amp'"),
        ("validation.metrics=[accuracy, 3]", ("validation", "metrics", 1), "expected a string, got int 3"),
        ("model.kwargs=[1]", ("model", "kwargs"), "expected a mapping of keyword arguments, got a list"),
        ("trainer.max_steps=0", ("trainer", "max_steps"), "must be an integer >= 1 or null (got 0)"),
        ("trainer.preemption_signal=SIGKILL", ("trainer", "preemption_signal"), "SIGKILL cannot be caught"),
        ("logging.log_every_n_steps=0", ("logging", "log_every_n_steps"), "must be >= 1 (got 0)"),
        ("name=a/b", ("name",), "must be a plain directory name"),
        ("device=gpu", ("device",), "must be 'auto' or a torch device like 'cpu', 'cuda:0' (got 'gpu')"),
        ("model.factory=torch.nn.Linear", ("model", "factory"), "did you mean 'torch.nn:Linear'?"),
        ("validation.metrics=[acurracy]", ("validation", "metrics"), "did you mean 'accuracy'?"),
        ("hooks=[{decay: 1}]", ("hooks", 0, "name"), "a hook entry needs 'name' (got keys: decay)"),
        ("hooks=[3]", ("hooks", 0), "expected a hook name or a mapping"),
        # in the config file's words: null and true, not None and True
        ("trainer.num_epochs=true", ("trainer", "num_epochs"), "expected an integer, got true"),
        ("validation.every_n_steps=0", ("validation", "every_n_steps"), "must be >= 1 or null (got 0)"),
        ("name=no", ("name",), "expected a string, got false"),
    ],
)
def test_value_errors_name_the_field(override: str, path: tuple[Any, ...], message: str) -> None:
    err = error_of(None, override)
    assert err.path == path
    assert err.location == f"--set {override}"
    assert message in str(err)
    assert str(err).startswith(f"--set {override}: {cfg.format_path(path)}: ")


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("max_steps=3", "unknown key 'max_steps' in the top level; did you mean 'trainer.max_steps'?"),
        ("max_step=3", "unknown key 'max_step' in the top level; did you mean 'trainer.max_steps'?"),
        ("trainer.log_every_n_steps=5", "in section 'trainer'; did you mean 'logging.log_every_n_steps'?"),
        ("validation.num_epochs=2", "in section 'validation'; did you mean 'trainer.num_epochs'?"),
        ("trainer.max_step=3", "in section 'trainer'; did you mean 'max_steps'?"),  # here before elsewhere
        ("optimizer.lr=0.1", "the factory's keyword arguments go under kwargs: did you mean 'optimizer.kwargs.lr'?"),
        ("data.batch_size=8", "did you mean 'data.kwargs.batch_size'?"),
        ("frobnicate=1", "unknown key 'frobnicate' in the top level (valid keys: name, output_dir, seed,"),
        ("logging.frobnicate=1", "in section 'logging' (valid keys: log_every_n_steps, progress_bar,"),
    ],
)
def test_an_unknown_key_is_pointed_to_where_it_belongs(override: str, hint: str) -> None:
    err = error_of(None, override)
    assert err.path == tuple(override.split("=")[0].split("."))
    assert hint in str(err)


def test_validator_error_is_located_at_the_key_line(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "logging:\n  csv: true\n  log_every_n_steps: 0\n")
    err = error_of(path)
    assert err.location == f"{path}:7:3" and err.path == ("logging", "log_every_n_steps")


def test_missing_required_section(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, "data: {factory: nvtrain.builtin.digits:make_loaders}\n"))
    assert "missing required key" in str(err) and "model" in str(err)


def test_several_problems_are_all_listed_on_one_line(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, MINIMAL + "seed: x\ndevice: 3\n"))
    assert err.path == ("seed",) and "(and 1 more: " in str(err)
    assert f"{tmp_path / 'run.yaml'}:6:1: device: expected a string" in str(err) and "\n" not in str(err)


def test_a_misspelt_key_is_reported_first_among_several_problems(tmp_path: Path) -> None:
    # Only a trainer section with a typo: the typo is the first thing the user reads,
    # and the missing sections are still listed.
    err = error_of(write(tmp_path, "trainer: {max_stepz: 10}\n"))
    assert str(err).startswith(f"{tmp_path / 'run.yaml'}:1:11: trainer.max_stepz: unknown key 'max_stepz'")
    assert "did you mean 'max_steps'?" in str(err)
    assert "(and 2 more: " in str(err)
    assert "model: missing required key 'model'" in str(err) and "data: missing required key 'data'" in str(err)


@pytest.mark.parametrize(
    ("text", "location", "message"),
    [
        ("model: [1\n", ":2:1", "invalid YAML"),
        (MINIMAL + "seed: 1\nseed: 2\n", ":6:1", "duplicate key 'seed' (first at"),
        ("- a\n- b\n", "", "a config file holds a mapping of sections, got a list"),
    ],
)
def test_malformed_files(tmp_path: Path, text: str, location: str, message: str) -> None:
    path = write(tmp_path, text)
    err = error_of(path)
    assert err.location == f"{path}{location}" and message in str(err)


def test_missing_file(tmp_path: Path) -> None:
    err = error_of(tmp_path / "nope.yaml")
    assert str(err) == f"{tmp_path / 'nope.yaml'}: no such config file"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer", "expected --set key.subkey=value"),
        ("=3", "expected --set key.subkey=value"),
        ("hooks.7.decay=1", "index 7 is out of range (the list has 3 items)"),
        ("hooks.emma.decay=1", "no item named 'emma'; did you mean 'ema'?"),
        # only a hook named by itself becomes {name: ..., setting: ...}; another list's str item takes no key
        ("validation.metrics.0.x=1", "validation.metrics[0]: cannot set a key inside str 'accuracy'"),
    ],
)
def test_malformed_set(override: str, message: str) -> None:
    err = error_of(None, override)
    assert err.location == f"--set {override}" and message in str(err)


def test_an_error_about_a_list_a_set_changed_an_item_of_is_located_at_that_set() -> None:
    """The error is about validation.metrics; the --set that put 'acc' in it is where it came from."""
    err = error_of(None, "validation.metrics.0=acc")
    assert err.location == "--set validation.metrics.0=acc" and err.path == ("validation", "metrics")


# -- errors found by prepare(): imports, signatures, hooks ---------------------------------------


def test_unknown_hook_lists_plugins_and_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "hooks:\n  - emma\n")
    err = prepare_error(path)
    assert err.location == f"{path}:6:5" and err.path == ("hooks", 0, "name")
    assert "unknown hook 'emma'; did you mean 'ema'?" in str(err)
    # Whatever else is installed on this machine: the plugins this project ships are listed among them.
    listed = re.search(r"installed plugins: ([^;]*);", str(err))
    assert listed is not None
    assert {"amp", "checkpoint", "ddp", "ema"} <= {name.strip() for name in listed.group(1).split(",")}
    assert "built-in hooks:" in str(err) and "clip" in str(err)


def test_unknown_hook_setting_points_at_the_setting(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "hooks:\n  - name: checkpoint\n    keep_lst: 2\n")
    err = prepare_error(path)
    assert err.location == f"{path}:7:5" and err.path == ("hooks", 0, "keep_lst")
    assert "did you mean 'keep_last_n'?" in str(err)


def test_hook_validator_error_points_at_the_setting() -> None:
    err = prepare_error(None, "hooks.ema.decay=1.5")
    assert err.path == ("hooks", 1, "decay") and "EMAHook.decay must be in [0.0, 1.0) (got 1.5)" in str(err)


def test_a_structured_validator_error_is_placed_by_its_field_not_its_wording(tmp_path: Path) -> None:
    (tmp_path / "picky_hooks_structured.py").write_text(
        textwrap.dedent(
            """\
            import attrs
            from nvtrain.validators import FieldValueError

            @attrs.define
            class Picky:
                level: int = attrs.field(default=0)

                @level.validator
                def _check(self, attribute, value):
                    if value > 3:
                        raise FieldValueError("too high", owner="Picky", field="level", value=value, expected="<= 3")
            """
        ),
        encoding="utf-8",
    )
    path = write(tmp_path, MINIMAL + "hooks:\n  - name: picky_hooks_structured:Picky\n    level: 5\n")
    err = prepare_error(path)
    assert err.path == ("hooks", 0, "level") and err.location == f"{path}:7:5"
    assert str(err).endswith("hook 'picky_hooks_structured:Picky': too high")


#: A bad value for each hook setting whose check was once written by hand: (hook entry, field, message).
HAND_WRITTEN_CHECKS = [
    ("{name: early_stopping, monitor: ''}", "monitor", "EarlyStoppingHook.monitor must be a non-empty key"),
    ("{name: early_stopping, mode: highest}", "mode", "EarlyStoppingHook.mode must be 'min'"),
    ("{name: clip, max_norm: 1.0, model_keys: 5}", "model_keys", "GradientClippingHook.model_keys must be null or"),
    ("{name: trainable_params, trainable: ['']}", "trainable", "must hold non-empty glob strings"),
    ("{name: trainable_params, trainable: a, frozen: [a, 3]}", "frozen", "must hold non-empty glob strings"),
    ("{name: trainable_params, trainable: a, model_keys: 3}", "model_keys", "TrainableParameterHook.model_keys"),
    ("{name: module_patch, patches: {'*': nn.Identity}}", "patches", "ModulePatchHook.patches['*'] must be callable"),
    ("{name: module_patch, patches: 3}", "patches", "ModulePatchHook.patches must be a mapping"),
    ("{name: spike_skip, monitor: weights}", "monitor", "SpikeSkipHook.monitor must name one or both"),
    ("{name: stage_timing, stages: [forward]}", "stages", "StageTimingHook.stages must be TrainingStage values"),
    ("{name: stage_timing, stages: [1]}", "stages", "StageTimingHook.stages must be a non-empty set of batch"),
    ("{name: stage_timing, log: 1}", "log", "StageTimingHook.log must be true or false (got 1)"),
    ("{name: amp, precision: fp8}", "precision", "MixedPrecisionHook.precision must be one of"),
    ("{name: profiler, schedule: 3}", "schedule", "TorchProfilerHook.schedule must be a callable"),
    ("{name: profiler, activities: [gpu]}", "activities", "unknown activity name 'gpu'"),
    ("{name: checkpoint, checkpoint_dir: ''}", "checkpoint_dir", "CheckpointHook.checkpoint_dir must be a non-empty"),
    ("{name: checkpoint, resume: 3}", "resume", "CheckpointHook.resume must be 'never', 'auto' or a checkpoint"),
    ("{name: ddp, model_keys: []}", "model_keys", "DDPHook.model_keys must name at least one model"),
    ("{name: ddp, sampler_cls: nodots}", "sampler_cls", "'nodots' is not a dotted path"),
    ("{name: ddp, sampler_kwargs: {dataset: 1}}", "sampler_kwargs", "must not hold 'dataset'"),
]


@pytest.mark.parametrize(("entry", "field", "message"), HAND_WRITTEN_CHECKS)
def test_a_hand_written_check_is_placed_at_its_setting_without_reading_the_message(
    entry: str, field: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nvtrain.app.hook_stack

    monkeypatch.setattr(nvtrain.app.hook_stack, "field_of", lambda err: None)  # the wording fallback, out of the way
    err = prepare_error(None, f"hooks=[{entry}]")
    assert err.path == ("hooks", 0, field) and message in str(err)


def test_a_hand_written_check_in_yaml_is_located_at_its_key(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "hooks:\n  - name: amp\n    precision: fp8\n")
    err = prepare_error(path)
    assert err.path == ("hooks", 0, "precision") and err.location == f"{path}:7:5"
    path = write(tmp_path, MINIMAL + "trainer:\n  preemption_signal: SIGBOGUS\n")
    err = error_of(path)
    assert err.path == ("trainer", "preemption_signal") and err.location == f"{path}:6:3"
    assert "'SIGBOGUS' is not a signal name" in str(err)


def test_a_plain_validator_error_of_a_hook_from_elsewhere_is_placed_by_its_wording(tmp_path: Path) -> None:
    # Hooks outside nvtrain (the plugin template's validators too) raise ValueError("Owner.field must ...").
    (tmp_path / "picky_hooks_plain.py").write_text(
        textwrap.dedent(
            """\
            import attrs

            @attrs.define
            class Picky:
                level: int = attrs.field(default=0)

                @level.validator
                def _check(self, attribute, value):
                    if value > 3:
                        raise ValueError(f"Picky.level must be <= 3 (got {value!r})")
            """
        ),
        encoding="utf-8",
    )
    path = write(tmp_path, MINIMAL + "hooks:\n  - name: picky_hooks_plain:Picky\n    level: 5\n")
    err = prepare_error(path)
    assert err.path == ("hooks", 0, "level") and err.location == f"{path}:7:5"


def test_an_unknown_setting_is_named_by_the_error_itself() -> None:
    from nvtrain.hooks import GradientClippingHook
    from nvtrain.plugins import PluginSettingsError, build_hook

    with pytest.raises(PluginSettingsError) as info:
        build_hook(GradientClippingHook, {"max_nrm": 1.0, "foo": 2}, label="hook 'clip'")
    assert info.value.unknown == ("max_nrm", "foo")


def test_a_wrong_choice_is_reported_as_the_value_it_is() -> None:
    # The words "missing" and "required" in a value once made it read as a missing key.
    err = error_of(None, "lr_scheduler.interval='missing required'")
    assert err.path == ("lr_scheduler", "interval")
    assert err.problem == "expected one of 'step', 'epoch', got str 'missing required'"


def test_model_kwarg_typo_is_caught_before_building() -> None:
    err = prepare_error(None, "model.kwargs.hiden=3")
    assert err.path == ("model", "kwargs", "hiden")
    assert "nvtrain.builtin.digits:make_classifier takes no argument 'hiden'; did you mean 'hidden'?" in str(err)


def test_unresolvable_import_path_suggests_the_name() -> None:
    err = prepare_error(None, "optimizer.factory=torch.optim:AdamWW")
    assert err.path == ("optimizer", "factory") and "did you mean 'AdamW'?" in str(err)


def test_use_ema_without_an_ema_hook() -> None:
    err = prepare_error(None, "hooks=[]", "validation.use_ema=true")
    assert err.path == ("validation", "use_ema") and "no EMA hook is configured" in str(err)


def test_scheduler_gets_the_step_count_when_it_takes_one() -> None:
    plan = prepare(load_config(None), world_size=1)
    assert plan.scheduler_total_steps == ("T_max",)
    assert prepare(load_config(None, ["lr_scheduler.kwargs={T_max: 5}"]), world_size=1).scheduler_total_steps == ()


def test_torchrun_launch_adds_the_ddp_plugin() -> None:
    plan = prepare(load_config(None), world_size=2)
    assert [getattr(h, "plugin_name", None) for h in plan.hooks].count("ddp") == 1


def test_outputs_default_into_the_run_directory(tmp_path: Path) -> None:
    plan = prepare(load_config(None, [f"output_dir={tmp_path}"]), world_size=1)
    (checkpoint,) = [h for h in plan.hooks if getattr(h, "plugin_name", None) == "checkpoint"]
    assert Path(checkpoint.checkpoint_dir) == tmp_path / "digits" / "checkpoints"
    assert not (tmp_path / "digits").exists()  # checking writes nothing


def test_import_paths_resolve_from_the_config_folder(tmp_path: Path) -> None:
    (tmp_path / "local_thing.py").write_text("VALUE = 42\n", encoding="utf-8")
    assert cfg.resolve_import_path("local_thing:VALUE", [tmp_path]) == 42
    with pytest.raises(ImportError, match="cannot import module 'not_a_module_here'"):
        cfg.resolve_import_path("not_a_module_here:x", [tmp_path])


# -- the reference in docs/cli.md ----------------------------------------------------------------


def test_docs_carry_the_generated_reference() -> None:
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    begin, end = "<!-- BEGIN CONFIG REFERENCE -->\n", "<!-- END CONFIG REFERENCE -->"
    assert begin in text and end in text
    block = text.split(begin, 1)[1].split(end, 1)[0]
    assert block.strip() == cfg.reference_markdown().strip(), "regenerate with nvtrain.config.reference_markdown()"


def test_every_field_has_help() -> None:
    for section, cls in cfg.SECTIONS:
        for field in attrs.fields(cls):
            text = field.metadata.get("help") or (cfg.TRAINER_HELP.get(field.name) if section == "trainer" else None)
            assert text, f"{cls.__name__}.{field.name} has no help text for docs/cli.md"
