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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ray import serve

from specsample.options import DEFAULT_TARGET, EngineOptions
from specsample.options_cli import parse_text, settings
from specsample.server.options import SERVE_ENGINE_DEFAULTS, ServerOptions, serve_engine_options

if TYPE_CHECKING:
    from fastapi import FastAPI

    from specsample.server.state import SpecServer

log = logging.getLogger("specsample.deploy")
HUB_NAME = "specsample-metrics-hub"
HUB_NAMESPACE = "specsample"
# arguments named unlike their fields: as vLLM names them, like serve's flags
RAY_NAMES = {"target": "model", "model_name": "served_model_name", "max_seq_len": "max_model_len"}
PLACEMENT = ("replicas", "autoscale", "num_cpus", "num_gpus")  # the builder's, not a replica's


@dataclass(frozen=True)
class ReplicaSettings:
    """What each replica is started with: the engine's options and the server's (the flags of `specsample serve`, or
    `args` in a Serve config YAML: a field's name, or its RAY_NAMES name, and its value, text included)."""

    engine: EngineOptions = SERVE_ENGINE_DEFAULTS
    server: ServerOptions = field(default_factory=lambda: ServerOptions(model_name=DEFAULT_TARGET))

    def server_options(self, replica_id: str | None = None) -> ServerOptions:
        return replace(self.server, replica_id=replica_id)

    def as_args(self) -> dict[str, Any]:
        """The settings as deployment arguments (what `from_args` reads back)."""
        return {
            RAY_NAMES.get(name, name): getattr(record, name)
            for record in (self.engine, self.server)
            for name in settings(type(record))
        }

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> ReplicaSettings:
        """The settings deployment arguments give (bad ones fail here, before any replica loads a model); the
        served model name defaults to the model's."""
        values: dict[type, dict[str, Any]] = {EngineOptions: {}, ServerOptions: {}}
        known = {RAY_NAMES.get(name, name): (record, name) for record in values for name in settings(record)}
        unknown = set(args) - set(known) - set(PLACEMENT)
        if unknown:
            raise ValueError(f"unknown specsample deployment argument(s): {', '.join(sorted(unknown))}")
        for key, value in args.items():
            if key in known:
                record, name = known[key]
                values[record][name] = parse_text(record, name, value)
        engine = serve_engine_options(values[EngineOptions])
        server = values[ServerOptions]
        server["model_name"] = server.get("model_name") or engine.target
        return cls(engine, ServerOptions(**server))


def _hub() -> Any:  # a Ray actor handle
    import ray

    class MetricsHub:
        """Latest Prometheus text of every replica."""

        def __init__(self) -> None:
            self.texts: dict[str, tuple[float, str]] = {}

        def push(self, replica: str, text: str) -> None:
            self.texts[replica] = (time.time(), text)

        def collect(self, max_age: float = 30.0) -> list[str]:
            now = time.time()
            return [text for seen, text in self.texts.values() if now - seen <= max_age]

    hub = ray.remote(num_cpus=0)(MetricsHub)
    return hub.options(name=HUB_NAME, namespace=HUB_NAMESPACE, get_if_exists=True, lifetime="detached").remote()


class ReplicaServer:
    """One replica: loads the pair, runs its own engine thread, serves the shared FastAPI routes (deployed as
    `SpecsampleReplica`)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id if context is not None else "local"
        self.server = replica_server(settings, self.replica_id)
        self.hub = _hub()
        self.server.metrics_text = self._aggregated_metrics
        self._pusher = threading.Thread(target=self._push_metrics, daemon=True)
        self._pusher.start()

    def __serve_build_asgi_app__(self) -> FastAPI:
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


SpecsampleReplica = serve.deployment(
    name="SpecsampleReplica", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64
)(serve.ingress()(ReplicaServer))


def replica_server(args: dict[str, Any], replica_id: str | None) -> SpecServer:
    """A replica's server: its pair loaded from deployment arguments (`ReplicaSettings.as_args`)."""
    from specsample.server.state import SpecServer
    from specsample.speculator import load

    settings = ReplicaSettings.from_args(args)
    return SpecServer(load(settings.engine, compile_behind=True), settings.server_options(replica_id))


def deployment_options(
    replicas: int = 1,
    autoscale: str | None = None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    max_batch_size: int = 8,
) -> dict[str, Any]:
    """Serve options: a fixed replica count, or autoscaling on ongoing requests ('MIN:MAX')."""
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus}}
    if autoscale:
        low, _, high = autoscale.partition(":")
        if not (low.isdigit() and high.isdigit() and 0 < int(low) <= int(high)):
            raise ValueError(f"--autoscale takes MIN:MAX with 0 < MIN <= MAX, got {autoscale!r}")
        options["autoscaling_config"] = {
            "min_replicas": int(low),
            "max_replicas": int(high),
            "target_ongoing_requests": max_batch_size,
        }
    else:
        if replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {replicas}")
        options["num_replicas"] = replicas
    return options


def builder(args: dict[str, Any]) -> serve.Application:
    """Serve application builder: `serve run specsample.deploy:builder model=... replicas=2`."""
    settings = ReplicaSettings.from_args(args)  # bad arguments fail here, before any replica starts
    options = deployment_options(
        int(args.get("replicas", 1)),
        args.get("autoscale"),
        float(args.get("num_cpus", 1)),
        float(args.get("num_gpus", 0)),
        settings.server.max_batch_size,
    )
    return SpecsampleReplica.options(**options).bind(settings.as_args())


app = SpecsampleReplica.bind(ReplicaSettings().as_args())
