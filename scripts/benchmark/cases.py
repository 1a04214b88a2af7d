"""The benchmark's presets: lists of short train.py runs, each switching one technique on against the
same baseline (the model's `default` case)."""

from __future__ import annotations

from dataclasses import dataclass

COMPILE = ("--compile.enable", "true")
TECHNIQUES = {
    "compile": COMPILE,
    "AC full": ("--activation_checkpoint.mode", "full"),
    "AC selective 2": ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"),
    "AC op": ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"),
    # float8 pays off only compiled (eager, its casts cost more than the faster matmuls save): compare with compile.
    "float8 tensorwise + compile": ("--float8.enable", "true", "--float8.recipe_name", "tensorwise", *COMPILE),
    "float8 rowwise + compile": ("--float8.enable", "true", "--float8.recipe_name", "rowwise", *COMPILE),
    "document masking": ("--training.document_masking", "true"),
}


@dataclass(frozen=True)
class Case:
    name: str
    flags: tuple[str, ...] = ()
    """train.py flags: the model, then the technique."""
    all_devices: bool = False
    """Spread over the local devices by FSDP (and context parallelism where the flags ask for it): torchrun, one
    process per GPU (2 processes over gloo on a CPU)."""


@dataclass(frozen=True)
class Preset:
    cases: tuple[Case, ...]
    steps: int
    warmup: int
    """Steps left out of the figures: the first ones compile and warm the allocator."""
    needs_gpu: bool = False


def model_cases(model: str, flags: tuple[str, ...], techniques: list[str], longer_seq: tuple[int, int] | None = None,
                fsdp: bool = True) -> list[Case]:
    """`<model> default`, then each technique on top of it; `longer_seq`: (seq_len, local batch) of a
    longer-sequence case; `fsdp`: a case sharding the model over the local devices."""
    cases = [Case(f"{model} default", flags)]
    cases += [Case(f"{model} {name}", flags + TECHNIQUES[name]) for name in techniques]
    if longer_seq:
        seq_len, batch = longer_seq
        cases.append(Case(f"{model} seq {seq_len}", flags + ("--training.seq_len", str(seq_len),
                                                             "--training.local_batch_size", str(batch))))
    if fsdp:
        cases.append(Case(f"{model} FSDP", flags, all_devices=True))
    return cases


def long_context_cases(model: str, flags: tuple[str, ...], seq_len: int) -> list[Case]:
    """One sequence of `seq_len` tokens per step: on one device with full AC, causal and within documents
    (FlexAttention on CUDA); and split over the local devices by each context-parallel method at degree 2."""
    flags = flags + ("--training.seq_len", str(seq_len), "--training.local_batch_size", "1")
    ac = TECHNIQUES["AC full"]
    cases = [Case(f"{model} seq {seq_len} AC full", flags + ac),
             Case(f"{model} seq {seq_len} AC full + document masking", flags + ac + TECHNIQUES["document masking"])]
    cases += [Case(f"{model} seq {seq_len} CP 2 {method}", flags + ("--parallelism.context_parallel_degree", "2",
                                                                    "--parallelism.context_parallel_method", method),
                   all_devices=True) for method in ("allgather", "ring", "alltoall")]
    return cases


DEBUG = ("--job.config_file", "debug_model.toml")  # fp32, seq 256 x batch 4, the shipped 4k tokenizer
# Llama 3 1B and 8B on the shipped corpus, with GPT-2's BPE ranks standing in for Llama 3's tokenizer
# (a 50,512-token vocabulary instead of 128,256: the output layer is smaller than the real model's),
# in bf16 at Llama 3 8B's learning rate (the debug model's 2e-3 risks a diverging bf16 run).
GPU_BASE = (*DEBUG, "--model.tokenizer_path", "tests/assets/tokenizers/gpt2.tiktoken",
            "--training.mixed_precision_param", "bfloat16", "--optimizer.lr", "3e-4")
LLAMA_1B = (*GPU_BASE, "--model.flavor", "1B", "--training.seq_len", "2048", "--training.local_batch_size", "4")
LLAMA_8B_4_LAYERS = (*GPU_BASE, "--model.flavor", "8B", "--model.n_layers", "4", "--training.seq_len", "2048",
                     "--training.local_batch_size", "4")
