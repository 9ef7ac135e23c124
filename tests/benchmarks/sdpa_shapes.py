"""Benchmark: SDPA forward + backward when every call has a new shape, per backend.

Train's micro-batches grouped by length (tuning.max_tokens_per_micro_batch) and generate's old-log-prob
pass give attention a new (rows, width) at almost every call. cuDNN's backend builds an execution
plan for each new shape; this times a causal fwd+bwd over a list of shapes, then the same shapes again
(plans cached), for each backend, in milliseconds per call.

    python tests/benchmarks/sdpa_shapes.py [--heads 20] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--shapes", default="7x576,25x300,13x333,9x417,30x211,18x290,11x501,26x240")
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    backends = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    x = torch.randn(1, 1, 8, args.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(x, x, x).sum().backward()  # CUDA and library start-up, outside the timings
    print(f"{'backend':<10} {'new shapes ms/call':>18} {'seen shapes ms/call':>19}")
    for n, (name, backend) in enumerate(backends.items()):
        # Widths shifted per backend: no backend finds a shape another one has already planned.
        mine = [(b, s + n) for b, s in shapes]
        rounds = []
        for _ in range(2):
            times = []
            for b, s in mine:
                q, k, v = (torch.randn(b, args.heads, s, args.head_dim, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with sdpa_kernel([backend]) if backend else contextlib.nullcontext():
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.sum().backward()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            rounds.append(sum(times) / len(times))
        print(f"{name:<10} {rounds[0]:>18.2f} {rounds[1]:>19.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
