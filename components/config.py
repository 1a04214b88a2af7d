"""The configuration schema and its loading: a TOML file, then `--section.key value` overrides.

Every field below can be set in a file under `train_configs/` or on the command line. Unknown keys
and values of the wrong type stop the run at start-up with a message that names the key (and the
nearest valid one). docs/configuration.md is generated from this file by
`python -m components.config --markdown` and a test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import subprocess
import sys
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "train_configs"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes a config may name (mixed precision, export), by their config spelling."""


@dataclass
class Job:
    config_file: str = ""
    """TOML file to read; a bare name is looked up in train_configs/."""
    dump_folder: str = "./outputs"
    """Everything a run writes goes here: config.toml, metrics.jsonl, tb/, checkpoints."""
    description: str = "ingot training job"


@dataclass
class Model:
    name: str = "llama3"
    """Package under models/ that holds the model, its flavors and its parallelize function."""
    flavor: str = "debugmodel"
    tokenizer_path: str = "tests/assets/tokenizers/shakespeare_bpe_4k.model"
    """A sentencepiece .model, a tiktoken BPE-ranks file (Llama 3's tokenizer.model) or a Hugging Face
    tokenizer.json (or a folder holding one; needs the tokenizers package: pip install 'ingot[hf]')."""
    n_layers: int | None = None
    """This and the keys below override the flavor's value when set (handy for ablations)."""
    dim: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    multiple_of: int | None = None
    ffn_dim_multiplier: float | None = None
    ffn_dim: int | None = None
    """The feed-forward hidden size, replacing the multiple_of / ffn_dim_multiplier rule (e.g. for
    a Hugging Face checkpoint whose intermediate_size that rule does not give)."""
    norm_eps: float | None = None
    rope_theta: float | None = None
    use_rope_scaling: bool | None = None
    """Llama 3.1 RoPE frequency scaling for long context."""
    rope_scaling_factor: float | None = None
    """How much Llama 3.1 scaling slows the low frequencies (8 for Llama 3.1, 32 for Llama 3.2)."""
    tie_embeddings: bool | None = None
    """One matrix for the token embedding and the output projection (Llama 3.2 1B and 3B)."""
    vocab_size: int | None = None
    """Defaults to the tokenizer's vocabulary; may be set larger (e.g. padded to a multiple of 64)."""
    rope_per_document: bool = False
    """With training.document_masking: RoPE positions restart at 0 at each document."""
    qk_norm: bool = False
    """Llama 3: an RMSNorm over each head's queries and keys before RoPE, as in Qwen3 (which always has it):
    bounds the attention logits, against loss spikes in long runs. Such a model has no Hugging Face Llama form."""
    mup: bool = False
    """Llama 3: the maximal-update parametrization (µP, docs/mup.md), so that an lr tuned at width
    mup_base_dim carries over to wider models: with m = dim / mup_base_dim, the block matrices' init std
    is divided by sqrt(m) and their AdamW lr by m, and the logits by m. Such a model has no Hugging Face
    Llama form."""
    mup_base_dim: int = 256
    """Under mup: the width (model.dim) at which µP is the standard parametrization, the width whose
    tuned lr is reused."""


