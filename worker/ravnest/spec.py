"""The RavnestJob spec: one model, one validator, for every front door.

`ravnest run job.yaml`, `ravnest plan`, the seed API and the Kubernetes operator all read a job
through `load_job` / `parse_job`, so a mistake is reported the same way everywhere: one line per
problem, naming the field path, the offending value and what is expected, e.g.
``spec.providers[2].ram: must be a positive quantity, got '-1'``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from ravnest import podsecurity, storing
from ravnest.errors import SpecError, shown

_QUANTITY = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_DECIMAL = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_MANAGER = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
"""A domain-prefixed path, as a Kubernetes Job's managedBy is."""
MANAGER = "ravnest.io/operator"
"""spec.managedBy of the jobs the ravnest operator runs (the default)."""
_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
_KEY = re.compile(r"^[\w-]+$")
_ENTRYPOINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8", "bool")

KNOWN_OPTIMIZERS = frozenset({
    "ASGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "NAdam", "RAdam", "RMSprop",
    "Rprop", "SGD", "SparseAdam"})
KNOWN_SCHEDULERS = frozenset({
    "ChainedScheduler", "ConstantLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts",
    "CyclicLR", "ExponentialLR", "LambdaLR", "LinearLR", "MultiStepLR", "MultiplicativeLR",
    "OneCycleLR", "PolynomialLR", "ReduceLROnPlateau", "SequentialLR", "StepLR"})
KNOWN_LOSSES = frozenset({
    "BCELoss", "BCEWithLogitsLoss", "CTCLoss", "CosineEmbeddingLoss", "CrossEntropyLoss",
    "GaussianNLLLoss", "HingeEmbeddingLoss", "HuberLoss", "KLDivLoss", "L1Loss", "MSELoss",
    "MarginRankingLoss", "MultiLabelMarginLoss", "MultiLabelSoftMarginLoss", "MultiMarginLoss",
    "NLLLoss", "PoissonNLLLoss", "SmoothL1Loss", "SoftMarginLoss", "TripletMarginLoss",
    "TripletMarginWithDistanceLoss"})
"""torch classes every supported torch has, known without importing torch (which takes most of
a second and ~700 MB): `ravnest validate` stays light. Any other name is looked up in torch."""

MAX_DOCUMENT_BYTES = 1 << 20
"""The largest job file `load_job` reads (1 MiB); a job is a few hundred bytes to a few KB."""
MAX_DOCUMENT_VALUES = 100_000
"""The most values (mappings, lists, keys and scalars, each YAML alias counted as the copy it
stands for) a job may hold: ten lines of aliases can stand for 10**9 values."""


def parse_gigabytes(value: Any) -> float:
    """Turn a RAM value into gigabytes (GiB): a bare number is GB as in the seeds'
    node_configs.json, a string may carry a Kubernetes suffix (``512Mi``, ``8Gi``, ``2G``)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number, scale = float(value), float(2**30)
        except OverflowError:
            raise ValueError("must be a positive quantity in GB, got a number too large to use"
                             ) from None
    elif isinstance(value, str) and (m := _QUANTITY.match(value)):
        number = float(m.group(1))
        suffix = m.group(2)
        if not suffix:
            scale = float(2**30)
        elif suffix in _BINARY:
            scale = _BINARY[suffix]
        elif suffix in _DECIMAL:
            scale = _DECIMAL[suffix]
        else:
            raise ValueError("must be a quantity with a suffix Ki, Mi, Gi, Ti, Pi, k, M, G, T "
                             f"or P, got {shown(value)}")
    else:
        raise ValueError(f"must be a positive quantity such as 4 (GB), '512Mi' or '8Gi', "
                         f"got {shown(value)}")
    gigabytes = number * scale / 2**30
    if not math.isfinite(gigabytes) or gigabytes <= 0:
        raise ValueError(f"must be a positive quantity, got {shown(value)}")
    return gigabytes


def is_torch_optimizer(name: str) -> bool:
    """Whether torch.optim has an optimizer class of this name (imports torch)."""
    import torch.optim

    cls = getattr(torch.optim, name, None)
    return isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)


def is_torch_scheduler(name: str) -> bool:
    """Whether torch.optim.lr_scheduler has a class of this name (imports torch)."""
    import torch.optim.lr_scheduler as sched

    return isinstance(getattr(sched, name, None), type)


def is_torch_module(name: str) -> bool:
    """Whether torch.nn has a Module class of this name, such as a loss (imports torch)."""
    import torch.nn

    cls = getattr(torch.nn, name, None)
    return isinstance(cls, type) and issubclass(cls, torch.nn.Module)


class _Model(BaseModel):
    """Strict at the boundary: `true` is no batch size, `"32"` no integer and `"yes"` no
    boolean (an integer is a number, and `ram` takes quantity strings on purpose)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True,
        allow_inf_nan=False, strict=True,
    )


