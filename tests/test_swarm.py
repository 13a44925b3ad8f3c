"""Real swarms: `meshnode join` subprocesses on 127.0.0.1 with real libp2p, the tiny model.

Every wait polls a condition with a deadline; every process a test starts is stopped by its own
pid / process group in a finalizer (SIGTERM, then SIGKILL), never by name.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from pathlib import Path

import pytest
import torch

from meshnode.config import load_config
from meshnode.node.procs import LocalSwarm, tail
from meshnode.protocol import keys
from meshnode.protocol.records import PeerRecord

from .conftest import TINY

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]


def wait_for(cond, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)  # polling interval of a deadline-bounded wait, not synchronisation
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


class Swarm(LocalSwarm):
    def __init__(self, tmp: Path, cache: Path, overrides: list[str]):
        super().__init__(tmp, TINY, overrides, cache_dir=cache)


@pytest.fixture
def swarm_factory(tmp_path, cache_dir):
    made: list[Swarm] = []

    def make(overrides: list[str]) -> Swarm:
        s = Swarm(tmp_path, cache_dir, overrides)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


THREE = ["model.stages=3", "model.tiny_layers=6"]


def test_three_stages_and_anchor(swarm_factory, tmp_path, cache_dir):
    key_file = tmp_path / "anchor.key"
    anchor_key = keys.public_key_string(keys.load_or_create_identity(key_file))
    steps = 40
    sw = swarm_factory(THREE + [
        "mask.ratio=0.95", "anchor.enabled=true", "anchor.period=5", "spectral.rank=8", f"train.steps={steps}",
        f"anchor.allowed_keys=[{json.dumps(anchor_key)}]",
    ])
    sw.start("stage1", "--stage", "1")
    sw.start("stage2", "--stage", "2", wait=False)
    sw.start("anchor", "--role", "anchor", "--identity", str(key_file), wait=False)
    for p in sw.procs:
        p.wait_ready(120)
    metrics = tmp_path / "driver.jsonl"
    sw.start("stage0", "--metrics-out", str(metrics))  # --stage auto: the only free stage is 0
    wait_for(lambda: len(sw.metrics(metrics)) >= steps, 240, "the driver to finish")

    def priors_everywhere():
        st = sw.status()
        return st if all(s["prior_age"] is not None for s in st["stages"]) else None

    st = wait_for(priors_everywhere, 60, "every stage to hold a prior")
    by_stage = {s["stage"]: s for s in st["stages"]}
    assert st["driver_step"] == steps
    for s in range(3):
        assert len(by_stage[s]["fast_peers"]) == 1, by_stage[s]
        assert len(by_stage[s]["anchor_peers"]) == 1
    roles = {p["role"]: p["stage"] for p in st["peers"] if p["state"] == "online"}
    assert roles["driver"] == 0 and roles["anchor"] == -1
    assert st["health"][0].startswith("ok"), st["health"]
    assert st["bytes_per_token"]["pp_fwd"] > 0 and st["bytes_per_token"]["anchor"] > 0

    from meshnode.node.inspect import SwarmReader, heldout_loss_of

    with SwarmReader(sw.bootstrap, sw.cfg.run_id) as reader:
        weights, _ = reader.stage_weights(3)
    before = heldout_loss_of(sw.cfg, None, cache_dir)
    after = heldout_loss_of(sw.cfg, weights, cache_dir)
    assert after < before - 0.5, (before, after)


def test_anchor_follows_dp_instead_of_fetching_weights(swarm_factory, tmp_path, cache_dir):
    """``anchor.snapshot = dp``: the anchor keeps each stage's global weights by replaying a fast peer's DP log
    (stage 1 has two peers that all-reduce; stage 0 syncs alone) and publishes priors from them."""
    key_file = tmp_path / "anchor.key"
    anchor_key = keys.public_key_string(keys.load_or_create_identity(key_file))
    steps = 30
    sw = swarm_factory([
        "mask.ratio=0.95", "anchor.enabled=true", "anchor.period=5", "anchor.snapshot=\"dp\"", "spectral.rank=4",
        f"train.steps={steps}", "dp.enabled=true", "dp.replicas=2", "dp.inner_steps=3", "dp.rank=4",
        "dp.round_timeout=10.0", "dp.overlap=true", f"anchor.allowed_keys=[{json.dumps(anchor_key)}]",
        "dp.matchmaking_time=4.0",  # above the averager's 2 s join-request timeout, as hivemind recommends
        "anchor.priors=\"dht\"",  # the factors as DHT values (test_three_stages_and_anchor: served by the anchor)
        "dp.clock=\"driver\"",  # stage 1's replicas count their syncs on the driver's steps
    ])
    sw.start("s1a", "--stage", "1")
    sw.start("s1b", "--stage", "1", wait=False)
    anchor = sw.start("anchor", "--role", "anchor", "--identity", str(key_file), wait=False)
    for p in sw.procs:
        p.wait_ready(120)
    metrics = tmp_path / "driver.jsonl"
    sw.start("stage0", "--stage", "0", "--metrics-out", str(metrics))
    wait_for(lambda: len(sw.metrics(metrics)) >= steps, 240, "the driver to finish")

    def priors_everywhere():
        st = sw.status()
        return st if all(s["prior_age"] is not None for s in st["stages"]) else None

    st = wait_for(priors_everywhere, 90, "every stage to hold a prior")
    log = anchor.log.read_text()
    replayed = {int(s): int(n) for s, n in re.findall(r"stage (\d) replayed (\d+) DP outer steps", log)}
    assert set(replayed) == {0, 1}, tail(anchor.log)
    total = sum(int(n) for n in re.findall(r"replayed (\d+) DP outer steps", log))
    assert total >= 4, tail(anchor.log)  # stage 0 alone syncs every 3 steps: several outer steps replayed
    assert "following DP of stage" not in log, tail(anchor.log)  # no failed attempt
    # every peer started from the pretrained weights, so the anchor replays each log from its first entry: no full
    # load of an outer state, unless one of stage 1's peers realigned its start weights to its partner's (a sync one
    # of them applied and the other abandoned, e.g. its Q round timing out, leaves their starts one outer step apart;
    # the next round's fingerprints show it and the newer log no longer leads from the pretrained weights)
    stage1 = {p.name: p.log.read_text() for p in sw.procs[:2]}
    realigned = [name for name, text in stage1.items() if "start weights differed from the group's" in text]
    loads = re.findall(r"stage (\d) follows DP of \S+ from its outer state", log)
    report = "\n".join([tail(anchor.log), *(f"--- {n}\n{t[-3000:]}" for n, t in stage1.items())])
    assert "0" not in loads, report  # stage 0 syncs alone: its log always leads from the pretrained weights
    assert not loads or realigned, report
    syncs = [p for p in sw.procs[:2] if "DP sync" in p.log.read_text() and "group of 2" in p.log.read_text()]
    dp_lines = "\n".join(ln for p in sw.procs[:2] for ln in p.log.read_text().splitlines()
                         if "DP " in ln or "averag" in ln or "matchmaking" in ln)
    assert syncs, f"stage 1's two peers never averaged together:\n{dp_lines[-4000:]}"
    assert st["bytes_per_token"]["anchor"] > 0

    # an averaged fetch (meshnode export --average): stage 1's two replicas' exact mean, stage 0's one peer as it is
    from meshnode.node.inspect import SwarmReader

    with SwarmReader(sw.bootstrap, sw.cfg.run_id) as reader:
        mean, meta = reader.stage_weights(average=True)
    records = [(p["stage"], p["dp_syncs"], p["step"]) for p in st["peers"] if p["role"] != "anchor"]
    assert set(meta) == {0, 1} and meta[1]["averaged"] == 2 and meta[0]["averaged"] == 1, (meta, records)
    with SwarmReader(sw.bootstrap, sw.cfg.run_id) as reader:
        own = reader.peer_weights(meta[1]["peers"])
    for n, t in mean[1].items():
        assert torch.allclose(t.float(), (own[0][n].float() + own[1][n].float()) / 2, atol=1e-2, rtol=1e-2), n


@pytest.mark.parametrize("codec, grad_share", [
    # the gradient goes back at the activation's K positions: the same bytes
    (["mask.ratio=0.9"], (1.0, 1.0)),
    # rotq weighted by the receiver's norm gains (the sender's copy of them), 1-bit gradients against 4-bit activations
    (["mask.codec=rotq", "mask.bits=4", "mask.rotq_weight=norm_std", "mask.grad_bits=1"], (0.0, 0.4)),
    # dp.v_correction: a replica of an X = 2 run that has not synced yet (H beyond the run), the mesh's replica 0
    (["mask.ratio=0.9", "dp.enabled=true", "dp.replicas=2", "dp.inner_steps=1000", "dp.v_correction=true"],
     (1.0, 1.0)),
    # reference coding: both ends compute the frozen pretrained model's boundary tensors; the swarm's peers each
    # hold the whole pretrained model and must compute what the mesh's shared reference computes (the gradient at
    # the same K positions; the activation also carries its 64-byte reference check, mask.reference_check)
    (["mask.ratio=0.9", "mask.reference=both"], (0.99, 1.0)),
    # and the residual map: stage 0 and 1 refit theirs every 2 steps and send each to the next stage's peer once
    # (the trace counts the payloads without it: 1-bit gradients against 1-bit centred activations)
    (["mask.codec=rotq", "mask.bits=1", "mask.reference=both", "mask.reference_map_rank=8",
      "mask.reference_map_period=2"], (0.8, 1.0)),
    # and the transform code fitted with the map (32 bits a token for H = 64): from the first fit on, the
    # activations go in 4 bytes of codes and a 2-byte scale a token against the gradients' 8 and 4: twice as many
    (["mask.codec=rotq", "mask.bits=1", "mask.reference=both", "mask.reference_map_rank=8",
      "mask.reference_map_period=2", "mask.reference_code_bits=32"], (0.8, 2.0)),
    # and the gradient's transform code, which stage 2 (1) ships to stage 1 (0) with a reply when the request says
    # the caller does not hold it yet; the maps and codes in 8 bits per value (mask.reference_fit_bits), the
    # activation's code weighted by the gradients its sender receives (mask.reference_code_metric), and those
    # gradients applied only along the directions the code sent (mask.reference_code_grad)
    (["mask.codec=rotq", "mask.bits=1", "mask.reference=both", "mask.reference_map_rank=8",
      "mask.reference_map_period=2", "mask.reference_code_bits=32", "mask.reference_grad_code_bits=32",
      "mask.reference_fit_bits=8", "mask.reference_code_metric=fisher", "mask.reference_code_grad=project"],
     (0.5, 2.0)),
    # and the reference moves (mask.reference_refresh_rank): after steps 3 and 6 each stage's peer sends its rank-1
    # int8 move to the peers whose plan computes its stage, and every peer applies all of them at its first
    # microbatch of the next step (at step 6 the new fits are withdrawn, as in the mesh)
    (["mask.codec=rotq", "mask.bits=1", "mask.reference=both", "mask.reference_map_rank=8",
      "mask.reference_map_period=2", "mask.reference_code_bits=32", "mask.reference_refresh=3",
      "mask.reference_refresh_rank=1", "mask.reference_refresh_bits=8"], (0.8, 2.0)),
], ids=["m90", "rotq4g1", "m90_vcorr", "m90_ref", "rotq1_refmap", "rotq1_refmap_tc", "rotq1_refmap_tc_g",
        "rotq1_refmap_tc_rr"])
def test_equivalence_with_in_process_mesh(swarm_factory, tmp_path, cache_dir, codec, grad_share):
    """One peer per stage, compressed boundaries: the swarm's losses are the mesh's.

    Tolerance 1e-5 (absolute): both run the same StageWorker code, same seeds, same masks and the same
    data positions, with one torch thread per stage (the test sets the mesh to one thread too), so the
    arithmetic is the same; in practice the losses are bit-identical. The only room for a difference is
    float summation order if a kernel chose another path, which stays far below 1e-5 over 8 steps.
    With DP on, the swarm's one driver draws shard 0 of ``dp.replicas``: the mesh's replica 0.
    """
    steps = 8
    over = THREE + [*codec, f"train.steps={steps}", "train.microbatches=2"]
    sw = swarm_factory(over)
    sw.start("stage2", "--stage", "2")
    traces = {s: tmp_path / f"trace{s}.jsonl" for s in (0, 1)}
    sw.start("stage1", "--stage", "1", "--trace-out", str(traces[1]))
    metrics = tmp_path / "eq.jsonl"
    sw.start("stage0", "--stage", "0", "--metrics-out", str(metrics), "--trace-out", str(traces[0]))
    wait_for(lambda: len(sw.metrics(metrics)) >= steps, 120, "the driver to finish")
    swarm_losses = [m["loss"] for m in sorted(sw.metrics(metrics), key=lambda m: m["step"])]

    # --trace-out: every call to the next stage, and every forward served, with times that nest
    calls, served = sw.metrics(traces[0]), sw.metrics(traces[1])
    ids = {(c["step"], c["mb"]) for c in calls if c["kind"] == "call"}
    assert ids == {(s, m) for s in range(steps) for m in range(2)}
    serve = {(r["step"], r["mb"]): r for r in served if r["kind"] == "serve"}
    assert set(serve) == ids and {r["stage"] for r in served if r["kind"] == "call"} == {1}
    for c in calls:
        r = serve[(c["step"], c["mb"])]
        assert c["t_call"] <= r["t_in"] <= r["t_out"] <= c["t_back"] and c["bytes"] > 0 < r["bytes"]
        assert grad_share[0] <= r["bytes"] / c["bytes"] <= grad_share[1]

    from meshnode.mesh import MeshTrainer

    mesh_bytes = {}

    def mesh_losses(cfg) -> list[float]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            trainer = MeshTrainer(cfg, cache_dir)
            out = [trainer.train_step()["replica_loss"][0] for _ in range(steps)]
            mesh_bytes.setdefault("ref", trainer.counter.snapshot().get("ref", 0))
            return out
        finally:
            torch.set_num_threads(threads)

    assert swarm_losses == pytest.approx(mesh_losses(sw.cfg), abs=1e-5)
    if sw.cfg.mask.reference_refresh:  # every stage's moves reached its followers: the mesh's ref bytes, by the logs
        pattern = re.compile(r"reference move (\d+) \((\d+) bytes\) sent to (\d+) followers")

        def sent():
            found = [m for p in sw.procs for m in pattern.findall(p.log.read_text())]
            return found if len(found) == 2 * 3 else None  # 2 moves (steps 3, 6) of 3 stages

        moves = wait_for(sent, 60, "the reference moves' log lines")
        assert sorted(int(m[0]) for m in moves) == [1, 1, 1, 2, 2, 2]
        assert all(int(m[2]) == 2 for m in moves)  # with mask.reference = both, every other stage follows each
        assert sum(int(m[1]) * int(m[2]) for m in moves) == mesh_bytes["ref"] > 0
        plain = mesh_losses(load_config(TINY, [o for o in over if not o.startswith("mask.reference_refresh")]))
        assert max(abs(a - b) for a, b in zip(swarm_losses, plain)) > 1e-4
    if sw.cfg.dp.v_correction:  # and the correction mattered: without it the same replica's losses differ
        plain = mesh_losses(load_config(TINY, [o for o in over if o != "dp.v_correction=true"]))
        assert max(abs(a - b) for a, b in zip(swarm_losses, plain)) > 1e-4
    if sw.cfg.mask.reference != "none":  # and the reference was used: plain m90's losses differ
        plain = mesh_losses(load_config(TINY, [o for o in over if not o.startswith("mask.reference")]))
        assert max(abs(a - b) for a, b in zip(swarm_losses, plain)) > 1e-4
    if sw.cfg.mask.reference_map_rank:  # and the maps reached the next stages: without them the losses differ
        plain = mesh_losses(load_config(TINY, [o for o in over if not o.startswith("mask.reference_")]))
        assert max(abs(a - b) for a, b in zip(swarm_losses, plain)) > 1e-4
    for key in ("code", "grad_code"):  # and so did the transform codes
        if getattr(sw.cfg.mask, f"reference_{key}_bits"):
            plain = mesh_losses(load_config(TINY, [o for o in over if not o.startswith(f"mask.reference_{key}")]))
            assert max(abs(a - b) for a, b in zip(swarm_losses, plain)) > 1e-4
    if sw.cfg.mask.reference_code_metric != "plain":  # and the gradients reached the code's metric
        plain = mesh_losses(load_config(TINY, [o for o in over if not o.startswith("mask.reference_code_metric")]))
        assert max(abs(a - b) for a, b in zip(swarm_losses, plain)) > 1e-4
    if sw.cfg.mask.reference_code_grad != "straight":  # and the senders projected it: straight through differs
        plain = mesh_losses(load_config(TINY, [o for o in over if not o.startswith("mask.reference_code_grad")]))
        assert max(abs(a - b) for a, b in zip(swarm_losses, plain)) > 1e-4


def test_churn_kill_and_join(swarm_factory, tmp_path):
    """Stage 1 has two peers; one is SIGKILLed mid-run, a new one joins, loads state and serves."""
    steps = 20000  # far more than the test runs: the run must not end before the newcomer is up
    sw = swarm_factory([f"train.steps={steps}", "train.warmup_steps=5"])
    sw.start("s1a", "--stage", "1")
    sw.start("s1b", "--stage", "1")
    metrics = tmp_path / "churn.jsonl"
    sw.start("driver", "--stage", "0", "--metrics-out", str(metrics))
    wait_for(lambda: len(sw.metrics(metrics)) >= 40, 120, "training to start")
    victim = sw.procs[1]
    killed_at = len(sw.metrics(metrics))
    victim.kill()  # SIGKILL to its process group: no goodbye, its record stays in the DHT until it expires
    wait_for(lambda: len(sw.metrics(metrics)) >= killed_at + 40, 120, "training to continue after the kill")
    newcomer = sw.start("s1c", "--stage", "1")
    assert newcomer.alive()

    def newcomer_contributes():
        st = sw.status()
        return any(p["peer_id"] == newcomer.ready()["peer_id"] and p["tokens"] > 0 for p in st["peers"])

    wait_for(newcomer_contributes, 120, "the new peer to train")
    log = newcomer.log.read_text()
    assert "loaded stage 1 state" in log, tail(newcomer.log)
    recs = sw.metrics(metrics)
    walls = [r["wall_s"] for r in sorted(recs, key=lambda r: r["step"])]
    longest = max(b - a for a, b in zip(walls, walls[1:]))
    # bound: one failed stream open (immediate on a dead peer) and a retry on the live peer, plus a
    # loaded 2-core machine; a dead peer costs a retry, never a stall of the run
    assert longest < 20.0, f"longest gap between steps {longest:.1f}s"


def test_bad_input_and_bad_priors(swarm_factory, tmp_path, cache_dir):
    good_key_file = tmp_path / "good.key"
    good = keys.load_or_create_identity(good_key_file)
    sw = swarm_factory(["anchor.enabled=true", f"anchor.allowed_keys=[{json.dumps(keys.public_key_string(good))}]"])
    target = sw.start("stage1", "--stage", "1")
    peer_id = target.ready()["peer_id"]
    asyncio.run(_attack(sw, peer_id, good))
    assert target.alive(), tail(target.log)

    def all_ignored():
        text = target.log.read_text()
        return all(n in text for n in ("not in anchor.allowed_keys", "does not fit", "non-finite"))

    wait_for(all_ignored, 60, "the bad priors to be logged as ignored")
    assert "applied the anchor prior" not in target.log.read_text()


async def _attack(sw: Swarm, peer_id: str, good_key) -> None:
    import os

    from hivemind.p2p import PeerID

    from meshnode.compression import ByteCounter, DenseCodec
    from meshnode.node.anchor import PriorServicer
    from meshnode.node.host import weights_from_chunks
    from meshnode.node.priors import HEADER_NAME
    from meshnode.node.swarm import SwarmClient, start_dht
    from meshnode.protocol.limits import Limits
    from meshnode.protocol.messages import WireError, forward_request, pack, tensor_to_bytes
    from meshnode.protocol.records import cycle_digest, factors_digest, prior_value
    from meshnode.protocol.servicer import RPCError, call_rpc, stream_rpc

    cfg = sw.cfg
    run = cfg.run_id
    limits = Limits.from_config(cfg, cfg.model.tiny_hidden, cfg.model.tiny_vocab)
    dht = await asyncio.to_thread(start_dht, run, cfg.model.stages, initial_peers=sw.bootstrap,
                                  host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity=good_key, client_mode=True)
    client = SwarmClient(dht, run, good_key, limits)
    await client.start()
    peer = PeerID.from_base58(peer_id)
    handler = f"{run}.rpc_forward"
    B, T, H = cfg.train.batch_size, cfg.data.seq_len, cfg.model.tiny_hidden

    async def uncut(call, attempts: int = 3):
        """``await call()``, again if the stream was cut (a WireError: the reply ended early or never began).

        Such cuts happen on 127.0.0.1 too, rarely (docs/swarm.md, the retry policy); the swarm's own calls retry
        them. This test calls the handlers directly, so it retries a cut the same way, and only a cut: an error
        reply (RPCError) or a wrong answer still fails at once."""
        for attempt in range(1, attempts + 1):
            try:
                return await call(attempt)
            except WireError as exc:
                if attempt == attempts:
                    raise
                print(f"stream cut, retrying ({attempt}/{attempts}): {exc}")

    async def weights():
        async def once(_):
            chunks = [c async for c in stream_rpc(client.p2p, peer, f"{run}.rpc_get_weights", {"run": run},
                                                  max_bytes=limits.max_message_bytes, timeout=30)]
            return weights_from_chunks(chunks)

        return await uncut(once)

    def valid(step=5, mb=0, attempt=1, value=None, shape=(B, T, H), wire="bfloat16"):
        x = torch.randn(*shape) if value is None else torch.full(shape, value)
        payload = DenseCodec(wire).encode(x)
        return forward_request(run=run, driver="attacker", step=step, mb=mb, attempt=attempt, boundary=0,
                               mask_version=0, payload=payload, labels=torch.randint(0, 256, shape[:2]), vocab=260)

    async def refused(request, needle=""):
        with pytest.raises(RPCError) as info:
            await uncut(lambda _: call_rpc(client.p2p, peer, handler, request, max_bytes=limits.max_message_bytes,
                                           timeout=30))
        assert needle in str(info.value), str(info.value)

    try:
        w0 = await weights()
        await refused(os.urandom(5000), "msgpack")
        await refused(pack({"type": "forward"}), "version")
        await refused(valid(shape=(B, T, H + 1)), "limits")
        await refused(valid(shape=(B * 8, T, H)), "limits")
        await refused(valid(wire="float16"), "")  # the codec of this run is bf16: the worker refuses it
        req = valid()
        req["payload"]["tensors"]["values"][0] = "float64"
        await refused(req, "not allowed")
        await refused(valid(value=float("nan")), "non-finite")
        await refused(valid(value=float("inf")), "non-finite")
        truncated = valid()
        truncated["payload"]["data"]["values"] = truncated["payload"]["data"]["values"][:-7]
        await refused(truncated, "bytes")
        # a frame announcing more bytes than allowed: refused before the body is read
        _, reader, writer = await client.p2p.call_binary_stream_handler(peer, handler)
        writer.write((limits.max_message_bytes + 1).to_bytes(8, "big") + b"\x00" * 1024)  # the body never follows
        await writer.drain()
        from meshnode.protocol.messages import read_frame, unpack

        reply = unpack(await asyncio.wait_for(read_frame(reader, 1 << 20), 30), 1 << 20)
        writer.close()
        assert not reply["ok"] and "exceeds" in reply["error"]
        # a truncated frame: the sender hangs up mid-body
        _, reader, writer = await client.p2p.call_binary_stream_handler(peer, handler)
        writer.write((1000).to_bytes(8, "big") + b"\x01" * 10)
        await writer.drain()
        writer.close()
        w1 = await weights()
        assert all(torch.equal(w0[k], w1[k]) for k in w0), "weights changed after bad input"
        # replay and staleness: a valid message is served once; its replay, and an old step, are refused
        ok = valid(step=10, attempt=3)
        # a retry after a cut is a new attempt at the same microbatch, as the swarm's driver would send it
        reply = await uncut(lambda k: call_rpc(client.p2p, peer, handler, ok if k == 1 else {**ok, "attempt": 10 + k},
                                               max_bytes=limits.max_message_bytes, timeout=60))
        assert reply["ok"] and reply["loss"] > 0
        w2 = await weights()
        await refused(ok, "replayed")
        await refused(valid(step=2, attempt=4), "stale")
        w3 = await weights()
        assert all(torch.equal(w2[k], w3[k]) for k in w2), "weights changed after a replay"

        # the DP log and the outer state (anchor.snapshot = dp): malformed requests, and a peer without DP
        async def refused_stream(method, request, needle):
            async def once(_):
                return [c async for c in stream_rpc(client.p2p, peer, f"{run}.{method}", request,
                                                    max_bytes=limits.max_message_bytes, timeout=30)]

            with pytest.raises(RPCError) as info:
                await uncut(once)
            assert needle in str(info.value), str(info.value)

        await refused_stream("rpc_dp_log", {"run": run, "since": -1}, "since")
        await refused_stream("rpc_dp_log", {"run": run, "since": True}, "since")
        await refused_stream("rpc_dp_log", {"run": run, "since": 0, "epoch": 5}, "epoch")
        await refused_stream("rpc_dp_log", {"run": run, "since": 0}, "without DP")
        await refused_stream("rpc_dp_log", {"run": "other", "since": 0}, "run")
        await refused_stream("rpc_get_weights", {"run": run, "what": "outer"}, "without DP")

        # priors: wrong shapes and non-finite values from the allowed key; good-looking ones from another key
        prior, prior_data = keys.prior_key(run, 1), keys.prior_data_key(run, 1)
        name = "layers.0.self_attn.q_proj.weight"
        names = sorted(n for n in w0 if n.endswith(("proj.weight",)))

        def entry(m, n, r=2, nan=False, step=1, nm=name):
            u, s, vh = torch.randn(m, r), torch.rand(r), torch.randn(r, n)
            if nan:
                s[0] = float("inf")
            ub, sb, vb = (tensor_to_bytes(t.half()) for t in (u, s, vh))
            return prior_value(kind="matrix", anchor_step=step, name=nm, rank=r, shape=[m, n], u=ub, s=sb, vh=vb,
                               digest=factors_digest(ub, sb, vb))

        def publish(c: SwarmClient, values: dict, step: int):
            async def go():
                for nm, v in values.items():
                    assert await c.store_signed(prior_data, nm, v, 120)
                head = prior_value(kind="header", anchor_step=step, names=sorted(values),
                                   digest=cycle_digest({nm: v["digest"] for nm, v in values.items()}))
                assert await c.store_signed(prior, HEADER_NAME, head, 120)
            return go()

        shapes = {n: tuple(w0[n].shape) for n in names}
        await publish(client, {n: entry(m + 1, k) for n, (m, k) in shapes.items()}, 1)
        await _wait_log(sw.procs[0].log, "does not fit")
        await publish(client, {n: entry(m, k, nan=True, step=2) for n, (m, k) in shapes.items()}, 2)
        await _wait_log(sw.procs[0].log, "non-finite")
        # anchor.priors = rpc: the header names this client as the anchor, which then serves factors other than
        # the ones the header was signed over; next a header naming a peer that serves no priors at all
        svc = PriorServicer(run, cfg.model.stages, limits.max_message_bytes, ByteCounter())
        await svc.add_p2p_handlers(client.p2p, run)
        signed = {n: entry(m, k, step=4, nm=n) for n, (m, k) in shapes.items()}
        svc.hold(1, 4, {n: entry(m, k, step=4, nm=n) for n, (m, k) in shapes.items()})
        head = prior_value(kind="header", anchor_step=4, names=sorted(signed), source=client.peer_id,
                           digest=cycle_digest({nm: v["digest"] for nm, v in signed.items()}))
        assert await client.store_signed(prior, HEADER_NAME, head, 120)
        await _wait_log(sw.procs[0].log, "header's digest")
        head = {**head, "anchor_step": 5, "source": peer_id}  # the target itself: no rpc_prior handler
        assert await client.store_signed(prior, HEADER_NAME, head, 120)
        await _wait_log(sw.procs[0].log, "(step 5) ignored: reading the factors from its anchor failed")
        # the refused cycle was read once; twice only if the first read failed on the way (a CI run: served 2)
        # and was tried again at the next poll, as unreachable anchors are
        retried = "(step 4) ignored: reading the factors from its anchor failed" in sw.procs[0].log.read_text()
        assert svc.served == 1 + retried, (svc.served, tail(sw.procs[0].log))
        rogue_key = keys.load_or_create_identity(None)
        rogue_dht = await asyncio.to_thread(start_dht, run, cfg.model.stages, initial_peers=sw.bootstrap,
                                            host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity=rogue_key, client_mode=True)
        try:
            rogue = SwarmClient(rogue_dht, run, rogue_key, limits)
            await publish(rogue, {n: entry(m, k, step=3) for n, (m, k) in shapes.items()}, 3)
        finally:
            rogue_dht.shutdown()
    finally:
        await client.p2p.shutdown()
        dht.shutdown()


async def _wait_log(path: Path, needle: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in path.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{needle!r} not in {path}")
        await asyncio.sleep(0.3)


@pytest.mark.parametrize("with_anchor", [False, True], ids=["no_anchor", "anchor"])
def test_a_peer_moves_into_a_stage_left_without_peers(swarm_factory, tmp_path, with_anchor):
    """Rebalancing: stage 2's only peer dies (SIGKILL: its record stays until it expires); of stage 1's two peers,
    both allowed to move, the one ``claim.should_rebalance`` names moves to stage 2 once the stage has been
    empty for ``--rebalance-after`` seconds, in the same process, and the pipeline trains again. While every
    stage was served nobody moved. Without an anchor the mover starts the stage from the pretrained weights;
    with one (its key allowed) from the anchor's copy, at the stage's step of the anchor's last cycle."""
    steps = 20000  # far more than the test runs
    overrides = THREE + [f"train.steps={steps}", "train.warmup_steps=5"]
    key_file = tmp_path / "anchor.key"
    if with_anchor:
        anchor_key = keys.public_key_string(keys.load_or_create_identity(key_file))
        overrides += ["mask.ratio=0.9", "anchor.enabled=true", "anchor.period=5", "spectral.rank=4",
                      f"anchor.allowed_keys=[{json.dumps(anchor_key)}]"]
    sw = swarm_factory(overrides)
    metrics = tmp_path / "rebalance.jsonl"
    sw.start("driver", "--stage", "0", "--metrics-out", str(metrics))  # first: stage 0 is never empty
    victim = sw.start("s2", "--stage", "2")
    movers = [sw.start(name, "--stage", "1", "--rebalance-after", "3") for name in ("s1a", "s1b")]
    if with_anchor:
        anchor = sw.start("anchor", "--role", "anchor", "--identity", str(key_file))
        wait_for(lambda: "anchor cycle 2:" in anchor.log.read_text(), 180, "two anchor cycles")
    wait_for(lambda: len(sw.metrics(metrics)) >= 10, 120, "training to start")
    assert not any("rebalance" in m.log.read_text() for m in movers)
    victim.kill()
    killed_at = len(sw.metrics(metrics))

    def moved():
        return [m for m in movers if "moving there from stage 1" in m.log.read_text()]

    mover = wait_for(moved, 120, "a stage-1 peer to move to stage 2")
    assert len(mover) == 1, [tail(m.log) for m in movers]
    wait_for(lambda: len(sw.metrics(metrics)) >= killed_at + 10, 180, "training to go on through the moved peer")
    log = mover[0].log.read_text()
    assert "of stage 2" in log, tail(mover[0].log)
    log = log[log.index("of stage 2"):]  # what it did once in stage 2
    if with_anchor:
        assert "took the anchor" in log and "starting from the pretrained weights" not in log, tail(mover[0].log)
    else:
        assert "starting from the pretrained weights" in log, tail(mover[0].log)
    stayer = next(m for m in movers if m is not mover[0])
    assert "moving there" not in stayer.log.read_text()
    by_stage = {s["stage"]: s for s in sw.status()["stages"]}
    assert by_stage[2]["fast_peers"] == [mover[0].ready()["peer_id"]], by_stage
    assert by_stage[1]["fast_peers"] == [stayer.ready()["peer_id"]], by_stage
    assert all(m.alive() for m in movers)


