"""Fuzzing the job-spec validator beyond test_spec.py: hostile values at every field of the
example (wrong types, NaN and infinities, huge numbers, deep nesting, cycles, YAML alias bombs),
arbitrary keys, and mutated YAML text. Only a SpecError with one path-qualified line per problem
ever comes out, and it comes out quickly whatever the value holds."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ravnest.errors import SpecError
from ravnest.spec import load_job, parse_job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"
BASE: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
SEGMENT = r"(\.[\w-]+|\[-?\d+\]|\['.*?'\]|\[\".*?\"\]|\[.*?\.\.\.\])"
LINE = re.compile(rf"^(<document>|(apiVersion|kind|metadata|spec){SEGMENT}*): \S")


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


def _nested(depth: int) -> list[Any]:
    root: list[Any] = []
    node = root
    for _ in range(depth):
        node.append([])
        node = node[0]
    return root


def _bomb(levels: int) -> list[Any]:
    """What a YAML alias bomb loads as: 10**levels leaves, each level shared 10 times."""
    node: list[Any] = [1] * 10
    for _ in range(levels):
        node = [node] * 10
    return node


_cycle: list[Any] = []
_cycle.append(_cycle)
HOSTILE = [None, True, "text", "", -1, 0, 2**63, -(10**400), 1e308, float("nan"), float("inf"),
           float("-inf"), "nan", "-inf", [], {}, [1, "a"], {"a": 1}, {3: 1}, b"bytes",
           "x" * 100_000, _nested(5000), _bomb(9), _cycle]


def assert_spec_error_lines(document: Any) -> None:
    try:
        parse_job(document)
    except SpecError as e:
        assert e.problems
        for line in e.problems:
            assert LINE.match(line), line[:500]
            assert "\n" not in line and len(line) < 400, line[:500]


PATHS = _paths(BASE)


@pytest.mark.parametrize("path", PATHS, ids=[".".join(map(str, p)) for p in PATHS])
def test_hostile_values_at_every_field_give_spec_errors(path: tuple[Any, ...]) -> None:
    for value in HOSTILE:
        doc = copy.deepcopy(BASE)
        node: Any = doc
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = value
        assert_spec_error_lines(doc)


def _alias_bomb(levels: int) -> str:
    """YAML lines that anchor `a{levels}`, which stands for 10**(levels + 1) ones."""
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


TOO_MANY = ("too large: holds {} values (each alias counted as the copy it stands for); "
            "a job may hold at most 100000")


def _held(problems: list[str]) -> int:
    """The count in the one line of a too-large document."""
    [line] = problems
    held = re.fullmatch("<document>: " + re.escape(TOO_MANY).replace(r"\{\}", "([0-9]+)"), line)
    assert held is not None, line
    return int(held.group(1))


def test_an_alias_bomb_in_data_kwargs_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """Issue 19 item 5: 1.5 KB of YAML standing for 10**8 ones in spec.data.kwargs passed
    validation and made `plan` run for minutes."""
    text = EXAMPLE.read_text().replace("    seed: 42\n", "    seed: 42\n    kwargs: {x: *a7}\n")
    path = tmp_path / "job.yaml"
    path.write_text(_alias_bomb(7) + text)
    assert path.stat().st_size < 2000
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert _held(err.value.problems) > 10**8


def test_an_alias_bomb_anywhere_in_the_file_is_refused(tmp_path: Path) -> None:
    text = EXAMPLE.read_text().replace("shape: [32, 1, 8, 8]", "shape: [32, *a8]")
    path = tmp_path / "job.yaml"
    path.write_text(_alias_bomb(8) + text)
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert _held(err.value.problems) > 10**9


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("x: &loop [1, *loop]\n" + EXAMPLE.read_text())
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert err.value.problems == [
        "<document>: " + TOO_MANY.format("infinitely many") + " (an alias inside its own anchor)"]


def test_a_job_file_over_one_mebibyte_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(EXAMPLE.read_text() + "# " + "x" * (1 << 20) + "\n")
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert err.value.problems == [
        f"{path}: a job file may be at most 1048576 bytes, this one is larger"]


def test_shared_aliases_within_the_bound_still_load(tmp_path: Path) -> None:
    text = EXAMPLE.read_text().replace("    seed: 42\n", "    seed: 42\n    kwargs: {x: *a3}\n")
    path = tmp_path / "job.yaml"
    path.write_text(_alias_bomb(3) + text)
    assert len(str(load_job(path).spec.data.kwargs["x"])) > 10**4


@pytest.mark.parametrize("document", [_bomb(9), _cycle], ids=["shared-lists", "cycle"])
def test_parse_job_bounds_an_object_tree_from_elsewhere(document: Any) -> None:
    """The operator hands parse_job an object, not text: it is bounded too."""
    doc = copy.deepcopy(BASE)
    doc["spec"]["data"]["kwargs"] = {"x": document}
    with pytest.raises(SpecError) as err:
        parse_job(doc)
    assert err.value.problems == ["<document>: " + TOO_MANY.format("more than 100000")]


KEYS = st.text(max_size=12) | st.integers(-5, 5) | st.none() | st.booleans() | st.floats()
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=10)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(PATHS), KEYS, VALUES), min_size=1, max_size=3))
def test_arbitrary_keys_and_values_anywhere_give_spec_errors(
        edits: list[tuple[tuple[Any, ...], Any, Any]]) -> None:
    doc = copy.deepcopy(BASE)
    for path, key, value in edits:
        node: Any = doc
        try:
            for step in path:
                node = node[step]
        except (KeyError, IndexError, TypeError):
            continue
        if isinstance(node, dict):
            node[key] = value
        elif isinstance(node, list):
            node.append(value)
    assert_spec_error_lines(doc)


TEXT = EXAMPLE.read_text()
YAML_CHARS = st.sampled_from([*":-[]{}&*!|>'\"#%@`,? \t\n", "!!binary", "&a", "*a", "<<", "\ufeff",
                              "\x00", "\udcff"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(TEXT)), st.integers(0, 5), YAML_CHARS),
                min_size=1, max_size=4))
def test_mutated_yaml_text_gives_a_job_or_one_line_errors(
        tmp_path_factory: pytest.TempPathFactory, edits: list[tuple[int, int, str]]) -> None:
    text = TEXT
    for at, cut, insert in edits:
        text = text[:at] + insert + text[at + cut:]
    path = tmp_path_factory.mktemp("job") / "job.yaml"
    path.write_text(text, errors="surrogatepass")
    try:
        load_job(path)
    except SpecError as e:
        assert e.problems
        for line in e.problems:
            assert line.startswith(str(path)) or LINE.match(line), line
            assert "\n" not in line, line