class ExampleInput(_Model):
    """Shape and dtype of one example batch, used to trace and size the model."""

    shape: list[int] = Field(min_length=1)
    dtype: str = "float32"
    high: int | None = None
    """For integer inputs (token ids): exclusive upper bound of the random example values."""

    @field_validator("shape")
    @classmethod
    def _positive_dims(cls, v: list[int]) -> list[int]:
        if any(d <= 0 for d in v):
            raise ValueError(f"every dimension must be positive, got {shown(v)}")
        return v

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in _DTYPES:
            raise ValueError(f"must be one of {', '.join(_DTYPES)}, got {shown(v)}")
        return v


class ModelSpec(_Model):
    """Which model to train: a Python entrypoint or a TorchScript file."""

    entrypoint: str | None = None
    torchscript: str | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)
    example_input: ExampleInput

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, v: str | None) -> str | None:
        if v is not None and not _ENTRYPOINT.match(v):
            raise ValueError(f"must look like 'package.module:callable', got {shown(v)}")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.entrypoint is None) == (self.torchscript is None):
            both = "both" if self.entrypoint is not None else "neither"
            raise ValueError(f"set exactly one of 'entrypoint' or 'torchscript', got {both}")
        return self


class DataSpec(_Model):
    """Where batches come from. The entrypoint returns ``(train_dataset, val_dataset)``."""

    entrypoint: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    batch_size: int = Field(64, gt=0)
    """Samples per cluster per batch."""
    microbatches: int = Field(1, gt=0)
    """Microbatches each batch is split into for the pipeline."""
    seed: int = 42
    shuffle: bool = True

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, v: str) -> str:
        if not _ENTRYPOINT.match(v):
            raise ValueError(f"must look like 'package.module:callable', got {shown(v)}")
        return v

    @field_validator("microbatches")
    @classmethod
    def _microbatches_fit(cls, v: int, info: ValidationInfo) -> int:
        batch_size = info.data.get("batch_size")
        if batch_size is not None and v > batch_size:
            raise ValueError(f"cannot exceed batchSize ({batch_size}), got {v}")
        return v


class NamedCall(_Model):
    """A torch class chosen by name (``Adam``, ``StepLR``, ``CrossEntropyLoss``) plus its params."""

    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class OptimizerSpec(NamedCall):
    """A ``torch.optim`` optimizer by class name."""

    @field_validator("name")
    @classmethod
    def _known_optimizer(cls, v: str) -> str:
        if v not in KNOWN_OPTIMIZERS and not is_torch_optimizer(v):
            raise ValueError(f"must be a torch.optim optimizer such as 'Adam', got {shown(v)}")
        return v


class SchedulerSpec(NamedCall):
    """A ``torch.optim.lr_scheduler`` class by name."""

    step_on: Literal["epoch", "step"] = "epoch"
    """Step the scheduler after every epoch (default) or after every optimizer update.
    ReduceLROnPlateau steps after each validation, on its loss (`validationFrequency`)."""

    @field_validator("name")
    @classmethod
    def _known_scheduler(cls, v: str) -> str:
        if v not in KNOWN_SCHEDULERS and not is_torch_scheduler(v):
            raise ValueError(
                f"must be a torch.optim.lr_scheduler class such as 'StepLR', got {shown(v)}"
            )
        return v

    @model_validator(mode="after")
    def _plateau_steps_on_validation(self) -> SchedulerSpec:
        if self.name == "ReduceLROnPlateau" and self.step_on == "step":
            raise ValueError("ReduceLROnPlateau steps on the validation loss, after each "
                             "validation: stepOn must be 'epoch', got 'step'")
        return self


class CriterionSpec(NamedCall):
    """A ``torch.nn`` loss by class name, or a ``package.module:callable`` entrypoint."""

    @field_validator("name")
    @classmethod
    def _known_criterion(cls, v: str) -> str:
        if ":" in v:
            if not _ENTRYPOINT.match(v):
                raise ValueError(f"must look like 'package.module:callable', got {shown(v)}")
            return v
        if v not in KNOWN_LOSSES and not is_torch_module(v):
            raise ValueError(
                "must be a torch.nn loss such as 'CrossEntropyLoss' or an entrypoint "
                f"'package.module:callable', got {shown(v)}"
            )
        return v


class ClippingSpec(_Model):
    max_norm: float = Field(gt=0)
    """Clip each stage's gradient norm to this value before every optimizer update."""


