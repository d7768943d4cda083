"""Compiled decode steps kept on disk: AOTInductor packages of `DecodeStep`, built once for a model's architecture and
loaded by later processes in seconds, with no tracing.

A package holds the generated C++ of one graph, compiled; not the weights: a process that loads it hands it the loaded
model's own tensors (`load_constants`, user-managed: no copy), so one package serves every checkpoint of an
architecture, and a weight updated in place is read as it is. Two graphs per model (`GRAPHS`): rows in consecutive
slots of the cache, read as views of it, and rows anywhere, gathered; each takes any batch and 1 to MAX_BLOCK tokens
per row (dynamic dimensions, so no shape compiles again after start-up).

A model's packages live in one folder of the cache (`root`), named by the digest of what the generated code depends
on (`key`): the architecture, the tensors' names, shapes and dtypes (the quantization layout with them), the
projections' layouts and kernels, the feature layers, the largest block, torch's version, the CPU's instruction sets
and our kernels' sources. Another key is another folder: a new torch or another CPU builds afresh. A package that does
not load, or no longer matches the model, is removed with a warning and built again; a build holds the folder's lock,
so processes sharing a cache (Ray replicas, `specsample compile` beside `specsample serve`) build each graph once.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from specsample.models import compile_events, row_kernels
from specsample.models.cpu import cpu_flags
from specsample.models.hub import cache_dir

log = logging.getLogger(__name__)

FORMAT = 1  # the layout of a package folder; a change builds every package again
GRAPHS = ("view", "gathered")  # rows in consecutive slots (read as views of the cache), rows anywhere (gathered)
ROOT_ENV = "SPECSAMPLE_COMPILED_STEPS"
# instruction sets the generated code (inductor's vector kernels) and our kernels are compiled for
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


class ExportedStep(nn.Module):
    """`DecodeStep` (models/compiled.py, typed `nn.Module` here: it imports this module) with the arguments an
    AOTInductor package takes: tensors only. For rows in consecutive slots the
    first slot comes as the length of `first [slot + 1]` (a dynamic size; a package's integer inputs cannot be
    dynamic); without `first`, rows are gathered."""

    def __init__(self, step: nn.Module, view: bool) -> None:
        super().__init__()
        self.step, self.view = step, view

    def forward(
        self,
        tokens: Tensor,  # [b, n]
        slots: Tensor,  # [b]
        positions: Tensor,  # [b]
        key_positions: Tensor,  # [length]
        keys: Tensor,  # a KVCache's flat stores
        values: Tensor,
        first: Tensor | None = None,  # [first slot + 1], for a view
    ) -> tuple[Tensor, Tensor | None]:
        start = first.shape[0] - 1 if self.view and first is not None else None
        out: tuple[Tensor, Tensor | None] = self.step(tokens, slots, positions, key_positions, keys, values, start)
        return out


def root() -> Path:
    """The folder of compiled steps: `$SPECSAMPLE_COMPILED_STEPS`, else the specsample cache's `steps` folder."""
    return Path(os.environ[ROOT_ENV]).expanduser() if os.environ.get(ROOT_ENV) else cache_dir() / "steps"


def _tensors(module: nn.Module) -> dict[str, Tensor]:
    return dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))


def key(step: nn.Module, max_block: int) -> dict[str, Any]:
    """What a `DecodeStep`'s generated code depends on (see the module): equal keys, interchangeable packages."""
    model: Any = step.model  # a LlamaModel
    tensors = {name: [list(t.shape), str(t.dtype)] for name, t in _tensors(step).items()}
    layouts = sorted(
        {f"{type(m).__name__}({m.extra_repr()}){getattr(m, '_ours', '')}" for m in model.modules() if not m._modules}
    )
    return {
        "format": FORMAT,
        "config": json.loads(json.dumps(dataclasses.asdict(model.config), default=str)),
        "tensors": hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest(),
        "layouts": layouts,
        "feature_layers": list(model.feature_layers) if model.feature_layers is not None else None,
        "max_block": max_block,
        "device": model.device.type,
        "torch": torch.__version__,
        "isa": sorted(set(ISA_FLAGS) & cpu_flags()),
        "kernels": row_kernels.digest() if row_kernels.available() else None,
        "code": _code_digest(),
    }


def _code_digest() -> str:
    """A hash of the sources a package's graph is traced from (the step, the layers, the projections, RoPE, the
    export): an edit to any of them builds the packages again."""
    hashed = hashlib.sha256()
    here = Path(__file__)
    for name in ("compiled", "layers", "llama", "quant", "rope"):  # read, not imported: they import this module
        hashed.update((here.parent / f"{name}.py").read_bytes())
    hashed.update(here.read_bytes())
    return hashed.hexdigest()[:16]


def folder(step: nn.Module, max_block: int, base: Path | None = None) -> Path:
    """The folder of `step`'s packages under `base` (default `root()`), named by its key's digest."""
    digest = hashlib.sha256(json.dumps(key(step, max_block), sort_keys=True).encode()).hexdigest()[:20]
    return (base or root()) / digest


def ready(where: Path) -> int:
    """How many of a folder's graphs are built (a package is written whole, then renamed into place)."""
    return sum((where / f"{graph}.pt2").exists() for graph in GRAPHS)


