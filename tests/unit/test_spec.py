"""The job spec: every mistake in a RavnestJob gives one clear, path-qualified line, and nothing
but a SpecError ever comes out of the parser, whatever the document holds."""

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
from ravnest.spec import load_job, parse_gigabytes, parse_job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"
BASE: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
DELETE = object()


def _steps(path: str) -> list[str | int]:
    return [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", path)]


def mutated(path: str, value: Any) -> dict[str, Any]:
    """The example document with the value at `path` replaced (or deleted with DELETE)."""
    doc = copy.deepcopy(BASE)
    *parents, last = _steps(path)
    node: Any = doc
    for step in parents:
        node = node[step]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


def problems(document: Any) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_job(document)
    return err.value.problems


SUFFIXES = "Ki, Mi, Gi, Ti, Pi, k, M, G, T or P"
NAME_RULE = ("must be a lowercase name of letters, digits and '-' that starts and ends with a "
             "letter or digit")

INVALID = [
    ("negative-ram", "spec.providers[2].ram", "-1",
     "spec.providers[2].ram: must be a positive quantity, got '-1'"),
    ("negative-ram-number", "spec.providers[2].ram", -1,
     "spec.providers[2].ram: must be a positive quantity, got -1"),
    ("zero-ram", "spec.providers[0].ram", "0Gi",
     "spec.providers[0].ram: must be a positive quantity, got '0Gi'"),
    ("ram-bad-suffix", "spec.providers[1].ram", "8Gb",
     f"spec.providers[1].ram: must be a quantity with a suffix {SUFFIXES}, got '8Gb'"),
    ("ram-not-a-quantity", "spec.providers[1].ram", "lots",
     "spec.providers[1].ram: must be a positive quantity such as 4 (GB), '512Mi' or '8Gi', "
     "got 'lots'"),
    ("ram-bool", "spec.providers[0].ram", True,
     "spec.providers[0].ram: must be a positive quantity such as 4 (GB), '512Mi' or '8Gi', "
     "got True"),
    ("ram-huge", "spec.providers[0].ram", 10**400,
     "spec.providers[0].ram: must be a positive quantity in GB, got a number too large to use"),
    ("ram-missing", "spec.providers[3].ram", DELETE, "spec.providers[3].ram: is required"),
    ("zero-bandwidth", "spec.providers[4].bandwidth", 0,
     "spec.providers[4].bandwidth: must be greater than 0, got 0"),
    ("zero-replicas", "spec.providers[0].replicas", 0,
     "spec.providers[0].replicas: must be greater than 0, got 0"),
    ("provider-not-mapping", "spec.providers[1]", "big",
     "spec.providers[1]: must be a mapping, got 'big'"),
    ("provider-bad-name", "spec.providers[0].name", "Big_One",
     f"spec.providers[0].name: {NAME_RULE}, got 'Big_One'"),
    ("empty-providers", "spec.providers", [], "spec.providers: must have at least 1 item, got []"),
    ("providers-not-list", "spec.providers", {"ram": 4},
     "spec.providers: must be a list, got {'ram': 4}"),
    ("zero-batch-size", "spec.data.batchSize", 0,
     "spec.data.batchSize: must be greater than 0, got 0"),
    ("microbatches-over-batch", "spec.data.microbatches", 64,
     "spec.data.microbatches: cannot exceed batchSize (32), got 64"),
    ("batch-size-text", "spec.data.batchSize", "big",
     "spec.data.batchSize: must be an integer, got 'big'"),
    ("seed-fraction", "spec.data.seed", 1.5, "spec.data.seed: must be an integer, got 1.5"),
    ("shuffle-not-bool", "spec.data.shuffle", "maybe",
     "spec.data.shuffle: must be true or false, got 'maybe'"),
    ("data-entrypoint", "spec.data.entrypoint", "datasets",
     "spec.data.entrypoint: must look like 'package.module:callable', got 'datasets'"),
    ("unknown-optimizer", "spec.training.optimizer.name", "Adamm",
     "spec.training.optimizer.name: must be a torch.optim optimizer such as 'Adam', got 'Adamm'"),
    ("optimizer-not-mapping", "spec.training.optimizer", "Adam",
     "spec.training.optimizer: must be a mapping, got 'Adam'"),
    ("optimizer-params-list", "spec.training.optimizer.params", [0.1],
     "spec.training.optimizer.params: must be a mapping, got [0.1]"),
    ("unknown-scheduler", "spec.training.lrScheduler.name", "StepLRR",
     "spec.training.lrScheduler.name: must be a torch.optim.lr_scheduler class such as 'StepLR', "
     "got 'StepLRR'"),
    ("scheduler-step-on", "spec.training.lrScheduler.stepOn", "batch",
     "spec.training.lrScheduler.stepOn: must be 'epoch' or 'step', got 'batch'"),
    ("plateau-per-step", "spec.training.lrScheduler",
     {"name": "ReduceLROnPlateau", "stepOn": "step"},
     "spec.training.lrScheduler: ReduceLROnPlateau steps on the validation loss, after each "
     "validation: stepOn must be 'epoch', got 'step'"),
    ("unknown-criterion", "spec.training.criterion.name", "CrossEntropy",
     "spec.training.criterion.name: must be a torch.nn loss such as 'CrossEntropyLoss' or an "
     "entrypoint 'package.module:callable', got 'CrossEntropy'"),
    ("criterion-bad-entrypoint", "spec.training.criterion.name", "losses:focal:v2",
     "spec.training.criterion.name: must look like 'package.module:callable', "
     "got 'losses:focal:v2'"),
    ("model-entrypoint-format", "spec.model.entrypoint", "ravnest.examples.digits.build_model",
     "spec.model.entrypoint: must look like 'package.module:callable', "
     "got 'ravnest.examples.digits.build_model'"),
    ("model-two-sources", "spec.model.torchscript", "model.pt",
     "spec.model: set exactly one of 'entrypoint' or 'torchscript', got both"),
    ("model-no-source", "spec.model.entrypoint", DELETE,
     "spec.model: set exactly one of 'entrypoint' or 'torchscript', got neither"),
    ("missing-model", "spec.model", DELETE, "spec.model: is required"),
    ("example-input-zero-dim", "spec.model.exampleInput.shape", [32, 0, 8, 8],
     "spec.model.exampleInput.shape: every dimension must be positive, got [32, 0, 8, 8]"),
    ("example-input-dtype", "spec.model.exampleInput.dtype", "float",
     "spec.model.exampleInput.dtype: must be one of float32, float64, float16, bfloat16, int64, "
     "int32, uint8, bool, got 'float'"),
    ("typo-in-training", "spec.training.epoch", 3,
     "spec.training.epoch: unknown field; check its spelling (fields are camelCase)"),
    ("snake-case-field", "spec.data.batch_size", 3,
     "spec.data.batch_size: unknown field; check its spelling (fields are camelCase)"),
    ("non-string-key", "spec.training.optimizer.params.7", 1,
     "spec.training.optimizer.params[7]: keys must be strings, got 7"),
    ("wrong-api-version", "apiVersion", "ravnest.io/v1",
     "apiVersion: must be 'ravnest.io/v1alpha1', got 'ravnest.io/v1'"),
    ("wrong-kind", "kind", "Job", "kind: must be 'RavnestJob', got 'Job'"),
    ("bad-metadata-name", "metadata.name", "Digits_1",
     f"metadata.name: {NAME_RULE}, got 'Digits_1'"),
    ("long-metadata-name", "metadata.name", "d" * 41,
     f"metadata.name: must be at most 40 characters long, got '{'d' * 41}'"),
    ("missing-metadata", "metadata", DELETE, "metadata: is required"),
    ("negative-epochs", "spec.training.epochs", -1,
     "spec.training.epochs: must be greater than 0, got -1"),
    ("epochs-text", "spec.training.epochs", "many",
     "spec.training.epochs: must be an integer, got 'many'"),
    ("bad-schedule", "spec.training.schedule", "fast",
     "spec.training.schedule: must be 'sync' or 'async', got 'fast'"),
    ("bad-compression", "spec.training.compression", "int4",
     "spec.training.compression: must be 'none', 'bf16', 'fp16' or 'int8', got 'int4'"),
    ("int8-without-outer", "spec.training.compression", "int8",
     "spec.training.compression: int8 quantizes the rings' pseudo-gradients, so it needs "
     "training.outer (outer: {optimizer: sgd, lr: 1, momentum: 0} takes the plain mean)"),
    ("smoothing-over-one", "spec.training.validationSmoothing", 2,
     "spec.training.validationSmoothing: must be at most 1, got 2"),
    ("zero-clipping", "spec.training.gradientClipping", {"maxNorm": 0},
     "spec.training.gradientClipping.maxNorm: must be greater than 0, got 0"),
    ("average-optimizer-not-bool", "spec.training.averageOptimizer", 3,
     "spec.training.averageOptimizer: must be true or false, got 3"),
    ("training-not-mapping", "spec.training", "fast",
     "spec.training: must be a mapping, got 'fast'"),
    ("zero-clusters", "spec.plan.clusters", 0, "spec.plan.clusters: must be greater than 0, got 0"),
    ("negative-backoff", "spec.runPolicy", {"backoffLimit": -1},
     "spec.runPolicy.backoffLimit: must be at least 0, got -1"),
    ("bad-clean-pod-policy", "spec.runPolicy", {"cleanPodPolicy": "Some"},
     "spec.runPolicy.cleanPodPolicy: must be 'Running', 'All' or 'None', got 'Some'"),
    ("spec-null", "spec", None, "spec: must be a mapping, got None"),
]


@pytest.mark.parametrize(("path", "value", "expected"), [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
def test_each_mistake_gives_exactly_its_line(path: str, value: Any, expected: str) -> None:
    assert problems(mutated(path, value)) == [expected]


def test_every_problem_is_reported_at_once() -> None:
    doc = mutated("spec.training.epochs", 0)
    doc["spec"]["providers"][1]["ram"] = "-2Gi"
    doc["kind"] = "Job"
    assert problems(doc) == [
        "kind: must be 'RavnestJob', got 'Job'",
        "spec.training.epochs: must be greater than 0, got 0",
        "spec.providers[1].ram: must be a positive quantity, got '-2Gi'",
    ]


def test_long_values_are_shortened_in_the_message() -> None:
    [line] = problems(mutated("spec.providers", {"ram": "x" * 500}))
    assert line.startswith("spec.providers: must be a list, got {'ram': 'xxx")
    assert line.endswith("...") and len(line) < 120


@pytest.mark.parametrize("document", [None, [], ["a"], "RavnestJob", 3],
                         ids=["empty", "empty-list", "list", "string", "number"])
def test_a_document_that_is_not_a_mapping_is_refused(document: Any) -> None:
    got = "an empty document" if document is None else f"a {type(document).__name__}"
    assert problems(document) == [f"<document>: must be a mapping (a RavnestJob), got {got}"]


def test_the_example_parses_with_defaults_filled_in() -> None:
    job = load_job(EXAMPLE)
    assert job.name == "digits"
    spec = job.spec
    assert spec.model.entrypoint == "ravnest.examples.digits:build_model"
    assert spec.model.torchscript is None
    assert spec.model.example_input.shape == [32, 1, 8, 8]
    assert (spec.data.batch_size, spec.data.microbatches, spec.data.shuffle) == (32, 2, True)
    assert spec.training.optimizer.name == "Adam"
    assert spec.training.optimizer.params == {"lr": 0.003}
    assert spec.training.lr_scheduler is not None
    assert spec.training.lr_scheduler.step_on == "epoch"
    assert spec.training.compression == "none"
    assert spec.training.metric == "accuracy"
    assert spec.training.max_in_flight == 4
    assert spec.training.average_optimizer is False
    assert spec.training.gradient_clipping is None
    assert [p.ram for p in spec.providers] == [4, 8, 2, 16, 4, 8]
    assert [p.compute for p in spec.providers] == [1.0, 2.0, 1.0, 2.0, 1.0, 1.0]
    assert all(p.replicas == 1 and p.name is None for p in spec.providers)
    assert spec.plan.clusters == 2 and spec.plan.max_clusters is None
    assert (spec.checkpoint.path, spec.checkpoint.every_steps, spec.checkpoint.keep) == (
        "checkpoints", 40, 2)
    assert spec.run_policy.backoff_limit == 3
    assert spec.run_policy.clean_pod_policy == "Running"
    assert spec.run_policy.suspend is False


def test_to_dict_is_camel_case_and_parses_back_to_the_same_job() -> None:
    job = parse_job(BASE)
    document = job.to_dict()
    assert document["spec"]["training"]["maxInFlight"] == 4
    assert document["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    assert parse_job(document) == job


def test_a_minimal_job_gets_every_default() -> None:
    job = parse_job({
        "apiVersion": "ravnest.io/v1alpha1", "kind": "RavnestJob", "metadata": {"name": "m"},
        "spec": {"model": {"torchscript": "model.pt", "exampleInput": {"shape": [1, 4]}},
                 "data": {"entrypoint": "pkg.data:load"}, "providers": [{"ram": 2}]},
    })
    assert job.spec.model.example_input.dtype == "float32"
    assert (job.spec.data.batch_size, job.spec.data.microbatches, job.spec.data.seed) == (64, 1, 42)
    assert job.spec.training.epochs == 1
    assert job.spec.training.optimizer.name == "Adam"
    assert job.spec.training.criterion.name == "CrossEntropyLoss"
    assert job.spec.training.schedule == "sync"
    assert job.spec.training.lr_scheduler is None


def test_criterion_may_be_an_entrypoint() -> None:
    job = parse_job(mutated("spec.training.criterion.name", "mypkg.losses:focal"))
    assert job.spec.training.criterion.name == "mypkg.losses:focal"


@pytest.mark.parametrize(("quantity", "gigabytes"), [
    (4, 4.0),
    (0.5, 0.5),
    ("4", 4.0),
    ("512Mi", 0.5),
    ("8Gi", 8.0),
    ("1Ti", 1024.0),
    ("1048576Ki", 1.0),
    ("2G", 2e9 / 2**30),
    ("1500M", 1.5e9 / 2**30),
    ("1e9", 1e9),
    (" 1.5Gi ", 1.5),
])
def test_ram_quantities_convert_to_gigabytes(quantity: Any, gigabytes: float) -> None:
    assert parse_gigabytes(quantity) == pytest.approx(gigabytes)
    job = parse_job(mutated("spec.providers[0].ram", quantity))
    assert job.spec.providers[0].ram == pytest.approx(gigabytes)


def test_replicas_expand_in_declaration_order() -> None:
    doc = mutated("spec.providers", [
        {"ram": "8Gi", "replicas": 3, "bandwidth": 100},
        {"ram": 2, "compute": 2},
        {"ram": "512Mi", "replicas": 2},
    ])
    spec = parse_job(doc).spec
    expanded = spec.expanded_providers()
    assert [(p.ram, p.compute) for p in expanded] == [
        (8.0, 1.0), (8.0, 1.0), (8.0, 1.0), (2.0, 2.0), (0.5, 1.0), (0.5, 1.0)]
    assert all(p.replicas == 1 for p in expanded)
    assert [p.bandwidth for p in expanded[:3]] == [100.0] * 3
    assert [p.replicas for p in spec.providers] == [3, 1, 2]


def test_load_job_reports_a_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as err:
        load_job(missing)
    assert err.value.problems == [f"{missing}: cannot read job file (No such file or directory)"]


def test_load_job_reports_a_directory(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as err:
        load_job(tmp_path)
    assert err.value.problems == [f"{tmp_path}: cannot read job file (Is a directory)"]


def test_load_job_reports_a_binary_file(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert err.value.problems == [
        f"{path}: cannot read job file (not UTF-8 text: invalid start byte)"]


@pytest.mark.parametrize(("text", "where", "reason"), [
    ("spec: [", ":1:8", "while parsing a flow node, expected the node content, "
     "but found '<stream end>'"),
    ("a: 1\n--- 2\n", ":2:1", "expected a single document in the stream, "
     "but found another document"),
    ("a: !!python/object:os.system x", ":1:4", "could not determine a constructor for the tag "
     "'tag:yaml.org,2002:python/object:os.system'"),
    ("a: 2001-13-45", "", "month must be in 1..12"),
    ("a: !!int x", "", "invalid literal for int() with base 10: 'x'"),
    ("a: !!timestamp x", "", "'NoneType' object has no attribute 'groupdict'"),
    ("a: " + "9" * 5000, "", "Exceeds the limit (4300 digits) for integer string conversion: "
     "value has 5000 digits; use sys.set_int_max_str_digits() to increase the limit"),
    ("[" * 800 + "]" * 800, "", "maximum recursion depth exceeded"),
], ids=["unclosed", "two-documents", "python-tag", "bad-date", "bad-int", "bad-timestamp",
        "huge-int", "deep-nesting"])
def test_load_job_reports_invalid_yaml_on_one_line(tmp_path: Path, text: str, where: str,
                                                   reason: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_job(path)
    [line] = err.value.problems
    assert line.startswith(f"{path}{where}: not valid YAML: {reason}")
    assert "\n" not in line


@pytest.mark.parametrize(("text", "expected"), [
    ("", "<document>: must be a mapping (a RavnestJob), got an empty document"),
    ("- a\n- b\n", "<document>: must be a mapping (a RavnestJob), got a list"),
])
def test_load_job_refuses_a_document_that_is_not_a_mapping(tmp_path: Path, text: str,
                                                            expected: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert err.value.problems == [expected]


def test_load_job_reports_spec_problems_by_path(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(mutated("spec.providers[2].ram", "-1")))
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert err.value.problems == ["spec.providers[2].ram: must be a positive quantity, got '-1'"]
    assert str(err.value) == "spec.providers[2].ram: must be a positive quantity, got '-1'"


# --- fuzzing: whatever the document holds, only a SpecError with path-qualified lines comes out


def _paths(node: Any, prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


PATHS = _paths(BASE)
KEYS = st.sampled_from(["ram", "name", "params", "entrypoint", "replicas", "shape", "spec",
                        "epochs", "batchSize", "x", "Ram", "batch_size", "clusters", "7"])
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12) | st.sampled_from(["-1", "8Gi", "512Mi", "Adam", "sync",
                                                     "a:b", "1e400", "0", "nan"])
           | st.sampled_from([400, 5000]).map(lambda digits: -(10**digits)))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(KEYS, inner, max_size=3), max_leaves=8)
MUTATION = st.tuples(st.sampled_from(PATHS), st.sampled_from(["set", "add", "delete"]), KEYS,
                     JSON)
PROBLEM = re.compile(r"^(<document>|(apiVersion|kind|metadata|spec)([.]\w+|\[\d+\])*): \S")


def _apply(doc: dict[str, Any], mutation: tuple[Any, ...]) -> None:
    path, action, key, value = mutation
    node: Any = doc
    for step in path[:-1]:
        try:
            node = node[step]
        except (KeyError, IndexError, TypeError):
            return
    if not path:
        if action == "add":
            doc[key] = value
        return
    last = path[-1]
    try:
        if action == "set":
            node[last] = value
        elif action == "delete":
            del node[last]
        elif isinstance(node[last], dict):
            node[last][key] = value
        elif isinstance(node[last], list):
            node[last].append(value)
    except (KeyError, IndexError, TypeError):
        return


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(MUTATION, min_size=1, max_size=4))
def test_any_mutation_gives_a_job_or_path_qualified_spec_errors(
        mutations: list[tuple[Any, ...]]) -> None:
    doc = copy.deepcopy(BASE)
    for mutation in mutations:
        _apply(doc, mutation)
    try:
        parse_job(doc)
    except SpecError as e:
        assert e.problems
        for line in e.problems:
            assert PROBLEM.match(line), line
            assert "\n" not in line
            assert "Input should" not in line and "Value error" not in line, line


@settings(max_examples=100, deadline=None)
@given(JSON)
def test_any_document_gives_a_job_or_spec_errors(document: Any) -> None:
    try:
        parse_job(document)
    except SpecError as e:
        assert all(PROBLEM.match(line) for line in e.problems), e.problems
