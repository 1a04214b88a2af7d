"""Export of a DCP checkpoint as a Hugging Face folder (config.json, safetensors, tokenizer): what
`python -m scripts.hf export` and, with checkpoint.last_save_in_hf, the end of a training run write.

The DCP checkpoint is read with dcp.load in this one process (DCP reassembles tensors saved under any
layout), one output file's worth of tensors at a time, so memory never holds more than one file.
torch's HuggingFaceStorageWriter is not used because it writes the index from a single dcp.save call,
which would need the whole model in memory at once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed.checkpoint as dcp

from components.checkpoint.dcp import one_process, saved_entries
from components.config import DTYPES, Config, ConfigError
from components.data.tokenizer import build_tokenizer
from components.hf.load import INGOT_MODEL
from components.model.attention import attention_layers

logger = logging.getLogger(__name__)



def model_and_args(config: Config, package: ModuleType):
    """The ModelArgs of the config for the family `package` (models/<config.model.name>) and its tokenizer."""
    tokenizer = build_tokenizer(config.model.tokenizer_path)
    return package.build_model_args(config, tokenizer.vocab_size), tokenizer


def checkpoint_shapes(checkpoint: Path, expected: dict[str, torch.Size]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """(shape, stored dtype) of every model weight of a DCP checkpoint, checked against the shapes
    the config's model expects."""
    if not (checkpoint / ".metadata").is_file():
        raise FileNotFoundError(f"no DCP checkpoint at {checkpoint} (its .metadata file is missing)")
    stored = saved_entries(checkpoint)
    found = {}
    for name, shape in expected.items():
        meta = stored.get(f"model.{name}")
        if meta is None:
            raise ConfigError(
                f"{checkpoint} has no weight model.{name}: is it a checkpoint of the model this config describes?"
            )
        if meta.size != shape:
            raise ConfigError(f"{checkpoint}: model.{name} has shape {list(meta.size)} but the config's model expects "
                              f"{list(shape)}: pass the config (and overrides) of the run that wrote it")
        found[name] = (meta.size, meta.properties.dtype)
    return found


def plan_files(names: list[str], nbytes: dict[str, int], max_bytes: int, joined: set[str] = frozenset()
               ) -> list[list[str]]:
    """Consecutive names in groups of at most max_bytes (a larger tensor gets a file of its own); a name in
    `joined` stays in the file of the name before it (to_hf joins them into one Hugging Face tensor)."""
    files, size = [[]], 0
    for name in names:
        if files[-1] and size + nbytes[name] > max_bytes and name not in joined:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes[name]
    return files


def copy_tokenizer(tokenizer_path: str | Path, output: Path) -> None:
    """Put the tokenizer in the HF folder if transformers can load it: a tokenizer.json as is, a
    sentencepiece model as tokenizer.model. A tiktoken file has no HF form to copy."""
    path = Path(tokenizer_path)
    if path.suffix == ".json":
        shutil.copyfile(path, output / "tokenizer.json")
        return
    import sentencepiece

    try:
        sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError):
        logger.info(f"{path} is not a tokenizer.json or a sentencepiece model (tiktoken?): no tokenizer written to "
                    f"{output}; copy the HF tokenizer files (tokenizer.json, tokenizer_config.json) there yourself")
        return
    shutil.copyfile(path, output / "tokenizer.model")


CHECK_LAYERS, CHECK_VOCAB, CHECK_MAX_PARAMETERS = 2, 512, 300_000_000
"""The copy of the model that check_hf_form runs: at most this many blocks and tokens, and run only when it has
at most this many parameters."""


def check_length(model: torch.nn.Module, max_seq_len: int) -> int:
    """The tokens the check runs: 16 (or the model's whole length if shorter), and past the widest sliding window
    an attention module declares (components/model/attention.py), which a shorter sequence would never reach: a form
    without the window would pass."""
    windows = [layer.attention_mask.window for _, layer in attention_layers(model) if layer.attention_mask.window]
    return max([min(16, max_seq_len), *(window + 1 for window in windows)])