@contextmanager
def _locked(where: Path) -> Iterator[None]:
    where.mkdir(parents=True, exist_ok=True)
    with open(where / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _examples(model: Any, view: bool) -> tuple[Tensor, ...]:
    """Inputs to trace a graph with: 2 rows of 3 tokens each (sizes above 1, so none is specialised)."""
    cache = model.new_cache(4, 32)
    slots = torch.tensor([1, 2] if view else [2, 0])
    cache.lengths[slots] = torch.tensor([5, 3])
    positions = cache.lengths[slots].clone()
    tokens = torch.zeros(2, 3, dtype=torch.long, device=model.device)
    inputs = (tokens, slots, positions, torch.arange(8, device=model.device), cache.flat_keys, cache.flat_values)
    return (*inputs, torch.empty(int(slots[0]) + 1)) if view else inputs


def _dynamic_shapes(view: bool, max_block: int) -> tuple[Any, ...]:
    from torch.export import Dim

    batch, auto = Dim("batch", min=1), Dim.AUTO
    shapes: tuple[Any, ...] = (
        {0: batch, 1: Dim("block", min=1, max=max_block)},
        {0: batch},
        {0: batch},
        {0: auto},
        {0: auto, 2: auto},
        {0: auto, 2: auto},
    )
    return (*shapes, {0: Dim("first", min=1)}) if view else shapes


def build(step: nn.Module, graph: str, path: Path, max_block: int) -> float:
    """Export `step` for `graph` and compile it into the package `path` (written whole, then renamed into place);
    returns the seconds it took."""
    start = time.perf_counter()
    view = graph == "view"
    exported = ExportedStep(step, view).eval()
    with torch.no_grad():  # not inference mode: the compile runs the graph on its examples outside it
        program = torch.export.export(
            exported, _examples(step.model, view), dynamic_shapes=_dynamic_shapes(view, max_block), strict=False
        )
    partial = path.with_suffix(f".{os.getpid()}.partial.pt2")
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(partial), inductor_configs={"aot_inductor.package_constants_in_so": False}
    )
    os.replace(partial, path)
    compile_events.graph_compiled()
    return time.perf_counter() - start


class Unusable(Exception):
    """A package that does not load, or does not fit the model it is meant for."""


def load(step: nn.Module, path: Path) -> Any:
    """The package `path`, running on `step`'s own tensors; `Unusable` where it does not load or fit them."""
    try:
        runner = torch._inductor.aoti_load_package(str(path))
        names = runner.get_constant_fqns()
    except Exception as exc:  # torch raises RuntimeError, OSError or its own errors for a damaged archive
        raise Unusable(f"it does not load ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    tensors = {f"step.{name}": tensor for name, tensor in _tensors(step).items()}  # named as in ExportedStep
    missing = [name for name in names if name not in tensors]
    if missing:
        raise Unusable(f"it reads tensors the model lacks ({', '.join(missing[:3])})")
    try:
        runner.load_constants({name: tensors[name] for name in names}, check_full_update=True, user_managed=True)
    except Exception as exc:
        raise Unusable(f"the model's tensors do not fit it ({exc})") from None
    return runner


def open_or_build(
    step: nn.Module, max_block: int, base: Path | None = None, build_missing: bool = True
) -> dict[str, Any]:
    """`step`'s graphs from its folder (`folder`), each loaded (`load`); one missing or unusable is built now where
    `build_missing` (an unusable one removed with a warning first), else the result lacks it."""
    where = folder(step, max_block, base)
    expected = key(step, max_block)
    runners: dict[str, Any] = {}
    for graph in GRAPHS:
        path = where / f"{graph}.pt2"
        runner = _try_load(step, path, where, expected)
        if runner is None and build_missing:
            with _locked(where):
                runner = _try_load(step, path, where, expected)  # another process may have built it meanwhile
                if runner is None:
                    log.info("compiling the decode step's %s graph (1-3 min on a small CPU; kept in %s)", graph, where)
                    (where / "key.json").write_text(json.dumps(expected, indent=1, sort_keys=True))
                    seconds = build(step, graph, path, max_block)
                    log.info("compiled the decode step's %s graph in %.0f s", graph, seconds)
                    runner = load(step, path)
        if runner is not None:
            runners[graph] = runner
    return runners


def _try_load(step: nn.Module, path: Path, where: Path, expected: dict[str, Any]) -> Any:
    """The package at `path` loaded, or None where there is none or it is unusable (then removed, with a warning)."""
    if not path.exists():
        return None
    start = time.perf_counter()
    try:
        stored = json.loads((where / "key.json").read_text())
    except (OSError, ValueError):
        stored = None
    try:
        if stored != expected:
            raise Unusable("it was built for another model, torch or CPU (key.json differs)")
        runner = load(step, path)
    except Unusable as exc:
        log.warning("compiled decode step %s is unusable, building it again: %s", path, exc)
        path.unlink(missing_ok=True)
        return None
    log.info("loaded the decode step's %s graph in %.1f s (%s)", path.stem, time.perf_counter() - start, path)
    return runner
