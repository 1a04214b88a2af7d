"""The model-package contract: what a folder under models/ must export for train.py and the scripts.

docs/models.md explains each name and how to fork a model; a test keeps its table and MODEL_EXPORTS
in step."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from types import ModuleType

from components.errors import ConfigError

MODEL_EXPORTS = (
    "ModelConfig", "ModelArgs", "Transformer", "flavors", "build_model_args",
    "parallelize", "tensor_parallel_plan",
    "HF_MODEL_TYPES", "HF_CONFIG_KEYS", "from_hf", "hf_config", "model_args_from_hf", "to_hf",
)

logger = logging.getLogger(__name__)


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


def model_package_names() -> list[str]:
    """The model families on the `models` package's path: each folder with an __init__.py, forks included."""
    import models

    roots = [Path(root) for root in models.__path__ if Path(root).is_dir()]  # not an editable install's hook
    return sorted({folder.name for root in roots for folder in root.iterdir() if (folder / "__init__.py").is_file()})


def families_reading(model_type: str) -> list[str]:
    """The families whose HF_MODEL_TYPES name a Hugging Face model_type. A folder that does not import, or does
    not fulfil the contract, reads nothing (said in the log): one broken fork must not stop loading the others."""
    readers = []
    for name in model_package_names():
        try:
            package = import_model_package(name)
        except Exception as e:  # noqa: BLE001 -- any failure of another family's import
            logger.info(f"models/{name} is left out of the Hugging Face model types: {e}")
            continue
        if model_type in package.HF_MODEL_TYPES:
            readers.append(name)
    return readers
