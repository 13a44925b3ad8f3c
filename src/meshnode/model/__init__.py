"""meshnode.model: load a pretrained causal LM from local files and cut it into pipeline stages."""

from .loading import (
    SUPPORTED_ARCHITECTURES,
    ModelLoadError,
    build_tiny,
    cached_smollm2,
    check_architecture,
    default_cache_dir,
    load_model,
    smollm2_gguf_path,
    tiny_config,
)
from .stages import (
    StageModule,
    assemble_hf_model,
    average_state_dicts,
    balanced_boundaries,
    cut_model,
    layer_ranges,
    load_stage_state_dict,
    stage_costs,
    stage_state_dict,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES", "ModelLoadError", "StageModule", "assemble_hf_model", "average_state_dicts",
    "balanced_boundaries",
    "build_tiny", "cached_smollm2", "check_architecture", "cut_model", "default_cache_dir", "layer_ranges",
    "load_model", "load_stage_state_dict", "smollm2_gguf_path", "stage_costs", "stage_state_dict", "tiny_config",
]
