"""Seconds that ``dp.v_correction`` adds to one replica's optimizer step of SmolLM2-135M, against AdamW's own step.

The tracker (:class:`meshnode.optim.MicrobatchNoise`) runs ``after_microbatch`` once per microbatch, ``variance``
before clipping, ``before_step`` and ``after_step`` around the AdamW step and ``reset``; all of it is
elementwise work on parameter-sized fp32 buffers, so its cost is memory traffic. The parameters are
SmolLM2-135M's shapes (30 layers, the embedding once), random, with random gradients; no model is loaded.

    python scripts/bench_noise.py --microbatches 2 --repeats 5 --out /tmp/noise.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from meshnode.optim import MicrobatchNoise

LAYER = {"q": (576, 576), "k": (192, 576), "v": (192, 576), "o": (576, 576), "gate": (1536, 576), "up": (1536, 576),
         "down": (576, 1536), "ln1": (576,), "ln2": (576,)}


def smollm2_params(device: torch.device) -> dict[str, torch.nn.Parameter]:
    shapes = {"embed": (49152, 576), "norm": (576,)}
    shapes.update({f"{i}.{n}": s for i in range(30) for n, s in LAYER.items()})
    g = torch.Generator().manual_seed(0)
    return {n: torch.nn.Parameter((torch.randn(*s, generator=g) * 0.02).to(device)) for n, s in shapes.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    params = smollm2_params(dev)
    plist = list(params.values())
    n_params = sum(p.numel() for p in plist)
    opt = torch.optim.AdamW(plist, lr=1e-4, foreach=True)
    noise = MicrobatchNoise(params, replicas=2, microbatches=args.microbatches)
    g = torch.Generator().manual_seed(1)
    grads = [[(torch.randn(p.shape, generator=g) * 1e-3).to(dev) for p in plist] for _ in range(args.microbatches)]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def clock(t: dict[str, float], name: str, fn, *args):
        sync()
        t0 = time.perf_counter()
        out = fn(*args)
        sync()
        t[name] += time.perf_counter() - t0
        return out

    times: dict[str, list[float]] = {"after_microbatch": [], "variance": [], "before_step": [], "adamw_step": [],
                                     "after_step": [], "reset": []}
    for rep in range(args.repeats + 1):  # the first round allocates the buffers and AdamW's state: not timed
        t = {k: 0.0 for k in times}
        for p in plist:
            p.grad = None
        for j in range(args.microbatches):
            for p, gr in zip(plist, grads[j]):
                if p.grad is None:
                    p.grad = gr.clone()
                else:
                    p.grad.add_(gr)
            sync()
            t0 = time.perf_counter()
            noise.after_microbatch()
            sync()
            t["after_microbatch"] += time.perf_counter() - t0
        variance = clock(t, "variance", noise.variance)
        clock(t, "before_step", noise.before_step, opt, variance, 0.5)
        clock(t, "adamw_step", opt.step)
        clock(t, "after_step", noise.after_step, opt)
        del variance
        t0 = time.perf_counter()
        noise.reset()
        sync()
        t["reset"] += time.perf_counter() - t0
        if rep:
            for k in times:
                times[k].append(t[k])
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    overhead = med["after_microbatch"] + med["variance"] + med["before_step"] + med["after_step"] + med["reset"]
    held_bytes = sum(t.numel() * t.element_size() for t in noise.buffers())
    for k, v in med.items():
        print(f"{k:>17}: {v:.3f} s (median of {args.repeats})")
    print(f"v_correction total: {overhead:.3f} s per step = {overhead / med['adamw_step']:.2f}x AdamW's step "
          f"({n_params / 1e6:.1f}M parameters, M = {args.microbatches}, {args.threads} threads, {dev})")
    print(f"buffers held: {held_bytes / 2**30:.2f} GiB = {held_bytes / n_params:.1f} B/parameter")
    if args.out:
        rec = {"command": "python scripts/bench_noise.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
            "platform": platform.platform(), "torch": torch.__version__, "params": n_params,
            "median_s": med, "overhead_s": overhead, "overhead_vs_adamw": overhead / med["adamw_step"],
            "buffer_bytes": held_bytes, "buffer_bytes_per_param": held_bytes / n_params}
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
