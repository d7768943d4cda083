"""Loaders and runtimes on small models written by the tests: parity with transformers, GGUF, adapter."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from devices import DEVICE
from model_factory import make_tokenizer, write_hf_model, write_llama_gguf

from specsample import ModelDrafter, SamplingParams, SpecConfig, generate
from specsample.drafters.ngram import NgramDrafter
from specsample.models.loader import load_model
from specsample.planner import FixedGamma

TEXT = "the quick brown fox jumps over the lazy dog, the quick brown fox"
CONFIGS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral_window": ("mistral", {"sliding_window": 8}),
    "qwen2_window_from_layer_1": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "rope_linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "rope_llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "rope_yarn": (
        "qwen2",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    "bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "tied": ("llama", {"tie_word_embeddings": True}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    tokenizer = make_tokenizer()
    out = {
        name: write_hf_model(root / name, kind, tokenizer=tokenizer, **extra) for name, (kind, extra) in CONFIGS.items()
    }
    out["gemma3"] = write_hf_model(root / "gemma3", "gemma3", tokenizer=tokenizer, sliding_window=4)
    out["gemma3_draft"] = write_hf_model(
        root / "gemma3_draft", "gemma3", tokenizer=tokenizer, seed=5, sliding_window=4, num_hidden_layers=1
    )
    out["gguf"] = write_llama_gguf(out["llama"], root / "tiny.gguf")
    return out


def _reference_logits(folder: Path, ids: torch.Tensor, gguf_file: str | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kwargs)
    with torch.no_grad():
        return model(ids).logits


def _incremental(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits from a prefill, a rejected detour rolled back, then one token at a time."""
    cache = model.new_cache(1, 128)
    slot = torch.tensor([0])
    parts = [model.forward_cached(ids[:, :10], cache, slot)]
    model.forward_cached(torch.tensor([[3, 4, 5]]), cache, slot)  # drafts that get rejected...
    cache.truncate(slot, torch.tensor([10]))  # ...and rolled back by lowering the length
    parts += [model.forward_cached(ids[:, i : i + 1], cache, slot) for i in range(10, ids.shape[1])]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_our_runtime_matches_transformers(folders, name) -> None:
    loaded = load_model(str(folders[name]), dtype="float32", device=DEVICE)
    assert loaded.runtime == "ours"
    ids = torch.tensor([loaded.tokenizer.encode(TEXT, chat=True)])
    reference = _reference_logits(folders[name], ids)  # transformers on the CPU
    for logits in (loaded.model(ids).cpu(), _incremental(loaded.model, ids).cpu()):
        assert (logits - reference).abs().max().item() < 1e-4
        assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_sliding_window_changes_the_output(folders) -> None:
    loaded = load_model(str(folders["mistral_window"]), dtype="float32")
    ids = torch.tensor([loaded.tokenizer.encode(TEXT, chat=True)])
    assert ids.shape[1] > 8
    windowed = loaded.model(ids)
    loaded.model.config = dataclasses.replace(loaded.model.config, sliding_window=None)
    assert (windowed - loaded.model(ids)).abs().max().item() > 1e-3  # the parity test above has teeth


def test_gguf_loads_like_the_folder_and_like_transformers(folders) -> None:
    from_folder = load_model(str(folders["llama"]), dtype="float32")
    from_gguf = load_model(str(folders["gguf"]), dtype="float32")
    ids = torch.tensor([from_folder.tokenizer.encode(TEXT, chat=True)])
    assert from_gguf.tokenizer.encode(TEXT, chat=True) == ids[0].tolist()
    ours = from_gguf.model(ids)
    reference = _reference_logits(folders["gguf"].parent, ids, gguf_file=folders["gguf"].name)
    assert (ours - reference).abs().max().item() < 1e-4  # Q8_0 feed-forward weights dequantized alike
    assert (ours - from_folder.model(ids)).abs().max().item() < 0.05  # only Q8_0 rounding apart
    assert from_gguf.tokenizer.eos_token_ids == from_folder.tokenizer.eos_token_ids


def test_bfloat16_runtime(folders) -> None:
    fp32 = load_model(str(folders["llama"]), dtype="float32").model
    bf16 = load_model(str(folders["llama"]), dtype="bfloat16").model
    assert bf16.dtype == torch.bfloat16
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert (bf16(ids).float() - fp32(ids)).abs().max().item() < 0.1
    cache = bf16.new_cache(1, 32)
    cached = bf16.forward_cached(ids, cache, torch.tensor([0]))
    assert cached.dtype == torch.bfloat16 and cached.shape == (1, 6, fp32.vocab_size)