class OuterSpec(_Model):
    """An outer optimizer on each ring (DiLoCo): at every round the members all-reduce their
    pseudo-gradient (their parameters at the last round minus now) and each applies one step of
    this optimizer to its parameters at the last round. `sgd` with lr 1 and no momentum is the
    plain mean that rings take without it."""

    optimizer: Literal["nesterov", "sgd"] = "nesterov"
    """`nesterov`: SGD with Nesterov momentum, DiLoCo's outer optimizer; `sgd`: SGD with (heavy
    ball) momentum, or none."""
    lr: float = Field(0.7, gt=0, le=10)
    momentum: float = Field(0.9, ge=0, lt=1)

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OuterSpec:
        if self.optimizer == "nesterov" and self.momentum == 0:
            raise ValueError("nesterov needs a momentum above 0 (for none, use optimizer: sgd)")
        return self


class TrainingSpec(_Model):
    epochs: int = Field(1, gt=0)
    optimizer: OptimizerSpec = OptimizerSpec(name="Adam", params={"lr": 1e-3})
    lr_scheduler: SchedulerSpec | None = None
    criterion: CriterionSpec = CriterionSpec(name="CrossEntropyLoss")
    metric: Literal["accuracy", "none"] = "accuracy"
    update_frequency: int = Field(1, gt=0)
    """Batches whose gradients are accumulated before one optimizer update."""
    reduce_factor: int = Field(1, gt=0)
    """Optimizer updates between two ring all-reduces across clusters."""
    average_optimizer: bool = False
    """Also average optimizer state (e.g. Adam moments) in the ring."""
    outer: OuterSpec | None = None
    """An outer optimizer on each ring's pseudo-gradient (DiLoCo); absent: rings take the mean
    of the parameters."""
    compression: Literal["none", "bf16", "fp16", "int8"] = "none"
    """What float32 tensors weigh on the wire: `bf16`/`fp16` for activations, gradients and ring
    pieces; `int8` (with `outer`) sends the rings' pseudo-gradients as int8 codes, one scale per
    256 values, with error feedback (what rounding loses goes into the next round), their other
    tensors as float32, and activations and gradients as bfloat16."""
    ring_transport: Literal["grpc", "tcp"] = "tcp"
    """How ring all-reduce pieces travel: as raw bytes on one authenticated (and, with
    security.tls, mutual-TLS) TCP connection per ring neighbour on a second port (the default:
    several times less CPU per byte, level with or ahead of gloo), or over the workers' gRPC
    servers, one port for everything (see docs/performance.md)."""
    schedule: Literal["sync", "async"] = "sync"
    max_in_flight: int = Field(4, gt=0)
    """Microbatches a root may have in flight (backpressure; bounds staleness in async)."""
    validation_frequency: int = Field(1, gt=0)
    """Epochs between two validations."""
    validation_smoothing: float = Field(1.0, gt=0, le=1)
    """Exponential smoothing factor of the validation loss used to pick the best model."""
    gradient_clipping: ClippingSpec | None = None
    reduce_timeout_seconds: float = Field(30.0, gt=0)
    """How long a ring waits for a peer before the round is recorded as skipped."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """The stages' forward passes and the leaf's loss under autocast to this dtype (weights,
    gradients and optimizer state stay fp32; `fp16` scales the loss, see train/scaling.py); on
    a CPU too. What activations and gradients weigh on the wire is `compression`."""

    @field_validator("compression")
    @classmethod
    def _int8_needs_outer(cls, v: str, info: ValidationInfo) -> str:
        # (an `outer` that failed its own checks is not in info.data: its error is enough)
        if v == "int8" and "outer" in info.data and info.data["outer"] is None:
            raise ValueError("int8 quantizes the rings' pseudo-gradients, so it needs "
                             "training.outer (outer: {optimizer: sgd, lr: 1, momentum: 0} takes "
                             "the plain mean)")
        return v


class Provider(_Model):
    """One compute provider (or ``replicas`` identical ones), as in the seeds' node_configs.json."""

    name: str | None = Field(None, pattern=_NAME, max_length=40)
    ram: Annotated[float, WithJsonSchema({
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "description": "Memory for training: GB as a number, or a quantity string such as "
                       "'512Mi', '8Gi' or '0.5'."})]
    """Memory for training in GB (GiB); strings with a Kubernetes suffix are accepted."""
    bandwidth: float | None = Field(None, gt=0)
    """Network bandwidth in Mbps."""
    compute: float = Field(1.0, gt=0)
    """Relative compute speed (1.0 = reference)."""
    device: str = Field("cpu", json_schema_extra={"pattern": r"^(cpu|cuda(:[0-9]+)?)$"})
    """Where the provider's stage trains: `cpu`, or `cuda` (then `ram` is its GPU memory); for
    `ravnest run` on a machine with several GPUs, `cuda:N`."""
    replicas: int = Field(1, gt=0, le=1000)
    resources: dict[str, Any] | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] | None = None
    image: str | None = None

    @field_validator("ram", mode="before")
    @classmethod
    def _quantity(cls, v: Any) -> float:
        return parse_gigabytes(v)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", v):
            raise ValueError(f"must be cpu, cuda or cuda:N (a GPU's index), got {v!r}")
        return v


