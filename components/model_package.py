"""The model-package contract: what a folder under models/ must export for train.py and the scripts.

docs/models.md explains each name and how to fork a model; a test keeps its table and MODEL_EXPORTS
in step."""

from __future__ import annotations

import importlib
from types import ModuleType

from components.config import ConfigError

MODEL_EXPORTS = (
    "ModelConfig", "ModelArgs", "Transformer", "flavors", "build_model_args",
    "parallelize", "tensor_parallel_plan",
    "HF_CONFIG_KEYS", "from_hf", "hf_config", "model_args_from_hf", "to_hf",
)


def import_model_package(name: str) -> ModuleType:
    """The package models/<name>, checked against the contract; a clear error names what is wrong."""
    try:
        package = importlib.import_module(f"models.{name}")
    except ModuleNotFoundError as e:
        if e.name not in (f"models.{name}", "models"):
            raise  # the package exists but imports something missing
        raise ConfigError(f"model.name '{name}': there is no package models/{name} (see docs/models.md)") from e
    missing = [export for export in MODEL_EXPORTS if export not in getattr(package, "__all__", ())]
    if missing:
        raise ConfigError(
            f"model.name '{name}': models/{name}/__init__.py does not export {', '.join(missing)} in __all__ "
            "(the contract in docs/models.md)"
        )
    return package
