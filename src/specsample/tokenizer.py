"""Tokenizers: chat templates, every end-of-sequence id, and streaming detokenisation."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# special tokens that end a turn or a document in common model families
_END_TOKENS = (
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<eos>",
    "</s>",
    "<|end|>",
)


class Tokenizer:
    """A Hugging Face tokenizer plus the stop ids and chat handling generation needs."""

    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Iterable[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = set(int(i) for i in extra_eos_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        special = {t.content: i for i, t in getattr(hf_tokenizer, "added_tokens_decoder", {}).items() if t.special}
        for name in _END_TOKENS:
            if name in special:  # only real special tokens, never the plain text "</s>"
                eos.add(int(special[name]))
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load from a Hugging Face model folder, reading extra EOS ids from generation_config.json."""
        from transformers import AutoTokenizer

        folder = Path(folder)
        return cls(AutoTokenizer.from_pretrained(str(folder)), _generation_eos_ids(folder))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids for `text`; with `chat`, wrapped as one user turn with the generation prompt."""
        if not chat:
            return list(self.hf(text)["input_ids"])
        return self.encode_messages(
            ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        )

    def encode_messages(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Apply the chat template to a conversation and add the assistant generation prompt."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use plain completion (--no-chat)")
        rendered = self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return list(self.hf(rendered, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Text for `ids`, special tokens removed."""
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def stream(self) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence."""
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental detokenisation that never emits half of a multi-byte character.

    Decodes a short window of recent tokens and emits the text they add; while the newest text ends
    in the replacement character (an incomplete UTF-8 sequence) it waits for more tokens.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context so the next token's leading space decodes right
        self.read_offset = 0  # tokens already turned into emitted text

    def push(self, new_ids: Iterable[int]) -> str:
        """Add tokens; return the text that became final (possibly empty)."""
        self.ids.extend(int(i) for i in new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Text still held back at the end of generation (a truncated character stays replaced)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


def _generation_eos_ids(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.exists():
        return []
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]
