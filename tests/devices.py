"""Where the model tests run: `SPECSAMPLE_TEST_DEVICE=cuda pytest ...` runs them on a GPU (CI uses the CPU)."""

from __future__ import annotations

import os

DEVICE = os.environ.get("SPECSAMPLE_TEST_DEVICE", "cpu")
