"""Loading Hugging Face weights into ingot models: what a training run and a notebook import.

`load_hf_weights` fills a run's (sharded, possibly pipeline-split) model from an HF folder at start-up
(`--checkpoint.initial_load_path HFDIR`); models/families.py's `load_hf_model(HFDIR)` builds a whole ingot model
from one, of the family it finds for the folder. The model-specific part (parameter names, config.json fields)
comes from
the model package: models/<name>/ exports HF_MODEL_TYPES, to_hf, from_hf, hf_config, model_args_from_hf and
HF_CONFIG_KEYS; nothing here names a family. The converter between DCP checkpoints and HF
folders is scripts/hf.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor

from components.checkpoint.dcp import ModelState
from components.config import ConfigError

logger = logging.getLogger(__name__)

INGOT_MODEL = "ingot_model"
"""The config.json field in which ingot's export names the family that wrote the folder (transformers keeps such
a field as an attribute of the config and ignores it)."""


LANGUAGE_MODEL = "model.language_model."
"""Where transformers' multimodal models (Qwen3.5's published checkpoints among them) keep their text decoder:
`model.language_model.layers.N.` for a text model's `model.layers.N.`, beside the vision tower's `model.visual.` and
with `lm_head.` at the top. Such a folder reads as its text decoder: the config's `text_config`, these weights
renamed, the vision tower's left out (said in the log); an export writes the text decoder alone."""


def read_hf_config(folder: str | Path) -> dict:
    """An HF folder's config.json; a multimodal model's is its text decoder's (`text_config`), with the top level's
    tie_word_embeddings, which is what transformers ties by."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}: not a Hugging Face model folder")
    config = json.loads(path.read_text())
    if "text_config" not in config:
        return config
    text = config["text_config"]
    return text | {"tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}


def _stored_names(folder: str | Path) -> dict[str, str]:
    """{text decoder's name: the name in the folder's .safetensors files}, read from their headers: the identity for
    a text model; for a multimodal one (LANGUAGE_MODEL), its decoder's tensors only."""
    from safetensors import safe_open

    names = set()
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            names |= set(f.keys())
    if not names:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    if not any(name.startswith(LANGUAGE_MODEL) for name in names):
        return {name: name for name in names}
    kept = {"model." + name.removeprefix(LANGUAGE_MODEL) if name.startswith(LANGUAGE_MODEL) else name: name
            for name in names if name.startswith(LANGUAGE_MODEL) or not name.startswith("model.")}
    logger.info(f"{folder}: a multimodal model's text decoder ({len(kept)} tensors); its other "
                f"{len(names) - len(kept)} tensors (the vision tower's) are not read")
    return kept


def read_hf_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an HF folder's .safetensors files, as stored, under the names of its text decoder."""
    from safetensors import safe_open

    stored = {name: ours for ours, name in _stored_names(folder).items()}
    weights = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            weights |= {stored[name]: f.get_tensor(name) for name in f.keys() if name in stored}
    return weights


def check_hf_config(package: ModuleType, args, hf: dict, source: str | Path) -> None:
    """Fail, naming the field and the ingot config key to change, unless the HF config describes the
    same model as `args` (first of all, one of the same model_type)."""
    ours = package.hf_config(args)
    if hf.get("model_type") not in (ours["model_type"], *package.HF_MODEL_TYPES):
        raise ConfigError(
            f"the Hugging Face model in {source} has model_type = {json.dumps(hf['model_type'])} but the ingot "
            f"config gives {json.dumps(ours['model_type'])}: set model.name to the family that reads it (its "
            "HF_MODEL_TYPES, docs/models.md) and model.flavor to match"
        )
    theirs = package.hf_config(package.model_args_from_hf(hf))
    for field, config_key in package.HF_CONFIG_KEYS.items():
        if ours.get(field) != theirs.get(field):
            raise ConfigError(
                f"the Hugging Face model in {source} has {field} = {json.dumps(theirs.get(field))} but the ingot "
                f"config gives {json.dumps(ours.get(field))}: set {config_key} (or the flavor) to match"
            )


def load_hf_weights(path: Path, model_parts: list[nn.Module], package: ModuleType, args) -> None:
    """Load the weights of an HF folder into this rank's (sharded, possibly pipeline-split) model
    parts. The parts' state dict is renamed to HF names and DCP reads it through torch's
    HuggingFaceStorageReader, which reads from the safetensors files only the slices of this rank's
    shards: nothing is materialized whole. DCP loads in place and to_hf's tensors are the parameters
    or views of them (e.g. one expert of a stacked experts' tensor), so this fills the parameters."""
    check_hf_config(package, args, read_hf_config(path), path)
    hf_state = package.to_hf(ModelState(model_parts).state_dict(), args)  # only the keys this rank's parts hold
    stored = _stored_names(path)
    missing = sorted(set(hf_state) - set(stored))
    if missing:  # e.g. layers the config adds (multi-token prediction's) that the checkpoint does not have
        raise ConfigError(f"the Hugging Face model in {path} lacks {len(missing)} weight(s) of this model, first "
                          f"{missing[0]}: its config and the ingot config agree, but not its files")
    dcp.load({stored[name]: t for name, t in hf_state.items()}, storage_reader=HuggingFaceStorageReader(str(path)))
    write_back_joined(package, hf_state, ModelState(model_parts).state_dict(), args)


def write_back_joined(package: ModuleType, hf_state: dict, state: dict, args) -> None:
    """A Hugging Face tensor that joins several of the model's (Qwen3.5's q, k and v projections) is a copy that
    to_hf made, not a view: DCP filled the copy, and from_hf's parts of it are written into the parameters."""
    views = {_storage(t) for t in state.values()}
    joined = {name: t for name, t in hf_state.items() if _storage(t) not in views}
    with torch.no_grad():
        for name, part in package.from_hf(joined, args).items():
            if name in state and not name.endswith("expert_bias"):
                state[name].copy_(part)


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.untyped_storage().data_ptr()
