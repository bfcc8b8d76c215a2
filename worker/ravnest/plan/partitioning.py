"""Split a model into contiguous stages with torch.fx, keeping the original parameter names.

The model is traced once into a flat graph of *layers* (every fx node that computes something).
A stage is a contiguous run of layers rebuilt as its own `GraphModule` over the original modules,
so BatchNorm and Dropout still follow `.train()`/`.eval()` and every parameter keeps its original
qualified name (fusing stages back is a plain dict merge). Values that jump over stages (skip
connections) are passed through the stages in between. Cuts are only allowed where every value
crossing them is a tensor.

Profiling runs the traced graph once on the example input, node by node, to record output sizes
and FLOPs (torch's own FLOP counter), which the planner uses as deterministic costs. Both depend
on shapes alone, so the graph runs on fake tensors of the example's shapes (nothing computed,
nothing held: ResNet-50 on a [100, 3, 224, 224] example took 35-194 s and 12 GB computed for
real, holding every node's output), and for real only where fake tensors cannot run the model.

Some submodules are kept whole, as one layer each (`Profile.kept_whole` says which and why):
those marked as leaves the way Ravnest's tracer honours it (a true `_is_leaf_module` attribute,
as in its minGPT sorter example), and those torch.fx cannot trace through (data-dependent
slicing or control flow): when tracing fails inside a submodule, the innermost submodule the
failure came out of is kept whole and the model is traced again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from ravnest.errors import PlanError

log = logging.getLogger(__name__)

_COMPUTE_OPS = ("call_module", "call_function", "call_method", "get_attr")


@dataclass(frozen=True)
class Layer:
    """One fx node of the traced model, with what the planner needs to know about it."""

    name: str
    op: str
    target: str
    state: tuple[str, ...]
    """Parameter and buffer names (original qualified names) this layer owns."""
    params: int
    """Number of parameter elements."""
    param_bytes: int
    buffer_bytes: int
    flops: int
    out_bytes: int
    """Bytes of this layer's output for the example input."""


@dataclass(frozen=True)
class Profile:
    """A traced model: its layers in execution order, and where it may be cut."""

    layers: tuple[Layer, ...]
    inputs: tuple[str, ...]
    cut_ok: tuple[bool, ...]
    """cut_ok[i]: the model may be cut after layer i (everything crossing is a tensor)."""
    cut_bytes: tuple[int, ...]
    """cut_bytes[i]: bytes crossing a cut after layer i, for the example input."""
    example_batch: int
    state_names: tuple[str, ...]
    """All parameter and buffer names, in the model's state_dict order."""
    kept_whole: tuple[tuple[str, str], ...] = ()
    """(qualified name, why) of each submodule traced as one layer although torch.fx would
    have traced through it: marked as a leaf, or not traceable (see `trace`)."""
    method: str = "run"
    """How the figures were taken: `FAKE` (the graph run on fake tensors at the example's full
    batch: shapes, bytes and FLOPs without computing or holding any data) or `RUN` (the example
    computed for real, for a model that fake tensors cannot run; see `_measure`). Both give the
    same figures; only the cost of taking them differs."""

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)


_TRACING = threading.Lock()
"""torch.fx tracing patches module-global state, and FlopCounterMode installs global module hooks
(concurrent profiles failed with "module is not installed as a submodule"): one trace or profile
at a time per process (the operator plans jobs in threads)."""


LEAF_MARKER = "_is_leaf_module"
"""The attribute by which a model marks a submodule as a leaf (Ravnest's tracer honours it: a
submodule whose `_is_leaf_module` is true is not traced through)."""

LeafSpec = type[nn.Module] | str
"""A module class (its instances are leaves) or a module's qualified name."""


class _LeafTracer(fx.Tracer):
    """fx's tracer, also keeping whole the marked modules, the given classes and names, and
    remembering the innermost submodule a tracing failure came out of (`failed_in`)."""

    def __init__(self, leaves: Sequence[LeafSpec], kept: dict[str, str]) -> None:
        super().__init__()
        self.leaf_types = tuple(x for x in leaves if isinstance(x, type))
        self.leaf_names = {x for x in leaves if isinstance(x, str)}
        self.kept = kept
        self.used: dict[str, str] = {}
        """Modules kept whole in this trace, and why, in the order they were first called."""
        self.failure: BaseException | None = None
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        why = self._why_leaf(m, module_qualified_name)
        if why is None:
            return super().is_leaf_module(m, module_qualified_name)
        self.used.setdefault(module_qualified_name, why)
        return True

    def _why_leaf(self, m: nn.Module, name: str) -> str | None:
        if name in self.kept:
            return self.kept[name]
        if getattr(m, LEAF_MARKER, False):
            return f"marked as a leaf ({LEAF_MARKER})"
        if name in self.leaf_names or isinstance(m, self.leaf_types):
            return "named as a leaf"
        return None

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as e:
            if not _caused_by(e, self.failure):
                self.failure, self.failed_in = e, self._name_of(m)
            raise

    def _name_of(self, m: nn.Module) -> str | None:
        try:
            return self.path_of_module(m)
        except Exception:  # not installed as a submodule: nothing to keep whole
            return None


