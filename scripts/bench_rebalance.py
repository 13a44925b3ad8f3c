"""Rebalancing by speed in a live swarm: what a move to a stage of slow peers does to the driver's rate.

A driver (stage 0), two peers of stage 1 at full speed and two of stage 2 that emulate hardware ``--slowdown``
times slower (``meshnode join --slowdown``), all on this machine. The counts are equal, so only the peers'
announced capacities show that stage 2 is the bottleneck. Two arms, each a fresh swarm run for ``--seconds``
after the driver's first step:

- ``pinned``: stage 1's peers never move (the control);
- ``rebalance``: they may move (``--rebalance-after``); one should, to stage 2.

Per arm: the driver's tokens per second over the first and the last ``--window`` seconds, each stage's
announced capacity (tokens/s) at the end, and in the rebalance arm when the move came (seconds after the first
step) and the driver's rate before and after it. Prints the numbers and writes a JSON record.

    python scripts/bench_rebalance.py --out docs/results/bench-rebalance.json
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

from meshnode.node.procs import LocalSwarm, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
MOVED = "moving there from stage 1"


def _rate(recs: list[dict], t0: float, t1: float) -> float | None:
    """The driver's tokens per second between wall-clock times t0 and t1 (from its per-step records)."""
    inside = [r for r in recs if t0 <= r["t"] <= t1]
    if len(inside) < 2 or inside[-1]["t"] <= inside[0]["t"]:
        return None
    return (inside[-1]["tokens"] - inside[0]["tokens"]) / (inside[-1]["t"] - inside[0]["t"])


def run_arm(args, arm: str, work: Path) -> dict:
    sw = LocalSwarm(work, args.config, args.set, cache_dir=args.cache_dir, ready_timeout=args.ready_timeout)
    metrics = work / "driver.jsonl"
    try:
        sw.start("driver", "--stage", "0", "--metrics-out", str(metrics))
        for name in ("s2a", "s2b"):
            sw.start(name, "--stage", "2", "--slowdown", str(args.slowdown))
        move = ["--rebalance-after", str(args.rebalance_after)] if arm == "rebalance" else ["--no-rebalance"]
        fast = [sw.start(name, "--stage", "1", *move) for name in ("s1a", "s1b")]
        deadline = time.monotonic() + args.ready_timeout
        while not read_jsonl(metrics):
            if time.monotonic() > deadline:
                raise TimeoutError("the driver took no step")
            time.sleep(0.5)  # poll interval of a deadline-bounded wait on another process's file
        first = read_jsonl(metrics)[0]["t"]
        moved_at = None
        end = first + args.seconds
        while time.time() < end:
            if moved_at is None:
                for p in fast:
                    if MOVED in p.log.read_text(errors="replace"):
                        moved_at = time.time() - first  # seen within the poll interval
            time.sleep(0.5)  # poll interval of a bounded run
        status = sw.status()
        recs = read_jsonl(metrics)
        last = recs[-1]["t"]
        out = {
            "arm": arm, "steps": recs[-1]["step"], "seconds": round(last - first, 1),
            "tokens_per_s_first_window": _rate(recs, first, first + args.window),
            "tokens_per_s_last_window": _rate(recs, last - args.window, last),
            "stages": [{"stage": s["stage"], "fast_peers": len(s["fast_peers"]), "capacity": round(s["capacity"], 1),
                        "tokens_per_s": round(s["tokens_per_s"], 1)} for s in status["stages"]],
            "moves": sum(MOVED in p.log.read_text(errors="replace") for p in fast),
            "moved_at_s": None if moved_at is None else round(moved_at, 1),
        }
        pattern = re.compile(r"^(\S+ \S+) WARN\S* meshnode\.node\.daemon: (rebalance: .*)$", re.M)
        out["rebalance_warnings"] = {p.name: [" ".join(m.groups()) for m in pattern.finditer(
            p.log.read_text(errors="replace"))][:6] for p in fast}
        if moved_at is not None:
            out["tokens_per_s_before_move"] = _rate(recs, first, first + moved_at)
            out["tokens_per_s_after_move"] = _rate(recs, first + moved_at + args.settle, last)
        return out
    finally:
        sw.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny.toml")
    ap.add_argument("--set", action="append", default=None, help="config overrides (default: tiny in 3 stages)")
    ap.add_argument("--slowdown", type=float, default=4.0, help="stage 2's peers emulate hardware this much slower")
    ap.add_argument("--rebalance-after", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=90.0, help="each arm runs this long after the first step")
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after a move left out of the after-rate")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--arms", default="pinned,rebalance")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.set is None:
        args.set = ["model.stages=3", "model.tiny_layers=6", "train.steps=1000000", "train.warmup_steps=5"]
    record = {"config": str(args.config), "set": args.set, "slowdown": args.slowdown,
              "rebalance_after": args.rebalance_after, "seconds": args.seconds, "window": args.window, "arms": {}}
    with tempfile.TemporaryDirectory(prefix="bench-rebalance-") as tmp:
        for arm in args.arms.split(","):
            res = run_arm(args, arm, Path(tmp) / arm)
            record["arms"][arm] = res
            print(json.dumps(res, indent=1), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
