"""Round planning: how many drafts each row proposes, from where, and what the round teaches."""

from specsample.planner.adaptive import GammaController
from specsample.planner.base import (
    BatchState,
    Extension,
    FixedGamma,
    Planner,
    RoundOutcome,
    RoundPlan,
    RowOutcome,
    RowPlan,
    RowState,
)

__all__ = [
    "BatchState",
    "Extension",
    "FixedGamma",
    "GammaController",
    "Planner",
    "RoundOutcome",
    "RoundPlan",
    "RowOutcome",
    "RowPlan",
    "RowState",
]