@dataclass
class MoE:
    """Mixture-of-experts models (models/moe.py); a dense model ignores this section."""

    num_experts: int | None = None
    """This and the next two override the flavor's value when set."""
    top_k: int | None = None
    """Experts per token."""
    hidden_dim: int | None = None
    """One expert's feed-forward hidden size."""
    bias_update_speed: float = 0.001
    """Auxiliary-loss-free load balancing (DeepSeek-V3): after every optimizer step each expert's routing
    bias moves by this much towards balance; 0 turns it off."""
    aux_loss_coef: float = 0.0
    """Weight of the auxiliary load-balancing loss added to the training loss (logged as moe_aux_loss
    whatever its weight)."""
    aux_loss_type: str = "sequence"
    """sequence: balance measured within each sequence; global: over each micro-batch."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (the mean squared logsumexp of the router's logits)."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """AdamW for every parameter; or Muon (orthogonalised momentum) for the matrices of the transformer
    blocks, MoE experts one by one, and AdamW for the rest: embeddings, output layer, norms, biases
    (docs/optimizers.md)."""
    lr: float = 8e-4
    """Peak learning rate; under Muon, of the Muon matrices (see muon_adjust_lr)."""
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay, lr x weight_decay per step; under Muon, of the Muon matrices."""
    beta1: float = 0.9
    beta2: float = 0.95
    implementation: str = "fused"
    """One of fused, foreach, for-loop. fused skips an optimizer step on the device (see
    training.on_nonfinite); the others need a device-to-host sync per step for that, and so does Muon."""
    adamw_lr: float | None = None
    """Under Muon: the peak lr of the parameters AdamW updates; unset: lr (with muon_adjust_lr =
    match_rms_adamw one lr suits both, as in Moonlight)."""
    adamw_weight_decay: float | None = None
    """Under Muon: the weight decay of the parameters AdamW updates; unset: weight_decay."""
    muon_momentum: float = 0.95
    """Muon's momentum: the buffer is momentum x buffer + (1 - momentum) x gradient."""
    muon_nesterov: bool = True
    """Orthogonalise the Nesterov look-ahead (gradient + momentum x (buffer - gradient)) rather than the buffer."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per orthogonalisation."""
    muon_adjust_lr: str = "match_rms_adamw"
    """How Muon scales lr for an A x B matrix. match_rms_adamw: 0.2 x sqrt(max(A, B)), which gives
    its update the RMS of a typical AdamW update (Moonlight), so that AdamW's lr and weight decay are
    a starting point; original: sqrt(max(1, A / B)) (Keller Jordan's Muon, whose lr is ~0.02); none: lr as is."""
    muon_ns_dtype: str = "bfloat16"
    """dtype of the Newton-Schulz iteration and of the all-gather of sharded updates that precedes it;
    float32 is exact across layouts (CPU tests), bfloat16 half the traffic and faster on GPUs."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Linear warmup from lr/(warmup_steps+1) to lr."""
    decay_ratio: float | None = None
    """Fraction of the steps spent decaying at the end (warmup-stable-decay); unset: decay over all
    steps after warmup."""
    decay_type: str = "linear"
    """One of linear, sqrt, cosine, constant (no decay)."""
    min_lr_factor: float = 0.0
    """The decay ends at lr * min_lr_factor."""


@dataclass
class Training:
    steps: int = 1000
    seq_len: int = 2048
    local_batch_size: int = 8
    """Sequences per data-parallel rank per micro-batch."""
    global_batch_size: int = -1
    """Sequences per optimizer step; -1 = local_batch_size x data-parallel degree. A larger value
    accumulates gradients over global / (local x dp) micro-batches."""
    max_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables."""
    seed: int = 42
    deterministic: bool = False
    """Use deterministic algorithms (slower on CUDA)."""
    dataset: str = "hf"
    """hf: files, dataset repositories or hub datasets streamed with Hugging Face datasets, each rank
    reading its share, packed on the fly; packed: folders written by python -m scripts.preprocess,
    memory-mapped (docs/data.md)."""
    dataset_path: list[str] = field(default_factory=lambda: ["tests/assets/shakespeare/train.jsonl"])
    """hf: files, globs, folders of files, local dataset repositories, save_to_disk folders or hub ids
    (owner/name[:config], online only). packed: folders. Either may carry blend weights ("a:0.7,b:0.3")."""
    dataset_text_field: str = "text"
    dataloader_workers: int = 2
    """Loader worker processes per rank (0: in the training process): they read packed data, or read,
    tokenize and pack hf data."""
    document_masking: bool = False
    """Attention never crosses a document boundary (EOS) inside a packed window."""
    mixed_precision_param: str = "bfloat16"
    """dtype of parameters in forward/backward (float32 keeps full precision; use it on CPU)."""
    mixed_precision_reduce: str = "float32"
    """dtype of the gradient reduction across data-parallel ranks."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradient norm is NaN/inf never updates the weights. stop: end the run
    (exit code 3) naming the step; skip: go on, counting skipped steps."""
    max_skipped_steps: int = 100
    """Stop (exit code 3) once more optimizer steps than this were skipped (non-finite or spike);
    -1: no limit."""
    spike_guard: bool = False
    """Skip the optimizer step when the loss or gradient norm is more than spike_sigma standard
    deviations above the mean of the last spike_window accepted steps."""
    spike_sigma: float = 6.0
    spike_window: int = 128
    """Accepted steps the spike statistics cover; the guard acts once the window is full."""
    z_loss: float = 0.0
    """Weight of the z-loss added to the training loss: the mean squared logsumexp of the output
    logits, which keeps them from drifting (PaLM and OLMo use 1e-4); 0: off. Logged as z_loss
    (unweighted) when on; the logged loss stays the cross-entropy alone."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    """-1 = whatever the world size leaves after the other degrees."""
    tensor_parallel_degree: int = 1
    pipeline_parallel_degree: int = 1
    context_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    """Mixture-of-experts models: each of this many ranks holds num_experts / N experts, tokens travel
    to them by all-to-all. Uses data-parallel ranks: must divide the data-parallel shard degree."""
    fsdp_reshard_after_forward: str = "default"
    """One of default, always, never."""
    fsdp_cpu_offload: bool = False
    """Keep FSDP's parameter shards, gradients and optimizer state in host memory (the optimizer steps
    on the CPU): for models whose training state does not fit in device memory, at a cost in speed.
    Turns FSDP on also where it would not be (one process, float32)."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with compute (CUDA with compile.enable only)."""
    pipeline_parallel_schedule: str = "1F1B"
    """One of GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
    DualPipeV (those the installed torch offers)."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch; local_batch_size must be a multiple."""
    pipeline_parallel_layers_per_stage: int | None = None
    """Transformer blocks per pipeline stage; unset: split evenly over the stages."""


