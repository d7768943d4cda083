"""Build the compiled decode steps a set of engine options will run, into the cache of compiled steps
(models/artifacts.py), apart from serving: `specsample compile` (ahead of time: a container build, a replica image) and
the low-priority process a server starts when its steps are missing (server/compile_behind.py, which runs
`python -m specsample.server.compile_worker OPTIONS_JSON`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import replace

from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.model import ModelDrafter
from specsample.models.llama import LlamaModel
from specsample.options import EngineOptions
from specsample.pair import Pair, load_pair

log = logging.getLogger("specsample")


def packaged_models(pair: Pair) -> list[LlamaModel]:
    """The models of `pair` whose decode steps run from compiled packages when compiled: the target and a draft
    model, where they run on our runtime on a CPU (a feature draft's head and the transformers runtime compile in the
    process that runs them, or not at all)."""
    drafter = pair.drafter.model if isinstance(pair.drafter, HybridDrafter) else pair.drafter
    models = [pair.target.model, drafter.model if isinstance(drafter, ModelDrafter) else None]
    return [m for m in models if isinstance(m, LlamaModel) and m.device.type == "cpu"]


def compile_steps(options: EngineOptions, say: Callable[[str], None]) -> int:
    """Load the models `options` name and build each one's missing compiled steps; returns how many models have
    them. Raises `ValueError` where nothing runs from packages (another device, the transformers runtime)."""
    pair = load_pair(replace(options, compile=False))
    models = packaged_models(pair)
    if not models:
        raise ValueError(
            f"nothing to compile ahead of time: {options.target} does not run on our runtime on a CPU "
            "(on a GPU the steps compile when the server starts)"
        )
    from specsample.models.compiled import PackagedDecode

    for model, role in zip(models, ("target", "draft model"), strict=False):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations while it exports
            PackagedDecode.open(model)
        say(f"the {role}'s compiled decode steps are ready ({time.perf_counter() - start:.0f} s)")
    return len(models)


def options_json(options: EngineOptions) -> str:
    """`options` as the JSON this module's process reads."""
    return json.dumps(dataclasses.asdict(options))