def _caused_by(e: BaseException, cause: BaseException | None) -> bool:
    """Whether `cause` is `e` or in the chain of exceptions `e` was raised from or during."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        if x is cause:
            return True
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    return False


def trace(model: nn.Module, leaves: Sequence[LeafSpec] = ()
          ) -> tuple[fx.GraphModule, tuple[tuple[str, str], ...]]:
    """Symbolically trace a model; name the op that cannot be traced if it fails.

    Returns the graph module and, for each submodule kept whole (one `call_module` layer),
    its qualified name and why. Submodules marked with `LEAF_MARKER`, instances of the classes
    in `leaves` and the modules it names are kept whole; so is a submodule that torch.fx cannot
    trace through (the innermost one the failure came out of; the model is traced again, as
    often as needed). A failure in the model's own forward is a PlanError.
    """
    kept: dict[str, str] = {}
    while True:
        tracer = _LeafTracer(leaves, kept)
        try:
            with _TRACING:
                graph = tracer.trace(model)
        except Exception as e:
            name = tracer.failed_in if _caused_by(e, tracer.failure) else None
            if not name or name in kept:
                raise _untraceable(model, e) from e
            kept[name] = f"torch.fx cannot trace it: {type(e).__name__}: {e}"
            continue
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        return gm, tuple(tracer.used.items())


def _untraceable(model: nn.Module, e: Exception) -> PlanError:
    return PlanError(
        f"model {type(model).__name__} cannot be traced by torch.fx: {type(e).__name__}: {e}. "
        "Data-dependent control flow (if/for on tensor values) must be moved into a submodule "
        f"(which is then kept whole), marked as a leaf ({LEAF_MARKER} = True), or rewritten "
        "with torch.where")


def _owned_state(gm: fx.GraphModule, node: fx.Node) -> list[tuple[str, torch.Tensor, bool]]:
    """(qualified name, tensor, is_parameter) for the state a node owns."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        out: list[tuple[str, torch.Tensor, bool]] = [
            (f"{node.target}.{n}", p, True) for n, p in mod.named_parameters()]
        out += [(f"{node.target}.{n}", b, False) for n, b in mod.named_buffers()]
        return out
    if node.op == "get_attr":
        value = _get_attr(gm, str(node.target))
        if isinstance(value, torch.Tensor):
            return [(str(node.target), value, isinstance(value, nn.Parameter))]
    return []


def _get_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


