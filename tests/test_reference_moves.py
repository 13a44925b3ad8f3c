"""Reference moves (``mask.reference_refresh_rank``): the move as sent, its wire form and checks, the digest that
chains moves, and one swarm peer's side of them (:mod:`meshnode.node.refmoves`) on in-process stage hosts."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from meshnode.model import cut_model, load_model
from meshnode.protocol.messages import WireError, pack, parse_reference_move, reference_move_request, unpack
from meshnode.stage import ReferenceModel, StageError, StageWorker
from meshnode.stage.moves import apply_move, check_move, make_move, move_nbytes, move_size
from meshnode.stage.reference import follower_stages


def _pair(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    held = {"w": torch.randn(12, 7, generator=g), "v": torch.randn(7, generator=g),
            "s": torch.randn(2, 1, generator=g)}
    live = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in held.items()}
    return held, live


@pytest.mark.parametrize("bits", [16, 8])
def test_a_move_is_sent_as_factors_and_applied_as_their_product(bits):
    held, live = _pair()
    move = make_move(held, live, 2, bits)
    assert set(move["w"]) == ({"a", "b"} if bits == 16 else {"a", "a_scale", "b", "b_scale"})
    assert set(move["v"]) == set(move["s"]) == {"d"}  # a vector, and a matrix of rank <= 2: whole, bfloat16
    assert move_nbytes(move) == move_size({n: tuple(t.shape) for n, t in held.items()}, 2, bits)
    moved = apply_move(held, move)
    step = moved["w"] - held["w"]
    assert int(torch.linalg.matrix_rank(step)) == 2
    best = torch.linalg.svd(live["w"] - held["w"], full_matrices=False)
    want = best.U[:, :2] @ torch.diag(best.S[:2]) @ best.Vh[:2]
    tol = 2e-2 if bits == 8 else 5e-3  # int8 or bfloat16 factors
    assert (step - want).abs().max() <= tol * want.abs().max()
    assert torch.allclose(moved["v"], live["v"], atol=1e-2)
    # the wire form round-trips bit for bit, and so does what a receiver applies
    got = parse_reference_move(unpack(pack(reference_move_request(run="r", stage=1, version=3, move=move)), 1 << 20),
                               run="r", num_stages=3)
    assert got[:2] == (1, 3)
    check_move(got[2], held, 2, bits)
    assert all(torch.equal(apply_move(held, got[2])[n], moved[n]) for n in held)


def test_a_move_that_does_not_fit_is_refused():
    held, live = _pair()
    move = make_move(held, live, 1, 8)
    with pytest.raises(ValueError, match="every parameter"):
        check_move({k: v for k, v in move.items() if k != "v"}, held, 1, 8)
    with pytest.raises(ValueError, match="parts"):
        check_move(move, held, 1, 16)  # int8 parts where this run sends bfloat16
    with pytest.raises(ValueError, match="expected"):
        check_move(move, held, 2, 8)  # rank 1 where this run sends rank 2
    bad = {**move, "v": {"d": torch.full((7,), float("nan"), dtype=torch.bfloat16)}}
    with pytest.raises(ValueError, match="non-finite"):
        check_move(bad, held, 1, 8)
    huge = {**move, "w": {**move["w"], "a_scale": torch.tensor([1e30])}}  # finite, but a^T b would overflow
    with pytest.raises(ValueError, match="changes a weight by up to"):
        check_move(huge, held, 1, 8)
    wire = reference_move_request(run="r", stage=0, version=1, move=move)
    for broken, needle in [({**wire, "run": "other"}, "for run"), ({**wire, "stage": 3}, "stage"),
                           ({**wire, "version": 0}, "version"), ({**wire, "move": {}}, "non-empty"),
                           ({**wire, "move": {"w": {"a": ["float64", [1, 7], b"\0" * 56]}}}, "dtype"),
                           ({**wire, "move": {"w": {"a": ["int8", [1, 7], b"\0" * 3]}}}, "bytes")]:
        with pytest.raises(WireError, match=needle):
            parse_reference_move(broken, run="r", num_stages=3)


def _stages(cfg, cache_dir):
    model, _ = load_model(cfg.model, cache_dir)
    return cut_model(model, cfg.model.stages)


def test_the_digest_chains_the_moves_and_two_holders_agree(tiny_cfg, cache_dir):
    cfg = tiny_cfg("model.stages=3")
    stages = _stages(cfg, cache_dir)
    a, b = ReferenceModel(list(stages.values())), ReferenceModel(list(stages.values()))
    origin = a.digest
    assert a.origin_digest == origin == b.digest
    live = {n: p.detach() + 0.01 * torch.randn_like(p) for n, p in stages[1].named_parameters()}
    move = make_move(dict(a.stages[1].named_parameters()), live, 1, 8)
    a.apply_move(1, move)
    assert a.versions == [0, 1, 0] and a.digest != origin and a.origin_digest == origin
    b.apply_move(1, move)
    assert b.digest == a.digest
    assert all(torch.equal(p, q) for p, q in zip(a.stages[1].parameters(), b.stages[1].parameters()))
    other = make_move(dict(b.stages[1].named_parameters()), live, 1, 16)
    b.apply_move(1, other)
    assert b.digest != a.digest and b.versions == [0, 2, 0]
    held = [p.clone() for p in a.stages[0].parameters()]
    with pytest.raises(ValueError, match="does not name"):
        a.apply_move(0, move)  # stage 1's move on stage 0
    assert all(torch.equal(p, q) for p, q in zip(held, a.stages[0].parameters())) and a.versions == [0, 1, 0]
    assert follower_stages(1, 3, "both") == [0, 2] and follower_stages(0, 3, "forward") == [1, 2]
    assert follower_stages(2, 3, "forward") == []  # the last stage's weights: no one codes a forward against them


def _hosts(cfg, cache_dir, lost: frozenset[int] = frozenset()):
    """A peer per stage of a 2-stage run, each holding its own reference and moving it (pushes go in-process;
    those of the stages in ``lost`` never arrive, and a peer fetches a move it misses from the stage's peer)."""
    from meshnode.node.host import StageHost
    from meshnode.node.refmoves import SwarmReference
    from meshnode.protocol.limits import Limits

    model, _ = load_model(cfg.model, cache_dir)
    limits = Limits.from_config(cfg, cfg.model.tiny_hidden, cfg.model.tiny_vocab)
    hosts: list[StageHost] = []

    async def call_next(stage, build):
        return await hosts[stage].forward(build(1, "peer1"))

    async def push_from(sender: int, stages: list[int], request: dict) -> int:
        got = 0
        for s in stages:
            if sender in lost:
                continue
            await hosts[s].reference_move(unpack(pack(request), limits.max_message_bytes), f"peer{sender}")
            got += 1
        return got

    async def fetch(stage: int, version: int, first: str | None = None):
        reply = await hosts[stage].reference_move({"run": "run", "fetch": [stage, version]}, "asker")
        return f"peer{stage}", unpack(pack(reply), limits.max_message_bytes)

    for s in range(2):
        cut = cut_model(load_model(cfg.model, cache_dir)[0], 2)
        w = StageWorker(cut[s], cfg)
        w.reference = ReferenceModel([cut_model(load_model(cfg.model, cache_dir)[0], 2)[i] for i in range(2)])
        h = StageHost(w, cfg, limits, "run", call_next=call_next if s == 0 else None)
        h.ref_moves = SwarmReference(h, push=lambda st, req, s=s: push_from(s, st, req), fetch=fetch)
        h.after_step_hooks.append(h.ref_moves.after_step)
        hosts.append(h)
    del model
    return hosts


def test_a_peer_waits_for_a_move_applies_it_at_its_step_and_refuses_what_does_not_fit(tiny_cfg, cache_dir,
                                                                                       monkeypatch):
    """Two stages, the reference moving after every step: the next step's microbatch finds both references moved by
    both moves (the digests agree, so the callee serves it); a move from a second peer of a stage is refused, as is a
    microbatch of a step the reference has moved past; a missing move fails the microbatch after the wait, and a
    state blob carries the moves to a fresh peer."""
    from meshnode.node import refmoves

    cfg = tiny_cfg("model.stages=2", "mask.codec=rotq", "mask.bits=2", "mask.reference=both", "train.microbatches=1",
                   "mask.reference_refresh=1", "mask.reference_refresh_rank=1", "mask.reference_refresh_bits=8")
    hosts = _hosts(cfg, cache_dir)
    ids = torch.randint(0, 200, (cfg.train.batch_size, cfg.data.seq_len))

    async def steps_done(n: int) -> None:
        for h in hosts:  # the step clock: each host's optimizer step (and its hook) taken, its moves sent
            async with h._cond:
                await asyncio.wait_for(h._cond.wait_for(lambda h=h: h.opt_step >= n and not h._stepping), 60)
            await asyncio.wait_for(asyncio.gather(*h.ref_moves._tasks), 60)

    async def go():
        _, loss = await hosts[0].process(driver="d", step=0, mb=0, attempt=1, inputs=ids, labels=ids)
        await steps_done(1)
        for h in hosts:  # each holds both moves of version 1 and applies none before a microbatch of step 1
            assert h.worker.reference.versions == [0, 0]
            assert sorted(v for s in h.ref_moves.pending.values() for v in s) == [1, 1]
        _, loss1 = await hosts[0].process(driver="d", step=1, mb=0, attempt=1, inputs=ids, labels=ids)
        assert math.isfinite(loss1)
        assert hosts[0].worker.reference.versions == hosts[1].worker.reference.versions == [1, 1]
        assert hosts[0].reference_digest == hosts[1].reference_digest != hosts[0].worker.reference.origin_digest
        await steps_done(2)
        # a second peer of stage 1 sends its own move of version 2: refused, the first one's kept
        own = hosts[1].ref_moves.pending[1][2]
        theirs = {n: {k: (-t if k in ("a", "d") else t) for k, t in parts.items()} for n, parts in own.items()}
        with pytest.raises(WireError, match="one peer per stage"):
            req = reference_move_request(run="run", stage=1, version=2, move=theirs)
            await hosts[0].reference_move(req, "another-peer")
        kept = hosts[0].ref_moves.pending[1][2]  # the first peer's move
        assert all(torch.equal(kept[n][k], t) for n, parts in own.items() for k, t in parts.items())
        # the state of stage 0 (one move applied of each stage, one held of each) loads into a fresh peer
        blob = await hosts[0].state_blob()
        fresh = _hosts(cfg, cache_dir)[0]
        fresh.load_state_blob(blob)
        assert fresh.worker.reference.versions == [1, 1] and fresh.reference_digest == hosts[0].reference_digest
        assert sorted(fresh.ref_moves.pending) == [0, 1] and all(2 in p for p in fresh.ref_moves.pending.values())
        # step 2 applies version 2; then a microbatch of step 1 (coded against version 1) is refused
        await hosts[0].process(driver="d", step=2, mb=0, attempt=1, inputs=ids, labels=ids)
        with pytest.raises(StageError, match="has moved to 2"):
            await hosts[0].ref_moves.at_step(1)
        # a move that never comes: the wait ends with the reason
        monkeypatch.setattr(refmoves, "MOVE_WAIT_S", 0.5)
        with pytest.raises(StageError, match=r"reference move 4 of stage\(s\) \[0, 1\] did not arrive"):
            await fresh.ref_moves.at_step(4)

    asyncio.run(go())


async def _steps(hosts, ids, steps: int) -> None:
    """Drive ``steps`` one-microbatch steps through ``hosts``, each host's optimizer step (and its reference move,
    sent) taken before the next."""
    for step in range(steps):
        _, loss = await hosts[0].process(driver="d", step=step, mb=0, attempt=1, inputs=ids, labels=ids)
        assert math.isfinite(loss)
        for h in hosts:
            async with h._cond:
                stepped = lambda h=h, n=step: h.last_step_served >= n and not h._stepping  # noqa: E731
                await asyncio.wait_for(h._cond.wait_for(stepped), 60)
            await asyncio.wait_for(asyncio.gather(*h.ref_moves._tasks), 60)


def test_with_forward_coding_each_boundary_compares_the_stages_both_ends_compute(tiny_cfg, cache_dir):
    """``mask.reference = forward``: stage 0's peer computes stage 0's reference only, stage 1's both stages; stage
    1's moves go to no one, and the boundary's digest names stage 0's moves alone, so the two ends agree after
    every move (the whole-reference digests differ)."""
    cfg = tiny_cfg("model.stages=2", "mask.codec=rotq", "mask.bits=2", "mask.reference=forward",
                   "train.microbatches=1", "mask.reference_refresh=1", "mask.reference_refresh_rank=1")
    hosts = _hosts(cfg, cache_dir)
    ids = torch.randint(0, 200, (cfg.train.batch_size, cfg.data.seq_len))

    async def go():
        await _steps(hosts, ids, 3)
        assert hosts[0].worker.reference.versions == [2, 0] and hosts[1].worker.reference.versions == [2, 2]
        assert hosts[0].ref_moves.followers == [1] and hosts[1].ref_moves.followers == []
        assert hosts[0].ref_moves.boundary_digest(0) == hosts[1].ref_moves.boundary_digest(0)
        assert hosts[0].reference_digest != hosts[1].reference_digest

    asyncio.run(go())


def test_a_peer_that_missed_a_push_fetches_the_move(tiny_cfg, cache_dir, monkeypatch):
    """Stage 0's pushes never reach stage 1: the microbatch of the next step waits FETCH_AFTER_S, then stage 1's
    peer asks stage 0's for the move and goes on with the same reference (the callee serves it; a move not held
    anywhere is refused by name)."""
    from meshnode.node import refmoves

    monkeypatch.setattr(refmoves, "FETCH_AFTER_S", 0.2)
    cfg = tiny_cfg("model.stages=2", "mask.codec=rotq", "mask.bits=2", "mask.reference=both", "train.microbatches=1",
                   "mask.reference_refresh=1", "mask.reference_refresh_rank=1", "mask.reference_refresh_bits=8")
    hosts = _hosts(cfg, cache_dir, lost=frozenset({0}))
    ids = torch.randint(0, 200, (cfg.train.batch_size, cfg.data.seq_len))

    async def go():
        await hosts[0].process(driver="d", step=0, mb=0, attempt=1, inputs=ids, labels=ids)
        for h in hosts:
            async with h._cond:
                await asyncio.wait_for(h._cond.wait_for(lambda h=h: h.opt_step >= 1 and not h._stepping), 60)
        assert 1 not in hosts[1].ref_moves.pending[0]  # lost
        _, loss = await hosts[0].process(driver="d", step=1, mb=0, attempt=1, inputs=ids, labels=ids)
        assert math.isfinite(loss) and hosts[1].ref_moves.fetched == 1
        assert hosts[1].worker.reference.versions == hosts[0].worker.reference.versions == [1, 1]
        with pytest.raises(WireError, match="not held"):
            await hosts[0].reference_move({"run": "run", "fetch": [0, 5]}, "asker")
        with pytest.raises(WireError, match="fetch"):
            await hosts[0].reference_move({"run": "run", "fetch": [0]}, "asker")

    asyncio.run(go())


def test_moves_follow_the_driver_steps_of_a_peer_whose_step_count_is_off(tiny_cfg, cache_dir, monkeypatch):
    """A peer restarted from an older checkpoint counts its optimizer steps behind the driver's: it still makes its
    moves when the next microbatch's driver step is a multiple of K, the step every other peer codes against (made
    by its own step count, stage 1's move of version 1 would come a step late and every microbatch would wait)."""
    from meshnode.node import refmoves

    monkeypatch.setattr(refmoves, "MOVE_WAIT_S", 10.0)
    cfg = tiny_cfg("model.stages=2", "mask.codec=rotq", "mask.bits=2", "mask.reference=both", "train.microbatches=1",
                   "mask.reference_refresh=2", "mask.reference_refresh_rank=1")
    hosts = _hosts(cfg, cache_dir)
    hosts[1].opt_step = 3  # as if it had resumed from a checkpoint three steps away from the driver's count
    ids = torch.randint(0, 200, (cfg.train.batch_size, cfg.data.seq_len))

    async def go():
        await _steps(hosts, ids, 3)
        assert hosts[0].worker.reference.versions == hosts[1].worker.reference.versions == [1, 1]
        assert hosts[1].opt_step == 6 and hosts[0].opt_step == 3

    asyncio.run(go())


def test_a_peer_far_behind_catches_up_in_order_within_the_records_horizon(tiny_cfg, cache_dir, monkeypatch):
    """A peer that joined with no moves (fixed routes: a new peer of a chain) fetches the moves it lacks in order,
    however many (past the 2 versions a push may run ahead), but none beyond the version of the newest driver step
    the signed records show (+2), whatever step a microbatch names; and it takes no answer that is not the move it
    asked for."""
    from meshnode.node import refmoves
    from meshnode.node.refmoves import SwarmReference

    monkeypatch.setattr(refmoves, "FETCH_AFTER_S", 0.1)
    monkeypatch.setattr(refmoves, "MOVE_WAIT_S", 1.0)
    cfg = tiny_cfg("model.stages=2", "mask.codec=rotq", "mask.bits=2", "mask.reference=both", "train.microbatches=1",
                   "mask.reference_refresh=1", "mask.reference_refresh_rank=1", "mask.reference_refresh_bits=8")
    hosts = _hosts(cfg, cache_dir)
    ids = torch.randint(0, 200, (cfg.train.batch_size, cfg.data.seq_len))
    limits = hosts[0].limits
    horizon = {"step": 1}
    swap = {"on": False}

    async def fetch(stage: int, version: int, first: str | None = None):
        if swap["on"]:  # a peer that answers with another move than the one asked for
            version = version + 1
        reply = await hosts[0].reference_move({"run": "run", "fetch": [stage, version]}, "asker")
        return "peer0", unpack(pack(reply), limits.max_message_bytes)

    async def go():
        await _steps(hosts, ids, 6)  # moves 1..5 made by both stages, held by stage 0's peer
        fresh = _hosts(cfg, cache_dir)[1]
        fresh.ref_moves = SwarmReference(fresh, push=None, fetch=fetch, horizon=lambda: horizon["step"])
        with pytest.raises(StageError, match="did not arrive"):
            await fresh.ref_moves.at_step(10 ** 9)  # a forged step: fetched only up to the records' version + 2
        assert max(fresh.ref_moves.pending[0]) == max(fresh.ref_moves.pending[1]) == 3
        assert fresh.worker.reference.versions == [0, 0]
        horizon["step"] = 5
        await fresh.ref_moves.at_step(5)  # five versions behind: fetched in order, applied at once
        assert fresh.worker.reference.versions == [5, 5] and fresh.ref_moves.fetched == 10
        assert fresh.ref_moves.boundary_digest(0) == hosts[0].ref_moves.boundary_digest(0)
        late = _hosts(cfg, cache_dir)[1]
        late.ref_moves = SwarmReference(late, push=None, fetch=fetch, horizon=lambda: horizon["step"])
        swap["on"] = True
        with pytest.raises(StageError, match="did not arrive"):
            await late.ref_moves.at_step(2)
        assert not any(late.ref_moves.pending.values()) and late.worker.reference.versions == [0, 0]

    asyncio.run(go())


def test_a_move_of_another_replica_chain_is_refused(tiny_cfg, cache_dir):
    """Fixed routes: a move names its sender's replica chain, and a peer takes only its own chain's (a sender with an
    old view of the chains, or a peer that has just changed chains, would otherwise mix two chains' references)."""
    cfg = tiny_cfg("model.stages=2", "mask.codec=rotq", "mask.bits=2", "mask.reference=both", "train.microbatches=1",
                   "mask.reference_refresh=1", "mask.reference_refresh_rank=1", "mask.reference_refresh_bits=8")
    hosts = _hosts(cfg, cache_dir)
    hosts[1].ref_moves.chain = lambda: 1
    move = hosts[0].ref_moves._make()

    async def go():
        for chain in (0, None):
            with pytest.raises(WireError, match=f"replica chain {chain}: this peer is in chain 1"):
                await hosts[1].reference_move(reference_move_request(run="run", stage=0, version=1, move=move,
                                                                     chain=chain), "peer0")
        assert not hosts[1].ref_moves.pending[0]
        await hosts[1].reference_move(reference_move_request(run="run", stage=0, version=1, move=move, chain=1),
                                      "peer0")
        assert 1 in hosts[1].ref_moves.pending[0]
        with pytest.raises(WireError, match="chain"):
            await hosts[1].reference_move({**reference_move_request(run="run", stage=0, version=2, move=move),
                                           "chain": "one"}, "peer0")

    asyncio.run(go())
