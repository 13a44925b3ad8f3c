"""The mask PRF: reproducible bit for bit, exactly K distinct channels, uniform, keyed by every field."""

from __future__ import annotations

import math

import pytest
import torch

from meshnode.compression import MaskKey, channel_hash, keep_indices, keep_mask, num_kept
from meshnode.compression.prf import fold_seed, mix64, mix64_int, stream_int, to_int64, to_uint64, uniform

KEY = MaskKey(run_seed=1234, step=7, microbatch=2, boundary=1, version=0)

# Computed once with this implementation; a change of platform, torch version or code that moves a
# single channel fails here.
GOLDEN_SEED = 0xC5DEFDABA6C28BD2
GOLDEN_HASH_000 = [1891852473726712264, 1935125542055170254, 5352828307577360614, 14747742387057383949]
GOLDEN_IDX = [
    [[4, 9, 10, 15], [0, 6, 7, 9], [1, 5, 6, 10]],
    [[1, 3, 6, 7], [1, 4, 10, 13], [1, 4, 7, 15]],
]


def reference_hash(key: MaskKey, batch: int, seq: int, hidden: int) -> list[list[list[int]]]:
    """The mask hash in plain Python ints (uint64 semantics), independent of torch."""
    seed = key.seed()
    out = []
    for r in range(batch):
        rs = stream_int(seed, r)
        rows = []
        for t in range(seq):
            ts = stream_int(rs, t)
            rows.append([stream_int(ts, c) for c in range(hidden)])
        out.append(rows)
    return out


def test_num_kept():
    assert num_kept(576, 0.95) == 29
    assert num_kept(576, 0.90) == 58
    assert num_kept(64, 0.0) == 64
    assert num_kept(10, 0.99) == 1  # at least one channel
    with pytest.raises(ValueError):
        num_kept(64, 1.0)
    with pytest.raises(ValueError):
        num_kept(0, 0.5)


def test_mix64_matches_python_reference():
    values = [0, 1, 2, 12345, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 0x9E3779B97F4A7C15]
    got = mix64(torch.tensor([to_int64(v) for v in values], dtype=torch.int64))
    assert [to_uint64(v) for v in got.tolist()] == [mix64_int(v) for v in values]
    # splitmix64's published first output for seed 0 (Vigna's reference implementation)
    assert stream_int(0, 0) == 0xE220A8397B1DCDAF


def test_hash_matches_python_reference_and_golden():
    assert KEY.seed() == GOLDEN_SEED
    h = channel_hash(KEY, 2, 3, 16)
    assert [[[to_uint64(v) for v in tok] for tok in row] for row in h.tolist()] == reference_hash(KEY, 2, 3, 16)
    assert [to_uint64(v) for v in h[0, 0, :4].tolist()] == GOLDEN_HASH_000


def test_golden_indices():
    idx = keep_indices(KEY, 2, 3, 16, 0.75)
    assert idx.dtype == torch.int64
    assert idx.tolist() == GOLDEN_IDX
    # the definition: the K channels of smallest hash (signed int64 order), ascending
    ref = reference_hash(KEY, 2, 3, 16)
    for b in range(2):
        for t in range(3):
            order = sorted(range(16), key=lambda c, b=b, t=t: (to_int64(ref[b][t][c]), c))
            assert sorted(order[:4]) == GOLDEN_IDX[b][t]


def test_recomputation_and_slicing_agree_bit_for_bit():
    a = keep_indices(KEY, 4, 32, 96, 0.9)
    b = keep_indices(KEY, 4, 32, 96, 0.9)
    assert torch.equal(a, b)
    rows = torch.cat([keep_indices(KEY, 1, 32, 96, 0.9, row_offset=r) for r in range(4)])
    assert torch.equal(a, rows)
    cols = torch.cat([keep_indices(KEY, 4, 8, 96, 0.9, pos_offset=p) for p in range(0, 32, 8)], dim=1)
    assert torch.equal(a, cols)
    chunked = keep_indices(KEY, 4, 32, 96, 0.9, chunk_elements=1)  # one row at a time
    assert torch.equal(a, chunked)


