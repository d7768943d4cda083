"""Deliberately broken verifiers, built by wrapping the real one, to prove the tests have teeth."""

from __future__ import annotations

import torch

from specsample.drafters.model import ModelDrafter
from specsample.sampling import sample
from specsample.verification.chain import Verdict, verify


def residual_as_target(draft_tokens, draft_probs, target_probs, generators, num_drafted=None) -> Verdict:
    """After a rejection, resample from the target instead of norm(max(0, target - draft))."""
    verdict = verify(draft_tokens, draft_probs, target_probs, generators, num_drafted)
    drafted = torch.full_like(verdict.num_accepted, draft_tokens.shape[1]) if num_drafted is None else num_drafted
    rejected = verdict.num_accepted < drafted
    rows = torch.arange(draft_tokens.shape[0])
    resampled = sample(target_probs[rows, verdict.num_accepted].float(), generators)
    return Verdict(verdict.num_accepted, torch.where(rejected, resampled, verdict.next_token), verdict.accepted)


def bonus_off_by_one(draft_tokens, draft_probs, target_probs, generators, num_drafted=None) -> Verdict:
    """When every draft passes, draw the bonus from the last draft's position instead of the next."""
    verdict = verify(draft_tokens, draft_probs, target_probs, generators, num_drafted)
    drafted = torch.full_like(verdict.num_accepted, draft_tokens.shape[1]) if num_drafted is None else num_drafted
    all_passed = (verdict.num_accepted == drafted) & (drafted > 0)
    rows = torch.arange(draft_tokens.shape[0])
    wrong = sample(target_probs[rows, (verdict.num_accepted - 1).clamp(min=0)].float(), generators)
    return Verdict(verdict.num_accepted, torch.where(all_passed, wrong, verdict.next_token), verdict.accepted)


BROKEN = {"residual_as_target": residual_as_target, "bonus_off_by_one": bonus_off_by_one}


def coupled_trusts_the_draft(draft_tokens, target_probs, noise, num_drafted=None) -> Verdict:
    """Coupled verification that accepts each draft because it is the draft's own Gumbel-max token with the shared
    noise (which every draft is), instead of checking it is the target's: the next token is the target's."""
    from specsample.verification.coupled import coupled_choices

    batch, gamma = draft_tokens.shape
    drafted = torch.full((batch,), gamma, dtype=torch.long) if num_drafted is None else num_drafted.cpu()
    choice = coupled_choices(target_probs, noise, [range(d + 1) for d in drafted.tolist()])[0]
    next_token = choice.gather(-1, drafted.unsqueeze(-1).to(choice.device)).squeeze(-1)
    accepted = torch.arange(gamma).unsqueeze(0) < drafted.unsqueeze(1)
    return Verdict(
        drafted.to(draft_tokens.device), next_token.to(draft_tokens.device), accepted.to(draft_tokens.device)
    )


class WrappedDrafter:
    """A drafter wrapped so a broken variant can override `propose` and pass everything else through."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size

    # spelled out, not delegated through __getattr__: Python 3.12's isinstance on a runtime-checkable
    # Protocol looks attributes up statically and would not see delegated methods
    def allocate(self, num_slots, max_len):
        self.inner.allocate(num_slots, max_len)

    def add_rows(self, slots, prompts):
        self.inner.add_rows(slots, prompts)

    def release_rows(self, slots):
        self.inner.release_rows(slots)

    def commit(self, slots, committed):
        self.inner.commit(slots, committed)

    @property
    def abilities(self):  # what the wrapped drafter declares (a feature draft still reads the target's features)
        return self.inner.abilities

    def add_features(self, slots, features):
        self.inner.add_features(slots, features)

    def __getattr__(self, name):  # anything else the engine asks of a model drafter
        return getattr(self.inner, name)


class GateDropsToken(WrappedDrafter):
    """A confidence gate that drops the low-confidence token instead of keeping it: whether a draft
    is proposed then depends on that very draw, which biases the output. Wraps a ModelDrafter."""

    def propose(self, request):
        from specsample.drafters.base import Proposal

        proposal = self.inner.propose(request)
        drafted = proposal.num_drafted.clone()
        thresholds = request.stop_thresholds
        for row in range(len(request.slots)):
            n = int(drafted[row])
            if n and n <= len(thresholds) and float(proposal.confidence[row, n - 1]) < thresholds[n - 1]:
                drafted[row] = n - 1
        return Proposal(proposal.tokens, proposal.probs, drafted, proposal.confidence)


class ExtensionDropsToken(WrappedDrafter):
    """Drafting past the plan that, where the extension declines to go on, drops the draft it judged instead of
    keeping it: whether that draft is proposed then depends on its own draw. Wraps a ModelDrafter."""

    def propose(self, request):
        from specsample.drafters.base import Proposal

        proposal = self.inner.propose(request)
        drafted = proposal.num_drafted.clone()
        for row in range(len(request.slots)):
            n = int(drafted[row])
            if request.extension is not None and request.drafts[row] <= n < request.reach[row]:
                drafted[row] = n - 1  # the extension stopped the row here: drop the token it stopped on
        return Proposal(proposal.tokens, proposal.probs, drafted, proposal.confidence)


class SubsetProbsUnmapped(WrappedDrafter):
    """A draft with an output subset (FR-Spec) that reports its probabilities in the subset's column order
    instead of at the tokens' vocabulary ids: the tokens are right, the q the verifier reads is not.
    Wraps a drafter (a draft model or a feature draft) with an output subset."""

    def propose(self, request):
        proposal = self.inner.propose(request)
        owner = self.inner if hasattr(self.inner, "output_subset") else self.inner.model
        subset = owner.output_subset.cpu()
        unmapped = torch.zeros_like(proposal.probs)
        unmapped[..., : len(subset)] = proposal.probs[..., subset]  # column j holds token subset[j]'s q
        return type(proposal)(proposal.tokens, unmapped, proposal.num_drafted, proposal.confidence)


class ProbsOneStepAhead(WrappedDrafter):
    """Drafts whose reported distributions are one position ahead of the ones their tokens were drawn from (a draft
    reading a feature one position off): position i reports position i + 1's q."""

    def propose(self, request):
        proposal = self.inner.propose(request)
        shifted = proposal.probs.clone()
        shifted[:, :-1] = proposal.probs[:, 1:]
        return type(proposal)(proposal.tokens, shifted, proposal.num_drafted, proposal.confidence)