@dataclass
class Checkpoint:
    enable: bool = False
    folder: str = "checkpoint"
    """Checkpoints go to <dump_folder>/<folder>/step-N; a run finding one there resumes from it."""
    interval: int = 500
    async_mode: str = "disabled"
    """One of disabled, async (save in a background thread), async_with_pinned_mem (CUDA: staging
    into pinned memory and a background process)."""
    keep_latest_k: int = 0
    """Keep only the newest k checkpoints; 0 keeps all."""
    initial_load_path: str = ""
    """A checkpoint folder to start from when the dump folder has none (weights only): a DCP
    checkpoint, or a Hugging Face model folder (config.json and *.safetensors, see docs/hf.md). Where
    the dump folder has one, that one wins and the run says so (see fresh_start)."""
    last_save_model_only: bool = False
    """The final checkpoint holds only the model weights, in export_dtype."""
    export_dtype: str = "float32"
    create_seed_checkpoint: bool = False
    """Initialise the model on one process, save it as step-0 and exit."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of the checkpoint a resume leaves as they start, e.g. ["dataloader", "lr_scheduler"] to
    resume the weights and optimizer on new data with a new schedule: any of model, optimizer,
    lr_scheduler, dataloader, step_guard."""
    last_save_in_hf: bool = False
    """After the last step, also write the final checkpoint as a Hugging Face folder that transformers
    loads, <dump_folder>/hf/step-N (in export_dtype; docs/hf.md)."""
    keep_damaged: int = 2
    """Damaged checkpoints (renamed step-N.damaged when a resume finds them broken) kept for
    inspection, the newest first; older ones are deleted at start-up."""
    checksums: bool = True
    """Record a CRC32 of every checkpoint file (each rank its own files, about 1 s per GB) and
    verify them before resuming; sizes are always recorded and verified."""
    fresh_start: bool = False
    """Start at step 1 although the dump folder holds a checkpoint (e.g. one of another model shape): the earlier
    run's checkpoints, metrics.jsonl, TensorBoard events and config.toml are moved, not deleted, to
    <dump_folder>/set_aside/<time>/. A relaunch of the fresh run (a requeue with the same command) resumes the
    checkpoints it wrote (docs/checkpointing.md)."""