def test_a_peer_moves_from_a_crowded_stage_to_a_thin_one(swarm_factory, tmp_path):
    """Rebalancing between served stages: stage 1 has three movable peers, stage 2 one; the smallest movable id of
    stage 1 moves to stage 2 and loads that stage's current state from its peer (the mid-run join path), so
    counts end at (1, 2, 2) and nobody else moves."""
    sw = swarm_factory(THREE + ["train.steps=20000", "train.warmup_steps=5"])
    metrics = tmp_path / "even.jsonl"
    sw.start("driver", "--stage", "0", "--metrics-out", str(metrics))
    sw.start("s2", "--stage", "2")
    crowd = [sw.start(name, "--stage", "1", "--rebalance-after", "3") for name in ("s1a", "s1b", "s1c")]

    def moved():
        return [m for m in crowd if "moving there from stage 1" in m.log.read_text()]

    mover = wait_for(moved, 120, "a stage-1 peer to move to stage 2")
    wait_for(lambda: "loaded stage 2 state" in mover[0].log.read_text(), 60, "the mover to load stage 2's state")
    moved_at = len(sw.metrics(metrics))
    wait_for(lambda: len(sw.metrics(metrics)) >= moved_at + 10, 120, "training to go on")
    assert len(moved()) == 1, [tail(m.log) for m in crowd]
    by_stage = {s["stage"]: s for s in sw.status()["stages"]}
    assert mover[0].ready()["peer_id"] in by_stage[2]["fast_peers"] and len(by_stage[2]["fast_peers"]) == 2
    assert len(by_stage[1]["fast_peers"]) == 2, by_stage


