"""Model implementations, looked up by the HF architecture name in `config.json`."""

from __future__ import annotations

from distserve_engine.errors import UnsupportedArchitectureError
from distserve_engine.model_config import ModelConfig
from distserve_engine.models.base import CausalLM
from distserve_engine.models.llama import LlamaForCausalLM
from distserve_engine.models.opt import OPTForCausalLM
from distserve_engine.parallel import ParallelState

ARCHITECTURE_TO_MODEL: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
}


def build_model(config: ModelConfig, state: ParallelState) -> CausalLM:
    """Instantiate the model class for config.architecture (weights uninitialised)."""
    cls = ARCHITECTURE_TO_MODEL.get(config.architecture)
    if cls is None:
        raise UnsupportedArchitectureError(
            f"architecture {config.architecture!r} is not supported; supported: "
            + ", ".join(sorted(ARCHITECTURE_TO_MODEL))
        )
    return cls(config, state)
