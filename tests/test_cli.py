"""`specsample generate` as a user runs it: JSON fields, streaming output, flags, one-line errors."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from model_factory import make_tokenizer, write_hf_model

from specsample.cli import main


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    tokenizer = make_tokenizer()
    return {
        "target": write_hf_model(root / "target", "llama", tokenizer=tokenizer, max_position_embeddings=64),
        "draft": write_hf_model(root / "draft", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1),
        "other_vocab": write_hf_model(root / "other", "llama", tokenizer=tokenizer, vocab_size=512),
    }


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`specsample ARGS` in this process (the console script's `main`), its exit status and output captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's exits: --help, bad flags
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["specsample", *args], code, out.getvalue(), err.getvalue())


def test_json_output(models) -> None:
    done = run_cli(
        "generate",
        "the quick brown fox",
        "--target",
        str(models["target"]),
        "--draft",
        str(models["draft"]),
        "--json",
        "--max-new-tokens",
        "12",
        "--seed",
        "1",
        "--gamma",
        "3",
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out) >= {"text", "token_ids", "stats", "prompt_tokens", "finish_reason"}
    assert 1 <= len(out["token_ids"]) <= 12
    stats = out["stats"]
    for field in (
        "new_tokens",
        "tokens_per_second",
        "ttft_seconds",
        "tpot_seconds",
        "acceptance_rate",
        "mean_accepted_length",
        "gamma",
        "acceptance_per_position",
        "draft_seconds",
        "target_seconds",
    ):
        assert field in stats
    assert stats["gamma"] == 3 and stats["drafted"] > 0
    again = json.loads(
        run_cli(
            "generate",
            "the quick brown fox",
            "--target",
            str(models["target"]),
            "--draft",
            str(models["draft"]),
            "--json",
            "--max-new-tokens",
            "12",
            "--seed",
            "1",
            "--gamma",
            "3",
        ).stdout
    )
    assert again["token_ids"] == out["token_ids"]  # same seed, same output


def test_streaming_text_and_summary(models) -> None:
    done = run_cli(
        "generate",
        "hello world",
        "--target",
        str(models["target"]),
        "--draft",
        "ngram",
        "--temperature",
        "0",
        "--max-new-tokens",
        "10",
        "--no-chat",
    )
    assert done.returncode == 0, done.stderr
    summary = done.stderr.strip().splitlines()[-1]
    for piece in ("new tokens", "tok/s", "TTFT", "TPOT", "acceptance", "tokens/round", "gamma"):
        assert piece in summary
    plain = run_cli(
        "generate",
        "hello world",
        "--target",
        str(models["target"]),
        "--no-speculation",
        "--temperature",
        "0",
        "--max-new-tokens",
        "10",
        "--no-chat",
    )
    assert plain.stdout == done.stdout  # greedy text is the same with and without speculation


def test_json_schema_flag(models, tmp_path) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    done = run_cli(
        "generate",
        "the quick brown fox",
        "--target",
        str(models["target"]),
        "--draft",
        str(models["draft"]),
        "--json",
        "--max-new-tokens",
        "16",
        "--seed",
        "2",
        "--temperature",
        "1",
        "--json-schema",
        str(tmp_path / "schema.json"),
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["finish_reason"] == "stop" and json.loads(out["text"]) in ({"ok": True}, {"ok": False})


def test_pad_rows_flag(models) -> None:
    """--pad-rows auto measures the target's widths first and changes no token of a greedy generation."""
    args = [
        "generate",
        "hello world",
        "--target",
        str(models["target"]),
        "--draft",
        str(models["draft"]),
        "--temperature",
        "0",
        "--max-new-tokens",
        "16",
        "--no-chat",
        "--json",
        "--gamma",
        "2",
    ]
    padded = run_cli(*args, "--pad-rows", "auto")
    assert padded.returncode == 0, padded.stderr
    assert "rounds of 1..3 tokens scored as (1, " in padded.stderr  # the measured table is shown
    assert json.loads(padded.stdout)["token_ids"] == json.loads(run_cli(*args).stdout)["token_ids"]
    bad = run_cli(*args, "--pad-rows", "on")
    assert bad.returncode != 0 and "--pad-rows: invalid choice" in bad.stderr


@pytest.mark.parametrize(
    "case, message",
    [
        ("unknown", "unknown model spec"),
        ("vocab", "vocabulary"),
        ("long", "context window"),
        ("gamma", "gamma"),
        ("compile-hf", "--compile needs our Llama-family runtime"),
        ("tree", "--tree: a tree is NODES or NODESxBRANCHxDEPTH"),
    ],
)
def test_errors_are_one_line(models, case, message) -> None:
    args = {
        "unknown": ["generate", "hi", "--target", "no-such-model"],
        "vocab": ["generate", "hi", "--target", str(models["target"]), "--draft", str(models["other_vocab"])],
        "long": ["generate", "fox " * 200, "--target", str(models["target"]), "--max-new-tokens", "8"],
        "gamma": ["generate", "hi", "--target", str(models["target"]), "--gamma", "0"],
        "compile-hf": ["generate", "hi", "--target", str(models["target"]), "--runtime", "hf", "--compile"],
        "tree": ["generate", "hi", "--target", str(models["target"]), "--tree", "8x2"],
    }[case]
    done = run_cli(*args)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr


@pytest.mark.slow
def test_defaults_run_the_embedded_models() -> None:
    """The installed console script, in a process of its own, on the default models."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "specsample.cli",
            "generate",
            "Name a color.",
            "--json",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["stats"]["target"] == "smollm2-135m-instruct" and out["text"]


def test_draft_window_flag(models, tmp_path) -> None:
    """A draft folder's draft_window.json is used by default (auto) or ignored (off); greedy text never changes."""
    import shutil

    draft = tmp_path / "windowed"
    shutil.copytree(models["draft"], draft)
    (draft / "draft_window.json").write_text(json.dumps({"sink": 2, "recent": 4, "limit": 12}))
    args = [
        "generate",
        "the quick brown fox jumps over the lazy dog " * 2,
        "--target",
        str(models["target"]),
        "--temperature",
        "0",
        "--max-new-tokens",
        "16",
        "--no-chat",
        "--json",
        "--gamma",
        "2",
    ]
    plain = json.loads(run_cli(*args, "--no-speculation").stdout)["token_ids"]
    for mode in ("auto", "off"):
        done = run_cli(*args, "--draft", str(draft), "--draft-window", mode)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert out["token_ids"] == plain and out["stats"]["drafted"] > 0
    bad = run_cli(*args, "--draft", str(draft), "--draft-window", "on")
    assert bad.returncode != 0 and "--draft-window: invalid choice" in bad.stderr