def test_a_fast_peer_moves_to_a_stage_of_slow_ones(swarm_factory, tmp_path):
    """Rebalancing by speed: stage 1 has two movable peers, stage 2 two pinned ones that emulate hardware 4x slower
    (``--slowdown 4``). The counts are equal, so only the capacities the peers announce show that stage 2 is the
    bottleneck: one of stage 1's peers moves there, the other stays (a stage's last peer never leaves), and the
    warning names both stages' rates."""
    sw = swarm_factory(THREE + ["train.steps=20000", "train.warmup_steps=5"])
    metrics = tmp_path / "speed.jsonl"
    sw.start("driver", "--stage", "0", "--metrics-out", str(metrics))
    for name in ("s2a", "s2b"):
        sw.start(name, "--stage", "2", "--slowdown", "4")
    fast = [sw.start(name, "--stage", "1", "--rebalance-after", "3") for name in ("s1a", "s1b")]

    def moved():
        return [m for m in fast if "moving there from stage 1" in m.log.read_text()]

    mover = wait_for(moved, 120, "a stage-1 peer to move to stage 2")
    log = mover[0].log.read_text()
    assert re.search(r"stage 2 serves \d+ tokens/s with 2 fast peers against \d+ with 2 here", log), tail(mover[0].log)
    wait_for(lambda: "loaded stage 2 state" in mover[0].log.read_text(), 60, "the mover to load stage 2's state")
    moved_at = len(sw.metrics(metrics))
    wait_for(lambda: len(sw.metrics(metrics)) >= moved_at + 10, 120, "training to go on")
    assert len(moved()) == 1, [tail(m.log) for m in fast]
    by_stage = {s["stage"]: s for s in sw.status()["stages"]}
    assert len(by_stage[2]["fast_peers"]) == 3 and len(by_stage[1]["fast_peers"]) == 1, by_stage
    assert mover[0].ready()["peer_id"] in by_stage[2]["fast_peers"]


