"""meshnode.data: corpora, tokenisation, packing into cached windows, split and per-peer shards."""

from ..config import ModelConfig
from .corpora import CorpusError, fetch_linuxdoc, iter_documents, linuxdoc_root, list_documents
from .dataset import (
    BatchSource,
    PreparedCorpus,
    heldout_batches,
    heldout_score,
    is_heldout,
    pack_windows,
    prepare_corpus,
    shard_indices,
)
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def make_tokenizer(model_cfg: ModelConfig, hf_tokenizer=None) -> Tokenizer:
    """The tokenizer a run uses: byte-level, or the model's own (``hf_tokenizer`` from the loader)."""
    if model_cfg.tokenizer == "bytes":
        return ByteTokenizer()
    if hf_tokenizer is None:
        raise CorpusError(
            f"model {model_cfg.source!r} has no tokenizer of its own: set model.tokenizer = \"bytes\""
        )
    return HFTokenizer(hf_tokenizer, name=f"{model_cfg.source}:{len(hf_tokenizer)}")


__all__ = [
    "BatchSource", "ByteTokenizer", "CorpusError", "HFTokenizer", "PreparedCorpus", "Tokenizer", "fetch_linuxdoc",
    "heldout_batches", "heldout_score", "is_heldout", "iter_documents", "linuxdoc_root", "list_documents",
    "make_tokenizer", "pack_windows", "prepare_corpus", "shard_indices",
]