class _Profiler(fx.Interpreter):
    """Runs the traced graph node by node and keeps, per node, its FLOPs, its output's bytes and
    whether it is a tensor, but not the value itself: the interpreter drops each value after its
    last user, so a real run holds only the live activations (holding every node's output made a
    ResNet-50 at batch 100 peak at 12 GB; now 1.9 GB)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.flops: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}
        self.is_tensor: dict[str, bool] = {}

    def run_node(self, n: fx.Node) -> Any:
        counter = FlopCounterMode(display=False)
        with counter:
            result = super().run_node(n)
        self.flops[n.name] = int(counter.get_total_flops())
        self.nbytes[n.name] = _nbytes(result)
        self.is_tensor[n.name] = isinstance(result, torch.Tensor)
        return result


FAKE = "fake"
"""`Profile.method` of a profile taken on fake tensors (shapes only, nothing computed)."""
RUN = "run"
"""`Profile.method` of a profile taken by computing the example input for real."""

_T = TypeVar("_T")


def _measure(model: nn.Module, run: Callable[[Sequence[Any]], _T],
             example_inputs: Sequence[torch.Tensor], fake: bool) -> tuple[_T, str]:
    """`run(inputs)` in eval mode without autograd, on fake tensors of the example's shapes when
    `fake` and that works, else on the example itself; returns its result and `FAKE` or `RUN`.

    Fake tensors (torch's FakeTensorMode) carry shapes, dtypes and strides but no data, so the
    figures the planner uses (output bytes and FLOPs, both functions of shapes alone) come out
    exactly as a real run at the full example batch gives them, at no memory and little time. A
    model that fake tensors cannot run (shapes or control flow that depend on values, `.item()`,
    an op without a shape function) raises there, and is then run for real: the figures are
    exact either way. The model's training mode is restored afterwards.
    """
    was_training = model.training
    model.eval()
    try:
        if fake:
            try:
                return _on_fake(run, example_inputs), FAKE
            except Exception as e:  # anything fake tensors cannot do: the real run decides
                log.debug("fake tensors cannot run %s (%s: %s); running the example input",
                          type(model).__name__, type(e).__name__, e)
        with _TRACING, torch.no_grad():
            return run(example_inputs), RUN
    finally:
        model.train(was_training)


def _on_fake(run: Callable[[Sequence[Any]], _T], example_inputs: Sequence[torch.Tensor]) -> _T:
    """`run` on fake copies of the inputs; the model's real parameters and buffers become fake
    tensors as they are used (`allow_non_fake_inputs`), without copying their data."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(x) for x in example_inputs]
    with _TRACING, torch.no_grad(), mode:
        return run(fakes)


def _run_graph(gm: fx.GraphModule) -> Callable[[Sequence[Any]], _Profiler]:
    def run(inputs: Sequence[Any]) -> _Profiler:
        profiler = _Profiler(gm)
        profiler.run(*inputs)
        return profiler
    return run


def profile(model: nn.Module, example_inputs: Sequence[torch.Tensor],
            leaves: Sequence[LeafSpec] = (), fake: bool = True) -> tuple[nn.Module, Profile]:
    """Trace and profile a model on an example input.

    Submodules are kept whole as `trace` says (`leaves`: more to keep whole, by class or
    qualified name); the profile lists them. A TorchScript model cannot be traced by torch.fx: it
    is profiled as one indivisible layer, so it trains data-parallel (one stage per cluster).
    The example is run on fake tensors (`fake`, the default) unless the model needs real data
    (see `_measure`); `fake=False` always computes it, the reference the fake run must equal."""
    if isinstance(model, torch.jit.ScriptModule):
        return model, _profile_scripted(model, example_inputs, fake)
    gm, kept_whole = trace(model, leaves)
    try:
        profiler, method = _measure(model, _run_graph(gm), example_inputs, fake)
    except Exception as e:
        raise PlanError(f"model {type(model).__name__} failed on the example input: "
                        f"{type(e).__name__}: {e}") from e
    nodes = list(gm.graph.nodes)
    inputs = tuple(n.name for n in nodes if n.op == "placeholder")
    compute = [n for n in nodes if n.op in _COMPUTE_OPS]
    if not compute:
        raise PlanError(f"model {type(model).__name__} has no layers to split")
    layers = _layers(gm, compute, profiler)
    order = {n.name: i for i, n in enumerate(compute)}
    order.update({name: -1 for name in inputs})
    cut_ok, cut_bytes = [], []
    for i in range(len(compute)):
        crossing = _crossing(nodes, order, i)
        cut_ok.append(i < len(compute) - 1 and all(profiler.is_tensor[c] for c in crossing))
        cut_bytes.append(sum(profiler.nbytes[c] for c in crossing))
    return gm, Profile(layers=layers, inputs=inputs, cut_ok=tuple(cut_ok),
                       cut_bytes=tuple(cut_bytes), example_batch=_batch(example_inputs),
                       state_names=tuple(model.state_dict().keys()),
                       kept_whole=_outermost(kept_whole), method=method)


def _layers(gm: fx.GraphModule, compute: list[fx.Node], profiler: _Profiler) -> tuple[Layer, ...]:
    """One Layer per compute node; a PlanError if two nodes own the same parameter."""
    seen_state: dict[str, str] = {}
    layers = []
    for n in compute:
        state = _owned_state(gm, n)
        for name, _, _ in state:
            if name in seen_state:
                raise PlanError(f"parameter {name!r} is used by layers {seen_state[name]!r} and "
                                f"{n.name!r}; shared weights across layers cannot be split")
            seen_state[name] = n.name
        layers.append(Layer(
            name=n.name, op=n.op, target=str(n.target),
            state=tuple(s[0] for s in state),
            params=sum(t.numel() for _, t, is_p in state if is_p),
            param_bytes=sum(_nbytes(t) for _, t, is_p in state if is_p),
            buffer_bytes=sum(_nbytes(t) for _, t, is_p in state if not is_p),
            flops=profiler.flops.get(n.name, 0), out_bytes=profiler.nbytes.get(n.name, 0),
        ))
    return tuple(layers)


def _batch(example_inputs: Sequence[torch.Tensor]) -> int:
    """The example's batch size: its first input's first dimension (1 for a scalar input)."""
    batch = int(example_inputs[0].shape[0]) if example_inputs and example_inputs[0].dim() else 1
    return max(batch, 1)


def _outermost(kept: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """The kept-whole modules that are not inside another one (kept whole before their parent
    failed too)."""
    names = {name for name, _ in kept}
    return tuple((name, why) for name, why in kept
                 if not any(name.startswith(f"{other}.") for other in names))


def _crossing(nodes: list[fx.Node], order: dict[str, int], i: int) -> list[str]:
    """Names of values produced at or before layer i and used after it."""
    out = []
    for n in nodes:
        if n.name not in order or order[n.name] > i:
            continue
        for user in n.users:
            if user.op == "output" or order.get(user.name, -1) > i:
                out.append(n.name)
                break
    return out


def _profile_scripted(model: torch.jit.ScriptModule, example_inputs: Sequence[torch.Tensor],
                      fake: bool) -> Profile:
    def run(inputs: Sequence[Any]) -> tuple[int, int]:
        counter = FlopCounterMode(display=False)
        with counter:
            out = model(*inputs)
        return int(counter.get_total_flops()), _nbytes(out)

    try:
        (flops, out_bytes), method = _measure(model, run, example_inputs, fake)
    except Exception as e:
        raise PlanError(f"TorchScript model failed on the example input: {e}") from e
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    layer = Layer(name="torchscript", op="call_module", target="",
                  state=tuple(model.state_dict().keys()),
                  params=sum(p.numel() for _, p in params),
                  param_bytes=sum(_nbytes(p) for _, p in params),
                  buffer_bytes=sum(_nbytes(b) for _, b in buffers),
                  flops=flops, out_bytes=out_bytes)
    return Profile(layers=(layer,), inputs=tuple(f"input_{i}" for i in range(len(example_inputs))),
                   cut_ok=(False,), cut_bytes=(0,), example_batch=_batch(example_inputs),
                   state_names=tuple(model.state_dict().keys()), method=method)


class Stage(nn.Module):
    """Layers [start, end) of a traced model as a module: named tensors in, named tensors out."""

    def __init__(self, gm: nn.Module, input_names: tuple[str, ...],
                 output_names: tuple[str, ...], is_last: bool, whole: bool = False) -> None:
        super().__init__()
        self.graph_module = gm
        self.input_names = input_names
        self.output_names = output_names
        self.is_last = is_last
        self.whole = whole
        """The module is a whole (TorchScript) model returning its output, not a tuple."""

    def forward(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.graph_module(*(inputs[n] for n in self.input_names))
        if self.whole:
            return {OUTPUT: out}
        return dict(zip(self.output_names, out, strict=True))

    def stage_state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers under the original model's names (`keep_vars`:
        the Parameter and buffer objects themselves, not detached aliases)."""
        return {k.removeprefix("graph_module."): v
                for k, v in self.state_dict(keep_vars=keep_vars).items()}


OUTPUT = "__output__"


def build_stage(gm: nn.Module, start: int, end: int) -> Stage:
    """Rebuild layers [start, end) of a traced model as a Stage sharing the original modules."""
    if isinstance(gm, torch.jit.ScriptModule):
        if (start, end) != (0, 1):
            raise PlanError("a TorchScript model is one layer: it cannot be split into stages")
        n_inputs = len(list(gm.graph.inputs())) - 1
        return Stage(gm, tuple(f"input_{i}" for i in range(n_inputs)), (OUTPUT,), True, whole=True)
    assert isinstance(gm, fx.GraphModule)
    nodes = list(gm.graph.nodes)
    compute = [n for n in nodes if n.op in _COMPUTE_OPS]
    inputs = [n.name for n in nodes if n.op == "placeholder"]
    if not 0 <= start < end <= len(compute):
        raise PlanError(f"stage layers [{start}, {end}) out of range 0..{len(compute)}")
    order = {n.name: i for i, n in enumerate(compute)}
    order.update({name: -1 for name in inputs})
    live_in = inputs if start == 0 else _crossing(nodes, order, start - 1)
    is_last = end == len(compute)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name in live_in:
        env[name] = graph.placeholder(name)
    for n in compute[start:end]:
        env[n.name] = graph.node_copy(n, lambda x: env[x.name])
    if is_last:
        output_node = next(n for n in nodes if n.op == "output")
        result = fx.node.map_arg(output_node.args[0], lambda x: env[x.name])
        graph.output((result,))
        out_names: tuple[str, ...] = (OUTPUT,)
    else:
        live_out = _crossing(nodes, order, end - 1)
        graph.output(tuple(env[name] for name in live_out))
        out_names = tuple(live_out)
    graph.lint()
    return Stage(fx.GraphModule(gm, graph), tuple(live_in), out_names, is_last)