def test_a_record_that_names_another_peer_does_not_shadow_it():
    """Any key may publish a record under the peers key, and a record's ``updated`` time is its publisher's word:
    a rogue that names a live peer's id with a later ``updated`` used to replace that peer's record in every
    snapshot (here: "offline", which takes it out of routing and DP). A record signed by another owner than the
    one held for a peer id now replaces nothing until the peer itself, asked over its authenticated libp2p
    connection (``rpc_owner``), names its key; then the rogue's records are dropped. Both orders: the genuine
    record seen first, and the rogue's."""
    from hivemind.utils.timed_storage import get_dht_time

    from meshnode.node.swarm import SwarmClient, start_dht

    cfg = load_config(TINY, [])
    run, stages = cfg.run_id, cfg.model.stages

    async def scenario(rogue_first: bool):
        dhts = []

        async def client(initial):
            key = keys.load_or_create_identity(None)
            dht = await asyncio.to_thread(start_dht, run, stages, initial_peers=initial,
                                          host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity=key)
            dhts.append(dht)
            c = SwarmClient(dht, run, key)
            await c.start()
            return c

        try:
            genuine = await client([])
            boot = [str(a) for a in genuine.dht.get_visible_maddrs(latest=True)][:1]
            rogue, observer = await client(boot), await client(boot)

            async def impersonate():
                fake = PeerRecord(peer_id=genuine.peer_id, role="fast", stage=1, num_stages=stages, state="offline",
                                  updated=time.time() + 1000.0)
                assert await rogue.dht.store(keys.peers_key(run), fake.to_value(), get_dht_time() + 120,
                                             subkey=rogue.owner, return_future=True)

            async def announce():
                assert await genuine.announce(PeerRecord(peer_id="", role="fast", stage=1, num_stages=stages,
                                                         state="online"), 120)

            first, second = (impersonate, announce) if rogue_first else (announce, impersonate)
            await first()
            held = {r.peer_id: r for r in await observer.refresh(full=True)}
            assert held[genuine.peer_id].state == ("offline" if rogue_first else "online")
            await second()
            snap = {r.peer_id: r for r in await observer.refresh(full=True)}
            # the conflict is seen: until the peer answers, the record held first stays (whoever published it)
            assert snap[genuine.peer_id].state == held[genuine.peer_id].state
            assert observer._owner_tasks, "the observer did not ask the peer which key is its own"
            await asyncio.wait_for(asyncio.gather(*observer._owner_tasks), 30)
            assert observer.bound_owners() == {genuine.peer_id: keys.owner_of(genuine.owner),
                                               observer.peer_id: keys.owner_of(observer.owner)}
            snap = {r.peer_id: r for r in await observer.refresh(full=True)}
            assert snap[genuine.peer_id].state == "online" and snap[genuine.peer_id].owner == keys.owner_of(
                genuine.owner)
            await impersonate()  # newer rogue records change nothing any more
            snap = {r.peer_id: r for r in await observer.refresh(full=True)}
            assert snap[genuine.peer_id].state == "online"
        finally:
            for dht in dhts:
                dht.shutdown()

    for rogue_first in (False, True):
        asyncio.run(scenario(rogue_first))


