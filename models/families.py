"""The model families: each folder under models/ with an __init__.py (forks included), imported by name and
checked against the model-package contract, what it must export for train.py and the scripts (docs/models.md
explains each name and how to fork a model; a test keeps its table and MODEL_EXPORTS in step). Code that takes
a family by name (train.py, the scripts, the config loader through `model_config_class`) finds it here; the
families import components/ and parallelisms/, never the other way round."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from components.config import ConfigError, Model
from components.hf.load import INGOT_MODEL, read_hf_config, read_hf_weights

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
        raise ConfigError(f"model.name '{name}': there is no package models/{name}; the families are "
                          f"{', '.join(model_package_names())} (docs/models.md)") from e
    missing = [export for export in MODEL_EXPORTS if export not in getattr(package, "__all__", ())]
    if missing:
        raise ConfigError(
            f"model.name '{name}': models/{name}/__init__.py does not export {', '.join(missing)} in __all__ "
            "(the contract in docs/models.md)"
        )
    return package


def model_config_class(name: str) -> type[Model]:
    """The [model] dataclass of the family models/<name> (its ModelConfig export): what load_config takes."""
    return import_model_package(name).ModelConfig


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


def model_name_of(folder: str | Path) -> str:
    """The ingot model package that reads the HF folder, by its config.json."""
    return model_package_for(read_hf_config(folder), folder)


def model_package_for(hf: dict, folder: str | Path) -> str:
    """The ingot model package for the config.json `hf` of `folder`: the family that exported it, else the one
    family that declares its model_type; none, or several, is a one-line error naming the file."""
    path = Path(folder) / "config.json"
    if hf.get(INGOT_MODEL) in model_package_names():
        return hf[INGOT_MODEL]
    model_type = hf.get("model_type")
    readers = families_reading(model_type)
    if not readers:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported (no family under models/ lists it in "
                         "its HF_MODEL_TYPES)")
    if len(readers) > 1:
        raise ValueError(f"{path}: model_type {model_type!r} is read by {' and '.join(readers)}: name the family "
                         "(model.name, or load_hf_model's model_name)")
    return readers[0]


def check_family_reads(name: str, hf: dict, folder: str | Path) -> None:
    """Refuse in one line, naming the file, an HF config that the family `name` does not read: no family reads
    its model_type, or others do (they are named)."""
    model_type = hf.get("model_type")
    readers = families_reading(model_type)
    if name not in readers:
        fix = f"set model.name to {' or '.join(readers)}" if readers else "no family under models/ lists it in its " \
            "HF_MODEL_TYPES"
        raise ConfigError(f"{Path(folder) / 'config.json'}: model_type {model_type!r} is not read by {name}: {fix}")


def load_hf_model(path: str | Path, model_name: str | None = None) -> nn.Module:
    """The ingot model of an HF folder (config.json and safetensors), in fp32 on CPU and in eval
    mode: called on token ids (batch, seq) it returns logits (batch, seq, vocab). `model_name`, the
    ingot model package, defaults to the one of config.json's model_type."""
    package = import_model_package(model_name or model_name_of(path))
    args = package.model_args_from_hf(read_hf_config(path))
    with torch.device("meta"):
        model = package.Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()  # fills the buffers (RoPE); every weight is then overwritten
    weights = package.from_hf(read_hf_weights(path), args)
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model.eval()
