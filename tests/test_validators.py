"""The shared attrs validators: what they accept, and errors that name class, field, expectation and value."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

from nvtrain.hooks import GradientAccumulationHook, GradientClippingHook, SpikeSkipHook
from nvtrain.validators import (
    FieldProblem,
    FieldTypeError,
    FieldValueError,
    a_callable,
    float_in_range,
    int_at_least,
    number_above,
    one_of,
    optional_int_at_least,
    optional_number_above,
    optional_str_tuple,
    refused,
    satisfies,
    strict_bool,
    strict_int,
)


def settings(validator: Any) -> type:
    @attrs.define
    class Settings:
        value: Any = attrs.field(validator=validator)

    return Settings


@pytest.mark.parametrize(
    ("validator", "good", "bad", "error", "message"),
    [
        (int_at_least(1), [1, 7], [0, 1.0, True, None, "2"], ValueError, "an int >= 1"),
        (int_at_least(None), [-3, 0, 9], [1.5, False, None], ValueError, "an int"),
        (optional_int_at_least(0), [None, 0, 4], [-1, 2.0, True], ValueError, "an int >= 0 or None"),
        (number_above(0), [1, 0.5, math.inf], [0, -1.0, math.nan, True, "1"], ValueError, "a number > 0"),
        (number_above(0, finite=True), [2, 1e300], [math.inf, 0.0], ValueError, "a finite number > 0"),
        (
            number_above(0, example="2.0 or float('inf')"),
            [math.inf],
            [0],
            ValueError,
            "a number > 0, e.g. 2.0 or float('inf')",
        ),
        (number_above(1.0), [1.5], [1.0, 1], ValueError, "a number > 1.0"),
        (optional_number_above(0), [None, 3.0], [0.0, math.nan, False], ValueError, "a number > 0 or None"),
        (float_in_range(0.0, 1.0), [0.5], [0.0, 1.0, math.nan, True], ValueError, "in (0.0, 1.0)"),
        (float_in_range(0.0, 1.0, include_low=True), [0.0, 0.999], [1.0, -0.1, "0.9"], ValueError, "in [0.0, 1.0)"),
        (float_in_range(0, 1, include_high=True), [1, 0.3], [0, 1.1], ValueError, "in (0, 1]"),
        (strict_bool, [True, False], [1, 0, None, "yes"], TypeError, "True or False"),
        (strict_int, [0, -5], [1.0, True, "3"], TypeError, "an int"),
        (one_of(("step", "epoch")), ["step", "epoch"], ["Step", 1, None], ValueError, "'step' or 'epoch'"),
        (one_of((True, False, "auto")), [True, "auto"], [1, 0, "yes"], ValueError, "True, False or 'auto'"),
        (one_of(("min",), "'min' (lower is better)"), ["min"], ["max"], ValueError, "'min' (lower is better)"),
        (a_callable("callable as f(x)"), [print, int], [3, None], TypeError, "callable as f(x)"),
        (
            optional_str_tuple("model names"),
            [None, ("a",), ("a", "b")],
            [(), ("",), ("a", 3), ["a"], "a"],
            ValueError,
            "None or a non-empty tuple of model names",
        ),
        (satisfies("even", lambda v: v % 2 == 0), [2], [3], ValueError, "even"),
        (satisfies("even", lambda v: v % 2 == 0, or_none=True), [None, 4], [5], ValueError, "even or None"),
        (satisfies("a str", lambda v: isinstance(v, str), error=FieldTypeError), ["x"], [1], TypeError, "a str"),
    ],
)
def test_accepts_the_good_and_names_the_bad(
    validator: Any, good: list[Any], bad: list[Any], error: type[Exception], message: str
) -> None:
    cls = settings(validator)
    for value in good:
        assert cls(value).value == value
    for value in bad:
        with pytest.raises(error) as caught:
            cls(value)
        assert str(caught.value) == f"Settings.value must be {message} (got {value!r})"


def test_the_message_names_the_subclass_that_failed() -> None:
    base = settings(int_at_least(1))

    class Tuned(base):  # type: ignore[misc, valid-type]
        pass

    with pytest.raises(ValueError, match=r"^Tuned\.value must be an int >= 1 \(got 0\)$"):
        Tuned(0)


@pytest.mark.parametrize(
    "build",
    [
        lambda priority: GradientAccumulationHook(steps=2, priority=priority),
        lambda priority: GradientClippingHook(max_norm=1.0, priority=priority),
        lambda priority: SpikeSkipHook(priority=priority),
    ],
    ids=["accumulate", "clip", "spike_skip"],
)
def test_every_builtin_hook_refuses_a_non_int_priority_the_same_way(build: Any) -> None:
    with pytest.raises(TypeError, match=r"\.priority must be an int \(got '10'\)"):
        build("10")


def test_the_error_carries_class_field_value_and_expectation() -> None:
    with pytest.raises(FieldValueError) as caught:
        settings(float_in_range(0.0, 1.0))(1.5)
    err = caught.value
    assert isinstance(err, FieldProblem) and isinstance(err, ValueError)
    assert (err.owner, err.field, err.value, err.expected) == ("Settings", "value", 1.5, "in (0.0, 1.0)")

    with pytest.raises(FieldTypeError) as caught_type:
        settings(strict_int)(1.0)
    type_err = caught_type.value
    assert isinstance(type_err, FieldProblem) and not isinstance(type_err, ValueError)
    assert (type_err.field, type_err.value, type_err.expected) == ("value", 1.0, "an int")


def test_a_private_field_is_named_as_it_is_set() -> None:
    """attrs sets ``_limit`` as ``limit``: the error names the setting the user wrote, so it can be placed."""

    @attrs.define
    class Stats:
        _limit: int = attrs.field(default=5, validator=int_at_least(0))

    with pytest.raises(FieldValueError) as info:
        Stats(limit=-1)
    assert str(info.value) == "Stats.limit must be an int >= 0 (got -1)"
    assert info.value.field == "limit"


def test_refused_is_the_error_a_converter_or_a_check_of_its_own_raises() -> None:
    err = refused("CheckpointHook", "resume", 3, "'never', 'auto' or a checkpoint path")
    assert isinstance(err, FieldValueError)
    assert str(err) == "CheckpointHook.resume must be 'never', 'auto' or a checkpoint path (got 3)"
    assert (err.owner, err.field, err.value, err.expected) == ("CheckpointHook", "resume", 3, err.expected)
    worded = refused("Hook", "stages", [], "batch stages", message="Hook.stages is empty", error=FieldTypeError)
    assert isinstance(worded, FieldTypeError) and str(worded) == "Hook.stages is empty"
    assert (worded.field, worded.value, worded.expected) == ("stages", [], "batch stages")
