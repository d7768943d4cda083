"""Ray Serve deployment of the specsample OpenAI API: the same routes as `specsample serve`, over replicas that each
hold their own target, draft and running batch.

    serve run specsample.deploy:app                              # defaults: 1 replica, default models
    serve run specsample.deploy:builder model=PATH replicas=2    # application builder with args
    serve deploy serve_config.yaml                               # see docs/serving.md
    specsample serve --replicas 2 [--ray-address ADDR] [--autoscale 1:4] [--compiled-steps DIR]

An application is two deployments. `SpecsampleIngress` takes every HTTP request: it reads the body, names a completion
request's prompt (server/relay.py) and passes the request on through a `DeploymentHandle` to `SpecsampleReplica`, the
engine replicas, whose handles route with Ray Serve's `PrefixCacheAffinityRouter` (`PrefixAffinityRouter`: routing
by load where its prefix tree does not answer): while the replicas' ongoing
requests differ by at most `affinity_imbalance`, a request goes to the replica that was sent the longest prefix of its
prompt (so it reuses that replica's prefix cache), or where no replica was sent a tenth of it, to the one that was sent
the least text; beyond that imbalance, to the less loaded of two replicas (Serve's default). Serve's HTTP proxy picks
a replica before it reads the body, so the router sees prompts only on handle calls. A replica answers with its own
FastAPI app and the ingress streams the response back as it comes; requests without a prompt (/health, /metrics,
/v1/models, /admin/draft) go by load alone.

Metrics are aggregated at the replicas: every replica pushes its Prometheus exposition (labelled `replica=<id>`) to a
small hub actor every METRICS_PUSH_SECONDS, and `/metrics` returns the merged text of all live replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentResponseGenerator

from specsample.models.artifacts import ROOT_ENV
from specsample.options import DEFAULT_TARGET, EngineOptions
from specsample.options_cli import parse_text, settings
from specsample.server.options import SERVE_ENGINE_DEFAULTS, ServerOptions, serve_engine_options
from specsample.server.relay import HttpCall, RoutingPrompt, app_path, read_body, replay, routing_prompt

try:  # where it is defined: its public name, ray.serve.llm.request_router, first imports vLLM or SGLang
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
except ImportError:
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle
    from starlette.types import Message, Receive, Scope, Send

    from specsample.server.state import SpecServer

log = logging.getLogger("specsample.deploy")
HUB_NAME = "specsample-metrics-hub"
HUB_NAMESPACE = "specsample"
METRICS_PUSH_SECONDS = 1.0  # how often each replica pushes its metrics to the hub
# arguments named unlike their fields: as vLLM names them, like serve's flags
RAY_NAMES = {"target": "model", "model_name": "served_model_name", "max_seq_len": "max_model_len"}
# the builder's, not a replica's
PLACEMENT = ("replicas", "autoscale", "num_cpus", "num_gpus", "affinity_imbalance", "compiled_steps")
INGRESS_MAX_ONGOING = 4096  # requests the ingress relays at once (each waits on a replica, which queues its own)


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
    """One engine replica (deployed as `SpecsampleReplica`): loads the pair, runs its own engine thread (the app's
    lifespan, entered at start and left at shutdown), and answers the requests the ingress hands it with the shared
    FastAPI routes."""

    async def __init__(self, settings: dict[str, Any]) -> None:  # type: ignore[misc]  # Serve awaits it
        from specsample.server.app import build_app

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id if context is not None else "local"
        self.server = replica_server(settings, self.replica_id)
        self.hub = _hub()
        self.server.metrics_text = self._aggregated_metrics
        self.app = build_app(self.server)  # the very routes `specsample serve` runs
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
        self._pusher = threading.Thread(target=self._push_metrics, daemon=True)
        self._pusher.start()

    async def __del__(self) -> None:
        """Serve's graceful shutdown: the app's lifespan ends (the engine thread stops)."""
        await self._lifespan.aclose()

    async def forward(self, *routing: RoutingPrompt, call: HttpCall) -> AsyncIterator[Message]:
        """Answer one HTTP request with this replica's app: the ASGI messages of its response, as they are sent.
        `routing`: the request's prompt, read by the router that picked this replica (not here)."""
        async for message in replay(self.app, call):
            yield message

    def _push_metrics(self) -> None:
        while True:
            try:
                self.hub.push.remote(self.replica_id, self.server.metrics.render().decode())
            except Exception:  # the hub may be restarting; metrics must never break serving
                log.debug("metrics push failed", exc_info=True)
            time.sleep(METRICS_PUSH_SECONDS)

    def _aggregated_metrics(self) -> bytes:
        import ray

        from specsample.server.metrics import merge_expositions

        self.hub.push.remote(self.replica_id, self.server.metrics.render().decode())
        return merge_expositions(ray.get(self.hub.collect.remote(), timeout=10)).encode()


