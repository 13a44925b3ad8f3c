"""Many ``quality_table.py`` runs at once on one accelerator: a long-horizon table plus seed repeats.

On 2 CPU cores one 60-step variant of the quality table takes ~10 minutes; on a GPU a run is launch-bound (a
135M model at batch 4 x 256 keeps the chip mostly idle), so many single-threaded runs share it well. This script
first *calibrates*: it starts one short dense run per long job, all at once, and reads the seconds per step each
saw under that much sharing. From that and ``--budget`` it sizes the long runs (``--steps 0``; a multiple of 40
so DP's half-length runs stay whole syncs), then starts every long job at once and the short seed repeats in the
remaining slots. Runs still going at the deadline are stopped (by their handles) and listed as unfinished.

    python scripts/quality_sweep.py --device cuda --budget 420 --out /tmp/sweep.json

Each run's own JSON and log go to ``--work-dir``; the merged record (the calibration, the chosen length, every
run's held-out losses, bytes per token, curves and wall time) goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "scripts" / "quality_table.py"
TOKENS_PER_STEP = 4 * 256  # the table's base batch: every variant sees this many tokens per base step
LONG = ["dense", "rotq4_ns_g1", "dense_dp", "rotq4_ns_g1_dpavg", "dense_b8", "m95", "m95_ap"]
SHORT = ["dense", "rotq4_ns_g1"]


@dataclass
class Job:
    task: str
    variant: str
    steps: int
    seed: int
    kind: str  # calibrate | long | short

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.task}-{self.variant}-s{self.seed}-{self.steps}"


def command(job: Job, args) -> list[str]:
    return [sys.executable, str(TABLE), "--device", args.device, "--tasks", job.task, "--variants", job.variant,
            "--steps", str(job.steps), "--eval-batches", str(1 if job.kind == "calibrate" else args.eval_batches),
            "--set", f"train.seed={job.seed}", "--set", "train.threads=1", "--cache-dir", args.cache_dir,
            "--out", str(Path(args.work_dir) / f"{job.name}.json")]


def run_pool(jobs: list[Job], args, slots: int, deadline: float) -> dict[str, dict]:
    """Run ``jobs`` in order, at most ``slots`` at once, until done or ``deadline`` (monotonic)."""
    work = Path(args.work_dir)
    queue, running, out = list(jobs), {}, {}
    while queue or running:
        while queue and len(running) < slots:
            job = queue.pop(0)
            log = open(work / f"{job.name}.log", "w")  # noqa: SIM115 (closed when the run ends)
            running[job.name] = (job, subprocess.Popen(command(job, args), stdout=log, stderr=subprocess.STDOUT,
                                                       cwd=ROOT), log, time.monotonic())
        for name, (job, proc, log, t0) in list(running.items()):
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            if proc.poll() is None:  # past the deadline
                proc.kill()
                proc.wait()
            log.close()
            del running[name]
            res = work / f"{name}.json"
            rec = {"task": job.task, "variant": job.variant, "seed": job.seed, "kind": job.kind,
                   "base_steps": job.steps, "process_s": round(time.monotonic() - t0, 1), "rc": proc.returncode}
            if proc.returncode == 0 and res.is_file():
                data = json.loads(res.read_text())
                rec.update(data["tasks"][job.task][job.variant], before=data["before"][job.task],
                           machine=data["machine"])
            else:
                rec["error"] = (work / f"{name}.log").read_text()[-2000:]
            out[name] = rec
            print(f"{name}: rc {proc.returncode}, {rec.get('heldout_loss', rec.get('error', '')[-300:])}", flush=True)
        if time.monotonic() >= deadline:
            for job in queue:
                out[job.name] = {"task": job.task, "variant": job.variant, "seed": job.seed, "kind": job.kind,
                                 "base_steps": job.steps, "error": "not started before the deadline"}
            queue.clear()
        time.sleep(0.5)  # the poll interval of a pool of subprocesses (no event to wait on across them)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for everything, calibration included")
    ap.add_argument("--steps", type=int, default=0, help="base steps of the long runs (0: sized by calibration)")
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--calibrate-steps", type=int, default=30)
    ap.add_argument("--tasks", default="domain,continual")
    ap.add_argument("--long", default=",".join(LONG))
    ap.add_argument("--short", default=",".join(SHORT))
    ap.add_argument("--short-steps", type=int, default=60)
    ap.add_argument("--seeds", default="1,2,3", help="seeds of the short repeats (the table's own runs are seed 0)")
    ap.add_argument("--short-slots", type=int, default=2)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "meshnode"))
    ap.add_argument("--work-dir", default="/tmp/quality_sweep")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t_start = time.monotonic()
    deadline = t_start + args.budget
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    tasks = args.tasks.split(",")
    long_variants = [v for v in args.long.split(",") if v]
    record: dict = {"command": " ".join(sys.argv), "budget_s": args.budget}
    steps = args.steps
    n_long = len(tasks) * len(long_variants)
    if not steps:
        cal = [Job("domain", "dense", args.calibrate_steps, 100 + i, "calibrate") for i in range(n_long)]
        t0 = time.monotonic()
        res = run_pool(cal, args, len(cal), deadline)
        ok = [r for r in res.values() if "tokens_per_s" in r]
        if not ok:
            record["calibration"] = res
            Path(args.out).write_text(json.dumps(record, indent=1))
            raise SystemExit("calibration failed: " + next(iter(res.values())).get("error", "")[-1000:])
        s_step = max(TOKENS_PER_STEP / r["tokens_per_s"] for r in ok)
        overhead = max(r["process_s"] - r["wall_s"] for r in ok)  # start-up, evaluations, exit
        left = deadline - time.monotonic()
        # the long runs' training time, with a quarter in reserve for the anchor's SVDs and for evaluation
        steps = int(max(0.0, left - 2 * overhead) * 0.75 / s_step) // 40 * 40
        steps = min(steps, args.max_steps)
        record["calibration"] = {"processes": len(cal), "steps": args.calibrate_steps, "s_per_step": round(s_step, 4),
                                 "overhead_s": round(overhead, 1), "wall_s": round(time.monotonic() - t0, 1)}
        print(f"calibration: {s_step:.3f} s/step with {len(cal)} runs sharing the device, start-up {overhead:.0f} s;"
              f" long runs of {steps} base steps", flush=True)
        if steps < 40:
            record["runs"] = {}
            Path(args.out).write_text(json.dumps(record, indent=1))
            raise SystemExit("too little time left for the long runs")
    record["steps"] = steps
    jobs = [Job(t, v, steps, 0, "long") for v in long_variants for t in tasks]
    jobs += [Job(t, v, args.short_steps, int(s), "short") for s in args.seeds.split(",") if s
             for v in args.short.split(",") if v for t in tasks]
    record["runs"] = run_pool(jobs, args, n_long + args.short_slots, deadline)
    record["wall_s"] = round(time.monotonic() - t_start, 1)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out} after {record['wall_s']} s", flush=True)


if __name__ == "__main__":
    main()
