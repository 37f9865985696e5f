"""YAML 1.1 number forms that YAML 1.2 reads differently are refused with their location, not guessed.

PyYAML's SafeLoader reads ``max_steps: 1:20`` as 80 (base 60) and ``017`` as 15 (octal);
YAML 1.2 reads a string and 17. The config reader refuses those plain
forms at their line and column, keeps the quoted ones strings, and bounds how far
aliases may expand (a "billion laughs" text is a few lines long).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvtrain.app import EXIT_USAGE
from nvtrain.cli import main
from nvtrain.config import load_config
from nvtrain.config import source as yaml_source
from nvtrain.config.errors import ConfigError
from nvtrain.config.source import MAX_VALUES, dump_yaml, parse_yaml

MINIMAL = """\
device: cpu
model: {factory: nvtrain.builtin.digits:make_classifier}
data: {factory: nvtrain.builtin.digits:make_loaders}
"""


def value_of(text: str) -> object:
    """What ``a: text`` reads as."""
    data, _ = parse_yaml(f"a: {text}\n", "f.yaml")
    return data["a"]


def refusal(text: str, source: str = "f.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        parse_yaml(text, source)
    return str(info.value)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(MINIMAL + text, encoding="utf-8")
    return path


# -- ambiguous numbers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("1:20", "ambiguous number 1:20: YAML 1.1 reads it as the base-60 number 80, YAML 1.2 as a string; "
         "write 80, or quote it ('1:20') for a string"),
        ("190:20:30", "the base-60 number 685230, YAML 1.2 as a string; write 685230,"),
        ("-1:20", "the base-60 number -80, YAML 1.2 as a string; write -80,"),
        ("1:20.5", "ambiguous number 1:20.5: YAML 1.1 reads it as the base-60 number 80.5, YAML 1.2 as a string; "
         "write 80.5, or quote it ('1:20.5') for a string"),
        ("017", "ambiguous number 017: with a leading zero YAML 1.1 reads it as octal (15), YAML 1.2 as 17; "
         "write 15 or 17, or quote it ('017') for a string"),
        ("-017", "with a leading zero YAML 1.1 reads it as octal (-15), YAML 1.2 as -17; write -15 or -17,"),
        ("08", "ambiguous number 08: with a leading zero YAML 1.1 reads it as a string, YAML 1.2 as 8; write 8,"),
        ("007", "reads it as octal (7), YAML 1.2 as 7; write 7, or quote it ('007')"),
    ],
)  # fmt: skip
def test_a_plain_number_yaml_1_1_and_1_2_read_differently_is_refused_at_its_place(text: str, problem: str) -> None:
    err = refusal(f"trainer:\n  max_steps: {text}\n")
    assert err.startswith("f.yaml:2:14: trainer.max_steps: ambiguous number "), err
    assert problem in err and "\n" not in err


def test_an_ambiguous_number_is_refused_in_a_list_and_as_a_key() -> None:
    assert refusal("a: [1, 1:20]\n").startswith("f.yaml:1:8: a[1]: ambiguous number 1:20: ")
    assert refusal("a: {017: x}\n").startswith("f.yaml:1:5: a: ambiguous number 017: ")
    # A list as a key is built by PyYAML before nvtrain refuses it: the number is refused first.
    assert refusal("? [017]\n: x\n").startswith("f.yaml:1:4: invalid YAML: ambiguous number 017: ")


@pytest.mark.parametrize(
    ("text", "value"),
    [("'1:20'", "1:20"), ('"1:20"', "1:20"), ("!!str 1:20", "1:20"), ("|-\n  1:20", "1:20"), ("'017'", "017"),
     ('"08"', "08"), ("!!str 017", "017")],
)  # fmt: skip
def test_quoted_and_tagged_forms_stay_strings(text: str, value: str) -> None:
    assert value_of(text) == value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("-0", 0),
        ("0.5", 0.5),
        ("017.5", 17.5),
        ("0x10", 16),
        ("-0x10", -16),
        ("1_000", 1000),
        ("0b11", 3),
        ("0o17", 15),  # YAML 1.2's octal: the way to write one now
        ("-0o17", -15),
        ("1e3", 1000.0),
        ("1:60", "1:60"),  # not a base-60 digit: a string in YAML 1.1 and 1.2 alike
        ("0x_", "0x_"),  # no digit: a string (PyYAML failed on it with a bare ValueError)
        ("0b_", "0b_"),
        ("._", "._"),
        ("08_", "08_"),  # a string in YAML 1.1 and 1.2 alike
    ],
)
def test_other_number_forms_are_read_as_before(text: str, value: object) -> None:
    read = value_of(text)
    assert read == value and type(read) is type(value)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=-(10**30), max_value=10**30), exponent=st.integers(min_value=-30, max_value=30))
def test_decimal_numbers_read_as_numbers_and_quoted_ones_as_strings(n: int, exponent: int) -> None:
    assert type(value_of(str(n))) is int and value_of(str(n)) == n
    assert value_of(f"{n}e{exponent}") == float(f"{n}e{exponent}")
    assert value_of(f"{n}.5E{exponent:+d}") == float(f"{n}.5e{exponent}")
    assert value_of(f"'{n}'") == str(n) and value_of(f'"{n}e{exponent}"') == f"{n}e{exponent}"


@settings(max_examples=100, deadline=None)
@given(hours=st.integers(min_value=1, max_value=10**6), minutes=st.integers(min_value=0, max_value=59))
def test_base_60_forms_are_refused_with_their_value_and_quoted_ones_stay_strings(hours: int, minutes: int) -> None:
    text = f"{hours}:{minutes:02d}"
    assert f"the base-60 number {hours * 60 + minutes}, YAML 1.2 as a string" in refusal(f"a: {text}\n")
    assert value_of(f"'{text}'") == text


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=0, max_value=10**12), sign=st.sampled_from(["", "-", "+"]))
def test_leading_zero_forms_are_refused_and_quoted_ones_stay_strings(n: int, sign: str) -> None:
    text = f"{sign}0{n}"
    assert f"ambiguous number {text}: with a leading zero YAML 1.1 reads it as " in refusal(f"a: {text}\n")
    assert value_of(f"'{text}'") == text


def test_load_config_refuses_an_ambiguous_number_in_the_file_and_in_a_set_value(tmp_path: Path) -> None:
    path = write(tmp_path, "trainer: {max_steps: 017}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:4:22: trainer.max_steps: ambiguous number 017: ")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, ""), ["trainer.max_steps=1:20"])
    assert str(info.value).startswith("--set trainer.max_steps=1:20:1:1: ambiguous number 1:20: YAML 1.1 reads it")


def test_a_quoted_set_value_reaches_the_field_as_a_string(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, ""), ["trainer.max_steps='1:20'"])
    assert "trainer.max_steps: expected an integer, got str '1:20'" in str(info.value)
    assert load_config(write(tmp_path, ""), ["trainer.max_steps=80"]).config.trainer.max_steps == 80


@pytest.mark.parametrize(
    ("extra", "argv", "where"),
    [
        ("trainer: {max_steps: 1:20}\n", [], "job.yaml:4:22: trainer.max_steps: ambiguous number 1:20: "),
        ("", ["--set", "trainer.max_steps=017"], "--set trainer.max_steps=017:1:1: ambiguous number 017: "),
    ],
)
def test_nvtrain_validate_refuses_an_ambiguous_number_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str, argv: list[str], where: str
) -> None:
    path = write(tmp_path, extra)
    assert main(["validate", str(path), *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("nvtrain validate: error: ") and err.count("\n") == 1, err
    assert where in err


# -- writing YAML the reader reads back ----------------------------------------------------------------


@pytest.mark.parametrize("text", ["08", "017", "0o17", "1:20", "1e-3", "yes", "0x10"])
def test_dump_yaml_quotes_a_string_the_reader_would_read_as_something_else(text: str) -> None:
    # PyYAML's safe_dump writes 08, 0o17 and 1e-3 plain: read back, refused, 15 and 0.001.
    data = {"name": text, "kwargs": {"values": [text, 15, 1e-3, 0.5, True, None]}}
    assert dump_yaml(data).startswith(f"name: '{text}'\n")
    assert parse_yaml(dump_yaml(data), "dumped.yaml")[0] == data


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="0123456789:._-+eEobx", max_size=8))
def test_any_number_like_string_survives_dump_and_parse(text: str) -> None:
    assert parse_yaml(dump_yaml({"a": text}), "dumped.yaml")[0] == {"a": text}


# -- alias expansion --------------------------------------------------------------------------------


def laughs(levels: int) -> str:
    """Each level a list of ten aliases to the one before: ``10**levels`` scalars from a few lines."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 10)}]" for n in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_nested_aliases_expanding_past_the_bound_are_refused() -> None:
    assert MAX_VALUES == 100_000
    err = refusal(laughs(9), "bomb.yaml")
    assert err.startswith("bomb.yaml:5:1: l4[7][8]: too many values: expected at most 100000 mappings, lists")
    assert err.endswith("got more (an alias counts everything it repeats, each time it is used)")