class PlanSpec(_Model):
    clusters: int | None = Field(None, gt=0)
    """Number of clusters; chosen by the planner when left out."""
    max_clusters: int | None = Field(None, gt=0)
    resources: dict[str, Any] | None = None
    """On Kubernetes, the planner pod's resources (requests and limits, as in a container); by
    default 500m CPU and 1Gi requested, 4Gi memory limit."""
    timeout_seconds: int = Field(600, gt=0, le=86400)
    """On Kubernetes, how long the planner pod may take, from its creation, before the job fails."""
    spares: Annotated[int | Literal["auto"], WithJsonSchema({
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "description": "Providers kept as hot spares instead of training: a number (the ones "
                       "the plan misses least), or 'auto' (those it does not need). A spare "
                       "runs no stage; when a provider is lost it takes over that provider's "
                       "stage if the stage fits its RAM."})] = 0
    """Providers kept as hot spares instead of training (see `planning.make_plan`)."""

    @field_validator("spares", mode="before")
    @classmethod
    def _spares(cls, v: Any) -> int | str:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1000):
            return v  # type: ignore[no-any-return]
        raise ValueError(f"must be 'auto' or a count from 0 to 1000, got {shown(v)}")


def _location(v: str | None) -> str | None:
    problem = None if v is None else storing.check(v)
    if problem:
        raise ValueError(f"{problem}, got {shown(v)}")
    return v


VOLUME_SOURCES = frozenset({
    "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "configMap", "csi",
    "downwardAPI", "emptyDir", "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk",
    "gitRepo", "glusterfs", "hostPath", "image", "iscsi", "nfs", "persistentVolumeClaim",
    "photonPersistentDisk", "portworxVolume", "projected", "quobyte", "rbd", "scaleIO", "secret",
    "storageos", "vsphereVolume"})
"""The volume sources of a Kubernetes Pod (core/v1 VolumeSource)."""
READ_ONLY_VOLUMES = frozenset({"configMap", "downwardAPI", "image", "projected", "secret"})
DURABLE_VOLUMES = frozenset({
    "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "fc", "flocker",
    "gcePersistentDisk", "glusterfs", "iscsi", "nfs", "persistentVolumeClaim",
    "photonPersistentDisk", "portworxVolume", "quobyte", "rbd", "scaleIO", "storageos",
    "vsphereVolume"})
"""Volume sources whose data outlives the pod and its node: claims and network or cloud disks.
Not emptyDir, ephemeral (a claim made and deleted with the pod), an inline csi volume (CSI's
ephemeral volumes), gitRepo or hostPath (the node's disk: a pod made again may land elsewhere)."""


def durable_volume(volume: dict[str, Any]) -> bool:
    """Whether a volume (a source, named or not) keeps what is written to it past its pod."""
    return any(k in DURABLE_VOLUMES for k in volume)