def check_hf_form(package: ModuleType, args) -> bool:
    """Refuse a model whose Hugging Face form (the family's hf_config and to_hf) is not the same model, before
    anything is written. The form is derived from the model's arguments (hidden_act, model_type, ...) or refused
    by hf_config; this checks that the derivation holds for the code as it is, a fork's edits included: a copy of
    the model with at most CHECK_LAYERS blocks, a vocabulary of CHECK_VOCAB and random weights is written as an HF
    folder, transformers loads it, and both must give the same logits. Skipped, saying so, without transformers
    or where that copy would exceed CHECK_MAX_PARAMETERS (the published shapes are tested by the suite). Whether it
    ran."""
    name = package.__name__
    try:
        import transformers
    except ImportError:
        logger.warning(f"{name}: the Hugging Face form is not checked: transformers is not installed (pip install "
                       "-e '.[hf]' installs it)")
        return False
    config_json = package.hf_config(args)  # refuses what it cannot express
    small = replace(args, n_layers=min(args.n_layers, CHECK_LAYERS), vocab_size=min(args.vocab_size, CHECK_VOCAB))
    with torch.device("meta"):
        model = package.Transformer(small)
    seq = check_length(model, getattr(small, "max_seq_len", 16))
    if seq > getattr(small, "max_seq_len", seq):  # the RoPE table must cover it
        small = replace(small, max_seq_len=seq)
        with torch.device("meta"):
            model = package.Transformer(small)
    size = sum(p.numel() for p in model.parameters())
    if size > CHECK_MAX_PARAMETERS:
        logger.info(f"{name}: the Hugging Face form is not checked: a {small.n_layers}-block copy of the model has "
                    f"{size / 1e6:.0f}M parameters")
        return False
    generator = torch.Generator().manual_seed(0)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():
        for param in model.parameters():  # every weight distinct from its neighbours and norms away from 1
            param.mul_(1 + 0.2 * torch.randn(param.shape, generator=generator))
    tokens = torch.randint(small.vocab_size, (2, seq), generator=generator)
    with tempfile.TemporaryDirectory() as folder:
        save_safetensors(package.to_hf(model.state_dict(), small), Path(folder) / "model.safetensors")
        write_json(Path(folder) / "config.json", package.hf_config(small))
        verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        try:
            hf, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        finally:
            transformers.logging.set_verbosity(verbosity)
            if bars:
                transformers.logging.enable_progress_bar()
    where = f"models/{name.split('.')[-1]}/hf_mapping.py"
    unmatched = {kind: names for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
                 if (names := [n for n in info.get(kind, ()) if n != "lm_head.weight" or not small.tie_embeddings])}
    if unmatched:
        shown = "; ".join(f"{kind.replace('_', ' ')}: {', '.join(map(str, names[:4]))}"
                          for kind, names in unmatched.items())
        raise ConfigError(f"{name}: the Hugging Face form ({config_json['architectures'][0]}) does not hold this "
                          f"model's weights ({shown}): make to_hf and hf_config in {where} describe the model")
    with torch.no_grad():
        ours, theirs = model.eval()(tokens).float(), hf.eval()(tokens).logits.float()
    error = ((ours - theirs).abs().max() / ours.abs().max().clamp(min=1e-6)).item()
    if not error < 1e-4:
        raise ConfigError(
            f"{name}: its Hugging Face form ({config_json['architectures'][0]}, hidden_act "
            f"{config_json.get('hidden_act')!r}) computes another model: logits {error:.1e} apart (relative) on a "
            f"{small.n_layers}-block copy with random weights; make hf_config and to_hf in {where} describe what the "
            "model computes (a changed activation belongs in ModelArgs.hidden_act)")
    return True


def export(config: Config, package: ModuleType, checkpoint: Path, output: Path, dtype: str = "float32",
           max_shard_gb: float = 5.0) -> None:
    """Write the model weights of a DCP checkpoint as an HF folder (e.g. LlamaForCausalLM's), once the form
    is checked (check_hf_form); `package` is the config's family (models/<config.model.name>)."""
    args, tokenizer = model_and_args(config, package)
    checked = check_hf_form(package, args)
    output.mkdir(parents=True, exist_ok=True)
    files, total_bytes = write_weights(package, args, checkpoint, output, DTYPES[dtype], int(max_shard_gb * 2**30))
    ids = {"bos_id": none_if_negative(tokenizer.bos_id), "eos_id": none_if_negative(tokenizer.eos_id)}
    family = package.__name__.rpartition(".")[2]
    write_json(output / "config.json", package.hf_config(args, dtype=dtype, **ids) | {INGOT_MODEL: family})
    generation = {"bos_token_id": ids["bos_id"], "eos_token_id": ids["eos_id"]}
    write_json(output / "generation_config.json", {k: v for k, v in generation.items() if v is not None})
    copy_tokenizer(config.model.tokenizer_path, output)
    size = f"{total_bytes / 2**20:.1f} MiB in {dtype}"
    logger.info(f"exported {checkpoint} to {output}: {files} safetensors file(s), {size}; "
                + ("its form checked against transformers" if checked else "its form NOT checked (see above)"))


