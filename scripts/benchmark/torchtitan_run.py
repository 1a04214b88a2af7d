"""The same cases through TorchTitan (--torchtitan), written against torchtitan 0.3.0.

Each ingot case is resolved to its config and mapped to torchtitan's settings: the same Llama 3
shapes (vocabulary size included), sequence length, batch, steps, dtype, compile, activation
checkpointing, float8 recipe and number of processes, on the same JSON-lines corpus. torchtitan
0.3.0's Python configs cannot express ingot's shapes from its command line, so `ingot_case` below is
the config function its ConfigManager imports (`--module scripts.benchmark.torchtitan_run --config
ingot_case`); it reads the settings from an environment variable. Differences that remain, which the
ratio includes: torchtitan's language models always mask attention at document boundaries
(FlexAttention), its selective AC is by op (it recomputes every second matmul), its loss is chunked,
and it reads the corpus with a byte-level tokenizer (the token ids do not change the work of a step).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from components.config import REPO_ROOT, Config, load_config
from components.data.tokenizer import build_tokenizer
from models.families import model_config_class
from models.llama3 import build_model_args
from scripts.benchmark.run import failure, harmonic_mean, run_logged

SETTINGS_ENV = "INGOT_BENCHMARK_TORCHTITAN"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# torchtitan's log line: step: 5  loss: ...  memory: 1.23GiB(4.56%)  tps: 12,345  tflops: ...  mfu: 7.89% (or N/A)
LOG_LINE = re.compile(r"step:\s*(\d+)\s.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+%|N/A)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def settings(config: Config, tokenizer_dir: Path, dump: Path) -> dict | str:
    """torchtitan's settings for a resolved ingot config, or why it has no counterpart there."""
    p, ac, training = config.parallelism, config.activation_checkpoint, config.training
    if config.model.name != "llama3":
        return "no counterpart: only Llama 3 is mapped to torchtitan"
    if (p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree,
            p.data_parallel_replicate_degree) != (1, 1, 1, 1):
        return "no counterpart: only FSDP layouts are mapped to torchtitan"
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        return "no counterpart: torchtitan 0.3.0 has no selective AC of every N-th block"
    if config.float8.enable and config.float8.recipe_name != "rowwise":
        return "no counterpart: torchtitan 0.3.0's float8 recipes are rowwise"
    if training.dataset != "hf" or not all(path.endswith((".json", ".jsonl")) for path in training.dataset_path):
        return "no counterpart: torchtitan is given JSON-lines files here"
    args = build_model_args(config, build_tokenizer(config.model.tokenizer_path).vocab_size)
    return {
        "flavor": config.model.flavor, "dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads or args.n_heads, "ffn_hidden_dim": args.ffn_hidden_dim,
        "vocab_size": args.vocab_size, "tie_embeddings": args.tie_embeddings, "rope_theta": args.rope_theta,
        "seq_len": training.seq_len, "local_batch_size": training.local_batch_size,
        "global_batch_size": training.global_batch_size, "steps": training.steps, "max_norm": training.max_norm,
        "mixed_precision_param": training.mixed_precision_param, "lr": config.optimizer.lr,
        "compile": config.compile.enable, "ac": "op" if ac.mode == "selective" else ac.mode,
        "float8": config.float8.recipe_name if config.float8.enable else None,
        "data_files": [str(REPO_ROOT / path) for path in training.dataset_path],
        "text_field": training.dataset_text_field, "tokenizer": str(tokenizer_dir), "dump_folder": str(dump),
    }