def _crash_and_restart_stage1(swarm_factory, tmp_path, overrides: list[str], *, saved_at_least: int, then_steps: int,
                              timeout: float):
    """A 2-stage swarm whose stage 1's only peer saves every second; once it has saved a step of at least
    ``saved_at_least`` it is SIGKILLed and restarted on the same directory, and the driver goes ``then_steps`` more
    steps. Returns the swarm, the driver's metrics file, the step saved, the driver's records at the kill and the
    restarted peer."""
    sw = swarm_factory(["train.steps=20000", "train.warmup_steps=5", *overrides])
    metrics, ck = tmp_path / "crash.jsonl", tmp_path / "ck"
    sw.start("driver", "--stage", "0", "--metrics-out", str(metrics))
    victim = sw.start("s1", "--stage", "1", "--checkpoint-dir", str(ck), "--checkpoint-every", "1")

    def saved_step():
        steps = [int(s) for s in re.findall(r"checkpoint of stage 1 at step (\d+)", victim.log.read_text())]
        return steps[-1] if steps and steps[-1] >= saved_at_least else None

    saved = wait_for(saved_step, 120, f"a periodic checkpoint at step {saved_at_least} or later")
    victim.kill()
    killed_at = len(sw.metrics(metrics))
    again = sw.start("s1-again", "--stage", "1", "--checkpoint-dir", str(ck))
    wait_for(lambda: len(sw.metrics(metrics)) >= killed_at + then_steps, timeout,
             "training to go on through the restarted peer")
    return sw, metrics, saved, killed_at, again


