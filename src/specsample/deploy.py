"""Ray Serve deployment of the specsample OpenAI API: the same routes as `specsample serve`, with each
replica holding its own target, draft and running batch.

    serve run specsample.deploy:app                              # defaults: 1 replica, default models
    serve run specsample.deploy:builder model=PATH replicas=2    # application builder with args
    serve deploy serve_config.yaml                               # see docs/serving.md
    specsample serve --replicas 2 [--ray-address ADDR] [--autoscale 1:4]

Metrics are aggregated at the ingress: every replica pushes its Prometheus exposition (labelled
`replica=<id>`) to a small hub actor every few seconds, and `/metrics` on any replica returns the
merged text of all live replicas.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from ray import serve

from specsample.server.options import DEFAULT_MAX_BODY_BYTES, ServerOptions
from specsample.speculator import DEFAULT_TARGET, EngineOptions

log = logging.getLogger("specsample.deploy")
HUB_NAME = "specsample-metrics-hub"
HUB_NAMESPACE = "specsample"


@dataclass(frozen=True)
class ReplicaSettings:
    """Per-replica settings (flags of `specsample serve`, or `args` in a Serve config YAML)."""

    model: str = DEFAULT_TARGET
    draft: str | None = None
    gamma: str = "auto"  # an integer, or "auto"
    max_gamma: int = 8
    tree: str = "off"  # see `specsample serve --tree`
    max_batch_size: int = 8
    max_model_len: int = 2048
    served_model_name: str | None = None
    api_key: str | None = None
    min_acceptance: float | None = None
    dtype: str = "auto"
    device: str = "cpu"
    quantize: str = "auto"  # see `specsample serve --quantize`
    quant_group: int = 32  # see `specsample serve --quant-group`
    draft_quantize: str = "auto"  # see `specsample serve --draft-quantize`
    pad_rows: str = "auto"  # see `specsample serve --pad-rows`
    draft_window: str = "auto"  # see `specsample serve --draft-window`
    admin_key: str | None = None  # see `specsample serve --admin-key`
    models_dir: str | None = None  # see `specsample serve --models-dir`
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # see `specsample serve --max-body-bytes`
    sampling: str | None = None  # see `specsample serve --sampling`
    deterministic: bool = False  # see `specsample serve --deterministic`
    compile: bool = False  # see `specsample serve --compile`
    prefix_cache_rows: int = 4  # see `specsample serve --prefix-cache-rows`
    suffix_cache_scope: str = "global"  # see `specsample serve --suffix-cache-scope` (each replica holds its own)

    def __post_init__(self) -> None:
        self.engine_options()  # bad settings fail here, before any replica loads a model
        self.server_options()

    def engine_options(self) -> EngineOptions:
        return EngineOptions(target=self.model, draft=self.draft, gamma=self.gamma, max_gamma=self.max_gamma,
                             tree=self.tree, dtype=self.dtype, device=self.device, pad_rows=self.pad_rows,
                             draft_window=self.draft_window, quantize=self.quantize, quant_group=self.quant_group,
                             draft_quantize=self.draft_quantize, sampling=self.sampling,
                             deterministic=self.deterministic, compile=self.compile,
                             suffix_cache_scope=self.suffix_cache_scope)

    def server_options(self, replica_id: str | None = None) -> ServerOptions:
        return ServerOptions(model_name=self.served_model_name or self.model, api_key=self.api_key,
                             min_acceptance=self.min_acceptance, max_batch_size=self.max_batch_size,
                             max_model_len=self.max_model_len, replica_id=replica_id, admin_key=self.admin_key,
                             models_dir=self.models_dir, max_body_bytes=self.max_body_bytes,
                             prefix_cache_rows=self.prefix_cache_rows)

    @classmethod
    def of(cls, options: EngineOptions, serving: ServerOptions) -> ReplicaSettings:
        """The settings of `specsample serve`'s options."""
        return cls(model=options.target, draft=options.draft, gamma=str(options.gamma), max_gamma=options.max_gamma,
                   tree=options.tree,
                   max_batch_size=serving.max_batch_size, max_model_len=serving.max_model_len,
                   served_model_name=serving.model_name, api_key=serving.api_key,
                   min_acceptance=serving.min_acceptance, dtype=options.dtype, device=options.device,
                   quantize=options.quantize, quant_group=options.quant_group, draft_quantize=options.draft_quantize,
                   pad_rows=options.pad_rows, draft_window=options.draft_window, admin_key=serving.admin_key,
                   models_dir=serving.models_dir, max_body_bytes=serving.max_body_bytes, sampling=options.sampling,
                   deterministic=options.deterministic, compile=options.compile,
                   prefix_cache_rows=serving.prefix_cache_rows, suffix_cache_scope=options.suffix_cache_scope)

    def as_args(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> ReplicaSettings:
        known = {f.name: f.type for f in fields(cls)}
        unknown = set(args) - set(known) - {"replicas", "autoscale", "num_cpus", "num_gpus"}
        if unknown:
            raise ValueError(f"unknown specsample deployment argument(s): {', '.join(sorted(unknown))}")
        casts = {"max_gamma": int, "max_batch_size": int, "max_model_len": int, "min_acceptance": float,
                 "max_body_bytes": int, "prefix_cache_rows": int, "quant_group": int, "deterministic": _flag,
                 "compile": _flag}
        return cls(**{k: v if v is None else casts.get(k, lambda v: v)(v) for k, v in args.items() if k in known})


def _flag(value: Any) -> bool:
    """A boolean deployment argument, given as a bool or as text (true/false, yes/no, 1/0)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1"):
        return True
    if text in ("false", "no", "0"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _hub():
    import ray

    @ray.remote(num_cpus=0)
    class MetricsHub:
        """Latest Prometheus text of every replica."""

        def __init__(self) -> None:
            self.texts: dict[str, tuple[float, str]] = {}

        def push(self, replica: str, text: str) -> None:
            self.texts[replica] = (time.time(), text)

        def collect(self, max_age: float = 30.0) -> list[str]:
            now = time.time()
            return [text for seen, text in self.texts.values() if now - seen <= max_age]

    return MetricsHub.options(name=HUB_NAME, namespace=HUB_NAMESPACE, get_if_exists=True,
                              lifetime="detached").remote()


@serve.deployment(name="SpecsampleReplica", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64)
@serve.ingress()
class SpecsampleReplica:
    """One replica: loads the pair, runs its own engine thread, serves the shared FastAPI routes."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from specsample.server.app import SpecServer
        from specsample.speculator import load

        s = ReplicaSettings(**settings)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id if context is not None else "local"
        self.server = SpecServer(load(s.engine_options()), s.server_options(self.replica_id))
        self.hub = _hub()
        self.server.metrics_text = self._aggregated_metrics
        self._pusher = threading.Thread(target=self._push_metrics, daemon=True)
        self._pusher.start()

    def __serve_build_asgi_app__(self):
        from specsample.server.app import build_app

        return build_app(self.server)  # the very routes `specsample serve` runs

    def _push_metrics(self) -> None:
        while True:
            try:
                self.hub.push.remote(self.replica_id, self.server.metrics.render().decode())
            except Exception:  # the hub may be restarting; metrics must never break serving
                log.debug("metrics push failed", exc_info=True)
            time.sleep(2.0)

    def _aggregated_metrics(self) -> bytes:
        import ray

        from specsample.server.metrics import merge_expositions

        self.hub.push.remote(self.replica_id, self.server.metrics.render().decode())
        return merge_expositions(ray.get(self.hub.collect.remote(), timeout=10)).encode()


def deployment_options(replicas: int = 1, autoscale: str | None = None, num_cpus: float = 1.0,
                       num_gpus: float = 0.0, max_batch_size: int = 8) -> dict[str, Any]:
    """Serve options: a fixed replica count, or autoscaling on ongoing requests ('MIN:MAX')."""
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus}}
    if autoscale:
        low, _, high = autoscale.partition(":")
        if not (low.isdigit() and high.isdigit() and 0 < int(low) <= int(high)):
            raise ValueError(f"--autoscale takes MIN:MAX with 0 < MIN <= MAX, got {autoscale!r}")
        options["autoscaling_config"] = {"min_replicas": int(low), "max_replicas": int(high),
                                         "target_ongoing_requests": max_batch_size}
    else:
        if replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {replicas}")
        options["num_replicas"] = replicas
    return options


def builder(args: dict[str, Any]):
    """Serve application builder: `serve run specsample.deploy:builder model=... replicas=2`."""
    settings = ReplicaSettings.from_args(args)
    options = deployment_options(int(args.get("replicas", 1)), args.get("autoscale"),
                                 float(args.get("num_cpus", 1)), float(args.get("num_gpus", 0)),
                                 settings.max_batch_size)
    return SpecsampleReplica.options(**options).bind(asdict(settings))


app = SpecsampleReplica.bind(asdict(ReplicaSettings()))
