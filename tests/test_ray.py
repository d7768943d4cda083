"""Ray Serve: the same OpenAI API over 2 replicas of a local Ray instance (tiny models, CPU).

Skip locally with `-m "not ray"`.
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import httpx
import openai
import pytest
from live_server import LiveServer, free_port
from model_factory import make_tokenizer, write_hf_model
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytestmark = pytest.mark.ray
MODEL = "tiny"
PROMPTS = ["the quick brown fox", "hello world", "speculative sampling", "the lazy dog jumps"]


def _ray_processes() -> set[int]:
    done = subprocess.run(["pgrep", "-f", "raylet|gcs_server|ray::"], capture_output=True, text=True)
    return {int(p) for p in done.stdout.split()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    tokenizer = make_tokenizer()
    return {
        "target": write_hf_model(root / "target", "llama", tokenizer=tokenizer, max_position_embeddings=256),
        "draft": write_hf_model(root / "draft", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1),
    }


@pytest.fixture(scope="module")
def steps_folder(tmp_path_factory):
    """The compiled-steps folder the replicas are given (not the session's: tests/conftest.py)."""
    return tmp_path_factory.mktemp("shared-steps")


@pytest.fixture(scope="module")
def cluster(folders, steps_folder):
    from specsample.deploy import ReplicaSettings, application, deployment_options

    before = _ray_processes()
    port = free_port()
    try:
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            object_store_memory=150 * 2**20,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        )
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = ReplicaSettings.from_args(
            {
                "model": str(folders["target"]),
                "draft": str(folders["draft"]),
                "gamma": "4",
                "max_batch_size": "4",
                "max_model_len": "256",
                "served_model_name": MODEL,
                "dtype": "float32",
                "compile": "false",
            }
        )
        options = deployment_options(replicas=2, num_cpus=0.5, max_batch_size=4, compiled_steps=str(steps_folder))
        options["health_check_period_s"] = 1.0  # a killed replica is noticed, and replaced, within a second
        serve.run(application(settings, options), name="specsample", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        deadline = time.time() + 30
        while _ray_processes() - before and time.time() < deadline:
            time.sleep(0.5)
        leftover = _ray_processes() - before
        assert not leftover, f"Ray processes left behind: {leftover}"


def _client(url: str, cls=openai.OpenAI):
    return cls(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def single_process(folders):
    from specsample.options import EngineOptions
    from specsample.server.options import ServerOptions
    from specsample.server.state import SpecServer
    from specsample.speculator import load

    speculator = load(
        EngineOptions(target=str(folders["target"]), draft=str(folders["draft"]), gamma=4, dtype="float32")
    )
    server = LiveServer(SpecServer(speculator, ServerOptions(model_name=MODEL, max_batch_size=4, max_seq_len=256)))
    yield server
    server.close()


def test_two_replicas_serve_the_same_api(cluster, single_process) -> None:
    client, reference = _client(cluster), single_process.client()
    for prompt in PROMPTS:
        want = reference.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        )
        assert got == want == streamed
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    assert chat.choices[0].message.role == "assistant"


def test_requests_spread_over_replicas_and_metrics_aggregate(cluster) -> None:
    async def fire():
        async with httpx.AsyncClient(timeout=120) as http:
            responses = await asyncio.gather(
                *(
                    http.post(
                        cluster + "/v1/completions",
                        json={"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0},
                    )
                    for p in PROMPTS * 4
                )
            )
        return responses

    responses = asyncio.run(fire())
    assert all(r.status_code == 200 for r in responses)
    replicas = {r.headers["x-specsample-replica"] for r in responses}
    assert len(replicas) == 2, replicas
    from specsample.deploy import METRICS_PUSH_SECONDS

    time.sleep(METRICS_PUSH_SECONDS + 1)  # every replica has pushed its counters since its last request
    text = httpx.get(cluster + "/metrics", timeout=30).text
    labelled = {
        s.labels.get("replica")
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "specsample_requests_total"
    }
    assert labelled == replicas  # one /metrics shows every replica's counters


def _samples(url: str, name: str) -> dict[tuple[str, str], float]:
    """Samples `name` of the aggregated /metrics by (replica, status)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        (s.labels.get("replica", ""), s.labels.get("status", "")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


def _until(check, seconds: float = 20.0) -> None:
    """Wait until `check()` holds (replicas push their metrics every few seconds)."""
    deadline = time.time() + seconds
    while not check():
        assert time.time() < deadline, "timed out"
        time.sleep(0.5)


SYSTEM = "You are a careful assistant who answers about the quick brown fox and the lazy dog in one sentence."


def test_a_shared_prefix_goes_to_the_replica_that_holds_it(cluster) -> None:
    """Six chats after one system prompt, one at a time (the load stays balanced), measured as the replicas bench
    suite measures: all go to one replica, where the five after the first start from the first's cached prefix."""
    from specsample.bench.replicas import measure
    from specsample.bench.report import replicas_section
    from specsample.deploy import METRICS_PUSH_SECONDS

    time.sleep(METRICS_PUSH_SECONDS + 0.5)  # every replica's counters pushed since the last request
    questions = [f"question {q}" for q in ("one", "two", "three", "four", "five", "six")]
    run = measure(cluster, SYSTEM, questions, clients=1, max_tokens=4)
    replicas = [r["replica"] for r in run["requests"]]
    assert len(set(replicas)) == 1, replicas  # routed by load alone, six in a row on one of two: p = 1/32
    grown = run["replicas"][replicas[0]]
    assert grown["requests"] == 6 and grown["hits"] >= 5 and 0 < grown["reused_tokens"] <= grown["prompt_tokens"]
    assert run["overall"]["requests"] == 6 and len(run["replicas"]) == 2  # the other replica: zeros
    table = "\n".join(replicas_section({"clients": 1, "system_tokens": 40, "waves": 6, "runs": {"2": run}}))
    assert f"| 2 | {replicas[0]} | 6 | " in table and "| 2 | all | 6 | " in table


def test_routes_and_streams_through_the_ingress(cluster, steps_folder) -> None:
    client = _client(cluster)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 8
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert httpx.get(cluster + "/v1/models", timeout=30).json()["data"][0]["id"] == MODEL
    bad = httpx.post(cluster + "/v1/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    unknown = httpx.post(cluster + "/v1/completions", json={"model": "other", "prompt": "hi"}, timeout=30)
    assert unknown.status_code == 404
    too_large = httpx.post(cluster + "/v1/completions", content=b" " * (2**20 + 1), timeout=30)
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"
    assert httpx.get(cluster + "/no-such-route", timeout=30).status_code == 404
    folders: dict[str, str] = {}
    for _ in range(40):  # /health goes to either replica: each reads the compiled-steps folder it was given
        health = httpx.get(cluster + "/health", timeout=30).json()
        folders[health["replica"]] = health["compiled_steps"]
        if len(folders) == 2:
            break
    assert folders and set(folders.values()) == {str(steps_folder)} and len(folders) == 2, folders


def test_a_client_leaving_mid_stream_ends_its_request(cluster) -> None:
    before = _samples(cluster, "specsample_requests_total")  # current: no earlier test left a request unfinished
    body = {
        "model": MODEL,
        "prompt": "the quick brown fox",
        "max_tokens": 220,
        "temperature": 0.8,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", cluster + "/v1/completions", json=body) as response:
            replica = response.headers["x-specsample-replica"]
            lines = response.iter_lines()
            while not next(lines).startswith("data:"):
                pass  # one chunk read, then the client hangs up

    def cancelled() -> bool:
        now = _samples(cluster, "specsample_requests_total")
        return now.get((replica, "cancelled"), 0) > before.get((replica, "cancelled"), 0)

    _until(cancelled)


def test_killing_a_replica_mid_run(cluster) -> None:
    async def stream_one(http: httpx.AsyncClient, prompt: str):
        async with http.stream(
            "POST",
            cluster + "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": 0.8, "stream": True},
        ) as response:
            replica = response.headers["x-specsample-replica"]
            chunks = 0
            try:
                async for line in response.aiter_lines():
                    chunks += line.startswith("data:")
                return replica, chunks, None
            except Exception as exc:  # the stream of the killed replica breaks off
                return replica, chunks, exc

    async def run():
        async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as http:
            tasks = [asyncio.ensure_future(stream_one(http, p)) for p in PROMPTS * 2]
            await asyncio.sleep(1.0)
            names = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::specsample#SpecsampleReplica")
            ]
            victim_name = sorted(names)[0]
            ray.kill(ray.get_actor(victim_name, namespace="serve"), no_restart=True)
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
            return victim_name, results

    victim_name, results = asyncio.run(run())
    survivors = [(r, c, e) for r, c, e in results if not victim_name.endswith(r)]
    assert survivors and all(e is None and c > 1 for _, c, e in survivors)  # the other replica's streams completed
    deadline = time.time() + 180
    while True:  # Serve replaces the dead replica; new requests succeed meanwhile and after
        out = _client(cluster).completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
        assert out.choices[0].text is not None
        names = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::specsample#SpecsampleReplica")
        ]
        if len(names) == 2 and victim_name not in names:
            break
        assert time.time() < deadline, "Serve did not restart the killed replica"
        time.sleep(0.5)


def test_replicas_share_the_compiled_steps_folder_given(tmp_path) -> None:
    from specsample.deploy import PrefixAffinityRouter, builder, deployment_options
    from specsample.models.artifacts import ROOT_ENV

    options = deployment_options(replicas=2, compiled_steps=str(tmp_path))
    assert options["ray_actor_options"]["runtime_env"] == {"env_vars": {ROOT_ENV: str(tmp_path)}}
    assert "runtime_env" not in deployment_options(replicas=2)["ray_actor_options"]
    router = options["request_router_config"]
    assert router.request_router_class is PrefixAffinityRouter or router.request_router_class.endswith(
        "PrefixAffinityRouter"
    )
    assert router.request_router_kwargs["imbalanced_threshold"] == 2  # a quarter of the default batch of 8
    assert (
        deployment_options(affinity_imbalance=0)["request_router_config"].request_router_kwargs["imbalanced_threshold"]
        == 0
    )
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a folder"):
        deployment_options(compiled_steps=str(tmp_path / "file"))
    with pytest.raises(ValueError, match="affinity-imbalance"):
        deployment_options(affinity_imbalance=-1)
    assert builder({"compiled_steps": str(tmp_path), "affinity_imbalance": "3", "replicas": 2}) is not None


def test_the_router_routes_by_load_when_its_prefix_tree_fails() -> None:
    """Ray's router asks its prefix tree (an actor) where a prompt's prefix is; an actor that does not answer leaves
    the request to the load-based choice instead of failing its routing."""
    from ray.exceptions import RayActorError

    from specsample.deploy import PrefixAffinityRouter
    from specsample.server.relay import RoutingPrompt

    class Unreachable:
        def __getattr__(self, name):
            class Method:
                @staticmethod
                def remote(*args):
                    raise RayActorError()

            return Method()

    class Replica:
        replica_id = type("Id", (), {"to_full_id_str": staticmethod(lambda: "r")})()
        max_ongoing_requests = 8

    class Pending:
        args = [RoutingPrompt("a shared system prompt and a question")]

    router = object.__new__(PrefixAffinityRouter)
    router._tree_actor = Unreachable()
    router._imbalanced_threshold = 2
    router._match_rate_threshold = 0.1
    router._use_replica_queue_len_cache = True
    router._replica_queue_len_cache = type("Cache", (), {"get": staticmethod(lambda replica_id: 0)})()
    replicas: list = [Replica(), Replica()]
    assert asyncio.run(router._prefix_match_best_replicas(Pending(), replicas)) == [[]]
    with pytest.raises(RayActorError):  # Ray's own router fails the routing
        asyncio.run(super(PrefixAffinityRouter, router)._prefix_match_best_replicas(Pending(), replicas))
    router.on_request_routed(Pending(), Replica.replica_id, None)  # no raise


def test_serve_config_yaml_builds() -> None:
    import yaml

    from specsample.deploy import builder

    config = yaml.safe_load(
        (__import__("pathlib").Path(__file__).parents[1] / "deploy" / "serve_config.yaml").read_text()
    )
    args = config["applications"][0]["args"]
    application = builder(args)
    assert application is not None
    with pytest.raises(ValueError, match="unknown specsample deployment argument"):
        builder({**args, "modle": "typo"})
    with pytest.raises(ValueError, match="MIN:MAX"):
        builder({**args, "autoscale": "4:1"})
