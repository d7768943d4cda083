"""Logits processors: penalties, logit bias and a grammar mask, applied alike to the draft's and the target's logits.

A processed distribution at a position is a function of the tokens before it: the prompt, the committed output
and, inside a round, the drafts before that position (in a tree: its ancestors). The drafter processes its logits at
each draft step with the drafts it drew before it, the target each scored position with the drafts before it,
through the same `Shaper`; the verifier then sees processed q and p, and the output follows the processed target
exactly (the rejection rule holds for any pair of distributions given the past). The state a row carries between
rounds, its token counts and its grammar matcher, moves only on commit.

Order on the logits (vLLM's definitions): repetition penalty (a seen token's positive logit divided by it, a
negative one multiplied, over prompt and output), frequency and presence penalties (over the output), logit bias,
min_tokens (an end-of-sequence token gets -inf at a position with fewer than min_tokens output tokens before it),
then the grammar mask (a disallowed token gets -inf). A grammar that allows only end-of-sequence before min_tokens
leaves no token: the row ends with an error.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor

from specsample.config import SamplingParams
from specsample.grammar import GrammarCompiler, Matcher


class RowProcessors:
    """One request's processors and what they remember: the prompt's tokens, the output's counts and length, the
    grammar."""

    def __init__(
        self,
        params: SamplingParams,
        prompt: Sequence[int],
        vocab_size: int,
        grammars: GrammarCompiler | None,
        eos_token_ids: Collection[int] = (),
    ) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.output_length = 0
        self.eos = torch.zeros(vocab_size, dtype=torch.bool)  # [vocab]: masked while the output is under min_tokens
        self.eos[torch.tensor([t for t in eos_token_ids if 0 <= t < vocab_size], dtype=torch.long)] = True
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
        self.in_prompt[torch.tensor(list(prompt), dtype=torch.long)] = True
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float64)
        if params.logit_bias:
            self.bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
            self.bias_values = torch.tensor([v for _, v in params.logit_bias], dtype=torch.float64)
        self.matcher: Matcher | None = None
        if params.grammar is not None:
            if grammars is None:
                raise ValueError("this engine has no grammar compiler (it needs the target's tokenizer)")
            self.matcher = grammars.matcher(params.grammar)
        self.penalised = params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1

    def commit(self, tokens: Sequence[int]) -> bool:
        """Count committed tokens and move the grammar past them; False if the grammar disallows one."""
        self.output_length += len(tokens)
        if tokens:
            self.output_counts.index_put_(
                (torch.tensor(list(tokens), dtype=torch.long),),
                torch.ones(len(tokens), dtype=torch.float64),
                accumulate=True,
            )
        return self.matcher.commit(tokens) if self.matcher is not None else True


class Shaper:
    """A round's processors by slot, batched: `next_logits` for a drafter's step, `block_logits` for the target's
    scored block. Rows whose slot has none pass through unchanged."""

    def __init__(self, rows: Mapping[int, RowProcessors]) -> None:
        self.rows = dict(rows)
        states = list(self.rows.values())
        self._index = {slot: i for i, slot in enumerate(self.rows)}  # slot -> row of the stacked tensors
        params = [r.params for r in states]
        vocab = states[0].vocab_size
        self.counted = any(r.penalised for r in states)
        self.output_counts = torch.stack([r.output_counts for r in states]) if self.counted else None  # [R, vocab]
        self.repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float64)  # [R]
        self.frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float64)
        self.presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float64)
        self.in_prompt = (
            torch.stack([r.in_prompt for r in states]) if any(p.repetition_penalty != 1 for p in params) else None
        )  # [R, vocab]
        self.bias = None
        if any(p.logit_bias for p in params):
            self.bias = torch.zeros(len(states), vocab, dtype=torch.float64)  # [R, vocab]
            for i, r in enumerate(states):
                if r.params.logit_bias:
                    self.bias[i, r.bias_ids] = r.bias_values
        self.min_tokens = None
        if any(p.min_tokens for p in params):
            self.min_tokens = torch.tensor([p.min_tokens for p in params], dtype=torch.long)  # [R]
            self.output_length = torch.tensor([r.output_length for r in states], dtype=torch.long)  # [R]
            self.eos = torch.stack([r.eos for r in states])  # [R, vocab]
        self.matchers = {i: r.matcher for i, r in enumerate(states) if r.matcher is not None}
        self.vocab_size = vocab

    def output_lengths(self, index: Tensor, drafts_before: Sequence[Sequence[int]]) -> Tensor:
        """Output tokens before each position `[n]`: the row's committed ones and the drafts before it."""
        return self.output_length[index] + torch.tensor([len(before) for before in drafts_before], dtype=torch.long)

    def _apply(self, logits: Tensor, rows: list[int], drafts_before: Sequence[Sequence[int]]) -> Tensor:
        """Processed `logits [n, vocab]`: position i of stacked row `rows[i]`, after its committed tokens and the
        drafts `drafts_before[i]`."""
        out = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        device, dtype = out.device, out.dtype
        index = torch.tensor(rows, dtype=torch.long)
        if self.output_counts is not None:  # counted
            counts = self.output_counts[index]  # [n, vocab]: the output's, then each position's drafts before it
            drafted = [i for i, before in enumerate(drafts_before) for _ in before]
            if drafted:
                tokens = torch.tensor([t for before in drafts_before for t in before], dtype=torch.long)
                counts.index_put_(
                    (torch.tensor(drafted), tokens), torch.ones(len(drafted), dtype=counts.dtype), accumulate=True
                )
            counts = counts.to(device=device, dtype=dtype)
            if self.in_prompt is not None:
                seen = (counts > 0) | self.in_prompt[index].to(device)
                penalty = self.repetition[index].to(device=device, dtype=dtype).unsqueeze(-1)  # [n, 1]
                out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
            out = out - self.frequency[index].to(device=device, dtype=dtype).unsqueeze(-1) * counts
            out = out - self.presence[index].to(device=device, dtype=dtype).unsqueeze(-1) * (counts > 0).to(dtype)
        if self.bias is not None:
            out = out + self.bias[index].to(device=device, dtype=dtype)
        if self.min_tokens is not None:
            short = self.output_lengths(index, drafts_before) < self.min_tokens[index]  # [n]
            out = out.masked_fill((short.unsqueeze(-1) & self.eos[index]).to(device), float("-inf"))
        if self.matchers:
            allowed = torch.ones(out.shape, dtype=torch.bool)
            at: dict[int, list[int]] = {}
            for i, row in enumerate(rows):
                if row in self.matchers:
                    at.setdefault(row, []).append(i)
            for row, positions in at.items():
                allowed[positions] = self.matchers[row].allowed([drafts_before[i] for i in positions])
            out = out.masked_fill(~allowed.to(device), float("-inf"))
        return out

    def next_logits(
        self,
        logits: Tensor,
        slots: Sequence[int],
        drafts_before: Sequence[Sequence[int]],
        columns: Tensor | None = None,
    ) -> Tensor:
        """Processed `logits [m, K]`: row i belongs to slot `slots[i]` and follows its committed tokens and the drafts
        `drafts_before[i]`; `columns [K]`: the token id of each column (None: the vocabulary in order)."""
        chosen = [i for i, slot in enumerate(slots) if slot in self._index]
        if not chosen:
            return logits
        out = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32).clone()
        picked = out[chosen]
        if columns is not None:  # a draft with an output subset: process over the vocabulary, read its columns back
            full = torch.full((len(chosen), self.vocab_size), float("-inf"), dtype=out.dtype, device=out.device)
            full[:, columns.to(out.device)] = picked
            picked = full
        shaped = self._apply(picked, [self._index[slots[i]] for i in chosen], [drafts_before[i] for i in chosen])
        out[chosen] = shaped if columns is None else shaped[:, columns.to(out.device)]
        return out

    def block_logits(self, logits: Tensor, slots: Sequence[int], tokens: Tensor, parents: Tensor | None) -> Tensor:
        """Processed target logits `[b, n, vocab]` of a scored block: `tokens [b, n]` the pending token then the
        drafts, `parents [b, n]` each block index's parent (None: a chain). The logits at block index j follow the
        drafts up to it: in a tree, its ancestors and itself (the pending token is committed already)."""
        chosen = [i for i, slot in enumerate(slots) if slot in self._index]
        if not chosen:
            return logits
        out = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32).clone()
        token_rows = tokens[chosen].cpu().tolist()
        parent_rows = None if parents is None else parents[chosen].cpu().tolist()
        rows: list[int] = []
        drafts_before: list[list[int]] = []
        for k, i in enumerate(chosen):
            row_tokens = token_rows[k]
            rows += [self._index[slots[i]]] * len(row_tokens)
            drafts_before += (
                [row_tokens[1 : j + 1] for j in range(len(row_tokens))]
                if parent_rows is None
                else _tree_drafts_before(row_tokens, parent_rows[k])
            )
        width = out.shape[1]
        out[chosen] = self._apply(out[chosen].flatten(0, 1), rows, drafts_before).view(len(chosen), width, -1)
        return out


def _tree_drafts_before(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Per block index, the drafts from the pending token's child down to it (parents come before children)."""
    before: list[list[int]] = [[]]
    for j in range(1, len(tokens)):
        before.append(before[parents[j]] + [tokens[j]])
    return before


def token_logprobs(
    logits: Tensor, tokens: Sequence[int], top: int
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Per position of `logits [n, vocab]` (processed target logits), the log-probability of `tokens[i]` at
    temperature 1 and the `top` most likely tokens with theirs (most likely first)."""
    if not len(tokens):
        return []
    log_probs = torch.log_softmax(logits[: len(tokens)].to(torch.float64), dim=-1)  # [n, vocab]
    chosen = log_probs.gather(-1, torch.tensor(list(tokens), device=log_probs.device).unsqueeze(-1)).squeeze(-1)
    out = []
    if top:
        values, ids = log_probs.topk(min(top, log_probs.shape[-1]), dim=-1)
        alternatives = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [()] * len(tokens)
    for lp, alt in zip(chosen.tolist(), alternatives):
        out.append((lp, alt))
    return out