@dataclass
class ActivationCheckpoint:
    mode: str = "none"
    """One of none, full (recompute every block in backward), selective."""
    selective_ac_option: str = "2"
    """With selective: N checkpoints every N-th block; "op" checkpoints every block but keeps the
    outputs of its matmuls and attention."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (and the loss); CPU (inductor) and CUDA."""


@dataclass
class Float8:
    enable: bool = False
    """float8 matmuls in nn.Linear layers with torchao (emulated where the GPU lacks float8)."""
    recipe_name: str = "tensorwise"
    """One of tensorwise (one scale per tensor), rowwise (one per row)."""
    enable_fsdp_float8_all_gather: bool = False
    """FSDP all-gathers weights already cast to float8 (tensorwise only)."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """Compute the scales of all float8 weights in one go after each optimizer step."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers whose name contains one of these stay in high precision."""


@dataclass
class Metrics:
    log_freq: int = 10
    enable_tensorboard: bool = True
    save_tb_folder: str = "tb"
    peak_flops: float = 0.0
    """Peak dense FLOP/s of one device for MFU (e.g. 989e12); 0 = from a table of known GPUs by the
    training dtype; CPUs and other GPUs then log no MFU."""
    per_layer: bool = False
    """Every log_freq steps, log each block's weight norm, grad norm and output RMS / max."""
    enable_wandb: bool = False
    """Also log to Weights & Biases (docs/wandb.md): rank 0 only, its files under <dump_folder>/wandb/. Needs
    `pip install -e '.[wandb]'`; WANDB_MODE=offline keeps the run on disk. The keys below left empty leave
    the choice to wandb and its WANDB_* variables."""
    wandb_project: str = ""
    """Empty: WANDB_PROJECT, else wandb's default project."""
    wandb_run_name: str = ""
    """Empty: WANDB_NAME, else a name wandb makes up."""
    wandb_group: str = ""
    """Runs to show together, e.g. a sweep's; empty: WANDB_RUN_GROUP."""
    wandb_tags: list[str] = field(default_factory=list)
    """e.g. `--metrics.wandb_tags baseline,muon`; empty: WANDB_TAGS."""


@dataclass
class Validation:
    enable: bool = False
    """Log the validation loss and perplexity every `freq` steps and after the last step."""
    dataset_path: list[str] = field(default_factory=lambda: ["tests/assets/shakespeare/validation.jsonl"])
    """Packed folders (their validation split is used) or hf files, as training.dataset_path. One
    source is logged as val_loss; several, or one written `name=path`, each as val_loss/<name> (name:
    the file's stem or the folder's name unless given)."""
    freq: int = 500
    steps: int = 10
    """Batches (local_batch_size x data-parallel degree windows each) from the start of the data."""


