"""Loading Hugging Face weights into ingot models: what a training run and a notebook import.

`load_hf_weights` fills a run's (sharded, possibly pipeline-split) model from an HF folder at start-up
(`--checkpoint.initial_load_path HFDIR`); `load_hf_model(HFDIR)` builds a whole ingot model from one.
The model-specific part (parameter names, config.json fields) comes from the model package: models/<name>/
exports to_hf, from_hf, hf_config, model_args_from_hf and HF_CONFIG_KEYS. The converter between DCP
checkpoints and HF folders is scripts/hf.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader

from components.checkpoint import ModelState
from components.config import ConfigError
from components.model_package import import_model_package


def read_hf_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}: not a Hugging Face model folder")
    return json.loads(path.read_text())


def read_hf_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every .safetensors file of an HF folder, as stored."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    return {name: tensor for file in files for name, tensor in load_file(file).items()}


def check_hf_config(package: ModuleType, args, hf: dict, source: str | Path) -> None:
    """Fail, naming the field and the ingot config key to change, unless the HF config describes the
    same model as `args`."""
    ours, theirs = package.hf_config(args), package.hf_config(package.model_args_from_hf(hf))
    for field, config_key in package.HF_CONFIG_KEYS.items():
        if ours[field] != theirs[field]:
            raise ConfigError(
                f"the Hugging Face model in {source} has {field} = {json.dumps(theirs[field])} but the ingot config "
                f"gives {json.dumps(ours[field])}: set {config_key} (or the flavor) to match"
            )


def load_hf_model(path: str | Path, model_name: str = "llama3") -> nn.Module:
    """The ingot model of an HF folder (config.json and safetensors), in fp32 on CPU and in eval
    mode: called on token ids (batch, seq) it returns logits (batch, seq, vocab)."""
    package = import_model_package(model_name)
    args = package.model_args_from_hf(read_hf_config(path))
    with torch.device("meta"):
        model = package.Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()  # fills the buffers (RoPE); every weight is then overwritten
    weights = package.from_hf(read_hf_weights(path), args)
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model.eval()


def load_hf_weights(path: Path, model_parts: list[nn.Module], package: ModuleType, args) -> None:
    """Load the weights of an HF folder into this rank's (sharded, possibly pipeline-split) model
    parts. The parts' state dict is renamed to HF names and DCP reads it through torch's
    HuggingFaceStorageReader, which reads from the safetensors files only the slices of this rank's
    shards: nothing is materialized whole."""
    check_hf_config(package, args, read_hf_config(path), path)
    state = ModelState(model_parts)
    hf_state = package.to_hf(state.state_dict(), args)  # only the keys this rank's parts hold
    dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(str(path)))
    state.load_state_dict(package.from_hf(hf_state, args))