class CheckpointSpec(_Model):
    path: str = "checkpoints"
    """Where checkpoints go, shared by all nodes: a path (relative: in the node's output folder;
    on Kubernetes the pod's, lost with it unless ``volume`` is mounted there), ``s3://bucket/prefix``
    or ``pvc://claim/path`` (storage that outlives the pods), or another fsspec URI."""
    every_steps: int = Field(0, ge=0)
    """Optimizer updates between checkpoints; 0 checkpoints at the end of every epoch only."""
    keep: int = Field(2, gt=0)
    resume: Literal["auto", "force"] = "auto"
    """A checkpoint folder belongs to one job (`ravnest.run.owning`): another job's is refused.
    auto: resume from this job's checkpoints when its training settings are those they were
    written with (else the job is refused, naming each change); force: resume from them even
    so, and from those of an earlier job of the same name (on Kubernetes, one deleted and made
    again)."""
    volume: dict[str, Any] | None = None
    """A Kubernetes volume source (e.g. persistentVolumeClaim) mounted at ``path`` in pods."""

    _path_form = field_validator("path")(_location)

    @field_validator("volume")
    @classmethod
    def _volume_source(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        kinds = sorted(str(k) for k in v)
        if len(kinds) != 1:
            raise ValueError(f"must be one volume source (e.g. persistentVolumeClaim: "
                             f"{{claimName: ...}}), got {shown(kinds) if kinds else 'none'}"
                             + ("; the operator names the volume" if "name" in v else ""))
        kind = kinds[0]
        if kind not in VOLUME_SOURCES:
            raise ValueError(f"{shown(kind)} is not a volume source; one of "
                             f"{', '.join(sorted(VOLUME_SOURCES))}")
        if kind in READ_ONLY_VOLUMES:
            raise ValueError(f"a {kind} volume is read-only: checkpoints could not be written")
        if not isinstance(v[kind], dict):
            raise ValueError(f"{kind}: must be a mapping, got {shown(v[kind])}")
        return v


class OutputSpec(_Model):
    uri: str | None = None
    """Where the trained model, its learning curve and summary go: ``s3://bucket/prefix``,
    ``pvc://claim/path`` or a path; locally, by default, the run's folder. On Kubernetes,
    without one, nothing trained outlives the pods."""
    resources: dict[str, Any] | None = None
    """On Kubernetes, the finishing pod's resources (it holds the whole fused model); by default
    those of the planner pod."""
    timeout_seconds: int = Field(1800, gt=0, le=86400)
    """On Kubernetes, how long the finishing pod may take before the job fails."""

    _uri_form = field_validator("uri")(_location)


class S3Storage(_Model):
    endpoint_url: str | None = Field(None, pattern=r"^https?://[^\s/]+(/\S*)?$")
    """An S3-compatible store's endpoint (``http://minio.storage:9000``); none: AWS's."""
    region: str | None = None
    """The region (none: ``AWS_DEFAULT_REGION``, else the library's default)."""
    credentials_secret: str | None = Field(None, pattern=_SUBDOMAIN, max_length=253)
    """On Kubernetes, a Secret in the job's namespace holding ``AWS_ACCESS_KEY_ID`` and
    ``AWS_SECRET_ACCESS_KEY`` (and optionally ``AWS_SESSION_TOKEN``), given to the workers as those
    environment variables. Locally (`ravnest run`), the environment's own are used."""


class StorageSpec(_Model):
    """How to reach the storage the job's locations name."""

    s3: S3Storage = S3Storage()

    def options(self, pvc_root: str = storing.PVC_ROOT) -> storing.Options:
        return storing.Options(endpoint_url=self.s3.endpoint_url, region=self.s3.region,
                               pvc_root=pvc_root)


class RunPolicy(_Model):
    backoff_limit: int = Field(3, ge=0)
    recovery: Literal["cluster", "job"] = "cluster"
    """What a lost worker costs. cluster (elastic): only its cluster is restarted, takes its state
    from the other clusters and rejoins at a round boundary while they train on (with one
    cluster, or when no other cluster is whole, the job restarts from its newest checkpoint);
    job: every worker restarts from the newest checkpoint. The same on `ravnest run` (the runner
    restarts the cluster's processes) and on Kubernetes (the operator recreates its pods)."""
    recovery_limit: int = Field(10, ge=0)
    """How many times, in all, clusters are restarted alone; past that a loss restarts the whole
    job, which backoffLimit counts."""
    active_deadline_seconds: int | None = Field(None, gt=0)
    ttl_seconds_after_finished: int | None = Field(None, ge=0)
    clean_pod_policy: Literal["Running", "All", "None"] = "Running"
    suspend: bool = False
    """No pods while true (spec.suspend says the same: either suspends the job)."""
    scheduling_timeout_seconds: int | None = Field(None, gt=0)
    """On Kubernetes, how long a worker pod made for the job may stay unscheduled (Pending, not
    placed on a node) before the job gives up its pods (`schedulingTimeoutAction`): on a busy
    cluster the pods placed would otherwise hold their nodes while the rest wait, for ever."""
    scheduling_timeout_action: Literal["Fail", "Suspend"] = "Fail"
    """What a job whose pods stayed unscheduled past schedulingTimeoutSeconds does: Fail, or
    Suspend (spec.suspend is set: set it false again, or let a queue do so, to try again)."""


class SecuritySpec(_Model):
    """How the job's workers authenticate each other, on top of the job's token."""

    tls: bool = False
    """Mutual TLS between workers, with a certificate authority made for this job alone (by the
    operator, or by `ravnest run`); the job token is checked on top."""


RESERVED_VOLUMES = ("node-metadata", "ravnest-plan", "data", "tmp", "tls", "identity", "job",
                    "claim-0", "claim-1", "drain")
"""Volume names of the job's pods the operator sets; a pod template may not reuse them."""
RESERVED_MOUNTS = ("/etc/ravnest", "/etc/ravnest-plan", "/ravnest", "/tmp", "/etc/ravnest-tls",
                   "/etc/ravnest-identity", "/etc/ravnest-drain", storing.PVC_ROOT)
"""Mount paths of the job's containers the operator sets (and below `storing.PVC_ROOT`, where
the claims of ``pvc://`` locations go)."""


class TemplateMetadata(_Model):
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class TemplateContainer(_Model):
    """What a pod template may set on the job's container (`ravnest`, the worker or planner):
    merged over the operator's; command, args, image and ports stay the operator's."""

    name: Literal["ravnest"] = "ravnest"
    env: list[dict[str, Any]] | None = None
    env_from: list[dict[str, Any]] | None = None
    resources: dict[str, Any] | None = None
    """Merged over the operator's requests and limits (e.g. `nvidia.com/gpu: 1`)."""
    volume_mounts: list[dict[str, Any]] | None = None
    volume_devices: list[dict[str, Any]] | None = None
    security_context: dict[str, Any] | None = None
    """Merged over the operator's hardening: a key set here overrides it."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    working_dir: str | None = None

    @field_validator("env")
    @classmethod
    def _own_env(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, e in enumerate(v or []):
            name = e.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(f"env[{i}] needs a name")
            if name.startswith("RAVNEST_"):
                raise ValueError(f"env[{i}]: {name} is set by the operator")
        return v

    @field_validator("volume_mounts")
    @classmethod
    def _own_mounts(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, m in enumerate(v or []):
            path = str(m.get("mountPath", "")).rstrip("/")
            if path in RESERVED_MOUNTS or path.startswith(f"{storing.PVC_ROOT}/"):
                raise ValueError(f"volumeMounts[{i}]: {path} is mounted by the operator")
        return v


class TemplatePodSpec(_Model):
    """The pod fields a template may set; the rest (hostname, subdomain, restartPolicy, the
    container's command) is the operator's. Lists are added to the operator's, mappings merged."""

    containers: list[TemplateContainer] | None = Field(None, max_length=1)
    init_containers: list[dict[str, Any]] | None = None
    volumes: list[dict[str, Any]] | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] | None = None
    affinity: dict[str, Any] | None = None
    topology_spread_constraints: list[dict[str, Any]] | None = None
    image_pull_secrets: list[dict[str, Any]] | None = None
    service_account_name: str | None = None
    automount_service_account_token: bool | None = None
    priority_class_name: str | None = None
    priority: int | None = None
    preemption_policy: Literal["PreemptLowerPriority", "Never"] | None = None
    runtime_class_name: str | None = None
    scheduler_name: str | None = None
    security_context: dict[str, Any] | None = None
    """Merged over the operator's pod security context: a key set here overrides it."""
    dns_policy: Literal["ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"] | None = None
    dns_config: dict[str, Any] | None = None
    host_aliases: list[dict[str, Any]] | None = None
    termination_grace_period_seconds: int | None = Field(None, ge=0)

    @field_validator("volumes")
    @classmethod
    def _own_volumes(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, vol in enumerate(v or []):
            if vol.get("name") in RESERVED_VOLUMES:
                raise ValueError(f"volumes[{i}]: the name {vol['name']!r} is the operator's")
        return v


class PodTemplate(_Model):
    """`spec.template`: merged over the job's worker and planner pods (see the operator's
    `templating`)."""

    metadata: TemplateMetadata | None = None
    spec: TemplatePodSpec | None = None


class JobSpec(_Model):
    model: ModelSpec
    data: DataSpec
    training: TrainingSpec = TrainingSpec()
    providers: list[Provider] = Field(min_length=1)
    plan: PlanSpec = PlanSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    output: OutputSpec = OutputSpec()
    storage: StorageSpec = StorageSpec()
    run_policy: RunPolicy = RunPolicy()
    security: SecuritySpec = SecuritySpec()
    image: str | None = None
    template: PodTemplate | None = None
    """On Kubernetes, a pod template merged over the job's worker and planner pods."""
    suspend: bool | None = None
    """No pods while true, as runPolicy.suspend (either suspends the job): the field a Kubernetes
    Job has, which queues such as Kueue set to hold a job and clear to admit it. A job created
    suspended is planned only once resumed."""
    managed_by: str | None = Field(None, min_length=1, max_length=63, pattern=_MANAGER)
    """The controller that runs the job: `MANAGER` (the default) or another one (a queue's
    multi-cluster dispatcher, say), whose jobs the operator leaves alone. Immutable."""

    @property
    def suspended(self) -> bool:
        """Whether the job is suspended (spec.suspend or runPolicy.suspend)."""
        return bool(self.suspend) or self.run_policy.suspend

    def expanded_providers(self) -> list[Provider]:
        """Providers with ``replicas`` expanded, in declaration order."""
        out: list[Provider] = []
        for p in self.providers:
            out.extend([p.model_copy(update={"replicas": 1})] * p.replicas)
        return out


class Metadata(_Model):
    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(pattern=_NAME, max_length=40)
    namespace: str | None = None
    uid: str | None = Field(None, max_length=64)
    """On Kubernetes, the RavnestJob's uid (the operator fills it in for the job's pods): what
    tells this job from an earlier one of the same name."""


class Job(_Model):
    """A whole RavnestJob document (the same shape as the Kubernetes resource)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )
    api_version: Literal["ravnest.io/v1alpha1"]
    kind: Literal["RavnestJob"]
    metadata: Metadata
    spec: JobSpec

    @property
    def name(self) -> str:
        return self.metadata.name

    def to_dict(self) -> dict[str, Any]:
        """The job as a plain camelCase document, defaults filled in."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def _path(loc: tuple[int | str, ...]) -> str:
    """`spec.providers[2].ram`; a key that is not a plain name is quoted: `kwargs['a b']`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out and not _KEY.match(part):
            out += f"[{shown(part)}]"
        else:
            out += ("." if out else "") + part
    return out


def _number(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _items(n: int) -> str:
    return f"{n} item" if n == 1 else f"{n} items"






_MAPPING = "must be a mapping"
_EXPECTED: dict[str, str] = {
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "int_parsing_size": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": _MAPPING,
    "model_type": _MAPPING,
    "model_attributes_type": _MAPPING,
    "invalid_key": "keys must be strings",
}


def _message(err: dict[str, Any]) -> str:
    """One pydantic error as 'what is expected, got <value>', without pydantic's jargon."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden" and "template" in err["loc"]:
        return ("not a field a pod template may set: the operator sets hostname, subdomain, "
                "restartPolicy and the container's command, args, image and ports (or check its "
                "spelling; fields are camelCase)")
    if kind == "extra_forbidden":
        return "unknown field; check its spelling (fields are camelCase)"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", err["msg"]))
    if err["loc"] and err["loc"][-1] == "[key]":
        expected = "keys must be strings"
    elif kind in _EXPECTED:
        expected = _EXPECTED[kind]
    elif kind == "greater_than":
        expected = f"must be greater than {_number(ctx['gt'])}"
    elif kind == "greater_than_equal":
        expected = f"must be at least {_number(ctx['ge'])}"
    elif kind == "less_than":
        expected = f"must be less than {_number(ctx['lt'])}"
    elif kind == "less_than_equal":
        expected = f"must be at most {_number(ctx['le'])}"
    elif kind == "literal_error":
        expected = f"must be {ctx['expected']}"
    elif kind == "string_pattern_mismatch" and ctx.get("pattern") == _NAME:
        expected = ("must be a lowercase name of letters, digits and '-' that starts and ends "
                    "with a letter or digit")
    elif kind == "string_too_long":
        expected = f"must be at most {ctx['max_length']} characters long"
    elif kind == "too_short":
        expected = f"must have at least {_items(ctx['min_length'])}"
    elif kind == "too_long":
        expected = f"must have at most {_items(ctx['max_length'])}"
    else:
        msg = str(err["msg"])
        expected = "must be " + msg.removeprefix("Input should be ") if msg.startswith(
            "Input should be ") else msg[:1].lower() + msg[1:]
    return f"{expected}, got {shown(value)}"


_M = TypeVar("_M", bound=BaseModel)


def _too_many_values(count: str) -> str:
    return (f"too large: holds {count} values (each alias counted as the copy it stands for); "
            f"a job may hold at most {MAX_DOCUMENT_VALUES}")


def _bounded(document: Any) -> None:
    """Refuse an object tree of more than MAX_DOCUMENT_VALUES values, counting a shared (or
    cyclic) part each time it is reached, without walking more than that bound."""
    count, stack = 0, [document]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_DOCUMENT_VALUES:
            more = f"more than {MAX_DOCUMENT_VALUES}"
            raise SpecError([f"<document>: {_too_many_values(more)}"])
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)


def parse_job(document: Any, *, template_allow: Collection[str] | None = ()) -> Job:
    """Validate a parsed YAML/JSON document; raise SpecError listing every problem by path.

    `spec.template` is held to Pod Security's restricted level (`ravnest.podsecurity`) but for
    what `template_allow` names (`podsecurity.EXEMPTIONS`: a cluster admin's choice for the
    job's namespace). None skips that check, for the copies of a job the operator wrote itself
    (its plan's, a node's metadata), checked when the job was admitted."""
    if not isinstance(document, dict):
        got = "an empty document" if document is None else f"a {type(document).__name__}"
        raise SpecError([f"<document>: must be a mapping (a RavnestJob), got {got}"])
    _bounded(document)
    job = parse_section(Job, document)
    if template_allow is None:
        return job
    found: list[podsecurity.Problem] = []
    if job.spec.template is not None:
        template = job.spec.template.model_dump(by_alias=True, exclude_none=True)
        found += [(("spec", "template", *loc), what)
                  for loc, what in podsecurity.problems(template, template_allow)]
    if job.spec.checkpoint.volume is not None:
        found += [(("spec", "checkpoint", "volume", *loc), what) for loc, what in
                  podsecurity.volume_problems(job.spec.checkpoint.volume, template_allow)]
    if found:
        raise SpecError([f"{_path(loc)}: {what}" for loc, what in found])
    return job


def parse_section(model: type[_M], document: dict[str, Any]) -> _M:
    """Validate one part of a job (e.g. the seed API's arguments as a `TrainingSpec`); raise
    SpecError listing every problem by its path, as `parse_job` does."""
    try:
        return model.model_validate(document)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = tuple(p for p in err["loc"] if p != "[key]")
            problems.append(f"{_path(loc) or '<document>'}: {_message(dict(err))}")
        raise SpecError(problems) from None


def _expanded_size(root: yaml.Node) -> int:
    """How many values a composed YAML document stands for once its aliases are expanded (an
    alias shares its anchor's node): each node is visited once, so a billion-laughs file costs
    its own size; a document that contains itself stands for infinitely many."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            on_path.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in _children(node))
        elif id(node) in on_path:
            raise SpecError([f"<document>: {_too_many_values('infinitely many')} (an alias "
                             "inside its own anchor)"])
        elif id(node) not in sizes:
            on_path.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node))
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _duplicate_keys(root: yaml.Node) -> list[str]:
    """`spec.data.batchSize: given twice (lines 14 and 16)...` for each key a mapping repeats
    (PyYAML would let the last one win silently); merge keys (`<<`) are not keys."""
    problems: list[tuple[int, str]] = []
    stack: list[tuple[yaml.Node, tuple[int | str, ...]]] = [(root, ())]
    while stack:
        node, loc = stack.pop()
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, (*loc, i)) for i, child in enumerate(node.value))
        if not isinstance(node, yaml.MappingNode):
            continue
        first: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            line = key.start_mark.line + 1
            if (key.tag, key.value) in first:
                problems.append((line, f"{_path((*loc, key.value))}: given twice (lines "
                                       f"{first[key.tag, key.value]} and {line}); keep one"))
            first.setdefault((key.tag, key.value), line)
            stack.append((value, (*loc, key.value)))
    return [problem for _, problem in sorted(problems)]


class _JobLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses, before it builds them, documents standing for more
    than MAX_DOCUMENT_VALUES values and mappings that give a key twice."""

    def construct_document(self, node: yaml.Node) -> Any:
        size = _expanded_size(node)
        if size > MAX_DOCUMENT_VALUES:
            raise SpecError([f"<document>: {_too_many_values(str(size))}"])
        if problems := _duplicate_keys(node):
            raise SpecError(problems)
        return super().construct_document(node)


def _read(p: Path) -> str:
    try:
        with p.open("rb") as f:
            data = f.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as e:
        raise SpecError([f"{p}: cannot read job file ({e.strerror})"]) from e
    if len(data) > MAX_DOCUMENT_BYTES:
        raise SpecError([f"{p}: a job file may be at most {MAX_DOCUMENT_BYTES} bytes, "
                         "this one is larger"])
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise SpecError([f"{p}: cannot read job file (not UTF-8 text: {e.reason})"]) from e


def load_job(path: str | Path) -> Job:
    """Read and validate a job file of at most MAX_DOCUMENT_BYTES standing for at most
    MAX_DOCUMENT_VALUES values."""
    p = Path(path)
    text = _read(p)
    try:
        document = yaml.load(text, Loader=_JobLoader)  # a SafeLoader: no Python tags
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        parts = [getattr(e, "context", None), getattr(e, "problem", None)]
        reason = ", ".join(filter(None, parts)) or str(e).splitlines()[0]
        raise SpecError([f"{where}: not valid YAML: {reason}"]) from e
    except (ValueError, AttributeError, TypeError, RecursionError) as e:
        # PyYAML's scalar constructors raise plain errors on values such as `2001-13-45`,
        # `!!int x` or a 5000-digit number, and its composer recurses on deep nesting.
        raise SpecError([f"{p}: not valid YAML: {str(e).splitlines()[0]}"]) from e
    return parse_job(document)
