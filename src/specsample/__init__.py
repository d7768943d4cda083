"""specsample: exact (lossless) speculative sampling for LLM decoding.

    from specsample import EngineOptions, SamplingParams, load

    speculator = load(EngineOptions(target="smollm2-135m-instruct"))   # the target and its default draft
    engine = speculator.engine(max_batch_size=4)
    request = engine.add_request(prompt_ids, SamplingParams(temperature=0.7, max_new_tokens=64))
    for round_result in engine.stream():
        ...

`generate` / `generate_stream` run token-id prompts on models you already hold (any `CausalLM`).
"""

from specsample.api import Completion, GenerationResult, generate, generate_stream
from specsample.config import SamplingParams, SpecConfig
from specsample.drafters.base import Drafter, DraftRequest, Proposal
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.model import DraftWindow, ModelDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.drafters.suffix import SuffixDrafter
from specsample.engine import Engine, RoundResult, RoundStats, RowUpdate
from specsample.models.base import CausalLM
from specsample.models.loader import load_model
from specsample.models.tiny import tiny_lm
from specsample.options import EngineOptions
from specsample.pair import Pair, load_pair
from specsample.planner import FixedGamma, GammaController, Planner, RoundPlan
from specsample.speculator import Speculator, load
from specsample.verification.chain import Verdict, verify, verify_greedy

__all__ = [
    "CausalLM",
    "Completion",
    "DraftRequest",
    "DraftWindow",
    "Drafter",
    "Engine",
    "EngineOptions",
    "FixedGamma",
    "GammaController",
    "GenerationResult",
    "HybridDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "Pair",
    "Planner",
    "Proposal",
    "RoundPlan",
    "RoundResult",
    "RoundStats",
    "RowUpdate",
    "SamplingParams",
    "SpecConfig",
    "Speculator",
    "SuffixDrafter",
    "Verdict",
    "generate",
    "generate_stream",
    "load",
    "load_model",
    "load_pair",
    "tiny_lm",
    "verify",
    "verify_greedy",
]

__version__ = "0.1.0"