@dataclass
class Evaluation:
    enable: bool = False
    """Score the multiple-choice `tasks` (docs/evaluation.md) every `freq` steps and after the last step."""
    tasks: list[str] = field(default_factory=list)
    """Task files or folders, each `path` or `name=path` (name: the file's stem): JSONL, JSON, Parquet
    or a datasets.save_to_disk folder in the HellaSwag, ARC, PIQA or generic layout."""
    freq: int = 500
    limit: int = 0
    """Score the first `limit` examples of each task; 0: all of them."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces (a chrome trace per rank) every profile_freq steps."""
    save_traces_folder: str = "profile_traces"
    """Under the dump folder: <folder>/step-N/rank<R>_trace.json."""
    profile_freq: int = 100
    profiler_warmup: int = 3
    """Steps the profiler runs before recording, in each profile_freq window."""
    profiler_active: int = 1
    """Steps recorded in each window."""
    enable_memory_snapshot: bool = False
    """CUDA only: dump torch.cuda.memory snapshots (pickles for pytorch.org/memory_viz) at the end of
    each profiled window and on out-of-memory."""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Timeout of the first collectives (start-up, checkpoint loading)."""
    train_timeout_seconds: int = 100
    """Timeout of collectives once training runs."""
    trace_buf_size: int = 20000
    """CUDA: collectives the NCCL flight recorder keeps per rank (0 disables it). On a timeout
    each rank dumps them to <dump_folder>/<flight_recorder_folder>/rank_<R>."""
    flight_recorder_folder: str = "comm_traces"


@dataclass
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    moe: MoE = field(default_factory=MoE)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    evaluation: Evaluation = field(default_factory=Evaluation)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)


class ConfigError(ValueError):
    """A config file or command-line override that cannot be used; the message says why."""


CHOICES = {
    "optimizer.name": ("AdamW", "Muon"),
    "optimizer.muon_adjust_lr": ("match_rms_adamw", "original", "none"),
    "optimizer.muon_ns_dtype": ("bfloat16", "float32"),
    "optimizer.implementation": ("fused", "foreach", "for-loop"),
    "training.on_nonfinite": ("stop", "skip"),
    "lr_scheduler.decay_type": ("linear", "sqrt", "cosine", "constant"),
    "training.dataset": ("hf", "packed"),
    "training.mixed_precision_param": tuple(DTYPES),
    "training.mixed_precision_reduce": ("float32", "bfloat16"),
    "parallelism.fsdp_reshard_after_forward": ("default", "always", "never"),
    "parallelism.pipeline_parallel_schedule": (
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV",
    ),
    "checkpoint.async_mode": ("disabled", "async", "async_with_pinned_mem"),
    "checkpoint.export_dtype": tuple(DTYPES),
    "activation_checkpoint.mode": ("none", "full", "selective"),
    "float8.recipe_name": ("tensorwise", "rowwise"),
    "moe.aux_loss_type": ("sequence", "global"),
}


@dataclass(frozen=True)
class Range:
    """The values a numeric key allows: from `low` up to `high` (either end left open by `open_low` or
    `open_high`; None: no bound), plus the sentinels in `also` (e.g. -1: derived). Floats must be finite."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    also: tuple[int, ...] = ()
    note: str = ""
    """What a special value means, e.g. "0: off"."""

    def allows(self, value: float) -> bool:
        if value in self.also:
            return True
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.open_low else value >= self.low)
        below = self.high is None or (value < self.high if self.open_high else value <= self.high)
        return above and below

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.open_low else '['}{self.low}, {self.high}{')' if self.open_high else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.open_low else '>='} {self.low}"
        else:
            text = f"{'<' if self.open_high else '<='} {self.high}"
        text += "".join(f" or {value}" for value in self.also)
        return text + (f" ({self.note})" if self.note else "")


