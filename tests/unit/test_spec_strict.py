"""No silent coercion at the boundary (issue 19 item 10): a key given twice, `true` for a batch
size, `"32"` for an integer and `"yes"` for a boolean are mistakes the parser names by field,
never values it quietly turns into something else."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from ravnest.errors import SpecError
from ravnest.spec import load_job, parse_job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"
TEXT = EXAMPLE.read_text()
BASE: dict[str, Any] = yaml.safe_load(TEXT)


def problems_of_text(text: str, tmp_path: Path) -> list[str]:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_job(path)
    return err.value.problems


def problems_with(section: list[str | int], key: str, value: Any) -> list[str]:
    doc = copy.deepcopy(BASE)
    node: Any = doc
    for step in section:
        node = node.setdefault(step, {}) if isinstance(step, str) else node[step]
    node[key] = value
    with pytest.raises(SpecError) as err:
        parse_job(doc)
    return err.value.problems


def test_a_key_given_twice_is_refused_by_its_path(tmp_path: Path) -> None:
    text = TEXT.replace("    seed: 42\n", "    seed: 42\n    batchSize: 64\n")
    assert problems_of_text(text, tmp_path) == [
        "spec.data.batchSize: given twice (lines 14 and 17); keep one"]


def test_a_key_given_twice_in_a_list_item_is_refused_by_its_path(tmp_path: Path) -> None:
    text = TEXT.replace("- {ram: 2, bandwidth: 500}", "- {ram: 2, bandwidth: 500, ram: 64}")
    assert problems_of_text(text, tmp_path) == [
        "spec.providers[2].ram: given twice (lines 30 and 30); keep one"]


def test_merge_keys_may_still_override_what_they_merge(tmp_path: Path) -> None:
    text = TEXT.replace("    - {ram: 4, bandwidth: 200}\n",
                        "    - &small {ram: 4, bandwidth: 200}\n    - {<<: *small, ram: 6}\n")
    path = tmp_path / "job.yaml"
    path.write_text(text)
    assert [p.ram for p in load_job(path).spec.providers] == [4, 8, 2, 16, 4, 6, 8]


def test_a_boolean_batch_size_is_refused_and_microbatches_not_blamed() -> None:
    assert problems_with(["spec", "data"], "batchSize", True) == [
        "spec.data.batchSize: must be an integer, got True"]


@pytest.mark.parametrize(("section", "key", "value", "expected"), [
    (["spec", "data"], "batchSize", "32", "spec.data.batchSize: must be an integer, got '32'"),
    (["spec", "data"], "batchSize", 32.0, "spec.data.batchSize: must be an integer, got 32.0"),
    (["spec", "training"], "epochs", "8", "spec.training.epochs: must be an integer, got '8'"),
    (["spec", "security"], "tls", "yes", "spec.security.tls: must be true or false, got 'yes'"),
    (["spec", "data"], "shuffle", 1, "spec.data.shuffle: must be true or false, got 1"),
    (["spec", "providers", 0], "compute", "2", "spec.providers[0].compute: must be a number, "
     "got '2'"),
    (["spec", "providers", 0], "compute", True, "spec.providers[0].compute: must be a number, "
     "got True"),
    (["metadata"], "name", 7, "metadata.name: must be a string, got 7"),
    (["spec", "training", "optimizer"], "name", 3,
     "spec.training.optimizer.name: must be a string, got 3"),
], ids=["batch-size-text", "batch-size-float", "epochs-text", "tls-yes", "shuffle-one",
        "compute-text", "compute-bool", "name-number", "optimizer-number"])
def test_values_of_another_type_are_not_coerced(section: list[str | int], key: str, value: Any,
                                                expected: str) -> None:
    assert problems_with(section, key, value) == [expected]


def test_numbers_for_number_fields_and_quantities_for_ram_still_parse() -> None:
    doc = copy.deepcopy(BASE)
    doc["spec"]["providers"][0].update(ram="8Gi", compute=2, bandwidth=100)
    doc["spec"]["training"]["validationSmoothing"] = 1
    job = parse_job(doc)
    provider = job.spec.providers[0]
    assert (provider.ram, provider.compute, provider.bandwidth) == (8.0, 2.0, 100.0)
    assert isinstance(provider.compute, float)
    assert parse_job(job.to_dict()) == job


def test_a_kwarg_of_the_wrong_type_names_the_field_and_the_call() -> None:
    """`width: abc` gave only Python's "not all arguments converted during string formatting"."""
    from ravnest.plan.building import build_model

    doc = copy.deepcopy(BASE)
    doc["spec"]["model"]["kwargs"] = {"width": "abc"}
    with pytest.raises(SpecError) as err:
        build_model(parse_job(doc).spec)
    [line] = err.value.problems
    assert line.startswith("spec.model.kwargs: ravnest.examples.digits:build_model"
                           "(**{'width': 'abc'}) failed: TypeError: ")
    assert line.endswith("; check the kwargs' names and types")


@pytest.mark.parametrize("shape", [[32, 3, 8, 8], [32, 64]], ids=["channels", "rank"])
def test_an_example_input_the_model_does_not_take_names_the_field(shape: list[int]) -> None:
    from ravnest.plan.building import plan_job

    doc = copy.deepcopy(BASE)
    doc["spec"]["model"]["exampleInput"]["shape"] = shape
    with pytest.raises(SpecError) as err:
        plan_job(parse_job(doc))
    [line] = err.value.problems
    assert line.startswith(f"spec.model.exampleInput: the model fails on an input of shape "
                           f"{shape} and dtype float32 (RuntimeError: ")
    assert line.endswith("); give the shape and dtype of one batch it takes")
    assert "\n" not in line
