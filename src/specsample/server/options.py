"""What a serving process was started with (besides its models): shared by `specsample serve` and Ray replicas."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specsample.config import SettingError

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full context of text is a few tens of KiB
DEFAULT_GRAMMAR_COMPILE_TIMEOUT = 10.0  # seconds; the schemas within specsample.json_schema's limits take < 1 s
DEFAULT_SHUTDOWN_TIMEOUT = 5.0  # seconds in-flight requests may finish in after SIGTERM or Ctrl-C


@dataclass(frozen=True)
class ServerOptions:
    """The server's settings (vLLM's flag names in the CLI)."""

    model_name: str  # the model id in the API
    api_key: str | None = None  # require 'Authorization: Bearer KEY' on the inference routes
    min_acceptance: float | None = None  # warn when the recent acceptance rate stays below this
    max_batch_size: int = 8  # requests decoded together; more wait in line
    max_model_len: int = 2048  # context length per request (prompt + output)
    replica_id: str | None = None  # set under Ray Serve: labels metrics, tagged on responses
    extra_labels: dict[str, str] = field(default_factory=dict)
    admin_key: str | None = None  # /admin/* exists only with it, and needs 'Authorization: Bearer ADMIN_KEY'
    models_dir: str | None = None  # /admin/draft may load the drafts in this folder (besides the built-in ones)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies are refused with 413 before being read
    # finished requests' cache rows kept for requests sharing their prefix (the next turn of a chat): each costs what
    # a running row's caches cost
    prefix_cache_rows: int = 4
    metrics_key: str | None = None  # /metrics needs 'Authorization: Bearer METRICS_KEY' (or the admin key)
    grammar_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT  # a request's grammar compile, its wait included
    grammar_workers: int = 2  # processes compiling grammars, apart from the decoding loop
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT  # after it, requests still running are ended (503 / error)

    def __post_init__(self) -> None:
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise SettingError("max_batch_size", f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise SettingError("max_model_len", f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise SettingError("max_body_bytes", f"max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")
        if isinstance(self.prefix_cache_rows, bool) or not isinstance(self.prefix_cache_rows, int) \
                or self.prefix_cache_rows < 0:
            raise SettingError("prefix_cache_rows",
                               f"prefix_cache_rows must be an integer >= 0, got {self.prefix_cache_rows!r}")
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
        if isinstance(self.grammar_workers, bool) or not isinstance(self.grammar_workers, int) \
                or self.grammar_workers < 1:
            raise SettingError("grammar_workers", f"grammar_workers must be an integer >= 1, got "
                                                  f"{self.grammar_workers!r}")
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise SettingError("admin_key", "admin_key must differ from api_key")
        if self.models_dir is not None and not Path(self.models_dir).is_dir():
            raise SettingError("models_dir", f"models_dir {self.models_dir!r} is not a folder")