# DeepSeek-V3 16B's shape (DeepSeek-V2-Lite's) cut to the 8 blocks that fit one 80 GB GPU with AdamW (the estimator:
# 69 GiB); its MFU counts the active parameters (6 of 64 experts and the 2 shared ones).
DEEPSEEK_V3_16B_8_LAYERS = (*GPU_BASE, "--job.config_file", "debug_deepseek_v3.toml", "--model.flavor", "16B",
                            "--model.n_layers", "8", "--model.rope_factor", "1", "--training.seq_len", "2048",
                            "--training.local_batch_size", "4")
# gpt-oss 20B's shape cut to the 4 blocks that fit one 80 GB GPU with AdamW at 8192 tokens (the estimator: 63 GiB);
# MFU on the active parameters (4 of 32 experts). Its window's saving: the same model with every layer's window as
# long as the sequence (full attention everywhere).
GPT_OSS_20B_4_LAYERS = (*GPU_BASE, "--job.config_file", "debug_gpt_oss.toml", "--model.flavor", "20B",
                        "--model.n_layers", "4", "--model.rope_factor", "1", "--training.seq_len", "8192",
                        "--training.local_batch_size", "1")
GPT_OSS_FULL_ATTENTION = ("--model.sliding_window", "8192")
# Qwen3.5 27B's shape cut to 4 blocks (3 Gated DeltaNet, 1 full attention) at 32K tokens with full AC (the linear
# layers' delta rule in PyTorch, chunked: no flash-linear-attention on the device); its saving against the same shape
# with full attention in every block.
QWEN3_5_27B_4_LAYERS = (*GPU_BASE, "--job.config_file", "debug_qwen3_5.toml", "--model.flavor", "27B",
                        "--model.n_layers", "4", "--training.seq_len", "32768", "--training.local_batch_size", "1",
                        *TECHNIQUES["AC full"])
QWEN3_5_FULL_ATTENTION = ("--model.full_attention_interval", "1")
ALL_TECHNIQUES = list(TECHNIQUES)
# Document masking and every-2nd-block AC are measured on 1B; left out of 8B for the time budget.
FEWER_TECHNIQUES = [name for name in TECHNIQUES if name not in ("AC selective 2", "document masking")]

PRESETS = {
    # What CI runs (tests/test_benchmark.py): a 2-layer debug model, seconds per case.
    "tiny": Preset(
        tuple(model_cases("debug", (*DEBUG, "--model.n_layers", "2", "--training.seq_len", "64",
                                    "--training.local_batch_size", "4"), ["AC full"])),
        steps=5, warmup=2,
    ),
    "cpu": Preset(
        tuple(model_cases("debug", DEBUG, ALL_TECHNIQUES, longer_seq=(1024, 1))),
        steps=12, warmup=3,
    ),
    "h100": Preset(
        tuple(model_cases("1B", LLAMA_1B, ALL_TECHNIQUES, longer_seq=(8192, 1))
              + long_context_cases("1B", LLAMA_1B, 32768)
              + model_cases("8B-4-layers", LLAMA_8B_4_LAYERS, FEWER_TECHNIQUES, fsdp=False)
              + model_cases("DeepSeek-V3-16B-8-layers", DEEPSEEK_V3_16B_8_LAYERS, ["compile"], fsdp=False)
              + model_cases("gpt-oss-20B-4-layers", GPT_OSS_20B_4_LAYERS, ["compile"], fsdp=False)
              + [Case("gpt-oss-20B-4-layers full attention", GPT_OSS_20B_4_LAYERS + GPT_OSS_FULL_ATTENTION)]
              + model_cases("Qwen3.5-27B-4-layers seq 32768", QWEN3_5_27B_4_LAYERS, ["compile"], fsdp=False)
              + [Case("Qwen3.5-27B-4-layers seq 32768 full attention", QWEN3_5_27B_4_LAYERS + QWEN3_5_FULL_ATTENTION)]),
        steps=20, warmup=5, needs_gpu=True,
    ),
}
