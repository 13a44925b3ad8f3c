"""DiLoCo outer Nesterov step, streaming fragments and their sync schedule."""

from __future__ import annotations

import copy

import pytest
import torch

from meshnode.optim import OuterNesterov, fragments, fragments_due, sync_schedule


def _params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    torch.manual_seed(seed)
    return {
        "a.weight": torch.nn.Parameter(torch.randn(4, 3)),
        "a.bias": torch.nn.Parameter(torch.randn(4)),
        "b.weight": torch.nn.Parameter(torch.randn(2, 4)),
    }


def _inner_steps(params: dict[str, torch.nn.Parameter], seed: int, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(steps):
            for p in params.values():
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def test_one_replica_lr1_no_momentum_reproduces_inner_weights() -> None:
    params = _params()
    outer = OuterNesterov(params, lr=1.0, momentum=0.0)
    for rnd in range(3):
        _inner_steps(params, seed=rnd)
        inner = {n: p.detach().clone() for n, p in params.items()}
        pg = outer.pseudo_gradient(params)
        assert all(pg[n].abs().max() > 0 for n in pg)
        outer.apply(pg, params)
        for n, p in params.items():
            torch.testing.assert_close(p.detach(), inner[n])
            torch.testing.assert_close(outer.start[n], inner[n])


def test_nesterov_matches_hand_computation_and_torch_sgd() -> None:
    p = {"w": torch.nn.Parameter(torch.tensor([1.0, 2.0]))}
    outer = OuterNesterov(p, lr=0.7, momentum=0.9)
    g1, g2 = torch.tensor([0.1, -0.2]), torch.tensor([0.3, 0.05])
    outer.apply({"w": g1}, p)
    # v1 = g1; update = g1 + 0.9*g1; start = [1, 2] - 0.7*1.9*g1
    expected1 = torch.tensor([1.0 - 0.7 * 1.9 * 0.1, 2.0 + 0.7 * 1.9 * 0.2])
    torch.testing.assert_close(p["w"].detach(), expected1)
    outer.apply({"w": g2}, p)
    v2 = 0.9 * g1 + g2
    expected2 = expected1 - 0.7 * (g2 + 0.9 * v2)
    torch.testing.assert_close(p["w"].detach(), expected2)

    ref = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for g in (g1, g2):
        ref.grad = g.clone()
        sgd.step()
    torch.testing.assert_close(p["w"].detach(), ref.detach())


def test_two_replicas_average() -> None:
    a, b = _params(), _params()
    oa, ob = OuterNesterov(a), OuterNesterov(b)
    _inner_steps(a, seed=1)
    _inner_steps(b, seed=2)
    pa, pb = oa.pseudo_gradient(a), ob.pseudo_gradient(b)
    avg = {n: (pa[n] + pb[n]) / 2 for n in pa}
    oa.apply(avg, a)
    ob.apply(avg, b)
    for n in a:  # the replicas agree again after the outer step
        assert torch.equal(a[n].detach(), b[n].detach())


def test_fragment_subset_and_state_dict() -> None:
    params = _params()
    frag = ["a.weight", "a.bias"]
    outer = OuterNesterov(params, names=frag)
    with pytest.raises(KeyError):
        OuterNesterov(params, names=["nope"])
    before_b = params["b.weight"].detach().clone()
    _inner_steps(params, seed=3)
    moved_b = params["b.weight"].detach().clone()
    assert not torch.equal(before_b, moved_b)
    pg = outer.pseudo_gradient(params)
    assert sorted(pg) == sorted(frag)
    outer.apply({"a.weight": pg["a.weight"]}, params)  # only part of the fragment this time
    assert torch.equal(params["b.weight"].detach(), moved_b)  # not owned: untouched
    with pytest.raises(KeyError):
        outer.apply({"b.weight": torch.zeros(2, 4)}, params)

    state = copy.deepcopy(outer.state_dict())
    _inner_steps(params, seed=4)
    snapshot = {n: p.detach().clone() for n, p in params.items()}
    outer.apply(outer.pseudo_gradient(params), params)
    after = {n: p.detach().clone() for n, p in params.items()}

    params2 = {n: torch.nn.Parameter(t.clone()) for n, t in snapshot.items()}
    outer2 = OuterNesterov(params2, names=frag)
    outer2.load_state_dict(state)
    outer2.apply(outer2.pseudo_gradient(params2), params2)
    for n in params2:
        assert torch.equal(params2[n].detach(), after[n])


def test_fragments_partition_names() -> None:
    names = [f"p{i}" for i in range(10)]
    for F in range(1, 11):
        frs = fragments(names, F)
        assert len(frs) == F and all(frs)
        assert [n for fr in frs for n in fr] == names  # contiguous, disjoint, covering, in order
        lens = [len(fr) for fr in frs]
        assert max(lens) - min(lens) <= 1
    assert fragments(names, 3) == fragments(list(names), 3)  # deterministic
    sized = fragments(["a", "b", "c", "d", "e"], 2, sizes=[10, 10, 10, 10, 40])
    assert sized == [["a", "b", "c", "d"], ["e"]]
    with pytest.raises(ValueError):
        fragments(names, 11)
    with pytest.raises(ValueError):
        fragments(names, 0)


def test_sync_schedule_is_staggered() -> None:
    H, F = 10, 4
    offsets = sync_schedule(H, F)
    assert offsets == [0, 2, 5, 7]
    assert sync_schedule(12, 1) == [0]
    syncs: dict[int, list[int]] = {f: [] for f in range(F)}
    for step in range(1, 41):
        due = fragments_due(step, H, offsets)
        assert len(due) <= 1  # never two fragments on the wire at once when F <= H
        for f in due:
            syncs[f].append(step)
    assert syncs[0] == [10, 20, 30, 40]
    assert syncs[1] == [2, 12, 22, 32]
    assert syncs[3] == [7, 17, 27, 37]
    assert fragments_due(0, H, offsets) == []


def test_fragments_due_by_clock_matches_own_steps_and_handles_jumps():
    from meshnode.optim import fragments_due_by_clock

    for H, F in [(10, 1), (10, 2), (5, 3), (1, 1), (4, 4)]:
        offs = sync_schedule(H, F)
        last: list[int] = []
        by_clock = {t: fragments_due_by_clock(t, H, offs, last) for t in range(1, 50)}
        assert by_clock == {t: fragments_due(t, H, offs) for t in range(1, 50)}, (H, F)
    # a clock that jumps (steps seen late): one sync per period passed over, never a burst
    last = []
    assert fragments_due_by_clock(1, 10, [0, 5], last) == []
    assert fragments_due_by_clock(7, 10, [0, 5], last) == [1]
    assert fragments_due_by_clock(31, 10, [0, 5], last) == [0, 1] and last == [3, 2]
    assert fragments_due_by_clock(31, 10, [0, 5], last) == [] and fragments_due_by_clock(34, 10, [0, 5], last) == []
    assert fragments_due_by_clock(35, 10, [0, 5], last) == [1]
    # a peer that joins mid-run waits for the next boundary
    last = []
    assert fragments_due_by_clock(137, 10, [0], last) == [] and fragments_due_by_clock(139, 10, [0], last) == []
    assert fragments_due_by_clock(140, 10, [0], last) == [0]