COUNT, OFF_AT_0, POSITIVE = Range(1), Range(0, note="0: off"), Range(0, open_low=True)
NON_NEGATIVE, FRACTION, DECAY = Range(0), Range(0, 1), Range(0, 1, open_high=True)
RANGES = {
    "model.n_layers": COUNT, "model.dim": COUNT, "model.n_heads": COUNT, "model.n_kv_heads": COUNT,
    "model.multiple_of": COUNT, "model.ffn_dim_multiplier": POSITIVE, "model.ffn_dim": COUNT,
    "model.norm_eps": POSITIVE, "model.rope_theta": POSITIVE, "model.rope_scaling_factor": Range(1),
    "model.vocab_size": COUNT, "model.mup_base_dim": COUNT,
    "moe.num_experts": COUNT, "moe.top_k": COUNT, "moe.hidden_dim": COUNT, "moe.bias_update_speed": OFF_AT_0,
    "moe.aux_loss_coef": NON_NEGATIVE, "moe.z_loss_coef": NON_NEGATIVE,
    "optimizer.lr": NON_NEGATIVE, "optimizer.eps": POSITIVE, "optimizer.weight_decay": NON_NEGATIVE,
    "optimizer.beta1": DECAY, "optimizer.beta2": DECAY, "optimizer.adamw_lr": NON_NEGATIVE,
    "optimizer.adamw_weight_decay": NON_NEGATIVE, "optimizer.muon_momentum": DECAY, "optimizer.muon_ns_steps": COUNT,
    "lr_scheduler.warmup_steps": NON_NEGATIVE, "lr_scheduler.decay_ratio": FRACTION,
    "lr_scheduler.min_lr_factor": FRACTION,
    "training.steps": COUNT, "training.seq_len": COUNT, "training.local_batch_size": COUNT,
    "training.global_batch_size": Range(1, also=(-1,), note="-1: local x data-parallel degree"),
    "training.max_norm": OFF_AT_0, "training.seed": NON_NEGATIVE, "training.dataloader_workers": NON_NEGATIVE,
    "training.max_skipped_steps": Range(0, also=(-1,), note="-1: no limit"),
    "training.spike_sigma": POSITIVE, "training.spike_window": Range(2), "training.z_loss": OFF_AT_0,
    "parallelism.data_parallel_replicate_degree": COUNT,
    "parallelism.data_parallel_shard_degree": Range(1, also=(-1,), note="-1: what the other degrees leave"),
    "parallelism.tensor_parallel_degree": COUNT, "parallelism.pipeline_parallel_degree": COUNT,
    "parallelism.context_parallel_degree": COUNT, "parallelism.expert_parallel_degree": COUNT,
    "parallelism.pipeline_parallel_microbatch_size": COUNT, "parallelism.pipeline_parallel_layers_per_stage": COUNT,
    "checkpoint.interval": COUNT, "checkpoint.keep_latest_k": Range(0, note="0: keep all"),
    "checkpoint.keep_damaged": NON_NEGATIVE,
    "metrics.log_freq": COUNT, "metrics.peak_flops": Range(0, note="0: from the table of known GPUs"),
    "validation.freq": COUNT, "validation.steps": COUNT,
    "evaluation.freq": COUNT, "evaluation.limit": Range(0, note="0: all examples"),
    "profiling.profile_freq": COUNT, "profiling.profiler_warmup": NON_NEGATIVE, "profiling.profiler_active": COUNT,
    "comm.init_timeout_seconds": COUNT, "comm.train_timeout_seconds": COUNT,
    "comm.trace_buf_size": Range(0, note="0: no flight recorder"),
}
"""The allowed range of every numeric key, checked by load_config once the file and overrides are applied."""


def check_ranges(config: Config) -> None:
    """Refuse the first numeric key whose value (when set) is out of its range, naming both."""
    for key, allowed in RANGES.items():
        section, _, name = key.partition(".")
        value = getattr(getattr(config, section), name)
        if value is not None and not allowed.allows(value):
            finite = "" if math.isfinite(value) else "finite and "
            raise ConfigError(f"{key} must be {finite}{allowed.describe()}, got {value!r}")


def field_types(section_cls) -> dict[str, object]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


SECTIONS = field_types(Config)
ALL_KEYS = [f"{s}.{k}" for s, cls in SECTIONS.items() for k in field_types(cls)]


def _nearest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f" (did you mean {close[0]}?)" if close else ""