def write_weights(
    package: ModuleType, args, checkpoint: Path, output: Path, dtype: torch.dtype, max_bytes: int
) -> tuple[int, int]:
    """The weights of a DCP checkpoint as safetensors files of at most max_bytes each, with an
    index if there are several, read from the checkpoint a file's worth at a time; returns the
    number of files and of bytes. A file holds the HF tensors of whole ingot tensors (an MoE layer's
    experts tensor becomes one HF tensor per expert, all in the same file)."""
    with torch.device("meta"):
        expected = package.Transformer(args).state_dict()
    stored = checkpoint_shapes(checkpoint, {name: tensor.shape for name, tensor in expected.items()})
    warn_of_routing_biases(checkpoint, stored)
    # The ingot tensors that have HF names (not a tied output, nor ingot-only state), in the model's order.
    exported = [name for name, tensor in expected.items() if package.to_hf({name: tensor}, args)]
    nbytes = {name: sum(t.numel() for t in package.to_hf({name: expected[name]}, args).values()) * dtype.itemsize
              for name in exported}  # an ingot tensor may have several HF names
    hf_names = {name: set(package.to_hf({name: expected[name]}, args)) for name in exported}
    joined = {name for before, name in zip(exported, exported[1:]) if hf_names[name] & hf_names[before]}
    files = plan_files(exported, nbytes, max_bytes, joined)
    weight_map = {}
    for i, names in enumerate(files, start=1):
        file_name = "model.safetensors" if len(files) == 1 else f"model-{i:05d}-of-{len(files):05d}.safetensors"
        tensors = {name: torch.empty(stored[name][0], dtype=stored[name][1]) for name in names}
        with one_process():
            dcp.load({"model": tensors}, checkpoint_id=str(checkpoint), no_dist=True)
        hf_tensors = package.to_hf(tensors, args)
        save_safetensors({name: tensor.to(dtype) for name, tensor in hf_tensors.items()}, output / file_name)
        weight_map |= dict.fromkeys(hf_tensors, file_name)
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
        write_json(output / "model.safetensors.index.json", index)
    return len(files), sum(nbytes.values())


def warn_of_routing_biases(checkpoint: Path, stored: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
    """Mixture-of-experts layers trained with auxiliary-loss-free balancing (moe.bias_update_speed > 0)
    choose experts with a routing bias that Hugging Face's MoE models do not have: exported without
    it, the model routes some tokens elsewhere. Say so when the biases are not zero."""
    names = [name for name in stored if name.endswith(".expert_bias")]
    if not names:
        return
    biases = {name: torch.empty(stored[name][0], dtype=stored[name][1]) for name in names}
    with one_process():
        dcp.load({"model": biases}, checkpoint_id=str(checkpoint), no_dist=True)
    largest = max(bias.abs().max().item() for bias in biases.values())
    if largest > 0:
        logger.warning(f"{checkpoint}: the experts' routing biases (moe.bias_update_speed, up to {largest:.3g}) have "
                       "no Hugging Face counterpart and are left out, so the exported model routes some tokens "
                       "differently; train with moe.bias_update_speed = 0 for an exact export")


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    # A tensor under two names (a family's copies, e.g. of the embedding in DeepSeek-V3's multi-token prediction
    # layers) is written twice: safetensors refuses names that share memory.
    written, seen = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.contiguous()
        written[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    # transformers refuses files whose metadata does not say "pt".
    save_file(written, str(path), metadata={"format": "pt"})
    # safetensors writes through a private temporary file (mode 0600): give it a new file's usual mode.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def none_if_negative(token_id: int) -> int | None:
    return None if token_id < 0 else token_id
