"""``torch.compile(fullgraph=True)`` traces the engine's draft and verify steps on CPU without a graph
break (every kernel is a registered op with a fake), and the compiled steps equal the eager ones."""
from __future__ import annotations

import pytest
import torch

from dflash.engine import DFlashEngine
from dflash.sampling import SamplingParams
from helpers.tiny_models import make_draft, make_target


def engine_pair(sampling: SamplingParams, stops):
    target = make_target("qwen3")
    draft = make_draft(target, layers=2, block_size=4, layer_types=["sliding_attention", "full_attention"],
                       sliding_window=3)
    prompts = [torch.randint(0, 48, (n,)) for n in (6, 11)]
    engines = []
    for _ in range(2):
        engine = DFlashEngine(target, draft, batch=2, capacity=32, block_size=4, kernel_backend="torch")
        with torch.inference_mode():
            engine.reset(prompts, [12, 12], stops, sampling, seed=5)
        engine.kv_bound = engine.capacity + engine.block_size  # static, as under graphs
        engines.append(engine)
    return engines


@pytest.mark.parametrize("sampling,stops", [(SamplingParams(), [[7], []]),
                                            (SamplingParams(temperature=0.8, top_k=5, top_p=0.9), [[], [3, 4]])])
def test_steps_compile_fullgraph_and_match_eager(sampling, stops):
    eager, compiled = engine_pair(sampling, stops)
    torch._dynamo.reset()
    steps = {name: torch.compile(getattr(compiled, f"{name}_step"), fullgraph=True, backend="aot_eager")
             for name in ("draft", "verify")}
    with torch.inference_mode():
        for _ in range(3):
            for name in ("draft", "verify"):
                getattr(eager, f"{name}_step")()
                steps[name]()
            for a, b in zip(eager.mutable_state(), compiled.mutable_state()):
                assert torch.equal(a, b)