def test_a_crashed_peer_resumes_its_stage_from_its_periodic_checkpoint(swarm_factory, tmp_path):
    """A peer's checkpoint used to be written only at a graceful stop: a crash (SIGKILL, a power cut) took its stage's
    training with it when it was the stage's only peer. With ``--checkpoint-every``, stage 1's only peer saves
    while it trains; SIGKILLed and restarted on the same directory, it resumes at its last save, and the driver's
    loss goes on near where it was, not from the untrained start."""
    sw, metrics, saved, killed_at, again = _crash_and_restart_stage1(
        swarm_factory, tmp_path, [], saved_at_least=30, then_steps=12, timeout=180)
    ck = tmp_path / "ck"
    assert (ck / "stage1.pt").is_file() and (ck / "stage1.json").is_file()
    assert json.loads((ck / "stage1.json").read_text())["opt_step"] >= saved
    log = again.log.read_text()
    resumed = re.search(r"resumed stage 1 from \S+ at step (\d+)", log)
    assert resumed and int(resumed.group(1)) >= saved, tail(again.log)
    assert "starting from the pretrained weights" not in log
    recs = sorted(sw.metrics(metrics), key=lambda r: r["step"])
    start = sum(r["loss"] for r in recs[:5]) / 5
    before = sum(r["loss"] for r in recs[killed_at - 5 : killed_at]) / 5
    after = sum(r["loss"] for r in recs[killed_at + 2 : killed_at + 7]) / 5
    assert after < (start + before) / 2, (start, before, after)