def test_transformers_adapter_gemma3(folders) -> None:
    loaded = load_model(str(folders["gemma3"]), dtype="float32", device=DEVICE)
    assert loaded.runtime == "hf"
    ids = torch.tensor([loaded.tokenizer.encode(TEXT, chat=True)])
    reference = _reference_logits(folders["gemma3"], ids)
    assert ids.shape[1] > 4  # crosses the sliding window, so cropping after it is exercised
    assert (_incremental(loaded.model, ids).cpu() - reference).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_greedy_speculation_with_each_runtime(folders, name) -> None:
    target = load_model(str(folders[name]), dtype="float32", device=DEVICE)
    draft_name = "gemma3_draft" if name == "gemma3" else "qwen2"
    draft = load_model(str(folders[draft_name]), dtype="float32", device=DEVICE)
    prompts = [target.tokenizer.encode(t, chat=True) for t in (TEXT, "hello world", "speculative sampling")]
    params = SamplingParams(temperature=0, max_new_tokens=20)
    plain = generate(target.model, prompts, params)
    for drafter in (ModelDrafter(draft.model), NgramDrafter(min_n=1)):
        spec = generate(target.model, prompts, params, draft=drafter, config=SpecConfig(), planner=FixedGamma(4))
        assert [c.token_ids for c in spec.completions] == [c.token_ids for c in plain.completions]


@pytest.mark.parametrize("name", ["llama", "mistral_window", "gemma3"])
def test_cached_forwards_run_without_cudnn_attention(folders, name, monkeypatch) -> None:
    """cuDNN's attention builds a graph per shape, which cost a GPU 45-57 ms in every one-token round that met a
    new (tokens, context length) shape (models/sdpa.py): both runtimes turn it off for every cached forward (prefill,
    scoring drafts, one-token decoding within or past a sliding window), put the flag back after each, and leave
    it on throughout when the model's `cudnn_attention` is set."""
    import torch.nn.functional as F

    model = load_model(str(folders[name]), dtype="float32", device=DEVICE).model
    flag = torch.backends.cuda.cudnn_sdp_enabled
    assert flag()
    real, seen = F.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        seen.append(flag())
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)

    def flags_in(tokens: list[int], cache, length: int) -> set[bool]:
        seen.clear()
        cache.truncate(torch.tensor([0]), torch.tensor([length]))
        model.forward_cached(torch.tensor([tokens]), cache, torch.tensor([0]))
        assert seen and flag()  # the runtime called SDPA, and the flag is back
        return set(seen)

    cache = model.new_cache(1, 64)
    assert flags_in(list(range(5, 15)), cache, 0) == {False}  # a prefill
    assert flags_in([3, 4, 5], cache, 10) == {False}  # a draft scored
    assert flags_in([3], cache, 10) == {False}  # a decode step (past the window of 8 or 4, where there is one)
    assert flags_in([3], cache, 3) == {False}  # a decode step within it
    model.cudnn_attention = True
    assert flags_in(list(range(5, 15)), cache, 0) == flags_in([3], cache, 10) == {True}


