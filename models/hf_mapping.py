"""What every family's hf_mapping.py does alike, written once: renaming parameters between ingot's names and Hugging
Face's by two tables (the ends', and a block's), and taking an imported config as the published flavor it is. A
family keeps its tables, its config fields and whatever its names need beyond them (DeepSeek-V3's multi-token
prediction layers, gpt-oss's quantized experts); a fork that names its blocks otherwise says so in `blocks`."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import torch


class HFNames:
    """ingot <-> Hugging Face names of a decoder's parameters: `top_level` {ingot: HF} for the ends, `in_block`
    {ingot name within a block: HF name within a layer} for the blocks, `<blocks>.N.` in ingot and `model.layers.N.`
    in Hugging Face. `family` names the model in errors."""

    def __init__(self, family: str, top_level: dict[str, str], in_block: dict[str, str], blocks: str = "layers"):
        self.family, self.top_level, self.in_block, self.blocks = family, top_level, in_block, blocks
        self.from_hf_top_level = {hf: ours for ours, hf in top_level.items()}
        self.from_hf_in_block = {hf: ours for ours, hf in in_block.items()}

    def hf_name(self, name: str) -> str:
        """The HF name of an ingot parameter, e.g. layers.3.feed_forward.w1.weight ->
        model.layers.3.mlp.gate_proj.weight."""
        if name in self.top_level:
            return self.top_level[name]
        match = re.fullmatch(rf"{re.escape(self.blocks)}\.(\d+)\.(.+)", name)
        if match and match[2] in self.in_block:
            return f"model.layers.{match[1]}.{self.in_block[match[2]]}"
        raise KeyError(f"{name} has no Hugging Face {self.family} name")

    def ingot_name(self, name: str) -> str:
        """The ingot name of an HF parameter (the inverse of hf_name)."""
        if name in self.from_hf_top_level:
            return self.from_hf_top_level[name]
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if match and match[2] in self.from_hf_in_block:
            return f"{self.blocks}.{match[1]}.{self.from_hf_in_block[match[2]]}"
        raise KeyError(f"{name} is not a {self.family} weight ingot knows")


def as_flavor(args, flavors: dict, hf_config: Callable[[object], dict], keys: dict, *kept: str):
    """The flavor whose Hugging Face config agrees with that of `args` on `keys` (the fields that fix the model),
    vocabulary aside, with the vocabulary, max_seq_len and the `kept` fields of `args`: an imported model of a
    published size then trains as its flavor does, with the flavor's settings that no HF field carries. `args`
    itself when no flavor matches."""

    def architecture(candidate) -> dict:
        try:
            config = hf_config(candidate)
        except ValueError:  # no HF form (e.g. a routing HF's model lacks): the dataclass fields say it
            return {"args": replace(candidate, max_seq_len=0)}
        return {key: config.get(key) for key in keys}

    wanted = architecture(args)
    for flavor in flavors.values():
        if architecture(replace(flavor, vocab_size=args.vocab_size)) == wanted:
            return replace(flavor, vocab_size=args.vocab_size, max_seq_len=args.max_seq_len,
                           **{key: getattr(args, key) for key in kept})
    return args


def has_hf_form(name: str, tied: bool) -> bool:
    """Whether an ingot tensor has a Hugging Face counterpart: not the routing bias of auxiliary-loss-free balancing
    (`expert_bias`, which HF's MoE models lack) nor, with `tied` embeddings, the output layer (HF files hold the
    matrix once, as the embedding)."""
    return not (name.endswith(".feed_forward.expert_bias") or (tied and name == "output.weight"))


def is_imported(hf_name: str, tied: bool) -> bool:
    """Whether an HF tensor is a weight to import: not RoPE's inv_freq buffer nor, with `tied` embeddings, the copy of
    the embedding that some tied checkpoints store as lm_head.weight."""
    return not (hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"))


def complete_import(renamed: dict, tied: bool) -> dict:
    """An imported state dict (ingot names) completed with what HF files lack: a zero routing bias for each
    mixture-of-experts router, and with `tied` embeddings the output layer as the embedding."""
    for name in list(renamed):
        router = re.fullmatch(r"(layers\.\d+\.feed_forward)\.router\.gate\.weight", name)
        if router:
            renamed[f"{router[1]}.expert_bias"] = torch.zeros(renamed[name].shape[0])
    if tied and "tok_embeddings.weight" in renamed:
        renamed["output.weight"] = renamed["tok_embeddings.weight"]
    return renamed
