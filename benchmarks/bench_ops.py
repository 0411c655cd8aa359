"""The operations the CPU speed work changed, before vs after, side by side in one run:
AdamW foreach vs fused, torch dropout vs ``fast_dropout``, and attention with dropout through SDPA vs ours.

    python benchmarks/bench_ops.py --repeats 5
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from reference_dropout import torch_dropout

from musiclm_stab.model.attention import attend, fast_dropout


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def dropout_row(dtype: torch.dtype, repeats: int) -> tuple:
    x = torch.randn(2, 12, 375, 375, dtype=dtype)
    return (f"dropout p=0.1 of [2, 12, 375, 375] {str(dtype)[6:]}", "F.dropout",
            best_ms(lambda: F.dropout(x, 0.1, True), repeats),
            "fast_dropout", best_ms(lambda: fast_dropout(x, 0.1, True), repeats))


def attention_row(dtype: torch.dtype, repeats: int) -> tuple:
    q, k, v = (torch.randn(2, 12, 375, 64, dtype=dtype, requires_grad=True) for _ in range(3))

    def step():
        attend(q, k, v, "sdpa", dropout=0.1, training=True).float().sum().backward()

    def before():
        with torch_dropout():
            step()

    return (f"attention fwd+bwd [2, 12, 375, 64] {str(dtype)[6:]}, dropout 0.1", "SDPA",
            best_ms(before, repeats), "ours", best_ms(step, repeats))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []

    params = [torch.nn.Parameter(torch.randn(768 * 768)) for _ in range(160)]  # ~94M, base's encoder size
    for q in params:
        q.grad = torch.randn_like(q)
    foreach = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    fused = torch.optim.AdamW(params, lr=1e-4, fused=True)
    rows.append(("AdamW step, 94M fp32 parameters", "foreach", best_ms(foreach.step, args.repeats),
                 "fused", best_ms(fused.step, args.repeats)))

    for dtype in (torch.float32, torch.bfloat16):
        rows.append(dropout_row(dtype, args.repeats))
        rows.append(attention_row(dtype, args.repeats))

    print(f"threads={torch.get_num_threads()}, best of {args.repeats}")
    print("| operation | before | ms | after | ms | before / after |\n|---|---|---|---|---|---|")
    for what, a, ta, b, tb in rows:
        print(f"| {what} | {a} | {ta:.1f} | {b} | {tb:.1f} | {ta / tb:.2f}x |")


if __name__ == "__main__":
    main()
