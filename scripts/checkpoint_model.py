"""The whole model of a trained checkpoint in one process, for the offline tools that run it
(scripts/generate.py, scripts/eval.py).

A DCP checkpoint (<dump>/<checkpoint.folder>/step-N) is read with the config.toml that its run wrote
to <dump>; DCP reassembles the tensors of any layout that saved it (FSDP, TP, PP, EP). A Hugging Face
folder (config.json, *.safetensors) describes its own model. Each process loads the whole model without
talking to the others, so this works alone and on every rank of a torchrun job alike. A DCP checkpoint
is first checked as a resume checks it: intact (file sizes, and CRC32s unless checkpoint.checksums is
false) and holding exactly the weights of the config's model.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from components.checkpoint.dcp import is_hf_folder, mismatch, one_process, saved_entries
from components.checkpoint.integrity import check_checkpoint
from components.config import Config, ConfigError, load_config
from components.data.tokenizer import Tokenizer, build_tokenizer
from components.hf.load import check_hf_config, read_hf_config
from models.families import check_family_reads, import_model_package, load_hf_model, model_config_class, model_name_of

logger = logging.getLogger(__name__)

RUN_CONFIG = "config.toml"
"""What train.py writes into its dump folder: the resolved config of the run."""


def model_from_checkpoint(checkpoint: Path, overrides: list[str] | None = None, device: torch.device | str = "cpu"
                          ) -> tuple[nn.Module, Config, Tokenizer]:
    """The whole model of a checkpoint in this one process, in fp32 and eval mode, with its run's config and tokenizer.

    `checkpoint`: a DCP step-N folder or a Hugging Face folder. `overrides`: `--section.key value`
    arguments as for train.py; a `--job.config_file` among them replaces the run's config.toml. Called
    on token ids (batch, seq) the model returns logits (batch, seq, vocab); the config's
    training.seq_len is the longest sequence it takes."""
    checkpoint, overrides = Path(checkpoint), list(overrides or [])
    start = time.perf_counter()
    if (checkpoint / ".metadata").is_file():
        model, config, tokenizer = _from_dcp(checkpoint, overrides, torch.device(device))
    elif is_hf_folder(checkpoint):
        model, config, tokenizer = _from_hf(checkpoint, overrides)
        model.to(device)
    else:
        raise FileNotFoundError(f"no DCP checkpoint (.metadata) or Hugging Face model (config.json, *.safetensors) "
                                f"at {checkpoint}")
    parameters = sum(p.numel() for p in model.parameters()) / 1e6
    logger.info(f"loaded {checkpoint} ({config.model.name}, {parameters:.2f}M parameters) in "
                f"{time.perf_counter() - start:.1f}s")
    return model.eval(), config, tokenizer


def run_config(checkpoint: Path, overrides: list[str]) -> Config:
    """The config of the run that wrote a DCP checkpoint: <dump>/config.toml with the overrides, or
    the overrides alone when they name a --job.config_file."""
    path = checkpoint.parent.parent / RUN_CONFIG
    config_file = ["--job.config_file", str(path)] if path.is_file() else []
    config = load_config([*config_file, *overrides], model_config_class)
    if not config.job.config_file:
        raise ConfigError(f"no {RUN_CONFIG} at {path} to say which model {checkpoint} holds: pass the config "
                          "of the run that wrote it with --job.config_file")
    return config


def _from_dcp(checkpoint: Path, overrides: list[str], device: torch.device) -> tuple[nn.Module, Config, Tokenizer]:
    config = run_config(checkpoint, overrides)
    problem = check_checkpoint(checkpoint, config.checkpoint.checksums)
    if problem:
        raise ValueError(f"checkpoint {checkpoint} is damaged: {problem}")
    tokenizer = build_tokenizer(config.model.tokenizer_path)
    package = import_model_package(config.model.name)
    with torch.device("meta"):
        model = package.Transformer(package.build_model_args(config, tokenizer.vocab_size))
    model.to_empty(device=device)
    model.init_weights()  # fills the buffers (RoPE); every weight is then overwritten
    # A plain module's state dict has the names train.py saves (components.checkpoint.dcp.ModelState) and
    # holds the parameters themselves, which DCP fills in place, casting from the stored dtype.
    weights = model.state_dict()
    problem = mismatch(saved_entries(checkpoint), weights, set(weights))
    if problem:
        raise ConfigError(f"checkpoint {checkpoint} does not fit the model of {config.job.config_file}: {problem}; "
                          "pass the config (and overrides) of the run that wrote it")
    with one_process():
        dcp.load({"model": weights}, checkpoint_id=str(checkpoint), no_dist=True)
    return model, config, tokenizer


def _from_hf(folder: Path, overrides: list[str]) -> tuple[nn.Module, Config, Tokenizer]:
    """An HF folder's model. Without a --job.config_file the config is the defaults with the folder's
    model family and, unless --model.tokenizer_path names one, its tokenizer; with one, the config
    must describe the folder's model."""
    config = load_config(overrides, model_config_class)
    hf = read_hf_config(folder)
    if not config.job.config_file:
        config.model.name = model_name_of(folder)
        if not names_key(overrides, "model.tokenizer_path"):
            config.model.tokenizer_path = str(hf_tokenizer(folder))
    tokenizer = build_tokenizer(config.model.tokenizer_path)
    package = import_model_package(config.model.name)
    if config.job.config_file:
        check_family_reads(config.model.name, hf, folder)
        check_hf_config(package, package.build_model_args(config, tokenizer.vocab_size), hf, folder)
    config.training.seq_len = min(config.training.seq_len, package.model_args_from_hf(hf).max_seq_len)
    return load_hf_model(folder, config.model.name), config, tokenizer


def names_key(overrides: list[str], key: str) -> bool:
    """Whether command-line overrides set `key` ("section.key", spelled with - or _)."""
    return any(arg.startswith("--") and arg[2:].partition("=")[0].replace("-", "_") == key for arg in overrides)


def hf_tokenizer(folder: Path) -> Path:
    """The tokenizer an HF folder holds: tokenizer.model (what scripts/hf.py exports from a
    sentencepiece model) or tokenizer.json."""
    for name in ("tokenizer.model", "tokenizer.json"):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"no tokenizer.model or tokenizer.json in {folder}: pass --model.tokenizer_path")