class SuffixFrequenciesAsProbs(WrappedDrafter):
    """A suffix drafter that reports each draft's estimated probability (its continuations' count ratio) as the
    distribution the draft was drawn from, the rest spread evenly over the vocabulary: the drafts were chosen, not
    drawn from it, so the verifier's acceptance min(1, p / q) and its residual are those of another draft. Wraps a
    SuffixDrafter (or a HybridDrafter around one: its lookup's rows only)."""

    def __init__(self, inner, vocab: int) -> None:
        super().__init__(inner)
        self.vocab_size = vocab

    def lookup_lengths(self, slots, max_tokens):
        return self.inner.lookup_lengths(slots, max_tokens)

    def drafts_otherwise(self, slots):
        return self.inner.drafts_otherwise(slots)

    def park_rows(self, slots):
        self.inner.park_rows(slots)

    def propose(self, request):
        from specsample.drafters.base import Proposal

        proposal = self.inner.propose(request)
        width = proposal.tokens.shape[1]
        probs = torch.zeros(len(request.slots), width, self.vocab_size, dtype=torch.float64)
        for row in range(len(request.slots)):
            draft = self.inner.row_draft(request, row)
            for j, (token, p) in enumerate(zip(draft.tokens, draft.probs)):
                probs[row, j] = (1.0 - p) / (self.vocab_size - 1)
                probs[row, j, token] = p
        return Proposal(proposal.tokens, probs, proposal.num_drafted, None, proposal.parents)


class MedusaTreeReportsHeadProbs(WrappedDrafter):
    """Medusa's candidate tree reporting, for each node, its head's (warped) distribution as the one it was drawn
    from: the nodes were chosen (the heads' top-k), not drawn, so the verifier's acceptance min(1, p / q) and its
    residual are those of another draft. Wraps a MedusaDrafter drafting trees."""

    def propose(self, request):
        from specsample.sampling import warp_rows

        proposal = self.inner.propose(request)
        logits = self.inner.head_logits(request.slots)  # [b, K, K']
        heads = [warp_rows(logits[:, k], request.params).double().cpu() for k in range(logits.shape[1])]
        parents = proposal.parents.cpu()
        depth = torch.zeros_like(parents)  # each node's depth - 1: its head
        for i in range(parents.shape[1]):  # parents come first
            depth[:, i] = torch.where(
                parents[:, i] < 0, 0, depth.gather(1, parents[:, i : i + 1].clamp(min=0))[:, 0] + 1
            )
        q = torch.stack(heads, dim=1).gather(
            1, depth.clamp(max=len(heads) - 1).unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        )
        probs = torch.zeros(*parents.shape, self.vocab_size, dtype=torch.float64)
        subset = self.inner.output_subset
        probs[..., subset.cpu() if subset is not None else slice(None)] = q  # [b, nodes, vocab]
        return type(proposal)(proposal.tokens, probs, proposal.num_drafted, proposal.confidence, proposal.parents)


def copy_prefix_off_by_one(self, source, slot, length):
    """`KVCache.copy_prefix` that writes each copied entry one position late (source position i at i + 1), the first
    left as it was: a copy whose positions are off by one."""
    if slot != source and length > 1:
        self.key_store[:, slot, :, 1:length] = self.key_store[:, source, :, : length - 1].clone()
        self.value_store[:, slot, :, 1:length] = self.value_store[:, source, :, : length - 1].clone()
    self.lengths[slot] = length


class PrefillATokenLate(ModelDrafter):
    """A draft model whose chunked prefill starts every part after a row's first a token late (that token is never
    fed): its cache positions are off by one from the second part on."""

    def prefill_rows(self, slots, units):
        for slot, count in zip(slots, units):
            if int(self.cache.lengths[slot]) > 0 and count > 0:
                self._unfed[slot] = self._unfed[slot][1:]
        super().prefill_rows(slots, units)