SpecsampleReplica = serve.deployment(
    name="SpecsampleReplica", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64
)(ReplicaServer)


class PrefixAffinityRouter(PrefixCacheAffinityRouter):
    """Ray Serve's `PrefixCacheAffinityRouter`, whose prefix tree is an actor that may not answer (a node short of CPU,
    an actor restarting) without failing the routing: a request it cannot place by prefix goes by load, as Serve's
    default router would send it, and the tree's view of the replicas catches up at their next change."""

    async def _prefix_match_best_replicas(self, pending_request: Any, candidate_replicas: Any) -> Any:
        try:
            return await super()._prefix_match_best_replicas(pending_request, candidate_replicas)
        except (RayError, KeyError) as exc:  # the tree unreachable, or naming a replica gone
            log.warning("a request routed by load alone: the prefix tree failed (%s)", exc)
            return [[]]

    def update_replicas(self, replicas: Any) -> None:
        try:
            super().update_replicas(replicas)
        except RayError as exc:  # the replicas are updated; the tree's tenants are not
            log.warning("the prefix tree missed a change of replicas: %s", exc)

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        try:
            super().on_request_routed(pending_request, replica_id, result)
        except RayError as exc:
            log.warning("the prefix tree missed a routed prompt: %s", exc)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        try:
            super().on_replica_actor_died(replica_id)
        except RayError as exc:
            log.warning("the prefix tree missed a replica's death: %s", exc)


class IngressServer:
    """Every HTTP request of the application (deployed as `SpecsampleIngress`), relayed to the engine replicas through
    their prefix-aware handle (`Relay`)."""

    def __init__(self, settings: dict[str, Any], replicas: DeploymentHandle) -> None:
        self.relay = Relay(ReplicaSettings.from_args(settings).server, replicas.options(stream=True))

    def __serve_build_asgi_app__(self) -> Relay:
        return self.relay


class Relay:
    """The ingress's ASGI app: a request is refused here where its keys or size do not pass (middleware.refusal, as
    a replica's `Gate` would), else read and handed to an engine replica through `replicas` (a streaming handle), a
    completion request with its prompt for the router; the replica's response is sent on as it comes."""

    def __init__(self, options: ServerOptions, replicas: DeploymentHandle) -> None:
        self.options, self.replicas = options, replicas

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from specsample.server.middleware import refusal, too_large
        from specsample.server.responses import error_response

        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        scope = {**scope, "path": app_path(scope), "root_path": ""}  # the engine app serves at its root
        refused = refusal(self.options, scope)
        if refused is not None:
            await refused(scope, receive, send)
            return
        body = await read_body(receive, self.options.max_body_bytes)
        if body is None:  # past the limit (or the client left while sending it)
            await too_large(self.options.max_body_bytes)(scope, receive, send)
            return
        prompt = await asyncio.to_thread(routing_prompt, scope["path"], body) if scope["method"] == "POST" else None
        response = self.replicas.forward.remote(*([prompt] if prompt else []), call=HttpCall.from_scope(scope, body))
        assert isinstance(response, DeploymentResponseGenerator)  # a streaming handle's
        watcher = asyncio.ensure_future(_until_disconnected(receive))

        def client_left(_: asyncio.Future) -> None:
            response.cancel()  # the replica stops the request

        watcher.add_done_callback(client_left)
        started = finished = False
        try:
            async for message in response:
                await send(message)
                started = started or message["type"] == "http.response.start"
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    finished = True  # the whole response is sent; the replica's call ends on its own
                    break
        except Exception as exc:
            if watcher.done():  # the client left, and the replica stopped its request
                return
            if started:  # the replica failed mid-response: the response breaks off
                raise
            log.warning("the replica taking %s %s failed: %s", scope["method"], scope["path"], exc)
            await error_response(503, "the replica taking this request failed; retry it", kind="server_error")(
                scope, receive, send
            )
        finally:
            watcher.remove_done_callback(client_left)
            gone = watcher.done()  # then `client_left` has cancelled the replica's call
            if not gone:
                watcher.cancel()
            elif not watcher.cancelled():
                watcher.exception()  # retrieved: a receive channel that closes ends the watch too
            if not (finished or gone):  # this call was cancelled (Serve's, or an error): so is the replica's
                response.cancel()