def _convert(key: str, value, typ):
    """Check `value` (from TOML, or a str from the command line) against `typ`; return it converted."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _convert(key, value, next(a for a in args if a is not type(None)))
    from_cli = isinstance(value, str) and typ is not str
    if origin is list:
        if isinstance(value, str):
            text = value.strip()
            value = _parse_toml_value(text) if text.startswith("[") else [v for v in text.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_convert(key, v, args[0]) for v in value]
    if typ is bool:
        if from_cli and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
    elif typ is int:
        if from_cli:
            try:
                return int(value)
            except ValueError:
                pass
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if from_cli:
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key} must be {getattr(typ, '__name__', typ)}, got {value!r}")


def _parse_toml_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"cannot parse {text!r} as a TOML value: {e}") from None


def _set(config: Config, key: str, value) -> None:
    section, _, name = key.partition(".")
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section '{section}'{_nearest(key, ALL_KEYS)}")
    types_ = field_types(SECTIONS[section])
    if name not in types_:
        raise ConfigError(f"unknown config key '{key}'{_nearest(key, ALL_KEYS)}")
    value = _convert(key, value, types_[name])
    choices = CHOICES.get(key)
    if choices and value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
    setattr(getattr(config, section), name, value)


def resolve_config_file(path: str) -> Path:
    """A path as given, or a bare name under train_configs/ (`--job.config_file llama3_8b.toml`)."""
    for candidate in (Path(path), CONFIG_DIR / path, CONFIG_DIR / f"{path}.toml"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"config file not found: {path} (looked in . and {CONFIG_DIR})")


def _split_cli(argv: list[str]) -> list[tuple[str, str]]:
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise ConfigError(f"expected --section.key [value], got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            else:
                value = "true"  # a bare flag such as --checkpoint.enable
        pairs.append((key.replace("-", "_"), value))
        i += 1
    return pairs


def load_config(argv: list[str] | None = None) -> Config:
    """Defaults, then the TOML file named by the last --job.config_file, then the other overrides."""
    overrides = _split_cli(sys.argv[1:] if argv is None else argv)
    config = Config()
    config_files = [v for k, v in overrides if k == "job.config_file"]
    if config_files:
        path = resolve_config_file(config_files[-1])
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not a UTF-8 text file (byte {e.start})") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: top-level key '{section}' must be a [section]"
                                  f"{_nearest(section, list(SECTIONS))}")
            for name, value in values.items():
                try:
                    _set(config, f"{section}.{name}", value)
                except ConfigError as e:
                    raise ConfigError(f"{path}: {e}") from None
        config.job.config_file = str(path)
    for key, value in overrides:
        if key != "job.config_file":
            _set(config, key, value)
    check_ranges(config)
    return config


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return ("-" if value < 0 else "") + ("nan" if math.isnan(value) else "inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def to_toml(config: Config) -> str:
    """The resolved config as TOML; unset optional keys (None) are left out, as TOML has no null."""
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for name, value in dataclasses.asdict(getattr(config, section)).items():
            if value is not None:
                lines.append(f"{name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def git_commit() -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + (" (uncommitted changes)" if dirty else "")


def dump_config(config: Config, folder: Path, start_step: int) -> Path:
    """Write the resolved config to <folder>/config.toml, the latest launch's, and a copy that stays,
    configs/launch-<n>-<time>.toml, so that the folder keeps the history of its launches."""
    history = folder / "configs"
    history.mkdir(parents=True, exist_ok=True)
    launch, started = len(list(history.glob("launch-*.toml"))) + 1, time.strftime("%Y%m%d-%H%M%S")
    text = (f"# git commit: {git_commit()}\n# command: {' '.join(sys.argv)}\n"
            f"# launch {launch} at {started}, training from step {start_step + 1}\n\n{to_toml(config)}")
    (history / f"launch-{launch:04d}-{started}.toml").write_text(text)
    path = folder / "config.toml"
    path.write_text(text)
    return path


def markdown_reference() -> str:
    """The configuration reference in docs/configuration.md, built from the dataclasses above."""
    import ast
    import inspect

    out = [
        "# Configuration reference",
        "",
        "Generated by `python -m components.config --markdown > docs/configuration.md`; a test keeps it in step.",
        "Every key is set in a TOML file under `train_configs/` (`[section]` then `key = value`) or on the",
        "command line as `--section.key value`. A numeric key's allowed range is checked at start-up: a value",
        "out of it stops the run (exit 2) with one line naming the key, the value and the range.",
        "",
    ]
    for section, cls in SECTIONS.items():
        docs, tree = {}, ast.parse(inspect.getsource(cls))
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(nxt.value.value.split())
        out += [f"## [{section}]", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for name, typ in field_types(cls).items():
            default = getattr(cls(), name)
            type_name = str(typ).replace(" | None", " (optional)")
            type_name = type_name if not isinstance(typ, type) else typ.__name__
            shown = "unset" if default is None else _toml_value(default)
            meaning = docs.get(name, "")
            if f"{section}.{name}" in CHOICES and "One of" not in meaning:
                meaning = (meaning + " One of " + ", ".join(CHOICES[f"{section}.{name}"]) + ".").strip()
            if f"{section}.{name}" in RANGES:
                meaning = (meaning + " Allowed: " + RANGES[f"{section}.{name}"].describe() + ".").strip()
            out.append(f"| `{section}.{name}` | {type_name} | `{shown}` | {meaning} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        print(markdown_reference(), end="")
    else:
        try:
            print(to_toml(load_config()), end="")
        except ConfigError as e:
            sys.exit(f"config error: {e}")
