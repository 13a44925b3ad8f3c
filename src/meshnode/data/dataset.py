"""Tokenise a corpus, pack it into fixed-length windows, cache them as numpy memmaps, and serve batches.

- **Split**: a document is held out when a hash of its *name* falls below ``heldout_fraction``
  (5% by default): deterministic, independent of order and of the random seed.
- **Packing**: each split's documents are tokenised in name order, each followed by the eos token,
  concatenated, and cut into windows of ``seq_len`` tokens (the tail is dropped).
- **Cache**: ``{cache}/data/{key}/{train,heldout}.npy`` (uint16 or uint32), where the key hashes the
  corpus, its slice, the tokenizer and ``seq_len``. ``meshnode data prepare`` builds it with a progress
  bar; training builds it on first use.
- **Sharding**: peer ``i`` of ``n`` owns windows ``i, i+n, i+2n, ...`` (disjoint, covering). Within a
  shard, each epoch visits the windows in a permutation drawn from a PCG64 generator seeded by
  (seed, epoch): deterministic on every platform. A batch is addressed by its *position* (how many
  batches this shard has served), so the data position saved in a checkpoint resumes exactly.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import DataConfig
from .corpora import CorpusError, iter_documents, list_documents
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1


def heldout_score(name: str) -> float:
    """A number in [0, 1) fixed by the document name alone."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_heldout(name: str, fraction: float) -> bool:
    return heldout_score(name) < fraction


def shard_indices(num_windows: int, shard: int, num_shards: int) -> np.ndarray:
    """Window indices owned by peer ``shard`` of ``num_shards``: disjoint, and together all of them."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    return np.arange(shard, num_windows, num_shards, dtype=np.int64)


def pack_windows(token_streams: Iterable[list[int]], eos_id: int, seq_len: int) -> np.ndarray:
    """Concatenate documents (each followed by eos) and cut into ``(N, seq_len)`` windows."""
    flat: list[int] = []
    for ids in token_streams:
        flat.extend(ids)
        flat.append(eos_id)
    n = len(flat) // seq_len
    return np.asarray(flat[: n * seq_len], dtype=np.int64).reshape(n, seq_len)


@dataclass(frozen=True)
class PreparedCorpus:
    """The cached windows of one corpus: ``train`` and ``heldout`` are ``(N, T)`` memmaps."""

    directory: Path
    train: np.ndarray
    heldout: np.ndarray
    meta: dict


def cache_key(cfg: DataConfig, tokenizer_name: str) -> str:
    blob = json.dumps(
        {
            "format": CACHE_FORMAT, "source": cfg.source, "path": cfg.path, "max_docs": cfg.max_docs,
            "seq_len": cfg.seq_len, "heldout": cfg.heldout_fraction, "tokenizer": tokenizer_name,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prepare_corpus(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    cache_dir: Path,
    progress: Callable[[int, int], None] | None = None,
) -> PreparedCorpus:
    """Tokenise, split, pack and cache (or open the cache). ``progress(done, total)`` is called per document."""
    directory = cache_dir / "data" / cache_key(cfg, tokenizer.name)
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        _build(cfg, tokenizer, cache_dir, directory, progress)
    meta = json.loads(meta_path.read_text())
    train = np.load(directory / "train.npy", mmap_mode="r")
    heldout = np.load(directory / "heldout.npy", mmap_mode="r")
    return PreparedCorpus(directory, train, heldout, meta)


def _build(cfg: DataConfig, tokenizer: Tokenizer, cache_dir: Path, directory: Path, progress) -> None:
    total = len(list_documents(cfg.source, cfg.path, cache_dir, cfg.max_docs))
    streams: dict[str, list[list[int]]] = {"train": [], "heldout": []}
    names: dict[str, int] = {"train": 0, "heldout": 0}
    for i, (name, text) in enumerate(iter_documents(cfg.source, cfg.path, cache_dir, cfg.max_docs)):
        split = "heldout" if is_heldout(name, cfg.heldout_fraction) else "train"
        streams[split].append(tokenizer.encode(text))
        names[split] += 1
        if progress is not None:
            progress(i + 1, total)
    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32
    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, docs in streams.items():
        windows = pack_windows(docs, tokenizer.eos_id, cfg.seq_len)
        if len(windows) == 0:
            raise CorpusError(
                f"corpus {cfg.source!r} gives no {split} window of {cfg.seq_len} tokens "
                f"({names[split]} documents): use more documents (data.max_docs) or a shorter data.seq_len"
            )
        out = np.lib.format.open_memmap(tmp / f"{split}.npy", mode="w+", dtype=dtype, shape=windows.shape)
        out[:] = windows
        out.flush()
        del out
        counts[split] = {"documents": names[split], "windows": int(len(windows)), "tokens": int(windows.size)}
    meta = {"source": cfg.source, "tokenizer": tokenizer.name, "seq_len": cfg.seq_len, "splits": counts}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if directory.exists():  # someone else built it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return
    tmp.replace(directory)
    logger.info("prepared %s: %s", directory, counts)


class BatchSource:
    """Deterministic batches of one shard of a window array, addressed by position.

    ``batch(position)`` returns token ids ``(B, T)`` as int64; it does not depend on what was drawn
    before, so a resumed run asks for the same positions and gets the same tokens.
    """

    def __init__(self, windows: np.ndarray, batch_size: int, shard: int = 0, num_shards: int = 1, seed: int = 0):
        self.windows = windows
        self.batch_size = batch_size
        self.indices = shard_indices(len(windows), shard, num_shards)
        if len(self.indices) == 0:
            raise CorpusError(f"shard {shard} of {num_shards} holds no window ({len(windows)} windows in all)")
        if not 0 < batch_size <= len(self.indices):
            raise CorpusError(f"a batch of {batch_size} sequences, but shard {shard} of {num_shards} holds "
                              f"{len(self.indices)} windows: use a smaller batch or more documents (data.max_docs)")
        self.seed = seed
        self._perm_cache: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm_cache = {epoch: self.indices[rng.permutation(len(self.indices))]}
        return self._perm_cache[epoch]

    def batch(self, position: int) -> torch.Tensor:
        n = len(self.indices)
        rows = []
        for j in range(self.batch_size):
            k = position * self.batch_size + j
            rows.append(self._order(k // n)[k % n])
        return torch.from_numpy(np.asarray(self.windows[np.asarray(rows)], dtype=np.int64))  # (B, T)

    def __len__(self) -> int:
        return len(self.indices)


def heldout_batches(windows: np.ndarray, batch_size: int, num_batches: int) -> list[torch.Tensor]:
    """The first ``num_batches`` batches of the held-out windows, in order (the fixed eval set)."""
    out = []
    for b in range(num_batches):
        rows = windows[b * batch_size : (b + 1) * batch_size]
        if len(rows) == 0:
            break
        out.append(torch.from_numpy(np.asarray(rows, dtype=np.int64)))
    if not out:
        raise CorpusError("the held-out split has no window")
    return out