async def _lifespan(receive: Receive, send: Send) -> None:
    """The ASGI lifespan protocol: nothing to start or stop."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _until_disconnected(receive: Receive) -> None:
    """Return once the client has gone (the body is read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


SpecsampleIngress = serve.deployment(
    name="SpecsampleIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=INGRESS_MAX_ONGOING
)(serve.ingress()(IngressServer))


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
    affinity_imbalance: int | None = None,
    compiled_steps: str | None = None,
) -> dict[str, Any]:
    """The engine replicas' Serve options: a fixed replica count, or autoscaling on ongoing requests ('MIN:MAX');
    routed by prefix affinity while their ongoing requests differ by at most `affinity_imbalance` (default: a quarter
    of `max_batch_size`, at least 1); every replica reading and building compiled decode steps in `compiled_steps`
    (default: its own `$SPECSAMPLE_COMPILED_STEPS`, else its cache's `steps` folder)."""
    actor: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if compiled_steps is not None:
        if Path(compiled_steps).expanduser().exists() and not Path(compiled_steps).expanduser().is_dir():
            raise ValueError(f"--compiled-steps {compiled_steps!r} is not a folder")
        actor["runtime_env"] = {"env_vars": {ROOT_ENV: compiled_steps}}  # the build processes inherit it too
    imbalance = max(1, max_batch_size // 4) if affinity_imbalance is None else affinity_imbalance
    if isinstance(imbalance, bool) or not isinstance(imbalance, int) or imbalance < 0:
        raise ValueError(f"--affinity-imbalance must be an integer >= 0, got {affinity_imbalance!r}")
    router = RequestRouterConfig(
        request_router_class=cast(Any, PrefixAffinityRouter),  # typed as its import path, also taken as a class
        # the router's prefix tree (prompt text per replica) bounded: the least recently used text goes first
        request_router_kwargs={"imbalanced_threshold": imbalance, "do_eviction": True},
    )
    options: dict[str, Any] = {"ray_actor_options": actor, "request_router_config": router}
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


def application(settings: ReplicaSettings, options: dict[str, Any]) -> serve.Application:
    """The ingress bound to engine replicas started with `settings` and deployed with `options`
    (`deployment_options`)."""
    args = settings.as_args()
    return SpecsampleIngress.bind(args, SpecsampleReplica.options(**options).bind(args))


def builder(args: dict[str, Any]) -> serve.Application:
    """Serve application builder: `serve run specsample.deploy:builder model=... replicas=2`."""
    settings = ReplicaSettings.from_args(args)  # bad arguments fail here, before any replica starts
    imbalance = args.get("affinity_imbalance")
    options = deployment_options(
        int(args.get("replicas", 1)),
        args.get("autoscale"),
        float(args.get("num_cpus", 1)),
        float(args.get("num_gpus", 0)),
        settings.server.max_batch_size,
        None if imbalance is None else int(imbalance),
        None if args.get("compiled_steps") is None else str(args["compiled_steps"]),
    )
    return application(settings, options)


app = application(ReplicaSettings(), deployment_options())
