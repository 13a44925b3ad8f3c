"""``meshnode demo``: a whole swarm on 127.0.0.1, one command.

The demo process hosts the bootstrap DHT peer itself, then starts every other peer as a separate
``meshnode join`` process: one (or ``--dp-peers``) fast peer per stage, stage 0 being the driver,
plus one anchor peer that holds all stages. It shows live progress from the DHT, waits until every
driver (one per DP replica) reached ``train.steps``, fetches every stage's weights from its peers (as
``meshnode export`` does) to measure the held-out loss, prints the status table, and stops every process it started,
by pid (also on Ctrl+C).

Methods: ``dense`` (no compression, no anchor) and ``m95`` (mask p = 0.95 at every boundary, the
anchor prior, PowerSGD-compressed DP when a stage has several peers).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from ..config import load_config
from ..protocol import keys
from .claim import fixed_routes
from .inspect import heldout_loss_of
from .procs import PeerProcess, read_jsonl, start_peer
from .status import bytes_per_token, render_table, slowest_driver_step, status_json
from .swarm import SwarmClient, SwarmError, start_dht

logger = logging.getLogger(__name__)

TINY_TOML = """# meshnode demo --tiny: a random 6-layer Llama, 3 stages, byte-level tokens, a CPython slice.
name = "demo-tiny"

[model]
source = "tiny"
tokenizer = "bytes"
stages = 3
tiny_layers = 6
tiny_hidden = 64
tiny_heads = 4
tiny_kv_heads = 2
tiny_intermediate = 128

[data]
source = "cpython"
max_docs = 150
seq_len = 128

[train]
batch_size = 8
steps = 60
lr = 3e-3
warmup_steps = 5
min_lr_ratio = 0.1
eval_batches = 4
"""

SMOLLM2_TOML = """# meshnode demo: SmolLM2-135M-Instruct cut into 3 stages, adapted on the CPython standard library.
name = "demo-smollm2"

[model]
source = "smollm2"
stages = 3

[data]
source = "cpython"
max_docs = 400
seq_len = 256

