"""Per-token cost of grammar engines on this CPU: xgrammar, llguidance and outlines-core, with the SmolLM2 tokenizer.

For a JSON schema (and free JSON, json_object) and a document that satisfies it, each engine compiles the grammar,
then for every token of the document computes the next-token mask over the vocabulary and accepts the token:
the work a constrained decoding step adds. Reported: compile time, median and p90 per-token mask time, and the
accept time. The engines run interleaved, document by document, `--repeats` times.

    python benchmarks/grammar_engines.py --out docs/results/grammar_engines
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["mathematics", "analytical engine", "notes"],
    "address": {"city": "London", "zip": "W1 1AA"},
    "active": True,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character byte-level BPE writes it as."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _byte_vocab(hf) -> list[bytes]:
    """Each token id's bytes (byte-level BPE decoded), for engines that take raw bytes."""
    decoder = {c: b for b, c in _bytes_to_unicode().items()}
    out = []
    for token in hf.convert_ids_to_tokens(list(range(len(hf)))):
        try:
            out.append(bytes(decoder[c] for c in token))
        except KeyError:  # a special token: its text
            out.append(token.encode())
    return out


def xgrammar_engine(hf, schema: str | None):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf), stop_token_ids=[hf.eos_token_id])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(schema) if schema else compiler.compile_builtin_json_grammar()
    compile_s = time.perf_counter() - started
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    return compile_s, lambda: matcher.fill_next_token_bitmask(bitmask), matcher.accept_token, matcher.reset


def llguidance_engine(hf, schema: str | None):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema or '{"type": "object"}')
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)  # llguidance compiles lazily: count the first mask
    matcher.reset()
    compile_s = time.perf_counter() - started
    return (
        compile_s,
        lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0),
        matcher.consume_token,
        matcher.reset,
    )


def outlines_engine(hf, schema: str | None):
    from outlines_core import Guide, Index, Vocabulary, json_schema

    tokens: dict[bytes, list[int]] = {}
    for i, token in enumerate(_byte_vocab(hf)):
        if i != hf.eos_token_id:
            tokens.setdefault(token, []).append(i)
    vocabulary = Vocabulary(hf.eos_token_id, tokens)
    started = time.perf_counter()
    index = Index(json_schema.build_regex_from_schema(schema or json.dumps({"type": "object"})), vocabulary)
    compile_s = time.perf_counter() - started
    guide = Guide(index)
    mask = torch.zeros((len(hf) + 31) // 32, dtype=torch.int32)

    def fill() -> None:
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

    return compile_s, fill, guide.advance, guide.reset


ENGINES = {"xgrammar": xgrammar_engine, "llguidance": llguidance_engine, "outlines-core": outlines_engine}


def measure(hf, repeats: int) -> dict:
    document = hf(json.dumps(DOCUMENT), add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
    results: dict = {}
    for case, schema in (("json_schema", json.dumps(SCHEMA)), ("json_object", None)):
        built = {}
        for name, make in ENGINES.items():
            try:
                built[name] = make(hf, schema)
            except Exception as exc:  # noqa: BLE001 - an engine that cannot run this case is reported, not fatal
                results.setdefault(case, {})[name] = {"error": f"{type(exc).__name__}: {exc}"}
        masks: dict[str, list[float]] = {n: [] for n in built}
        accepts: dict[str, list[float]] = {n: [] for n in built}
        for _ in range(repeats):  # interleaved: each engine walks the document once per repeat
            for name, (_, fill, accept, reset) in built.items():
                reset()
                for token in document[:-1] if name == "outlines-core" else document:
                    started = time.perf_counter()
                    fill()
                    masked = time.perf_counter()
                    accept(token)
                    masks[name].append(masked - started)
                    accepts[name].append(time.perf_counter() - masked)
        for name, (compile_s, *_rest) in built.items():
            ordered = sorted(masks[name])
            results.setdefault(case, {})[name] = {
                "compile_ms": round(1000 * compile_s, 1),
                "mask_us_median": round(1e6 * statistics.median(ordered), 1),
                "mask_us_p90": round(1e6 * ordered[int(0.9 * (len(ordered) - 1))], 1),
                "accept_us_median": round(1e6 * statistics.median(accepts[name]), 1),
                "tokens": len(document),
                "repeats": repeats,
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("docs/results/grammar_engines"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from specsample.models.hub import alias_folder

    hf = AutoTokenizer.from_pretrained(str(alias_folder(args.target)))
    torch.set_num_threads(1)
    results = measure(hf, args.repeats)
    versions = {}
    for module in ("xgrammar", "llguidance", "outlines_core"):
        from importlib.metadata import version

        versions[module] = version(module.replace("_", "-"))
    report = {
        "target": args.target,
        "vocab": len(hf),
        "machine": platform.processor() or platform.machine(),
        "cpus": torch.get_num_threads(),
        "versions": versions,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grammar_engines.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
