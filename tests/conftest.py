"""Shared fixtures: tiny float64 models so a failure means a bug, not rounding; the real SmolLM2 once per session."""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE

from specsample.models.tiny import tiny_lm


def pytest_report_header(config) -> str:
    return f"specsample model tests on device: {DEVICE}"


OPT_IN = ("load", "packages")  # markers of tests that run only when a -m expression names them


def pytest_collection_modifyitems(config, items) -> None:
    """The load test and the second package build run only when a -m expression names them: another -m (e.g. "not
    slow") replaces the default "not load and not packages" of pyproject.toml, and must not bring them back."""
    named = [m for m in OPT_IN if m in (config.option.markexpr or "")]
    left_out = [item for item in items if any(item.get_closest_marker(m) for m in OPT_IN if m not in named)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]


@pytest.fixture(scope="session", autouse=True)
def compiled_steps(tmp_path_factory):
    """Compiled decode steps (models/artifacts.py) go to one folder for the whole session, not the user's cache: a
    tiny model's graphs are built once and shared by every test that compiles a model of its architecture."""
    from specsample.models import artifacts

    folder = tmp_path_factory.mktemp("compiled-steps")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(artifacts.ROOT_ENV, str(folder))
        yield folder


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_lm(32, seed=1, init_scale=0.2, dtype=torch.float64, device=DEVICE)


@pytest.fixture(scope="session")
def tiny_draft():
    return tiny_lm(32, seed=2, init_scale=0.2, num_layers=1, dtype=torch.float64, device=DEVICE)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct in float32 (fetched through its alias on first use), shared by the slow tests."""
    from specsample.models.loader import load_model

    return load_model("smollm2-135m-instruct", dtype="float32", device=DEVICE)


@pytest.fixture(autouse=True, scope="session")
def planner_profiles_apart(tmp_path_factory):
    """Gamma auto's profiles (planner/profile.py) saved by the tests live in a folder of their own, not the user's
    cache: a test's planner never starts from what another test measured there."""
    import specsample.speculator as speculator

    patch = pytest.MonkeyPatch()
    patch.setattr(speculator, "cache_dir", lambda: tmp_path_factory.mktemp("specsample-cache"))
    yield
    patch.undo()