[train]
batch_size = 4
steps = 40
lr = 1e-4
warmup_steps = 10
min_lr_ratio = 0.1
eval_batches = 8
"""


DEMO_METHODS = ("dense", "m95", "rotq4", "rotq4g1", "rotq2", "rotq2ref", "rotq1refmap", "rotq1refmaptc",
                "rotq1refmaptcrr")


def method_overrides(method: str, *, tiny: bool, dp_peers: int, anchor: bool, anchor_key: str) -> list[str]:
    """Config overrides of a demo method: ``dense`` boundaries, ``m95`` (the paper: M95 + anchor prior), or
    ``rotq4`` / ``rotq2`` (every channel at 4 / 2 bits after a rotation, weighted by the receiving layer's norm
    gains and the channels' spread: ``mask.rotq_weight = norm_std``), ``rotq4g1`` (the same 4-bit activations,
    the gradient back at 1 bit: ``mask.grad_bits = 1``), ``rotq2ref`` (2 bits both ways, unweighted, each
    boundary coded as its change from the frozen pretrained model's: ``mask.reference = both``, every peer holds
    the whole pretrained model), ``rotq1refmap`` (1 bit both ways against the reference, with the residual map:
    ``mask.reference_map_rank``, rank 64 refitted every 10 steps, 8 on the tiny model), ``rotq1refmaptc`` (the
    same, with the activations and the gradients in fitted transform codes of half a bit per coordinate:
    ``mask.reference_code_bits`` and ``mask.reference_grad_code_bits`` 288 bits a token, 32 on the tiny model),
    ``rotq1refmaptcrr`` (the same against a reference that moves every 10 steps by each stage's rank-1 move in
    int8: ``mask.reference_refresh``; with ``dp_peers > 1`` each replica chain keeps to its own route and moves
    its own reference, :func:`.claim.fixed_routes`); with DP when ``dp_peers > 1`` (then the anchor takes its
    weights from the DP log: ``anchor.snapshot = dp``)."""
    if method not in DEMO_METHODS:
        raise ValueError(f"unknown demo method {method!r} (one of {', '.join(DEMO_METHODS)})")
    if method == "dense":
        out = ["mask.ratio=0.0"]
    elif method == "rotq2ref":
        out = ["mask.codec=rotq", "mask.bits=2", "mask.reference=both"]
    elif method.startswith("rotq1refmap"):
        out = ["mask.codec=rotq", "mask.bits=1", "mask.reference=both", f"mask.reference_map_rank={8 if tiny else 64}",
               "mask.reference_map_period=10"]
        if "tc" in method[len("rotq1refmap"):]:
            bits = 32 if tiny else 288
            out += [f"mask.reference_code_bits={bits}", f"mask.reference_grad_code_bits={bits}"]
        if method.endswith("rr"):
            out += ["mask.reference_refresh=10", "mask.reference_refresh_rank=1", "mask.reference_refresh_bits=8"]
    elif method.startswith("rotq"):
        bits, _, grad_bits = method[4:].partition("g")
        out = ["mask.codec=rotq", f"mask.bits={bits}", "mask.rotq_weight=norm_std"]
        if grad_bits:
            out.append(f"mask.grad_bits={grad_bits}")
    else:
        out = ["mask.ratio=0.95"]
        if anchor:
            out += ["anchor.enabled=true", f"anchor.period={5 if tiny else 10}", "anchor.max_staleness=30",
                    f"spectral.rank={8 if tiny else 16}", f"anchor.allowed_keys=[{json.dumps(anchor_key)}]"]
    if dp_peers > 1:
        out += ["dp.enabled=true", f"dp.replicas={dp_peers}", "dp.inner_steps=10", "dp.rank=4" if tiny else
                "dp.rank=32"]
        if method == "m95" and anchor:  # the anchor follows the DP log instead of fetching weights each cycle
            out.append("anchor.snapshot=dp")
    return out


@dataclass(kw_only=True)
class DemoOptions:
    tiny: bool = False
    steps: int | None = None
    method: str = "m95"
    config: Path | None = None
    overrides: list[str] = field(default_factory=list)
    metrics_out: Path | None = None
    workdir: Path | None = None
    dp_peers: int = 1
    anchor: bool = True
    cache_dir: Path | None = None
    ready_timeout: float = 300.0
    train_timeout: float = 1800.0


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    if main:
        # SIGTERM (a `timeout`, a service manager) as Ctrl-C: the finally below stops every peer the demo started;
        # without it the process died at once and left six peers training (seen with `timeout 900 meshnode demo`)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return _run_demo(opts)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _run_demo(opts: DemoOptions) -> dict[str, Any]:
    console = Console(stderr=True)
    own_tmp = opts.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="meshnode-demo-")) if own_tmp else Path(opts.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    anchor_identity = workdir / "anchor.key"
    anchor_key = keys.public_key_string(keys.load_or_create_identity(anchor_identity))
    if opts.config is not None:
        base = Path(opts.config)
    else:
        base = workdir / "run.toml"
        base.write_text(TINY_TOML if opts.tiny else SMOLLM2_TOML)
    overrides = method_overrides(opts.method, tiny=opts.tiny, dp_peers=opts.dp_peers,
                                 anchor=opts.anchor and opts.method == "m95", anchor_key=anchor_key)
    overrides += list(opts.overrides)
    if opts.steps is not None:
        overrides.append(f"train.steps={opts.steps}")
    cfg = load_config(base, overrides)
    console.print(f"[bold]meshnode demo[/]: run {cfg.run_id}, {cfg.model.stages} stages x {opts.dp_peers} fast "
                  f"peer(s){' + 1 anchor' if cfg.anchor.enabled else ''}, {cfg.train.steps} steps, method "
                  f"{opts.method}; logs in {workdir}")
    console.print("held-out loss before: ...", end="\r")
    before = heldout_loss_of(cfg, None, opts.cache_dir)
    console.print(f"held-out loss before: {before:.4f}")

    identity = keys.load_or_create_identity(None)
    dht = start_dht(cfg.run_id, cfg.model.stages, initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                    identity=identity)
    procs: list[PeerProcess] = []
    try:
        bootstrap = [str(m) for m in dht.get_visible_maddrs()]
        console.print(f"bootstrap peer: {bootstrap[0]}")
        common = dict(initial_peers=bootstrap, cache_dir=opts.cache_dir)
        def stage_peers(s: int) -> list[PeerProcess]:
            out = []
            for r in range(opts.dp_peers):
                name = f"stage{s}" + (f"-{r}" if opts.dp_peers > 1 else "")
                extra = ["--stage", str(s)]
                if s == 0:
                    extra += ["--metrics-out", str(workdir / f"{name}.metrics.jsonl")]
                out.append(start_peer(name, workdir, base, overrides, extra=extra, **common))
                if fixed_routes(cfg):  # one at a time: each takes its replica chain seeing the ones before it
                    out[-1].wait_ready(opts.ready_timeout)
            return out

        # the drivers (stage 0) start last, so training begins with the whole pipeline and the anchor up
        for s in range(1, cfg.model.stages):
            procs += stage_peers(s)
        if cfg.anchor.enabled:
            procs.append(start_peer("anchor", workdir, base, overrides, extra=[
                "--role", "anchor", "--identity", str(anchor_identity)], **common))
        for p in procs:
            p.wait_ready(opts.ready_timeout)
        drivers = stage_peers(0)
        procs += drivers
        for p in drivers:
            p.wait_ready(opts.ready_timeout)
        console.print(f"{len(procs)} peers online; training")
        result = asyncio.run(_watch(dht, identity, cfg, procs, console, opts, workdir))
        result["heldout_loss_before"] = before
        after = heldout_loss_of(cfg, result.pop("weights"), opts.cache_dir)
        result["heldout_loss_after"] = after
        mean = result.pop("mean_weights")
        if mean is not None:
            result["heldout_loss_after_mean"] = heldout_loss_of(cfg, mean, opts.cache_dir)
        console.print(render_table(result.pop("status")))
        if opts.dp_peers > 1:  # how the microbatches were split between the replicas of each stage
            console.print("optimizer steps per replica: " + "; ".join(
                f"stage {s}: " + ", ".join(str(r["step"]) for r in result["replicas"] if r["stage"] == s)
                for s in range(cfg.model.stages)))
        console.print(f"held-out loss: before {before:.4f} -> after {after:.4f}")
        if "heldout_loss_after_mean" in result:
            counts = ", ".join(f"stage {s}: {m['averaged']}" for s, m in result["mean_from"].items())
            mean_loss = result["heldout_loss_after_mean"]
            console.print(f"held-out loss of each stage's replicas' exact mean: {mean_loss:.4f} (replicas averaged: "
                          f"{counts})")
        bpt = result["bytes_per_token"]
        console.print("bytes per trained token: " + ", ".join(f"{k} {v:.1f}" for k, v in bpt.items()))
        if opts.metrics_out is not None:
            Path(opts.metrics_out).write_text(json.dumps(result, indent=1))
        return result
    finally:
        for p in procs:
            p.stop(timeout=20)
        dht.shutdown()
        if own_tmp and opts.metrics_out is None:
            shutil.rmtree(workdir, ignore_errors=True)


async def _watch(dht, identity, cfg, procs, console: Console, opts: DemoOptions, workdir: Path) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .inspect import SwarmReader, reduce_replicas

    client = SwarmClient(dht, cfg.run_id, identity)
    deadline = time.monotonic() + opts.train_timeout
    with Progress(TextColumn("[bold]swarm"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("train", total=cfg.train.steps, info="")
        last_print = -1
        while True:
            peers = await client.refresh(full=True)
            step = slowest_driver_step(peers, opts.dp_peers)  # every driver (one per DP replica) must finish
            loss = next((p.loss for p in peers if p.role == "driver" and p.loss is not None), None)
            info = f"loss {loss:.4f}" if loss is not None else ""
            progress.update(task, completed=step, info=info)
            if not console.is_terminal and step // 10 != last_print // 10:
                console.print(f"step {step}/{cfg.train.steps} {info}")
                last_print = step
            if step >= cfg.train.steps:
                break
            dead = [p.name for p in procs if not p.alive()]
            if dead:
                raise SwarmError(f"peer(s) {', '.join(dead)} exited: see their logs in {workdir}")
            if time.monotonic() > deadline:
                raise SwarmError(f"training did not finish within {opts.train_timeout:.0f}s")
            await asyncio.sleep(1.0)
    finished = time.time()
    # final counters: wait until every live peer announced after the end and was idle then (its last step's DP
    # sync done). Records announced after the end but during that sync undercounted DP (2 of 3 syncs of stage 0
    # in two real-model demos, docs/swarm.md)
    settle = time.monotonic() + 60
    while time.monotonic() < settle:
        peers = await client.refresh(full=True)
        if all(p.updated >= finished and not p.busy for p in peers if p.state == "online"):
            break
        await asyncio.sleep(0.5)
    else:
        console.print("[yellow]some peers were still busy 60 s after training ended: their counters may be short")
    status = status_json(peers, cfg.run_id, cfg.model.stages)
    reader = SwarmReader.__new__(SwarmReader)  # reuse this DHT for the weight fetch
    reader.run_id, reader.dht, reader.client = cfg.run_id, dht, client
    await client.start()
    try:
        # several replicas a stage: one fetch of them all gives one peer's weights (the first) and their exact
        # mean (what `meshnode export --average` writes)
        replicas = await reader.collect_replicas(cfg.model.stages, 120.0, average=opts.dp_peers > 1)
        weights, meta = reduce_replicas(replicas, average=False)
        mean, mean_meta = reduce_replicas(replicas, average=True) if opts.dp_peers > 1 else (None, None)
    finally:
        await client.p2p.shutdown()
    metrics = []
    for path in sorted(workdir.glob("stage0*.metrics.jsonl")):
        metrics += read_jsonl(path)
    wall = max((m["wall_s"] for m in metrics), default=0.0)
    tokens = sum(p.tokens for p in peers if p.role == "driver")
    return {
        "run": cfg.run_id, "method": opts.method, "steps": cfg.train.steps, "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0, "bytes_per_token": bytes_per_token(peers),
        "peers": len([p for p in peers if p.state == "online"]), "weights": weights, "status": status,
        "weights_from": meta, "mean_weights": mean, "mean_from": mean_meta, "replicas": [
            {"stage": p.stage, "role": p.role, "peer": p.peer_id, "step": p.step, "tokens": p.tokens,
             "capacity": round(p.capacity, 1), "dp_syncs": p.dp_syncs}
            for p in sorted(peers, key=lambda p: (p.stage, p.peer_id)) if p.state == "online" and p.role != "anchor"],
        "losses": [m["loss"] for m in sorted(metrics, key=lambda m: m["step"])],
    }


__all__ = ["DEMO_METHODS", "DemoOptions", "method_overrides", "run_demo"]
