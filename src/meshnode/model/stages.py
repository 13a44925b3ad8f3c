"""Cut a causal LM into pipeline stages, and put stages back together as a Hugging Face model.

A **stage** is a contiguous range of decoder layers. Stage 0 also owns the token embeddings, the
last stage owns the final norm and the lm_head. Each stage computes its own rotary embeddings from
position ids, so nothing but the hidden state ``(B, T, H)`` crosses a boundary.

Tied embeddings (SmolLM2 ties ``lm_head.weight`` to ``embed_tokens.weight``) are **untied** at cut
time: the last stage gets an independent copy of the embedding matrix as its lm_head. The two stop
being equal as soon as training updates either, which is why exported models are written with
``tie_word_embeddings = false``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)


def balanced_boundaries(num_layers: int, stages: int) -> list[int]:
    """First-layer index of stages 1..Y-1 so that layer counts differ by at most one."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    bounds, start = [], 0
    for s in range(stages - 1):
        start += base + (1 if s < extra else 0)
        bounds.append(start)
    return bounds


def layer_ranges(num_layers: int, stages: int, boundaries: Sequence[int] = ()) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` per stage, from explicit ``boundaries`` or balanced."""
    bounds = list(boundaries) or balanced_boundaries(num_layers, stages)
    if len(bounds) != stages - 1:
        raise ValueError(f"{len(bounds)} boundaries for {stages} stages")
    edges = [0, *bounds, num_layers]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"boundaries {bounds} do not cut {num_layers} layers into non-empty stages")
    return list(zip(edges, edges[1:]))


def stage_costs(config, stages: int, boundaries: Sequence[int] = (), seq_len: int = 0) -> list[float]:
    """Forward + backward FLOPs per token of each stage of a Llama-style ``config``: 6 x the multiply-adds of its
    linear layers (q, k, v, o, gate, up, down; the last stage's lm_head, V x H), plus causal attention's
    ``seq_len x heads x head_dim`` multiply-adds per layer (scores and weighted sum, over T / 2 positions on
    average). The embedding lookup is free. Rebalancing uses the ratios to carry a peer's measured speed from
    the stage it serves to another one (SmolLM2-135M in 3 stages: the last costs 1.8x the middle one)."""
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    per_layer = (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
                 + 3 * hidden * int(config.intermediate_size) + int(seq_len) * heads * head_dim)
    ranges = layer_ranges(int(config.num_hidden_layers), stages, boundaries)
    costs = [6.0 * (stop - start) * per_layer for start, stop in ranges]
    costs[-1] += 6.0 * int(config.vocab_size) * hidden
    return costs


class StageModule(nn.Module):
    """One pipeline stage of a decoder-only LM.

    Input: token ids ``(B, T)`` on stage 0, the hidden state ``(B, T, H)`` elsewhere.
    Output: logits ``(B, T, V)`` on the last stage, the hidden state ``(B, T, H)`` elsewhere.
    """

    def __init__(
        self,
        *,
        index: int,
        num_stages: int,
        layer_range: tuple[int, int],
        layers: Sequence[nn.Module],
        rotary_emb: nn.Module,
        embed_tokens: nn.Module | None = None,
        norm: nn.Module | None = None,
        lm_head: nn.Module | None = None,
        next_input_gain: Tensor | None = None,
    ):
        super().__init__()
        self.index, self.num_stages, self.layer_range = index, num_stages, tuple(layer_range)
        # A copy of the next stage's first input RMSNorm gains, as loaded (not trained here, not saved): the
        # boundary codec may weight its error by them (``mask.rotq_weight``).
        self.next_input_gain: Tensor | None
        self.register_buffer("next_input_gain", None if next_input_gain is None else
                             next_input_gain.detach().float().clone(), persistent=False)
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.rotary_emb = rotary_emb
        self.norm = norm
        self.lm_head = lm_head

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, x: Tensor, position_ids: Tensor | None = None) -> Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x  # (B, T, H)
        batch, seq = h.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(seq, device=h.device).unsqueeze(0).expand(batch, seq)
        position_embeddings = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            out = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
            h = out[0] if isinstance(out, tuple) else out
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)  # (B, T, V)
        return h


def cut_model(
    model: nn.Module, stages: int, boundaries: Sequence[int] = (), keep: Sequence[int] | None = None
) -> dict[int, StageModule]:
    """Cut a ``*ForCausalLM`` into ``stages`` :class:`StageModule` s.

    The modules are moved, not copied, out of ``model`` (which must not be used afterwards).
    ``keep`` selects which stage indices to build (default all): a swarm peer keeps only its own.
    Returns ``{stage_index: StageModule}``.
    """
    core = model.model
    num_layers = len(core.layers)
    ranges = layer_ranges(num_layers, stages, boundaries)
    keep = range(stages) if keep is None else keep
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out: dict[int, StageModule] = {}
    for s in keep:
        start, stop = ranges[s]
        last = s == stages - 1
        lm_head = None
        if last:
            lm_head = model.lm_head
            if tied or lm_head.weight is core.embed_tokens.weight:
                lm_head = nn.Linear(lm_head.in_features, lm_head.out_features, bias=lm_head.bias is not None)
                lm_head.to(dtype=model.lm_head.weight.dtype, device=model.lm_head.weight.device)
                with torch.no_grad():
                    lm_head.weight.copy_(core.embed_tokens.weight)
        out[s] = StageModule(
            index=s,
            num_stages=stages,
            layer_range=(start, stop),
            layers=[core.layers[i] for i in range(start, stop)],
            rotary_emb=copy.deepcopy(core.rotary_emb),
            embed_tokens=core.embed_tokens if s == 0 else None,
            norm=core.norm if last else None,
            lm_head=lm_head,
            next_input_gain=None if last else _input_norm_gain(core.layers[stop]),
        )
    return out


def _input_norm_gain(layer: nn.Module) -> Tensor | None:
    norm = getattr(layer, "input_layernorm", None)
    weight = getattr(norm, "weight", None)
    return weight if isinstance(weight, Tensor) else None


def stage_state_dict(stage: StageModule) -> dict[str, Tensor]:
    """The stage's weights under the *full model's* Hugging Face names (``model.layers.12.mlp...``)."""
    out: dict[str, Tensor] = {}
    start = stage.layer_range[0]
    for name, tensor in stage.state_dict().items():
        if name.startswith("rotary_emb."):
            continue
        if name.startswith("layers."):
            idx, rest = name[len("layers."):].split(".", 1)
            out[f"model.layers.{start + int(idx)}.{rest}"] = tensor
        elif name.startswith(("embed_tokens.", "norm.")):
            out[f"model.{name}"] = tensor
        else:
            out[name] = tensor  # lm_head.weight
    return out


def load_stage_state_dict(stage: StageModule, hf_state: dict[str, Tensor]) -> None:
    """Inverse of :func:`stage_state_dict`: load full-model-named weights into one stage (strict)."""
    start = stage.layer_range[0]
    local: dict[str, Tensor] = {}
    for name in stage.state_dict():
        if name.startswith("rotary_emb."):
            continue
        if name.startswith("layers."):
            idx, rest = name[len("layers."):].split(".", 1)
            key = f"model.layers.{start + int(idx)}.{rest}"
        elif name.startswith(("embed_tokens.", "norm.")):
            key = f"model.{name}"
        else:
            key = name
        if key not in hf_state:
            raise KeyError(f"missing weight {key} for stage {stage.index}")
        local[name] = hf_state[key]
    missing, unexpected = stage.load_state_dict(local, strict=False)
    missing = [m for m in missing if not m.startswith("rotary_emb.")]
    if missing or unexpected:
        raise KeyError(f"stage {stage.index}: missing {missing}, unexpected {unexpected}")


def assemble_hf_model(config, stages: Sequence[StageModule]) -> nn.Module:
    """Build a plain ``*ForCausalLM`` (untied embeddings) holding the weights of all ``stages``."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.tie_word_embeddings = False
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    state: dict[str, Tensor] = {}
    for stage in stages:
        state.update(stage_state_dict(stage))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise KeyError(f"assembling the model: missing {missing}, unexpected {unexpected}")
    return model


def average_state_dicts(states: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The exact average of several replicas' state dicts (float tensors averaged in float32, then cast back to
    the first's dtype). ValueError for a mismatch (other names or shapes), a non-finite value, or non-float
    tensors (buffers) that differ between replicas."""
    if not states:
        raise ValueError("nothing to average")
    ref = states[0]
    out = {}
    for name, t in ref.items():
        ts = [sd.get(name) for sd in states]
        if any(x is None or x.shape != t.shape for x in ts):
            raise ValueError(f"{name}: not every replica has it with shape {tuple(t.shape)}")
        if not t.is_floating_point():
            if any(not torch.equal(x, t) for x in ts):
                raise ValueError(f"{name}: a non-float tensor that differs between replicas")
            out[name] = t.clone()
            continue
        acc = torch.zeros(t.shape, dtype=torch.float32)
        for x in ts:
            acc += x.to(torch.float32)
        acc /= len(ts)
        if not bool(torch.isfinite(acc).all()):
            raise ValueError(f"{name}: non-finite values")
        out[name] = acc.to(t.dtype)
    extra = {n for sd in states for n in sd} - ref.keys()
    if extra:
        raise ValueError(f"tensors only some replicas have: {sorted(extra)[:3]}")
    return out
