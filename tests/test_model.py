"""Stage cutting reproduces the full model; GGUF and HF-directory loading; clear errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from meshnode.config import ModelConfig
from meshnode.model import (
    ModelLoadError,
    assemble_hf_model,
    average_state_dicts,
    balanced_boundaries,
    build_tiny,
    cut_model,
    layer_ranges,
    load_model,
)


def _tiny(layers=6):
    return build_tiny(ModelConfig(source="tiny", tiny_layers=layers, tiny_hidden=64, tiny_heads=4, tiny_kv_heads=2))


def test_balanced_boundaries():
    assert balanced_boundaries(30, 3) == [10, 20]
    assert balanced_boundaries(7, 3) == [3, 5]
    assert layer_ranges(6, 2, [1]) == [(0, 1), (1, 6)]
    with pytest.raises(ValueError):
        layer_ranges(6, 3, [3, 3])
    with pytest.raises(ValueError):
        balanced_boundaries(2, 3)


@pytest.mark.parametrize("stages,boundaries", [(1, []), (2, []), (3, []), (3, [1, 5]), (4, [1, 2, 3]), (6, [])])
def test_stages_compose_to_full_model(stages, boundaries):
    ref = _tiny().float()
    ids = torch.randint(0, 260, (3, 24))
    with torch.no_grad():
        full = ref(ids).logits
        cut = cut_model(copy.deepcopy(ref), stages, boundaries)
        h = ids
        for s in range(stages):
            h = cut[s](h)
    assert (h - full).abs().max().item() <= 1e-5
    assert cut[0].embed_tokens is not None and cut[stages - 1].lm_head is not None
    assert sum(len(m.layers) for m in cut.values()) == 6


def test_lm_head_is_untied_and_independent():
    cut = cut_model(_tiny(), 2)
    emb, head = cut[0].embed_tokens.weight, cut[1].lm_head.weight
    assert torch.equal(emb, head) and emb.data_ptr() != head.data_ptr()
    with torch.no_grad():
        head.add_(1.0)
    assert not torch.equal(emb, head)


def test_assemble_roundtrip_untied():
    ref = _tiny()
    cfg = copy.deepcopy(ref.config)
    cut = cut_model(copy.deepcopy(ref), 3)
    with torch.no_grad():
        cut[2].lm_head.weight.mul_(0.5)  # make the untie visible
    model = assemble_hf_model(cfg, [cut[0], cut[1], cut[2]])
    assert model.config.tie_word_embeddings is False
    ids = torch.randint(0, 260, (2, 10))
    with torch.no_grad():
        h = ids
        for s in range(3):
            h = cut[s](h)
        assert (model(ids).logits - h).abs().max() <= 1e-5


def test_unknown_source_and_architecture(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown source"):
        load_model(ModelConfig(source="nonsense"))
    (tmp_path / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    with pytest.raises(ModelLoadError, match="supports LlamaForCausalLM"):
        load_model(ModelConfig(source=f"hf:{tmp_path}"))
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(ModelConfig(source=f"gguf:{tmp_path / 'missing.gguf'}"))


def test_hf_directory_roundtrip(tmp_path):
    ref = _tiny(layers=2)
    ref.save_pretrained(tmp_path)
    model, tok = load_model(ModelConfig(source=f"hf:{tmp_path}"))
    ids = torch.randint(0, 260, (1, 8))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ref(ids).logits, atol=1e-6)
    assert tok is None


def _write_tiny_gguf(path, vocab=32, hidden=16, layers=2, heads=2, kv=1, ffn=32):
    """A tiny Llama GGUF written with the gguf package (F32 tensors, a toy BPE-free llama vocab)."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(vocab - 3)]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    head_dim = hidden // heads
    written = {}

    def t(name, shape):
        written[name] = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        w.add_tensor(name, written[name])

    t("token_embd.weight", (vocab, hidden))
    t("output.weight", (vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        t(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden))
        t(f"blk.{i}.attn_k.weight", (kv * head_dim, hidden))
        t(f"blk.{i}.attn_v.weight", (kv * head_dim, hidden))
        t(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim))
        t(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        t(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        t(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def test_gguf_loading_and_cut(tmp_path):
    path = tmp_path / "tiny.gguf"
    written = _write_tiny_gguf(path)
    model, tok = load_model(ModelConfig(source=f"gguf:{path}"))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 16
    assert not hasattr(model.config, "quantization_config")
    # the file's weights were loaded, not a random init
    np.testing.assert_array_equal(model.model.embed_tokens.weight.detach().numpy(), written["token_embd.weight"])
    np.testing.assert_array_equal(model.lm_head.weight.detach().numpy(), written["output.weight"])
    down = model.model.layers[1].mlp.down_proj.weight.detach().numpy()
    np.testing.assert_array_equal(down, written["blk.1.ffn_down.weight"])
    ids = torch.randint(0, 32, (2, 6))
    with torch.no_grad():
        full = model(ids).logits
        cut = cut_model(copy.deepcopy(model), 2)
        staged = cut[1](cut[0](ids))
    assert (full - staged).abs().max() <= 1e-5
    assert tok is not None


def test_average_state_dicts_is_the_exact_mean_and_refuses_what_does_not_average():
    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "n": torch.tensor([3])}
    b = {"w": torch.tensor([2.0, 4.0], dtype=torch.bfloat16), "n": torch.tensor([3])}
    c = {"w": torch.tensor([3.0, 0.0], dtype=torch.bfloat16), "n": torch.tensor([3])}
    avg = average_state_dicts([a, b, c])
    assert avg["w"].dtype == torch.bfloat16 and avg["w"].tolist() == [2.0, 2.0] and avg["n"].tolist() == [3]
    assert average_state_dicts([a])["w"].tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="shape"):
        average_state_dicts([a, {**b, "w": torch.zeros(3)}])
    with pytest.raises(ValueError, match="shape"):
        average_state_dicts([a, {"n": b["n"]}])
    with pytest.raises(ValueError, match="only some"):
        average_state_dicts([a, {**b, "x": torch.zeros(1)}])
    with pytest.raises(ValueError, match="non-finite"):
        average_state_dicts([a, {**b, "w": torch.tensor([float("nan"), 1.0])}])
    with pytest.raises(ValueError, match="non-float"):
        average_state_dicts([a, {**b, "n": torch.tensor([4])}])
    with pytest.raises(ValueError, match="nothing"):
        average_state_dicts([])
