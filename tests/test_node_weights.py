"""Weight streams split tensors larger than a frame into pieces, and the receiver joins them exactly."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from meshnode.node.host import StageHost, weights_from_chunks
from meshnode.protocol.limits import WEIGHT_CHUNK_BYTES
from meshnode.protocol.messages import WireError


def _fake_host(state: dict[str, torch.Tensor]) -> StageHost:
    host = StageHost.__new__(StageHost)
    host.run_id = "r"
    host._cond = asyncio.Condition()
    host._stepping = False
    host.opt_step = host.driver_step = 0
    host.dp = None
    host.worker = SimpleNamespace(module=SimpleNamespace(state_dict=lambda: state))

    async def run(fn, *args):
        return fn(*args)

    host.run = run
    return host


async def _collect(host, request):
    return [c async for c in host.weights_stream(request)]


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_large_tensors_are_split_and_rejoined(dtype):
    big = torch.randn(WEIGHT_CHUNK_BYTES // 4 + 1000, 3)  # > one frame even in bf16
    state = {"embed.weight": big, "norm.weight": torch.randn(7), "scalar": torch.tensor(2.5)}
    chunks = asyncio.run(_collect(_fake_host(state), {"run": "r", "dtype": dtype}))
    assert len(chunks) > 2 and chunks[-1]["last"] and not chunks[0]["last"]
    assert all(sum(len(p[3]) for p in c["pieces"]) <= WEIGHT_CHUNK_BYTES for c in chunks)
    out = weights_from_chunks(chunks)
    want = {k: (v.to(torch.bfloat16) if dtype else v) for k, v in state.items()}
    assert set(out) == set(want)
    for k in want:
        assert torch.equal(out[k], want[k]), k


def test_pieces_out_of_order_are_rejected():
    state = {"w": torch.randn(WEIGHT_CHUNK_BYTES // 2)}
    chunks = asyncio.run(_collect(_fake_host(state), {"run": "r"}))
    pieces = [p for c in chunks for p in c["pieces"]]
    assert len(pieces) >= 2
    with pytest.raises(WireError, match="out of order"):
        weights_from_chunks([{"pieces": [pieces[1], pieces[0]]}])
    with pytest.raises(WireError, match="needs"):
        weights_from_chunks([{"pieces": pieces[:1]}])  # truncated stream: byte count does not match
