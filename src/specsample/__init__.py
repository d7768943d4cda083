"""specsample: exact (lossless) speculative sampling for LLM decoding."""

from specsample.api import Completion, GenerationResult, generate, generate_stream
from specsample.config import SamplingParams, SpecConfig
from specsample.drafters.base import Drafter, Proposal
from specsample.drafters.model import ModelDrafter
from specsample.engine import Engine, RoundResult, RoundStats, RowUpdate
from specsample.models.base import CausalLM
from specsample.models.tiny import tiny_lm
from specsample.verify import Verdict, verify, verify_greedy

__all__ = [
    "CausalLM", "Completion", "Drafter", "Engine", "GenerationResult", "ModelDrafter", "Proposal",
    "RoundResult", "RoundStats", "RowUpdate", "SamplingParams", "SpecConfig", "Verdict", "generate",
    "generate_stream", "tiny_lm", "verify", "verify_greedy",
]

__version__ = "0.1.0"