def test_the_bound_counts_every_value_an_alias_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "a: &a [1, 2]\nb: [*a, *a]\n"  # the top, a and its 2, b and twice a with its 2: 11 values
    monkeypatch.setattr(yaml_source, "MAX_VALUES", 11)
    assert parse_yaml(text, "f.yaml")[0] == {"a": [1, 2], "b": [[1, 2], [1, 2]]}
    monkeypatch.setattr(yaml_source, "MAX_VALUES", 10)
    assert refusal(text).startswith("f.yaml:2:1: b[1][1]: too many values: expected at most 10 ")


@pytest.mark.parametrize("name", ["017", "0o17", "1e-3", "1:20"])
def test_a_printed_or_saved_config_loads_back_as_it_was(tmp_path: Path, name: str) -> None:
    """``--print-config`` and a run directory's config.yaml are configs too: run again, they load unchanged."""
    from nvtrain.app.run_watch import _dump
    from nvtrain.config import converter, dump_config

    loaded = load_config(write(tmp_path, ""), [f"name='{name}'"]).config
    assert loaded.name == name
    printed = tmp_path / "printed.yaml"
    printed.write_text(dump_config(loaded), encoding="utf-8")
    assert load_config(printed).config == loaded
    saved = tmp_path / "saved.yaml"
    saved.write_text(_dump(converter().unstructure(loaded)), encoding="utf-8")
    assert load_config(saved).config == loaded


@pytest.mark.parametrize("text", ["2024-01-01", "2024-01-01 10:00:00", "2024-01-01T10:00:00Z"])
def test_a_date_is_a_string_as_in_yaml_1_2(text: str) -> None:
    """YAML 1.1 makes it a datetime.date: a factory's keyword argument would get a date it never asked for."""
    assert value_of(text) == text
    assert parse_yaml(dump_yaml({"a": text}), "dumped.yaml")[0] == {"a": text}
