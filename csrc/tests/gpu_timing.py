"""Timing of the ext ops on a CUDA device (CUDA-graph replays, so launch overhead is included
once per call as in the decode loop). Prints one line per case; no assertions beyond equality.
Run from the repository root with ``PYTHONPATH=.`` (it reuses ``bench.common``)."""
import torch

import dflash_kernels
from bench.common import capture_graph, time_fn
from dflash_kernels.commit import commit_round
from dflash_kernels.verify import verify_greedy


def graph_time(fn) -> float:
    """Median microseconds of one CUDA-graph replay of ``fn`` (launch overhead included once, as in
    the decode loop)."""
    g = capture_graph(fn)
    return time_fn(g.replay, torch.device("cuda"), warmup=5, reps=200, budget_s=1.0)["median_ms"] * 1e3


def main():
    print(torch.__version__, torch.cuda.get_device_name(), dflash_kernels.available_backends("cuda"))
    for n, blk, v, dt in [(1, 16, 151936, torch.bfloat16), (8, 16, 151936, torch.bfloat16),
                          (32, 16, 151936, torch.bfloat16), (8, 16, 151936, torch.float32),
                          (8, 16, 32003, torch.float16)]:
        logits = torch.randn(n, blk, v, device="cuda").to(dt)
        draft = logits.argmax(-1)[:, :-1].contiguous()
        ref = verify_greedy(logits, draft, backend="torch")
        row = []
        for be in ("ext", "triton", "torch"):
            try:
                out = verify_greedy(logits, draft, backend=be)
                same = all(torch.equal(x, y) for x, y in zip(out, ref))
                us = graph_time(lambda: verify_greedy(logits, draft, backend=be))
                row.append(f"{be} {us:7.1f} us{'' if same else ' MISMATCH vs torch'}")
            except Exception as exc:  # keep timing the others
                row.append(f"{be} failed: {type(exc).__name__}: {str(exc)[:200]}")
        gb = logits.numel() * logits.element_size() / 1e9
        print(f"verify_greedy N={n} B={blk} V={v} {str(dt)[6:]} ({gb * 1e3:.1f} MB): " + " | ".join(row))
    R, blk, C = 64, 16, 4096
    st = dict(out_tokens=torch.zeros(R, C, dtype=torch.long, device="cuda"),
              lengths=torch.zeros(R, dtype=torch.long, device="cuda"),
              positions=torch.zeros(R, dtype=torch.long, device="cuda"),
              anchor=torch.zeros(R, dtype=torch.long, device="cuda"),
              done=torch.zeros(R, dtype=torch.bool, device="cuda"),
              max_lengths=torch.full((R,), C, dtype=torch.long, device="cuda"),
              stop_tokens=torch.tensor([-1], device="cuda"))
    draft = torch.randint(0, 1000, (R, blk - 1), device="cuda")
    acc = torch.randint(0, blk, (R,), device="cuda")
    bonus = torch.randint(0, 1000, (R,), device="cuda")

    def step(be):
        st["lengths"].zero_()
        st["done"].zero_()
        commit_round(draft, acc, bonus, backend=be, check=False, **st)

    print("commit_round R=64 B=16: " + " | ".join(f"{be} {graph_time(lambda: step(be)):6.1f} us (incl. 2 resets)"
                                                  for be in ("ext", "torch")))


if __name__ == "__main__":
    main()