def test_without_cudnn_attention_turns_only_cudnn_off_and_keeps_a_callers_choice() -> None:
    """The switch composes with `sdpa_kernel`: kernels a caller restricted stay restricted (cuDNN too: off stays
    off), cuDNN comes back on exit, an error inside included, and a caller who left no kernel that takes a mask on
    beside cuDNN's keeps it (turning it off would leave a masked forward nothing)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specsample.models.sdpa import without_cudnn_attention

    flags = torch.backends.cuda
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]):
        with without_cudnn_attention(False):
            assert not flags.cudnn_sdp_enabled() and flags.math_sdp_enabled() and not flags.flash_sdp_enabled()
        assert flags.cudnn_sdp_enabled()
    with sdpa_kernel([SDPBackend.MATH]):
        with without_cudnn_attention(False):
            pass
        assert not flags.cudnn_sdp_enabled()  # not switched on by the exit
    for only in ([SDPBackend.CUDNN_ATTENTION], [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        with sdpa_kernel(only), without_cudnn_attention(False):
            assert flags.cudnn_sdp_enabled()
    with without_cudnn_attention(True):
        assert flags.cudnn_sdp_enabled()
    with pytest.raises(RuntimeError, match="inside"), without_cudnn_attention(False):
        raise RuntimeError("inside")
    assert flags.cudnn_sdp_enabled()


def test_without_cudnn_attention_holds_across_threads() -> None:
    """The flag is process-wide: a forward in one thread ending must not turn cuDNN back on under another thread's
    forward still running; the last one out restores it (an error in one thread included)."""
    import threading

    from specsample.models.sdpa import without_cudnn_attention

    flags = torch.backends.cuda
    a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with pytest.raises(RuntimeError), without_cudnn_attention(False):
            a_inside.set()
            seen["second came in"] = b_inside.wait(5)
            raise RuntimeError("first forward fails")
        a_done.set()

    def second() -> None:
        seen["first came in"] = a_inside.wait(5)
        with without_cudnn_attention(False):
            b_inside.set()
            a_done.wait(5)
            seen["after the first left"] = flags.cudnn_sdp_enabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert a_done.is_set() and seen == {"first came in": True, "second came in": True, "after the first left": False}
    assert flags.cudnn_sdp_enabled()
    # a caller's sdpa_kernel that turns cuDNN on inside a hold: the next forward still runs without it
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with without_cudnn_attention(False):
        with sdpa_kernel([SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]):
            assert flags.cudnn_sdp_enabled()
            with without_cudnn_attention(False):
                assert not flags.cudnn_sdp_enabled()
    assert flags.cudnn_sdp_enabled()


def test_tokenizer_stop_ids_chat_and_streaming(folders) -> None:
    tokenizer = load_model(str(folders["llama"]), dtype="float32").tokenizer
    vocab = tokenizer.hf.get_vocab()
    assert {vocab["<|im_end|>"], vocab["<|endoftext|>"]} <= tokenizer.eos_token_ids
    chat = tokenizer.encode("hello", chat=True)
    assert chat[0] == vocab["<|im_start|>"] and tokenizer.hf.decode(chat).endswith("<|im_start|>assistant\n")
    text = "fox → 狐狸 🦊 é"  # multi-byte characters split over byte-level tokens
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.encode()) // 2
    decoder = tokenizer.stream()
    pieces = [decoder.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + decoder.flush() == tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no-such-model", "unknown model spec"),
        ("someorg/somemodel", "local path"),
    ],
)
def test_loader_errors(spec, message, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=message):
        load_model(spec)


def test_bad_files_are_clear_errors(tmp_path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a .gguf model"):
        load_model(str(tmp_path / "weights.bin"))
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 12)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model(str(tmp_path / "broken.gguf"))
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))


def test_a_token_tree_scores_each_path_as_a_chain_and_keeps_one_path() -> None:
    """One forward over a tree (each token seeing the context and its ancestors, at the position of its depth) gives
    every path the logits of that path decoded as a chain; keeping a path's cache entries leaves the cache as if
    that path alone had been decoded."""
    from specsample.models.tiny import tiny_lm

    model = tiny_lm(40, 2, init_scale=0.2, dtype=torch.float64)
    slot = torch.tensor([0])
    # the pending token 5 at block index 0; its children 6 and 7; 8 under 6; 9 under 8; 10 under 7
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2]])

    def fresh(prefix: list[int]):
        cache = model.new_cache(1, 32)
        model.prefill(torch.tensor([prefix]), cache, slot)
        return cache

    cache = fresh([1, 2, 3, 4])
    logits, hidden = model.forward_cached_tree(tokens, cache, slot, parents)
    assert torch.allclose(
        logits[0, [0, 1, 3, 4]],
        model.forward_cached(torch.tensor([[5, 6, 8, 9]]), fresh([1, 2, 3, 4]), slot)[0],
        atol=1e-12,
    )
    assert torch.allclose(
        logits[0, [2, 5]], model.forward_cached(torch.tensor([[7, 10]]), fresh([1, 2, 3, 4, 5]), slot)[0], atol=1e-12
    )
    with torch.inference_mode():
        assert torch.allclose(model.logits(hidden), logits)
    cache.keep_path(0, 4, [0, 1, 3, 4])
    assert int(cache.lengths[0]) == 8
    after = model.forward_cached(torch.tensor([[11]]), cache, slot)
    assert torch.allclose(
        after, model.forward_cached(torch.tensor([[11]]), fresh([1, 2, 3, 4, 5, 6, 8, 9]), slot), atol=1e-12
    )
    with pytest.raises(ValueError, match="must come before"):
        model.forward_cached_tree(tokens, fresh([1, 2]), slot, torch.tensor([[-1, 0, 3, 1, 3, 2]]))
