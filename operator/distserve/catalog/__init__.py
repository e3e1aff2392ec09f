"""The catalog: which models and accelerators the planner knows, and their shapes.

`get_model` and `get_accelerator` are the lookups everything else uses; both accept
the object itself too, so callers can pass either a name or an instance.
"""

from distserve.catalog.accelerators import (
    BUILTIN_ACCELERATORS,
    Accelerator,
    get_accelerator,
    known_accelerators,
)
from distserve.catalog.models import (
    BUILTIN_MODELS,
    ModelArch,
    get_model,
    known_models,
    model_from_hf_config,
)

__all__ = [
    "BUILTIN_ACCELERATORS",
    "BUILTIN_MODELS",
    "Accelerator",
    "ModelArch",
    "get_accelerator",
    "get_model",
    "known_accelerators",
    "known_models",
    "model_from_hf_config",
]
