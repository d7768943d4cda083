"""What a serving process was started with (besides its models): shared by `specsample serve` and Ray replicas."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerOptions:
    """The server's settings (vLLM's flag names in the CLI)."""

    model_name: str  # the model id in the API
    api_key: str | None = None  # require 'Authorization: Bearer KEY' (also enables /admin)
    min_acceptance: float | None = None  # warn when the recent acceptance rate stays below this
    max_batch_size: int = 8  # requests decoded together; more wait in line
    max_model_len: int = 2048  # context length per request (prompt + output)
    replica_id: str | None = None  # set under Ray Serve: labels metrics, tagged on responses
    extra_labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