def write_byte_tokenizer(folder: Path) -> Path:
    """A Hugging Face tokenizer of the 256 bytes plus BOS and EOS, which torchtitan can read (it needs a
    tokenizer.json; the ids fit in any model's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={byte: i for i, byte in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return folder


def parse_log(text: str, warmup: int) -> dict | None:
    """tokens/s (per device), MFU and peak memory from torchtitan's step lines; None without a step
    after the warm-up."""
    steps = [LOG_LINE.search(ANSI.sub("", line)) for line in text.splitlines()]
    steps = [m for m in steps if m]
    kept = [m for m in steps if int(m[1]) > warmup]
    if not kept:
        return None
    mfus = [None if m[4] == "N/A" else float(m[4].rstrip("%")) for m in kept]
    return {
        "tokens_per_second": harmonic_mean([float(m[3].replace(",", "")) for m in kept]),
        "mfu": None if None in mfus else harmonic_mean(mfus),
        "peak_memory_gib": max(float(m[2]) for m in steps),
    }


def run_torchtitan(argv: list[str], processes: int, warmup: int, timeout: float, folder: Path) -> dict:
    """Run the ingot case of train.py arguments `argv` through torchtitan in `folder` (the tokenizer
    goes beside it, for every case); its figures or status."""
    tokenizer_dir = folder.parent / "byte_tokenizer"
    if not (tokenizer_dir / "tokenizer.json").exists():
        write_byte_tokenizer(tokenizer_dir)
    folder.mkdir(parents=True, exist_ok=True)
    mapped = settings(load_config(argv, model_config_class), tokenizer_dir, folder)
    if isinstance(mapped, str):
        return {"status": mapped}
    # torchtitan's trainer expects torchrun's environment, even for one process.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               "-m", "torchtitan.train", "--module", __name__, "--config", "ingot_case"]
    rc = run_logged(command, folder / "run.log", timeout, env=dict(os.environ, **{SETTINGS_ENV: json.dumps(mapped)}))
    figures = parse_log((folder / "run.log").read_text(errors="replace"), warmup)
    if rc != 0:
        return {"status": failure(rc, folder / "run.log", timeout), "command": command}
    if figures is None:
        return {"status": f"failed: no step logged after the first {warmup} (warm-up)", "command": command}
    return {"status": "ok", **figures, "command": command}


def ingot_case():
    """torchtitan's Trainer.Config of the case in $INGOT_BENCHMARK_TORCHTITAN (see `settings`)."""
    import dataclasses

    from datasets import load_dataset
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.quantization import Float8LinearConverter
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataLoader
    from torchtitan.models.llama3 import _build_llama3_layers, model_registry
    from torchtitan.trainer import Trainer

    s = json.loads(os.environ[SETTINGS_ENV])
    # The flavor's embeddings, norm, output layer and RoPE, reshaped to ingot's model (torchtitan's
    # debugmodel, for one, has 16 KV heads and 2,048 tokens where ingot's has 4 and its tokenizer's).
    spec = model_registry(s["flavor"], attn_backend="flex")
    model, head_dim = spec.model, s["dim"] // s["n_heads"]
    rope = dataclasses.replace(model.layers[0].attention.rope, dim=head_dim, theta=s["rope_theta"])
    model.layers = _build_llama3_layers(n_layers=s["n_layers"], dim=s["dim"], n_heads=s["n_heads"],
                                        n_kv_heads=s["n_kv_heads"], hidden_dim=s["ffn_hidden_dim"], rope=rope,
                                        attn_backend="flex")
    model.dim = model.tok_embeddings.embedding_dim = model.norm.normalized_shape = model.lm_head.in_features = s["dim"]
    model.vocab_size = model.tok_embeddings.num_embeddings = model.lm_head.out_features = s["vocab_size"]
    model.enable_weight_tying = s["tie_embeddings"]
    if s["float8"]:
        converter = Float8LinearConverter.Config(recipe_name=s["float8"], filter_fqns=["lm_head"],
                                                 model_compile_enabled=s["compile"])
        spec.model = converter.build().convert(model)
    DATASETS["ingot_benchmark"] = DatasetConfig(
        path=s["data_files"][0], loader=lambda _: load_dataset("json", data_files=s["data_files"], split="train"),
        sample_processor=lambda sample: sample[s["text_field"]],
    )
    return Trainer.Config(
        model_spec=spec, hf_assets_path=s["tokenizer"], dump_folder=s["dump_folder"],
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=s["vocab_size"])),
        optimizer=default_adamw(lr=s["lr"]), lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(local_batch_size=s["local_batch_size"], global_batch_size=s["global_batch_size"],
                                seq_len=s["seq_len"], steps=s["steps"], max_norm=s["max_norm"],
                                mixed_precision_param=s["mixed_precision_param"]),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="ingot_benchmark"),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        activation_checkpoint={"none": None, "full": FullAC.Config(), "op": SelectiveAC.Config()}[s["ac"]],
        compile=CompileConfig(enable=s["compile"]),
    )