def test_a_crashed_peer_follows_the_moving_reference_again_after_its_restart(swarm_factory, tmp_path):
    """``mask.reference_refresh`` in the swarm: the reference moves every 3 steps by rank-1 moves. Stage 1's only peer
    is SIGKILLed and restarted (a new identity) from its periodic checkpoint, which holds the moves it had applied
    and held; those made since, it fetches from the driver (the pushes went to a dead peer), or, for one of its own
    that died with it, makes again; the forward requests' digests agree again and training goes on."""
    sw, metrics, _, killed_at, again = _crash_and_restart_stage1(
        swarm_factory, tmp_path, ["mask.codec=rotq", "mask.bits=1", "mask.reference=both", "mask.reference_refresh=3",
                                  "mask.reference_refresh_rank=1", "mask.reference_refresh_bits=8"],
        saved_at_least=12, then_steps=9, timeout=240)
    log = again.log.read_text()
    resumed = re.search(r"resumed stage 1 from \S+ at step (\d+)", log)
    assert resumed, tail(again.log)
    versions = [int(v) for v in re.findall(r"reference at version (\d+)", log)]
    assert versions and versions[-1] * 3 > int(resumed.group(1)), tail(again.log)  # it moved on past its checkpoint
    caught_up = re.findall(r"(fetched it from|making it now from this peer's weights)", log)
    assert caught_up or versions[0] * 3 <= int(resumed.group(1)) + 3, tail(again.log)
    recs = sorted(sw.metrics(metrics), key=lambda r: r["step"])
    assert all(math.isfinite(r["loss"]) for r in recs[killed_at:])


