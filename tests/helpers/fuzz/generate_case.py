"""The ``generate`` fuzz case: ``dflash.generate`` on a tiny random pair (``helpers/tiny_models.py``) with random
block sizes, tree budgets, max_new_tokens, stop lists, dtypes, runtimes, kernel backends and (on the engine)
ragged batches of 1-3 prompts. On the reference runtime the draft is an oracle (its proposals are the target's
continuation, corrupted at random; optionally with NaN logits), so that long acceptances occur; the engine runs the
random draft as it is.

Its reference is the target's own greedy decoding (Hugging Face ``generate``, stopping after the first stop token):
temperature 0 is lossless. In bf16 the speculative verify scores B rows at once where Hugging Face scores one, so
near-ties may round apart; bf16 cases check the output's form instead (the prompt kept, at most max_new_tokens new
tokens, every id in the vocabulary, nothing after the first stop token, and max_new_tokens reached unless stopped).
"""
from __future__ import annotations

import torch

import dflash
from dflash_kernels.tree import distinct_prefixes
from helpers.tiny_models import VOCAB, OracleDraft, make_draft, make_target

MAX_BLOCK = 64  # the largest block size a caller may ask for (the runtime documents its cap)


class NanOracle(OracleDraft):
    """An oracle draft whose logits get NaN at random positions: the draft is only a proposal, so the output must
    stay the target's (or the call must fail with a clear error naming NaN)."""

    def compute_logits(self, hidden, output_head, linear=None):
        logits = super().compute_logits(hidden, output_head) if linear is None else super().compute_logits(
            hidden, output_head, linear)
        hit = torch.rand(logits.shape[:-1], generator=self.rng) < 0.5
        return logits.masked_fill(hit[..., None] & (torch.rand(logits.shape, generator=self.rng) < 0.3), float("nan"))


class Generate:
    def __init__(self, c: dict, b):
        torch.manual_seed(c["seed"])
        self.dtype = b.dtype
        target = make_target(c["arch"], layers=c["layers"])
        draft = make_draft(target, block_size=c["draft_block"])
        self.target, self.draft = target.to(self.dtype), draft.to(self.dtype)
        p = c["prompt_len"]
        self.prompt = b.ints((p,), 0, VOCAB)
        if c["mutation"] in ("negative", "past_end", "huge"):
            self.prompt[b.pick(p)] = {"negative": -1, "past_end": VOCAB, "huge": 2**40}[c["mutation"]]
            b.mark("invalid")
        self.max_new = c["max_new"]
        self.block = c["block_size"]
        self.budget = c["tree_budget"]
        self.stops = c["stops"]
        self.backend, self.kernel_backend = c["runtime"], c["kernel_backend"]
        block = self.block if self.block is not None else c["draft_block"]
        if self.max_new < 1 or block < 1:
            b.mark("invalid")
        if block > MAX_BLOCK:
            b.mark("either")  # above the cap: a clear error, or the lossless output
        if self.budget is not None and not (1 <= self.budget <= min(64, distinct_prefixes(block - 1, VOCAB, 65))
                                            and block >= 2):
            b.mark("invalid")  # more nodes than the draft's distinct continuations also get a ValueError
        if any(not 0 <= s < VOCAB for s in self.stops):
            b.mark("either")  # a stop id outside the vocabulary never occurs
        # the oracle's proposals ride on the reference runtime's draft forward; the engine drafts with its own step
        self.oracle = self.backend == "reference"
        self.nan = c["nan_draft"] and self.oracle
        if self.nan:
            b.mark("either")
        self.exact = self.dtype == torch.float32
        # the engine also takes a ragged batch: more prompts, each with its own max_new_tokens
        extra = c["batch"] - 1 if self.backend == "fast" else 0
        self.prompts = [self.prompt] + [b.ints((1 + b.pick(12),), 0, VOCAB) for _ in range(extra)]
        self.max_news = [self.max_new] + [1 + b.pick(24) for _ in range(extra)]

    def _expected(self, prompt: torch.Tensor, max_new: int) -> torch.Tensor:
        ids = prompt[None]
        kwargs = {"eos_token_id": self.stops} if self.stops else {}
        with torch.no_grad():
            out = self.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                       do_sample=False, pad_token_id=0, **kwargs)[0]
        return _cut_at_stop(out, len(prompt), self.stops)

    def public(self, backend):
        # the oracle proposes the target's continuation (corrupted at random), so every acceptance length occurs
        valid_prompt = bool(((self.prompt >= 0) & (self.prompt < VOCAB)).all())
        usable = self.oracle and valid_prompt and self.max_new > 0
        continuation = self._expected(self.prompt, self.max_new)[len(self.prompt):] if usable else self.prompt[:0]
        draft = self.draft
        if self.oracle:
            draft.__class__ = NanOracle if self.nan else OracleDraft
            draft.attach(continuation, len(self.prompt), corrupt=0.3, seed=0)
        kwargs = {} if self.backend == "reference" else {"kernel_backend": self.kernel_backend}
        batched = len(self.prompts) > 1
        out = dflash.generate(self.target, draft, self.prompts if batched else self.prompt,
                              self.max_news if batched else self.max_new, stop_token_ids=self.stops or None,
                              block_size=self.block, backend=self.backend, tree_budget=self.budget, **kwargs)
        return list(out.sequences) if batched else [out.sequences[0]]

    def reference(self):
        return [self._expected(p, m) for p, m in zip(self.prompts, self.max_news)]

    def check_form(self, got: list) -> str | None:
        """For bf16 (no exact reference): what is wrong with the outputs' form, or None."""
        if len(got) != len(self.prompts):
            return f"{len(got)} sequences for {len(self.prompts)} prompts"
        for r, (seq, prompt, max_new) in enumerate(zip(got, self.prompts, self.max_news)):
            p = len(prompt)
            new = seq[p:]
            if not torch.equal(seq[:p], prompt):
                return f"request {r}: the prompt was changed"
            if not 1 <= len(new) <= max_new:
                return f"request {r}: {len(new)} new tokens for max_new_tokens={max_new}"
            if ((new < 0) | (new >= VOCAB)).any():
                return f"request {r}: token ids outside [0, {VOCAB}): {new.tolist()}"
            hits = [i for i, t in enumerate(new.tolist()) if t in self.stops]
            if hits and hits[0] != len(new) - 1:
                return f"request {r}: tokens after the first stop token (at {hits[0]}): {new.tolist()}"
            if not hits and len(new) != max_new:
                return f"request {r}: stopped after {len(new)} of {max_new} tokens without a stop token"
        return None


def _cut_at_stop(seq: torch.Tensor, p: int, stops: list[int]) -> torch.Tensor:
    """Hugging Face pads after a stop token in a batch; drop anything after the first stop."""
    new = seq[p:].tolist()
    for i, t in enumerate(new):
        if t in stops:
            return seq[: p + i + 1]
    return seq
