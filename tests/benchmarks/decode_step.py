"""Benchmark: one decode step of the compact sampler (stages/rl/decoding.py) at fixed shapes.

Builds the model (small-llama, bf16), a CompactDecoder, fills its buffer with one prefill, then
times each (rows, attended positions) step replayed as a CUDA graph (median of CUDA-event timings),
with syncrl's decode attention (matmul) and under each SDPA backend that accepts the shapes, and prints ms per step and the bandwidth the step
reached counting the weights and the attended K/V once.

    python tests/benchmarks/decode_step.py [--rows 1024] [--shapes 1024x64,1024x256,1024x512,256x256,32x512]

With --attention ROWSxATTENDxPADDED,...: the decode steps' attention alone, at the preset's heads, on one
layer's K/V (each row's first PADDED positions masked, as a call's left padding is), through the decode
kernel and the batched products, with the K/V bandwidth each reached counting the positions attended once.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-llama")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--length", type=int, default=576)
    parser.add_argument("--shapes", default="1024x64,1024x256,1024x576,256x256,256x576,32x576,4x576")
    parser.add_argument("--backends", default="matmul,default,efficient")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", default=None, help="ROWSxATTEND: list the kernels of eager steps at that shape")
    parser.add_argument("--attention", default=None, help="ROWSxATTENDxPADDED,...: time the attention alone")
    args = parser.parse_args()
    if args.attention:
        attention(args)
        return 0

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stages.rl.decoding import CompactDecoder
    from stages.rl.modeling import load_policy
    from stages.rl.tiny_model import create_base_model

    work = Path(tempfile.mkdtemp(prefix="syncrl-step-"))
    atexit.register(shutil.rmtree, work, True)  # a large preset's weights would fill the disk run after run
    path = create_base_model(work / "base", args.preset)
    model = load_policy(path, "bfloat16", torch.device("cuda")).eval()
    backends = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    if args.profile:
        profile(model, args, *map(int, args.profile.split("x")))
        return 0
    print(f"{'backend':<10} {'rows':>5} {'attend':>6} {'ms/step':>8} {'GB/s':>7}")
    for name in args.backends.split(","):
        dec = CompactDecoder(model, args.rows, args.length, decode_attention=name == "matmul")
        with torch.no_grad():
            dec.cache.set_layout(args.rows, args.length)
            dec._prefill([[5, 6, 7, 8, 9]] * (args.rows // 8), [8] * (args.rows // 8), 5)
        dec.mask.zero_()  # attend to every position: the cost does not depend on the mask's values
        for shape in args.shapes.split(","):
            b, attend = map(int, shape.split("x"))
            try:
                ctx = sdpa_kernel([backends[name]]) if name in backends else torch.no_grad()
                with ctx, torch.no_grad():
                    dec.cache.set_write_position(attend - 1)
                    dec._forward(b, attend)
                ms = replay_ms(dec.graphs.get(dec._graph_key(b, attend)), args.repeats)
                moved = dec.weight_bytes + b * attend * dec.kv_per_position
                print(f"{name:<10} {b:>5} {attend:>6} {ms:>8.3f} {moved / ms / 1e6:>7.0f}", flush=True)
            except Exception as e:  # noqa: BLE001 (a backend that refuses the shapes is reported, not fatal)
                print(f"{name:<10} {b:>5} {attend:>6} refused: {str(e).splitlines()[0][:100]}", flush=True)
                torch.cuda.synchronize()
        del dec
        torch.cuda.empty_cache()
    return 0


def replay_ms(graph, repeats: int) -> float:
    """The median of `repeats` replays of a CUDA graph, each timed by CUDA events (ms)."""
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def attention(args) -> None:
    import torch

    from stages.rl import decoding
    from stages.runtime.presets import PRESETS

    shape = PRESETS[args.preset]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    dim = shape["hidden_size"] // heads
    dtype = torch.bfloat16
    print(f"{args.preset}: {heads} query heads, {kv_heads} K/V heads of {dim}; one layer")
    print(f"{'path':<8} {'rows':>5} {'attend':>6} {'padded':>6} {'us':>8} {'K/V GB/s':>9}")
    for item in args.attention.split(","):
        rows, attend, padded = map(int, item.split("x"))
        q = torch.randn(rows, 1, heads, dim, device="cuda", dtype=dtype).transpose(1, 2)
        buffer = torch.randn(2, rows, kv_heads, args.length, dim, device="cuda", dtype=dtype)
        k, v = buffer[0, :, :, :attend], buffer[1, :, :, :attend]
        mask = torch.zeros(rows, 1, 1, args.length, device="cuda", dtype=dtype)
        mask[:, :, :, :padded] = torch.finfo(dtype).min
        mask = mask[:, :, :, :attend]
        attended = 2 * rows * kv_heads * (attend - padded) * dim * buffer.element_size()
        for name, fn in (("kernel", decoding.kernel_decode_attention), ("products", decoding.decode_attention)):
            with torch.no_grad():
                for _ in range(3):
                    fn(None, q, k, v, mask)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn(None, q, k, v, mask)
            ms = replay_ms(graph, args.repeats)
            print(f"{name:<8} {rows:>5} {attend:>6} {padded:>6} {ms * 1000:>8.1f} {attended / ms / 1e6:>9.0f}", flush=True)
        del q, buffer, k, v, mask
        torch.cuda.empty_cache()


def profile(model, args, b: int, attend: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from stages.rl.decoding import CompactDecoder

    dec = CompactDecoder(model, args.rows, args.length, cuda_graphs=False, decode_attention=args.backends == "matmul")
    with torch.no_grad():
        dec.cache.set_layout(args.rows, args.length)
        dec._prefill([[5, 6, 7, 8, 9]] * (args.rows // 8), [8] * (args.rows // 8), 5)
        dec.mask.zero_()
        dec.cache.set_write_position(attend - 1)
        for _ in range(3):
            dec._forward(b, attend)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                dec._forward(b, attend)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"{len(events) / 5:.0f} kernels per step at {b}x{attend}")


if __name__ == "__main__":
    sys.exit(main())
