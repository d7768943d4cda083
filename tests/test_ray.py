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
def cluster(folders):
    from specsample.deploy import ReplicaSettings, SpecsampleReplica, deployment_options

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
        options = deployment_options(replicas=2, num_cpus=0.5, max_batch_size=4)
        serve.run(SpecsampleReplica.options(**options).bind(settings.as_args()), name="specsample", route_prefix="/")
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
    time.sleep(3)  # replicas push their metrics every 2 s
    text = httpx.get(cluster + "/metrics", timeout=30).text
    labelled = {
        s.labels.get("replica")
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "specsample_requests_total"
    }
    assert labelled == replicas  # one /metrics shows every replica's counters


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
        time.sleep(2)


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
