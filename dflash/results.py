"""What :func:`dflash.generate` returns, and the clock both runtimes time their steps with."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


def device_clock(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work has finished (a no-op wait on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class GenerateResult:
    sequences: torch.Tensor  # [1, prompt + generated] int64, like z-lab's output
    acceptance_lengths: list[int]  # tokens emitted per round, bonus included
    num_prompt_tokens: int
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def num_generated_tokens(self) -> int:
        return self.sequences.shape[-1] - self.num_prompt_tokens

    @property
    def tau(self) -> float:
        """Mean acceptance length (tokens per round, bonus included)."""
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def decode_time(self) -> float:
        return self.total_time - self.prefill_time

    @property
    def other_time(self) -> float:
        return max(0.0, self.decode_time - self.draft_time - self.verify_time)


class BatchResult:
    """Per-request results of a batched call: ``.sequences`` and ``.acceptance_lengths`` are lists."""

    def __init__(self, results: list[GenerateResult]):
        self.results = results
        self.sequences = [r.sequences[0] for r in results]
        self.acceptance_lengths = [r.acceptance_lengths for r in results]
        first = results[0]
        self.prefill_time, self.draft_time = first.prefill_time, first.draft_time
        self.verify_time, self.total_time = first.verify_time, first.total_time

    @property
    def tau(self) -> float:
        rounds = [a for r in self.acceptance_lengths for a in r]
        return sum(rounds) / max(1, len(rounds))

    @property
    def other_time(self) -> float:
        return max(0.0, self.total_time - self.prefill_time - self.draft_time - self.verify_time)
