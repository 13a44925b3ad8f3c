"""Seconds per PowerSGD round of one stage of SmolLM2-135M, alone and with other processes sharing the device.

A round is what one DP sync of a fragment does on each replica: ``phase_p``, average, ``phase_q``, average,
``finish``, for two replicas, rank 16, 8-bit factors, over one stage's 10 layers of matrices. ``--impls`` picks the
orthonormalisation of the averaged P: ``sync`` as it was before 2026-12-04 (per tensor, a host sync,
``float(norm)``, per column), ``pertensor`` the sync-free one called per tensor (the first fix: ``current`` in
``docs/results/bench-powersgd-gpu.json``), ``current`` the library's (the tensors of one shape as one batch).
``--procs N`` starts N copies at once (each its own process and CUDA context), the way
``scripts/quality_sweep.py`` shares one GPU.

    python scripts/bench_powersgd.py --device cuda --procs 1,8 --out /tmp/psgd.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from meshnode.compression import powersgd

SHAPES = {"q": (576, 576), "k": (192, 576), "v": (192, 576), "o": (576, 576), "gate": (1536, 576),
          "up": (1536, 576), "down": (576, 1536)}


def orthonormalize_sync(p, eps: float = 1e-7):  # the pre-2026-12-04 version: one host sync per column
    p = p.to(torch.float32).clone()
    scale = float(p.norm()) or 1.0
    for i in range(p.shape[1]):
        col = p[:, i]
        if i:
            prev = p[:, :i]
            for _ in range(2):
                col = col - prev @ (prev.T @ col)
        norm = float(col.norm())
        p[:, i] = col / norm if norm > eps * scale else 0.0
    return p


def worker(args) -> dict:
    if args.impl in ("sync", "pertensor"):
        one = orthonormalize_sync if args.impl == "sync" else powersgd.orthonormalize
        powersgd.orthonormalize_all = lambda factors: {n: one(t) for n, t in factors.items()}
    dev = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    tensors = [{f"{layer}.{n}": (torch.randn(*s, generator=g) * 1e-3).to(dev) for layer in range(10)
                for n, s in SHAPES.items()} for _ in range(2)]
    states = [powersgd.PowerSGDState(16, quantize=True) for _ in range(2)]

    def one_round():
        ps = [st.phase_p(t) for st, t in zip(states, tensors)]
        p_avg = {k: (ps[0][k] + ps[1][k]) / 2 for k in ps[0]}
        qs = [st.phase_q(p_avg) for st in states]
        q_avg = {k: (qs[0][k] + qs[1][k]) / 2 for k in qs[0]}
        out = [st.finish(q_avg) for st in states]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return out

    one_round()  # warm-up (kernels, warm-start Q)
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        one_round()
    return {"s_per_round": (time.perf_counter() - t0) / args.rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--procs", default="1", help="comma-separated numbers of concurrent processes")
    ap.add_argument("--impls", default="sync,pertensor,current")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", default="current", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    results = []
    for impl in args.impls.split(","):
        for n in (int(x) for x in args.procs.split(",")):
            cmd = [sys.executable, __file__, "--worker", "--impl", impl, "--device", args.device,
                   "--rounds", str(args.rounds)]
            procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(n)]
            outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
            per = [o["s_per_round"] for o in outs]
            rec = {"impl": impl, "procs": n, "s_per_round_mean": sum(per) / n, "s_per_round_max": max(per)}
            results.append(rec)
            print(f"{impl:8s} {n:2d} processes: {rec['s_per_round_mean']:.3f} s per round (max {max(per):.3f})",
                  flush=True)
    record = {"device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "rounds": args.rounds, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
