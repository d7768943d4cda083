"""What a serving process was started with (besides its models): shared by `specsample serve` and Ray replicas."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import inf
from pathlib import Path
from typing import Any

from specsample.config import SettingError
from specsample.models import fused
from specsample.options import EngineOptions
from specsample.options_cli import setting

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full context of text is a few tens of KiB
DEFAULT_GRAMMAR_COMPILE_TIMEOUT = 10.0  # seconds; the schemas within specsample.json_schema's limits take < 1 s
# the most prompt tokens a round prefills beside decoding rows, and the time it spends on them as a multiple of their
# decoding's (docs/serving.md#chunked-prefill)
DEFAULT_PREFILL_CHUNK = 256
DEFAULT_PREFILL_TIME_RATIO = 0.7
DEFAULT_SHUTDOWN_TIMEOUT = 5.0  # seconds in-flight requests may finish in after SIGTERM or Ctrl-C


# The engine options `specsample serve` and Ray replicas start from: EngineOptions' defaults but where serving
# differs: a server decodes long enough for pad_rows auto's start-up measurement to pay, and compiles its decode
# steps (as vLLM captures CUDA graphs) where the fused step does not run them, unless --enforce-eager (see
# serve_engine_options)
SERVE_ENGINE_DEFAULTS = EngineOptions(pad_rows="auto", compile=True)


def serve_engine_options(given: dict[str, Any]) -> EngineOptions:
    """The engine options a server runs with: `given` (the engine settings named on the command line or in
    deployment arguments, `compile` None or absent where not named) over SERVE_ENGINE_DEFAULTS. Compiling is the
    default where it can run and the fused step (models/fused.py, faster than a compiled step and ready at once)
    will not: not in deterministic mode, whose kernels it would change, nor on the transformers runtime (`compile`
    named true with either is refused, by `EngineOptions`)."""
    values = {name: value for name, value in given.items() if not (name == "compile" and value is None)}
    if "compile" not in values:
        options = replace(SERVE_ENGINE_DEFAULTS, **values, compile=False)
        values["compile"] = (
            SERVE_ENGINE_DEFAULTS.compile
            and not options.deterministic
            and options.runtime != "hf"
            and not fused.expected(options.device, options.dtype, options.runtime)
        )
    return replace(SERVE_ENGINE_DEFAULTS, **values)


@dataclass(frozen=True)
class ServerOptions:
    """The server's settings (vLLM's flag names in the CLI; each help is its flag's, see `options_cli`)."""

    model_name: str = setting(help="model id in the API (default: the --model spec)", flag="--served-model-name")
    api_key: str | None = setting(None, help="require 'Authorization: Bearer KEY' on the inference routes")
    min_acceptance: float | None = setting(
        None, help="warn when the recent acceptance rate stays below this (0.7 suits a well-matched pair)"
    )
    max_batch_size: int = setting(8, help="requests decoded together; more wait in line")
    max_seq_len: int = setting(2048, help="context length per request (prompt + output)", flag="--max-model-len")
    replica_id: str | None = None  # set under Ray Serve: labels metrics, tagged on responses
    extra_labels: dict[str, str] = field(default_factory=dict)
    admin_key: str | None = setting(
        None,
        help="enable /admin/* (live draft replacement), which then needs "
        "'Authorization: Bearer ADMIN_KEY'; without it /admin/* answers 404",
    )
    models_dir: str | None = setting(
        None,
        help="folder of drafts /admin/draft may load, named by their path inside "
        "it (besides ngram, suffix, hybrid and the built-in drafts)",
    )
    max_body_bytes: int = setting(DEFAULT_MAX_BODY_BYTES, help="refuse request bodies larger than this with 413")
    prefix_cache_rows: int = setting(
        4,
        help="finished requests' cache rows kept for requests sharing their prefix, "
        "such as the next turn of a chat, which then prefills only what is new; "
        "each costs what a running row's caches cost (0: none)",
    )
    prefix_cache_tokens: int | None = setting(
        None,
        help="the most tokens the kept rows hold together, least recently used "
        "dropped first (default: bounded by --prefix-cache-rows alone; 0: no "
        "prefix is shared, not even a running request's)",
    )
    prefill_chunk_tokens: int | None = setting(
        DEFAULT_PREFILL_CHUNK,
        help="the most prompt tokens an engine round prefills while other requests "
        "decode: a longer prompt is prefilled over several rounds, so running "
        "streams keep their pace (0: no bound in tokens)",
    )
    prefill_time_ratio: float | None = setting(
        DEFAULT_PREFILL_TIME_RATIO,
        help="while other requests decode, an engine round spends on prefilling "
        "about this many times what their decoding takes (each model's prefill "
        "timed as it runs); the running streams' rounds take about 1 + this "
        "times as long, a little more as the prefill slows their decoding "
        "(0: no bound in time; with --prefill-chunk-tokens 0 too, whole prompts "
        "at once)",
    )
    metrics_key: str | None = setting(
        None,
        help="/metrics then needs 'Authorization: Bearer METRICS_KEY' (the admin "
        "key also works); with --api-key, /metrics answers only to these keys",
    )
    grammar_compile_timeout: float = setting(
        DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
        help="seconds a request's response_format grammar may take to compile, "
        "waiting for a free compiler included; past it: 400",
    )
    grammar_workers: int = setting(2, help="processes compiling grammars apart from the decoding loop")
    shutdown_timeout: float = setting(
        DEFAULT_SHUTDOWN_TIMEOUT,
        help="seconds requests in flight may finish in after SIGTERM or Ctrl-C; then "
        "they are ended (503 / error); a second signal ends them at once",
    )

    def __post_init__(self) -> None:
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise SettingError("max_batch_size", f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise SettingError("max_seq_len", f"max_seq_len must be an integer >= 2, got {self.max_seq_len!r}")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise SettingError("max_body_bytes", f"max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")
        if (
            isinstance(self.prefix_cache_rows, bool)
            or not isinstance(self.prefix_cache_rows, int)
            or self.prefix_cache_rows < 0
        ):
            raise SettingError(
                "prefix_cache_rows", f"prefix_cache_rows must be an integer >= 0, got {self.prefix_cache_rows!r}"
            )
        for name, least in (("prefix_cache_tokens", 0), ("prefill_chunk_tokens", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise SettingError(name, f"{name} must be an integer >= {least}, got {value!r}")
        ratio = self.prefill_time_ratio
        if ratio is not None and (
            isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio < inf
        ):
            raise SettingError("prefill_time_ratio", f"prefill_time_ratio must be a number >= 0, got {ratio!r}")
        if self.min_acceptance is not None and not 0.0 <= self.min_acceptance <= 1.0:
            raise SettingError("min_acceptance", f"min_acceptance must be in [0, 1], got {self.min_acceptance!r}")
        for name in ("api_key", "admin_key", "metrics_key"):
            if getattr(self, name) == "":
                raise SettingError(name, f"{name} must not be empty")
        if self.metrics_key is not None and self.metrics_key == self.api_key:
            raise SettingError("metrics_key", "metrics_key must differ from api_key")
        for name in ("grammar_compile_timeout", "shutdown_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise SettingError(name, f"{name} must be a number of seconds > 0, got {value!r}")
        if (
            isinstance(self.grammar_workers, bool)
            or not isinstance(self.grammar_workers, int)
            or self.grammar_workers < 1
        ):
            raise SettingError(
                "grammar_workers", f"grammar_workers must be an integer >= 1, got {self.grammar_workers!r}"
            )
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise SettingError("admin_key", "admin_key must differ from api_key")
        if self.models_dir is not None and not Path(self.models_dir).is_dir():
            raise SettingError("models_dir", f"models_dir {self.models_dir!r} is not a folder")
