"""Seeded structural fuzzing of what crosses the wire: a forward or backward request with one to three of its
fields (at any depth: the payload's header, meta, tensor specs and bytes, the labels) deleted, added, or replaced
by a value of another type or range. The parser refuses with WireError and nothing else; a payload it accepts
reaches the next stage's worker, which trains on it or refuses it with StageError and nothing else (the host
turns both into a clear refusal; anything else was a peer-side TypeError, OverflowError or codec error
surfacing from deep inside a decoder: found here, a mask key or row offset of the wrong type)."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch

from meshnode.compression import BoundaryContext, DenseCodec, MaskCodec, MaskKey, RotQuantCodec
from meshnode.protocol.limits import Limits
from meshnode.protocol.messages import (
    WireError,
    backward_request,
    forward_request,
    pack,
    parse_backward,
    parse_forward,
    unpack,
)

ROOT = Path(__file__).resolve().parents[1]
LIMITS = Limits(max_message_bytes=1 << 20, max_batch=4, max_seq=16, hidden=32, vocab=260)
POOL = [None, -1, 0, 1, 2**40, 1.5, float("nan"), float("inf"), "", "x", "x" * 300, b"", b"\x00" * 7, [], {},
        [1, 2], [[1, 2]], {"a": 1}, True, False, [None], [-1, 5, 3], ["bfloat16", [2, 8, 32]], ["float32", [0]],
        ["uint8", [3]]]


def _paths(obj, path=()):
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*path, i))


def _mutate(obj, rng: random.Random) -> None:
    """Delete, add or replace one field somewhere inside ``obj`` (in place)."""
    path = rng.choice([p for p in _paths(obj) if p])
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    r = rng.random()
    if r < 0.15 and isinstance(parent, dict):
        del parent[path[-1]]
    elif r < 0.25 and isinstance(parent, dict):
        parent[rng.choice(["zz", "extra", 5])] = copy.deepcopy(rng.choice(POOL))
    else:
        parent[path[-1]] = copy.deepcopy(rng.choice(POOL))


def _fuzzed(message: dict, target: dict, rng: random.Random, limit: int) -> dict | None:
    """``message`` after 1-3 mutations inside ``target`` (a part of it), through msgpack; None if it no longer packs
    (an int past 64 bits: the sender's msgpack refuses it before anything is sent)."""
    for _ in range(rng.randint(1, 3)):
        _mutate(target, rng)
    try:
        return unpack(pack(message), limit)
    except (WireError, OverflowError):
        return None


@pytest.mark.parametrize("codec", [DenseCodec("bfloat16"), MaskCodec(0.9), RotQuantCodec(bits=4)],
                         ids=["dense", "mask", "rotq"])
def test_the_parser_refuses_mutated_requests_only_with_wire_errors(codec):
    rng = random.Random(0)
    key = BoundaryContext(key=MaskKey(run_seed=0, step=3, microbatch=1, boundary=0))
    outcomes = {"accepted": 0, "refused": 0}
    for i in range(400):
        if i % 2 == 0:
            msg = forward_request(run="r", driver="d", step=3, mb=1, attempt=7, boundary=0, mask_version=0,
                                  payload=codec.encode(torch.randn(2, 8, 32), copy.copy(key)),
                                  labels=torch.randint(0, 260, (2, 8)), vocab=260)
            parse = lambda m: parse_forward(m, LIMITS, run="r", stage=1, mask_version=0)  # noqa: E731
        else:
            msg = backward_request(run="r", driver="d", step=3, mb=1, attempt=7, boundary=1,
                                   payload=codec.encode_grad(torch.randn(2, 8, 32), copy.copy(key)))
            parse = lambda m: parse_backward(m, LIMITS, run="r", stage=1)  # noqa: E731
        if i < 2:  # unmutated: accepted
            parse(unpack(pack(msg), LIMITS.max_message_bytes))
        wire = _fuzzed(msg, msg, rng, LIMITS.max_message_bytes)
        if wire is None:
            continue
        try:
            parse(wire)
            outcomes["accepted"] += 1
        except WireError:
            outcomes["refused"] += 1
    # both outcomes occur: the mutations reach fields the parser checks and fields it need not
    assert outcomes["refused"] > 200 and outcomes["accepted"] > 5, outcomes


@pytest.mark.parametrize("overrides", [["mask.ratio=0.9"], ['mask.codec="rotq"']], ids=["mask", "rotq"])
def test_a_worker_refuses_mutated_payloads_only_with_stage_errors(cache_dir, overrides):
    from meshnode.config import load_config
    from meshnode.model import cut_model, load_model
    from meshnode.stage import MicrobatchId, StageError, StageWorker

    cfg = load_config(ROOT / "configs" / "tiny.toml", ["model.stages=2", "mask.warmup_steps=0", *overrides])
    model, _ = load_model(cfg.model, cache_dir)
    mods = cut_model(model, 2)
    first, last = StageWorker(mods[0], cfg), StageWorker(mods[1], cfg)
    limits = Limits.from_config(cfg, cfg.model.tiny_hidden, cfg.model.tiny_vocab)
    B, T = cfg.train.batch_size, cfg.data.seq_len
    rng = random.Random(1)
    outcomes = {"trained": 0, "refused": 0}
    ids = torch.randint(0, 200, (B, T))
    mb = MicrobatchId(5, 0, "d")
    sent = forward_request(run="r", driver="d", step=5, mb=0, attempt=1, boundary=0, mask_version=cfg.mask.version,
                           payload=first.forward(mb, ids), labels=ids, vocab=limits.vocab)
    first.discard(mb)
    for _ in range(300):
        msg = copy.deepcopy(sent)
        wire = _fuzzed(msg, msg["payload"], rng, limits.max_message_bytes)
        if wire is None:
            continue
        try:
            req = parse_forward(wire, limits, run="r", stage=1, mask_version=cfg.mask.version)
        except WireError:
            continue
        try:
            last.forward(mb, req.payload, req.labels)
            last.backward(mb)
            outcomes["trained"] += 1
        except StageError:
            outcomes["refused"] += 1
        assert not last.in_flight
        assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in last.module.parameters())
        last.clear_step()
    assert outcomes["refused"] > 0 and sum(outcomes.values()) >= 8, outcomes  # the worker was reached


@pytest.mark.parametrize("field, value", [("row_offset", "x"), ("row_offset", 1.5), ("row_offset", True),
                                          ("row_offset", float("inf")), ("key", [0, 3, 1, 0, 1.5]),
                                          ("key", [0, 3, 1, 0, True])])
def test_a_mask_payloads_key_and_row_offset_must_be_integers(field, value):
    """What the fuzzing found: a row offset of "x" or inf escaped the mask codec as ValueError / OverflowError, and
    1.5 or True was truncated to an int and accepted; now each is a PayloadError (the worker's StageError)."""
    from meshnode.compression import PayloadError

    codec = MaskCodec(0.9)
    payload = codec.encode(torch.randn(2, 8, 32), BoundaryContext(key=MaskKey(run_seed=0, step=3, microbatch=1,
                                                                               boundary=0)))
    assert codec.decode(payload).shape == (2, 8, 32)
    payload.meta[field] = value
    with pytest.raises(PayloadError, match="row offset|mask key"):
        codec.decode(payload)