def test_thread_count_does_not_change_mask():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = keep_indices(KEY, 3, 64, 128, 0.95)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, keep_indices(KEY, 3, 64, 128, 0.95))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_agrees_with_cpu():
    cpu = keep_indices(KEY, 4, 64, 576, 0.95)
    gpu = keep_indices(KEY, 4, 64, 576, 0.95, device="cuda")
    assert torch.equal(cpu, gpu.cpu())
    assert torch.equal(channel_hash(KEY, 2, 8, 64), channel_hash(KEY, 2, 8, 64, device="cuda").cpu())
    assert torch.equal(uniform(99, (17, 5)), uniform(99, (17, 5), device="cuda").cpu())


def test_exactly_k_distinct_sorted_channels_per_token():
    h, ratio = 576, 0.95
    idx = keep_indices(KEY, 3, 50, h, ratio)
    k = num_kept(h, ratio)
    assert idx.shape == (3, 50, k)
    assert bool((idx.diff(dim=-1) > 0).all())  # strictly ascending: no duplicates
    assert int(idx.min()) >= 0 and int(idx.max()) < h
    mask = keep_mask(KEY, 3, 50, h, ratio)
    assert mask.dtype == torch.bool and mask.shape == (3, 50, h)
    assert bool((mask.sum(-1) == k).all())
    assert torch.equal(mask.nonzero()[:, 2].reshape(3, 50, k), idx)


def _chi2_upper_quantile(dof: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal score z."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def test_keep_frequencies_are_uniform_over_channels():
    # 8192 tokens x 6 of 64 channels: each channel's count is ~ Binomial(8192, 6/64), mean 768.
    # Chi-square over 64 channels has 63 degrees of freedom (the total is fixed); the threshold at
    # z = 4.75 has a false-alarm probability of about 1e-6 for a truly uniform PRF. Sampling without
    # replacement within a token only shrinks the variance (factor 1 - K/H), so the test is conservative.
    h, ratio, tokens = 64, 0.9, 16 * 512
    idx = keep_indices(KEY, 16, 512, h, ratio)
    k = num_kept(h, ratio)
    counts = torch.bincount(idx.flatten(), minlength=h).double()
    expected = tokens * k / h
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < _chi2_upper_quantile(h - 1, 4.75), (chi2, counts)
    # and the low channels are not favoured (a "first K channels" bug passes the count check per token)
    assert abs(float(counts[: h // 2].sum()) - tokens * k / 2) < 5 * math.sqrt(tokens * k / 4)
    # masks differ between tokens: almost no two tokens of the microbatch share their kept set
    flat = idx.reshape(-1, k)
    assert torch.unique(flat, dim=0).shape[0] > 0.99 * tokens


def test_chi_square_detects_a_biased_mask():
    # the same statistic on a mask that prefers low channels must fail, so the test above can fail
    h, k, tokens = 64, 6, 8192
    g = torch.Generator().manual_seed(0)
    biased = torch.stack([torch.randperm(h - 8, generator=g)[:k] for _ in range(tokens)])
    counts = torch.bincount(biased.flatten(), minlength=h).double()
    expected = tokens * k / h
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 > _chi2_upper_quantile(h - 1, 4.75)


@pytest.mark.parametrize("field", ["run_seed", "step", "microbatch", "boundary", "version"])
def test_every_key_field_changes_the_mask(field):
    base = keep_indices(KEY, 2, 64, 128, 0.9)
    other_key = MaskKey(**{**KEY.__dict__, field: getattr(KEY, field) + 1})
    other = keep_indices(other_key, 2, 64, 128, 0.9)
    same_tokens = (base == other).all(-1).float().mean().item()
    assert same_tokens < 0.01  # a token's 13-of-128 set repeats by chance with probability ~1e-17
    overlap = keep_mask(KEY, 2, 64, 128, 0.9) & keep_mask(other_key, 2, 64, 128, 0.9)
    # independent masks overlap on K^2/H = 1.3 channels per token on average
    assert overlap.sum(-1).double().mean().item() == pytest.approx(13 * 13 / 128, abs=0.3)


def test_fold_seed_is_order_sensitive():
    assert fold_seed(1, 2) != fold_seed(2, 1)
    assert fold_seed(1, 2, domain=1) != fold_seed(1, 2, domain=2)


def test_uniform_is_deterministic_and_in_range():
    u = uniform(5, (1000,))
    assert torch.equal(u, uniform(5, (1000,)))
    assert float(u.min()) >= -1.0 and float(u.max()) < 1.0
    assert abs(float(u.mean())) < 0.1
    assert not torch.equal(u, uniform(6, (1000,)))
