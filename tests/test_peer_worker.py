"""Benchmark peers in child processes (`bench/worker.py`, `bench/llama_cpp.py`): a peer that crashes, exits or raises
on a prompt is recorded as failing there, with the cause, and the suite goes on; the llama.cpp peer's context size.
A stand-in child (`fake_peer.py`) plays llama.cpp, so llama-cpp-python need not be installed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_peer import EXIT, RAISE, SEGFAULT

from specsample.bench import llama_cpp
from specsample.bench.report import compare_section
from specsample.bench.suites import _interleaved
from specsample.bench.systems import RunRecord
from specsample.bench.worker import MAX_DEATHS, PeerFailed, death_cause
from specsample.config import SamplingParams

FAKE = Path(__file__).with_name("fake_peer.py")


@pytest.fixture
def fake_llama(monkeypatch):
    """The llama.cpp peer class with the stand-in child in place of llama.cpp's."""
    monkeypatch.setattr(llama_cpp, "CHILD", FAKE)

    monkeypatch.setattr(llama_cpp.importlib.util, "find_spec", lambda name: True)  # installed or not

    def make(gguf: str = "model.gguf") -> llama_cpp.LlamaCpp:
        return llama_cpp.LlamaCpp(Path(gguf), 300, frozenset({0}), threads=1)

    return make


class Baseline:
    name = "target-only"

    def run(self, prompts, params):
        return [RunRecord(list(p), 0.01, 0.001, [0.001] * (len(p) - 1)) for p in prompts]


def test_a_peer_that_crashes_is_recorded_with_its_cause_and_the_suite_goes_on(fake_llama) -> None:
    peer = fake_llama()
    assert (peer.version, peer.n_ctx) == ("fake", 512)  # 300 tokens and a draft past them: two blocks of 256
    first = peer.worker.pid
    prompt_ids = [[5, 6, 7], [5, SEGFAULT, 7], [8, 9], [RAISE, 1], [10, 11, 12]]
    bench = SimpleNamespace(
        prompts=[SimpleNamespace(id=i, category="qa" if i % 2 else "math") for i in range(len(prompt_ids))],
        prompt_ids=prompt_ids,
        params=lambda t, i: SamplingParams(temperature=t, max_new_tokens=8, seed=i),
    )
    rows: list = []
    systems = [Baseline(), peer]
    _interleaved(bench, systems, list(range(len(prompt_ids))), 0.0, rows, SimpleNamespace(save=lambda: None), "t")
    assert [sorted(row["systems"]) for row in rows] == [
        ["llama.cpp", "target-only"],
        ["target-only"],
        ["llama.cpp", "target-only"],
        ["target-only"],
        ["llama.cpp", "target-only"],
    ]
    assert rows[0]["systems"]["llama.cpp"]["tokens"] == 3 and rows[4]["systems"]["llama.cpp"]["tokens"] == 3
    crash = rows[1]["failed"]["llama.cpp"]
    assert "killed by SIGSEGV" in crash and "Segmentation fault" in crash and "fake_peer.py" in crash, crash
    assert "ValueError: the scores buffer is too small" in rows[3]["failed"]["llama.cpp"]
    assert peer.worker.pid != first and peer.worker.deaths == 1  # a new child after the crash, kept after the raise
    systems = ["target-only", "llama.cpp", "llama.cpp-lookup"]  # the last ran on no prompt
    report = "\n".join(compare_section({"systems": systems, "runs": {"0.0": rows}}))
    assert "| llama.cpp (ran 3 of 5) |" in report and "Failed runs (2;" in report
    assert "| llama.cpp-lookup (ran 0 of 5) | – | – |" in report
    assert "| llama.cpp | 1 | qa | the llama.cpp worker died (killed by SIGSEGV" in report
    peer.close()
    assert peer.worker.pid is None


def test_a_peer_is_given_up_after_repeated_deaths_and_one_that_cannot_load_is_skipped(fake_llama) -> None:
    peer = fake_llama()
    params = [SamplingParams(temperature=0.7, max_new_tokens=4, seed=1)]
    for _ in range(MAX_DEATHS):
        with pytest.raises(PeerFailed, match="exit code 3"):
            peer.run([[EXIT]], params)
    with pytest.raises(PeerFailed, match=f"not run: the llama.cpp worker died {MAX_DEATHS} times"):
        peer.run([[1, 2]], params)  # given up: no third child
    assert peer.worker.pid is None
    skipped, reason = llama_cpp.peer_or_reason(Path("missing.gguf"), 100, frozenset(), threads=1)
    assert skipped is None and "llama.cpp skipped: llama.cpp could not load: FileNotFoundError" in reason


def test_without_llama_cpp_python_the_peer_is_skipped_with_the_install_command(monkeypatch) -> None:
    monkeypatch.setattr(llama_cpp.importlib.util, "find_spec", lambda name: None)
    peer, reason = llama_cpp.peer_or_reason(Path("model.gguf"), 100, frozenset(), lookup=True)
    assert peer is None and reason.startswith("llama.cpp-lookup skipped: llama-cpp-python is not installed")
    assert "-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" in reason


def test_the_context_is_a_multiple_of_256_with_room_for_a_draft() -> None:
    room = llama_cpp.LOOKUP_TOKENS + 1
    assert llama_cpp.context_size(1) == 256
    assert llama_cpp.context_size(256 - room) == 256
    assert llama_cpp.context_size(257 - room) == 512
    assert llama_cpp.context_size(1000) == 1024
    with pytest.raises(ValueError, match="at least one token"):
        llama_cpp.context_size(0)


def test_death_causes() -> None:
    dump = (
        "Fatal Python error: Segmentation fault\n\nCurrent thread 0x01 (most recent call first):\n"
        '  File "/x/llama_cpp/_internals.py", line 312 in decode\n  File "/x/llama.py", line 679 in eval\n'
    )
    assert death_cause(-11, dump) == "killed by SIGSEGV, Segmentation fault, in _internals.py:312 decode"
    assert death_cause(1, "Traceback...\nImportError: libggml.so") == "exit code 1: ImportError: libggml.so"
    assert death_cause(-9, "") == "killed by SIGKILL"
    assert death_cause(-11, "Fatal Python error: ") == "killed by SIGSEGV"  # a dump cut short by a second crash
