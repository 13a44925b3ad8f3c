"""Split, packing, shards and batches: deterministic, disjoint, covering."""

from __future__ import annotations

import numpy as np
import pytest

from meshnode.config import DataConfig
from meshnode.data import (
    BatchSource,
    ByteTokenizer,
    CorpusError,
    is_heldout,
    iter_documents,
    pack_windows,
    prepare_corpus,
    shard_indices,
)


def test_split_by_name_is_deterministic_and_near_fraction():
    names = [f"doc/{i}.py" for i in range(20000)]
    held = [n for n in names if is_heldout(n, 0.05)]
    assert held == [n for n in names if is_heldout(n, 0.05)]
    assert 0.045 < len(held) / len(names) < 0.055  # binomial sd is 0.0015: 3.3 sd either side
    assert not set(held) & {n for n in names if not is_heldout(n, 0.05)}
    # the split of a document does not depend on which other documents exist
    assert is_heldout(held[0], 0.05) and all(is_heldout(n, 0.05) for n in held[:50])


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_shards_disjoint_and_covering(n):
    parts = [shard_indices(101, i, n) for i in range(n)]
    allidx = np.concatenate(parts)
    assert sorted(allidx.tolist()) == list(range(101))
    assert len(set(allidx.tolist())) == 101
    with pytest.raises(ValueError):
        shard_indices(10, n, n)


def test_pack_windows():
    w = pack_windows([[1, 2, 3], [4, 5]], eos_id=9, seq_len=3)
    assert w.tolist() == [[1, 2, 3], [9, 4, 5]]  # trailing eos dropped with the tail


def test_prepare_corpus_split_and_cache(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(60):
        (docs / f"f{i:03d}.txt").write_text(f"document {i} " * 40)
    cfg = DataConfig(source=f"dir:{docs}", seq_len=32, heldout_fraction=0.2)
    a = prepare_corpus(cfg, ByteTokenizer(), tmp_path / "cache")
    b = prepare_corpus(cfg, ByteTokenizer(), tmp_path / "cache")
    assert a.directory == b.directory and np.array_equal(a.train, b.train)
    names = [n for n, _ in iter_documents(cfg.source)]
    held = [n for n in names if is_heldout(n, 0.2)]
    assert a.meta["splits"]["heldout"]["documents"] == len(held) > 0
    assert a.meta["splits"]["train"]["documents"] == len(names) - len(held)
    # held-out text never appears in train windows: every held-out doc mentions its own number
    held_numbers = {int(n[1:4]) for n in held}
    train_text = ByteTokenizer().decode(np.asarray(a.train).reshape(-1).tolist())
    for k in held_numbers:
        assert f"document {k} " not in train_text
    assert a.train.dtype == np.uint16 and a.train.shape[1] == 32


def test_batches_deterministic_disjoint_shards(tmp_path):
    windows = np.arange(40 * 4).reshape(40, 4)
    s0 = BatchSource(windows, 3, shard=0, num_shards=2, seed=5)
    s1 = BatchSource(windows, 3, shard=1, num_shards=2, seed=5)
    again = BatchSource(windows, 3, shard=0, num_shards=2, seed=5)
    rows0 = {tuple(r) for p in range(6) for r in s0.batch(p).tolist()}
    rows1 = {tuple(r) for p in range(6) for r in s1.batch(p).tolist()}
    assert not rows0 & rows1
    assert len(rows0) == 18  # 6 batches x 3 rows, no repeat inside the first epoch of 20
    assert all(np.array_equal(s0.batch(p), again.batch(p)) for p in (0, 5, 9, 3))  # any order, same tokens


def test_a_batch_larger_than_its_shard_is_refused():
    windows = np.arange(40 * 4).reshape(40, 4)
    assert BatchSource(windows, 20, shard=1, num_shards=2).batch(0).shape == (20, 4)  # the whole shard: fine
    for size in (21, 0):
        with pytest.raises(CorpusError, match=f"a batch of {size} sequences, but shard 1 of 2 holds 20 windows"):
            BatchSource(windows, size, shard=1, num_shards=2)


def test_missing_corpora_have_clear_errors(tmp_path):
    with pytest.raises(CorpusError, match="fetch-linuxdoc"):
        list(iter_documents("linuxdoc", path=str(tmp_path / "nothing")))
    with pytest.raises(CorpusError, match="not found"):
        list(iter_documents(f"dir:{tmp_path / 'nope'}"))
    with pytest.raises(CorpusError, match="unknown source"):
        list(iter_documents("wikipedia"))


def test_cpython_corpus_is_on_disk():
    docs = list(iter_documents("cpython", max_docs=5))
    assert len(docs) == 5 and all(text for _, text in docs)
    assert docs == sorted(docs)