# the moving reference of the equivalence test's last case: rank-1 int8 moves after every 3rd step
MOVING_REFERENCE = ["mask.codec=rotq", "mask.bits=1", "mask.reference=both", "mask.reference_map_rank=8",
                    "mask.reference_map_period=2", "mask.reference_code_bits=32", "mask.reference_refresh=3",
                    "mask.reference_refresh_rank=1", "mask.reference_refresh_bits=8"]


def test_two_replica_chains_each_move_their_own_reference(swarm_factory, tmp_path, cache_dir):
    """DP with a moving reference keeps fixed routes (``meshnode.node.claim.fixed_routes``): two peers per stage,
    each takes a replica chain, calls only its chain's next peer and sends its stage's reference moves to its
    chain's followers, so each chain moves its own reference towards its own weights, as the mesh's replicas do.

    Chain 0's driver trains from step 0 while the rest starts: with no DP round in the run (H beyond it) it is the
    mesh's replica 0, loss for loss within 1e-5, its moves' bytes as logged half the mesh's ``ref`` (two chains).
    Chain 1's driver joins later: it loads chain 0's driver's state with its reference moves (no peer of chain 1 has
    moved yet), and chain 1's other peers fetch those moves from it in order, however far behind they are; from then
    on chain 1 moves its own. Then chain 1's stage-1 peer is SIGKILLed and a new peer with no state joins stage 1: it
    takes chain 1 (the dead peer's record still names it; asked, it does not answer), loads chain 0's peer's weights
    without that chain's moves, fetches chain 1's when a microbatch needs them, and chain 1 trains on through it."""
    steps, total = 8, 100000  # neither chain stops before the test does
    over = THREE + [*MOVING_REFERENCE, "dp.enabled=true", "dp.replicas=2", "dp.inner_steps=1000",
                    f"train.steps={total}", "train.microbatches=2"]
    sw = swarm_factory(over)
    peers = {}
    for s in (2, 1):
        for c in (0, 1):  # one at a time: each sees the chains the ones before it took
            peers[s, c] = sw.start(f"stage{s}-{c}", "--stage", str(s))
    metrics = {c: tmp_path / f"driver{c}.jsonl" for c in (0, 1)}
    peers[0, 0] = sw.start("stage0-0", "--stage", "0", "--metrics-out", str(metrics[0]))
    wait_for(lambda: len(sw.metrics(metrics[0])) >= steps, 120, "chain 0's first steps")
    peers[0, 1] = sw.start("stage0-1", "--stage", "0", "--metrics-out", str(metrics[1]))
    chain_of = re.compile(r"stage (\d): replica chain (\d) of 2")
    for (s, c), p in peers.items():
        assert chain_of.findall(p.log.read_text()) == [(str(s), str(c))], tail(p.log)
    forked = re.search(r"loaded stage 0 state \(step (\d+)\) from peer \S+ of replica chain 0 with its reference "
                       r"moves", peers[0, 1].log.read_text())
    assert forked and int(forked.group(1)) >= steps, tail(peers[0, 1].log)
    wait_for(lambda: len(sw.metrics(metrics[1])) >= 6, 180, "chain 1's first steps")

    from meshnode.mesh import MeshTrainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = MeshTrainer(sw.cfg, cache_dir)
        mesh = [trainer.train_step()["replica_loss"][0] for _ in range(steps)]
    finally:
        torch.set_num_threads(threads)
    losses = [m["loss"] for m in sorted(sw.metrics(metrics[0]), key=lambda m: m["step"])][:steps]
    assert losses == pytest.approx(mesh, abs=1e-5)
    pattern = re.compile(r"stage (\d): reference move (\d+) \((\d+) bytes\) sent to (\d+) followers")
    sent = {c: [m for s in range(3) for m in pattern.findall(peers[s, c].log.read_text())] for c in (0, 1)}
    early = [m for m in sent[0] if int(m[1]) <= 2]  # moves 1, 2 of the 3 stages: the mesh's first 8 steps
    assert len(early) == 3 * 2 and all(int(m[3]) == 2 for m in early)
    assert 2 * sum(int(m[2]) * int(m[3]) for m in early) == trainer.counter.snapshot()["ref"] > 0
    fork = int(forked.group(1)) // 3
    assert {int(m[1]) for m in sent[1]} and min(int(m[1]) for m in sent[1]) > fork  # chain 1's own, after the fork
    for s in (1, 2):  # chain 1's peers took chain 0's moves up to the fork from chain 1's driver
        log = peers[s, 1].log.read_text()
        assert re.search(r"fetched it from", log) and f"reference at version {fork}" in log, tail(peers[s, 1].log)
    for p in peers.values():  # no microbatch or move refused (a fetch asks peers that may not hold the move)
        lines = p.log.read_text().splitlines()
        refused = [ln for ln in lines if "refused" in ln and "not held by this peer" not in ln]
        assert not refused, refused[:3]

    victim = peers[1, 1].ready()["peer_id"]
    peers[1, 1].kill()
    killed_at = len(sw.metrics(metrics[1]))
    new = sw.start("stage1-new", "--stage", "1")
    wait_for(lambda: len(sw.metrics(metrics[1])) >= killed_at + 4, 240, "chain 1 to train on")
    log = new.log.read_text()
    assert chain_of.findall(log) == [("1", "1")], tail(new.log)
    assert f"{victim[-8:]}'s record holds replica chain 1, but it does not answer" in log, tail(new.log)
    assert re.search(r"loaded stage 1 state \(step \d+\) from peer \S+ of replica chain 0 without", log), tail(new.log)
    assert "fetched it from" in log, tail(new.log)
    versions = [int(v) for v in re.findall(r"reference at version (\d+)", log)]
    assert versions and versions[0] > fork, tail(new.log)  # chain 1's own moves, fetched in one go
    recs = sorted(sw.metrics(metrics[1]), key=lambda r: r["step"])
    assert len(recs) >= killed_at + 4 and all(math.isfinite(r["loss"]) for r in recs)
