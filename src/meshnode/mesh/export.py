"""Turn a ``meshnode train`` checkpoint into a plain Hugging Face model directory.

The lm_head was untied from the embeddings when the model was cut, and training moved the two
apart, so the exported config says ``tie_word_embeddings = false``. Replica 0's weights are written
(after a DP sync all replicas hold the same start weights; between syncs they differ, and with
``dp.keep_residual`` each also keeps what its rounds did not send), or with ``average`` the replicas' exact
mean (what one closing uncompressed all-reduce would leave them with).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import brief
from ..model import assemble_hf_model, average_state_dicts, cut_model
from .trainer import CheckpointError, checkpoint_to_load, read_checkpoint_meta, read_stage_weights

logger = logging.getLogger(__name__)


def export_checkpoint(checkpoint: Path, out: Path, replica: int = 0, average: bool = False) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint, out = Path(checkpoint), Path(out)
    checkpoint = checkpoint_to_load(checkpoint)
    meta = read_checkpoint_meta(checkpoint)
    try:
        config = AutoConfig.from_pretrained(str(checkpoint / "hf_config.json"), local_files_only=True)
        stages_n = int(meta["stages"])
        boundaries = meta["config"]["model"]["boundaries"]
        if not 0 <= replica < int(meta["replicas"]):
            raise ValueError(f"replica {replica}, but the checkpoint holds {meta['replicas']}")
        skeleton = AutoModelForCausalLM.from_config(config)
        stages = cut_model(skeleton, stages_n, boundaries)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {checkpoint}: not a model this checkpoint describes ({brief(exc)})"
                              ) from None
    for module in stages.values():
        if average:
            replicas = [read_stage_weights(checkpoint, r, module) for r in range(int(meta["replicas"]))]
            try:
                weights = average_state_dicts(replicas)
            except ValueError as exc:
                raise CheckpointError(f"checkpoint {checkpoint}: its replicas do not average ({exc})") from None
        else:
            weights = read_stage_weights(checkpoint, replica, module)
        module.load_state_dict(weights)
    model = assemble_hf_model(config, [stages[s] for s in range(stages_n)])
    model.to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    tok_dir = checkpoint / "tokenizer"
    if tok_dir.is_dir():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True).save_pretrained(str(out))
    else:
        logger.warning("the checkpoint has no tokenizer (byte-level run): %s holds the model only", out)
    return out
