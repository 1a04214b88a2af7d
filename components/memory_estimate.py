"""Estimate the peak memory of one training rank before running it: a breakdown into parameters,
gradients, optimizer state, activations, FSDP buffers and temporary memory.

    python -m components.memory_estimate --job.config_file debug_model.toml [--section.key value ...]
    python -m components.memory_estimate --job.config_file llama3_8b.toml --world-size 8

How it works
------------
Persistent state is counted exactly from the model's shapes (built on the meta device, so nothing is
allocated): each parameter's elements on this rank after tensor parallelism (the layout of
`tensor_parallel_plan`: column-wise weights split along dim 0, row-wise ones along dim 1, norms
replicated) and FSDP (dim 0 cut in dp_shard x cp chunks, rank 0 holding the largest), then
- parameters: 4 bytes each (the fp32 master copy; FSDP's mixed precision computes in
  training.mixed_precision_param but keeps the sharded parameters fp32);
- gradients: 4 bytes each (FSDP reduce-scatters into fp32 shards);
- optimizer state: 8 bytes each (AdamW's exp_avg and exp_avg_sq in fp32).

Activations and working memory are measured by simulation: one forward and backward of a micro-batch
through the real model code (the real activation checkpointing wrappers and policy, the real loss
function) on fake tensors (torch._subclasses.FakeTensorMode: shapes and dtypes only, no data, no
memory), under a TorchDispatchMode that adds up the bytes of every tensor storage an operator
creates and subtracts them when the storage dies (weakref callbacks). What autograd keeps alive at the
end of the forward is the activation memory (saved tensors); the highest point of the
forward+backward timeline gives the temporary memory on top (logits and loss in fp32, gradients of
activations, recomputation under activation checkpointing) and tells how many parameter gradients
exist at that moment. The simulation is of one rank without parallelism, in the compute dtype, for
the micro-batch this rank sees (local_batch_size sequences, or pipeline_parallel_microbatch_size
under PP, of seq_len / cp tokens), and is then scaled to the layout:
- tensor parallel (with sequence parallel and loss parallel): activations and temporaries / tp, plus
  the all-gathered (full-sequence) inputs of the column-parallel matmuls, which blocks that are not
  checkpointed save whole;
- context parallel: simulated with seq_len / cp tokens and an attention that gathers the keys and
  values of the whole sequence, as parallelisms/context_parallel.py does;
- pipeline parallel: the stages of the rank are simulated (embeddings on the first, norm, output and
  loss on the last; the first and last ranks are estimated and the larger reported), with the
  activations of as many micro-batches as the schedule keeps in flight (GPipe: all; 1F1B: pp -
  rank; interleaved and V schedules: their warm-up depth, approximately);
- FSDP: the all-gathered parameters in the compute dtype of the root (embeddings, norm, output:
  never resharded between forward and backward) and of two blocks (the one running and the one
  prefetched; all of them with fsdp_reshard_after_forward = never or under PP), one block of
  unsharded gradients before its reduce-scatter, and, when gradients accumulate over micro-batches
  without a reduce-scatter (training.global_batch_size > local x dp, or PP), the unsharded
  accumulated gradients.
The peak is the larger of the forward/backward peak and the optimizer step (parameters, all
gradients, optimizer state and, for the foreach AdamW, one fp32 temporary per parameter).

Transformer blocks repeat, so only a few run in the simulation (a first block and two periods of the
checkpointing pattern) and the others are added exactly (see `simulate_micro_batch`): the simulation
takes well under a second for any model size, Llama 3 8B at seq 8192 or 405B alike.
torch.distributed._tools.mem_tracker.MemTracker does similar tracking (per module, with rounding to
CUDA's allocation granularity); the tracker here is a few lines that separate the categories this
breakdown needs and that weigh gradients differently for the layout.

What is measured differs by device, and so does what the estimate includes:
- CUDA: train.py reports torch.cuda.max_memory_reserved, tensor memory held by the caching
  allocator. The CUDA context, NCCL buffers and cuBLAS workspaces are not part of it (nor of this
  estimate); the caching allocator's rounding and fragmentation usually add a few percent.
- CPU: train.py reports the peak resident memory (VmHWM) of the whole process, which includes the
  Python interpreter, torch, the data and logging libraries: the estimate adds this baseline,
  measured in the estimator's own process after importing what the trainer imports (train.py, the
  model package, datasets and tensorboard when the config uses them) and before building anything,
  plus 0.03 GiB for what the trainer holds beyond its imports (tokenizer, data, TensorBoard writer,
  process group). glibc malloc also keeps memory resident beyond the live tensors: after the first
  step its dynamic mmap threshold rises (up to 32 MiB), so activations come from the heap, which
  fragments, and the resident size grows over the first 3-4 steps. That excess is modelled as 40%
  of the memory allocated and freed every step (activations + temporary), a figure measured on the
  debug model (0.38-0.39 at batch 8 and 16, 6 and 12 layers; more under full checkpointing). With
  MALLOC_MMAP_THRESHOLD_=65536 in the environment the excess disappears (measured peak then within
  a few % of the estimate without it). The estimate is of the peak after those first steps; the
  first step's peak is lower.

Not modelled: torch.compile (inductor saves fewer tensors; the eager estimate is an upper bound),
float8 (its casts save float8 copies; counted as the compute dtype), the flex-attention block mask on
CUDA (the dense boolean mask of CPU document masking is counted), asynchronous checkpointing's
staging copies.
"""

from __future__ import annotations

import importlib
import math
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from components.config import Config, ConfigError, load_config
from components.distributed import ParallelDims
from components.metrics import peak_rss_bytes

REPO_ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LLAMA3_VOCAB = 128256  # used when the config's tokenizer file is not on this machine
CPU_HEAP_FRAGMENTATION = 0.4
"""CPU: resident memory glibc malloc holds beyond the live tensors, as a fraction of the memory
allocated and freed in every step (activations and temporaries). Measured on the debug model
(0.38-0.39 with batch 8 or 16, 6 or 12 layers, a little more with full activation checkpointing)."""
CPU_TRAINER_STATE = 30 * 2**20
"""CPU: what the trainer process holds before its first step beyond its imports (tokenizer, data,
TensorBoard writer, process group): 0.03 GiB measured on the debug run."""


# --------------------------------------------------------------------------------------------------
# Tracking live storage bytes
# --------------------------------------------------------------------------------------------------


class StorageTracker(TorchDispatchMode):
    """Adds up the bytes of the tensor storages that operators create while it is active, and takes
    them off when a storage is freed. Storages given to `ignore` (parameters, buffers) are never
    counted. A storage that becomes a parameter's `.grad` moves from the `other` count to a
    gradient count (`root` or `block`, see `watch_grads`). `samples` holds (other, root_grads,
    block_grads) after every change, the timeline the peak is read from."""

    def __init__(self):
        super().__init__()
        self.other = self.root_grads = self.block_grads = 0
        self._live: dict[int, tuple[weakref.ref, int, str]] = {}  # id(storage) -> (ref, bytes, category)
        self._ignored: dict[int, weakref.ref] = {}
        self.samples: list[tuple[int, int, int]] = []

    def ignore(self, tensors) -> None:
        for t in tensors:
            st = t.untyped_storage()
            self._ignored[id(st)] = weakref.ref(st)

    def _known(self, st) -> bool:
        key = id(st)
        for table in (self._live, self._ignored):
            entry = table.get(key)
            if entry is not None:
                ref = entry[0] if isinstance(entry, tuple) else entry
                if ref() is st:
                    return True
        return False

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if self._known(st):
            return
        key, nbytes = id(st), st.nbytes()
        self._live[key] = (weakref.ref(st, lambda _, key=key: self._free(key)), nbytes, "other")
        self.other += nbytes
        self._sample()

    def _free(self, key: int) -> None:
        _, nbytes, category = self._live.pop(key)
        setattr(self, category, getattr(self, category) - nbytes)
        self._sample()

    def _sample(self) -> None:
        self.samples.append((self.other, self.root_grads, self.block_grads))

    def watch_grads(self, model: torch.nn.Module) -> None:
        """Reclassify each parameter's gradient when autograd stores it: `block_grads` for the
        transformer blocks' parameters, `root_grads` for the others (embeddings, norm, output)."""

        def hook(param: torch.Tensor, category: str) -> None:
            st = param.grad.untyped_storage()
            entry = self._live.get(id(st))
            if entry is not None and entry[0]() is st and entry[2] == "other":
                self._live[id(st)] = (entry[0], entry[1], category)
                self.other -= entry[1]
                setattr(self, category, getattr(self, category) + entry[1])

        for name, param in model.named_parameters():
            category = "block_grads" if name.startswith("layers.") else "root_grads"
            param.register_post_accumulate_grad_hook(lambda p, c=category: hook(p, c))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


# --------------------------------------------------------------------------------------------------
# Simulation of one micro-batch on fake tensors
# --------------------------------------------------------------------------------------------------


@dataclass
class Simulation:
    """Bytes measured for one micro-batch of one stage, one rank without parallelism."""

    saved: int
    """Tensors alive at the end of the forward (activations saved for backward, the loss)."""
    samples: list[tuple[int, int, int]]
    """(other, root gradients, block gradients) over the forward and backward."""
    root_grad_bytes: int
    block_grad_bytes: int
    seconds: float


def _cp_attention(cp: int):
    """Attention of a rank's sequence share to the keys and values of the whole sequence, with the
    memory behaviour of parallelisms.context_parallel.allgather_kv_attention on rank 0: an
    all-gather of the stacked k/v (here: copies), the reordering copy, and two query chunks attending
    to the keys up to their end under a boolean mask."""

    def attention(q, k, v):
        seq_dim = k.dim() - 2
        gathered = torch.stack([k, v]).repeat_interleave(cp, dim=seq_dim + 1)  # the all-gather's output
        half = gathered.shape[seq_dim + 1] // 2
        full = torch.cat([gathered.narrow(seq_dim + 1, 0, half), gathered.narrow(seq_dim + 1, half, half).flip(seq_dim + 1)], dim=seq_dim + 1)
        k, v = full[0], full[1]
        chunk = q.shape[2] // 2
        outputs = []
        for q_chunk, index in zip(q.split(chunk, dim=2), (0, 2 * cp - 1)):
            end = (index + 1) * chunk
            mask = torch.ones(chunk, end, dtype=torch.bool).tril(diagonal=end - chunk)
            outputs.append(F.scaled_dot_product_attention(q_chunk, k[:, :, :end], v[:, :, :end], attn_mask=mask,
                                                          enable_gqa=q.shape[1] != k.shape[1]))
        return torch.cat(outputs, dim=2)

    return attention


def _loss_fn():
    """train.py's loss, so that the simulation runs the very ops the trainer runs."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from train import cross_entropy_loss

    return cross_entropy_loss


def checkpoint_period(ac_mode: str, ac_option: str) -> int:
    """Blocks after which the activation checkpointing pattern repeats (N for selective by layer)."""
    return int(ac_option) if ac_mode == "selective" and ac_option.isdigit() and int(ac_option) > 0 else 1


def blocks_to_simulate(n_blocks: int, ac_mode: str, ac_option: str) -> int:
    """How many blocks the simulation runs: a first block (its input is the embeddings') and two
    periods of the checkpointing pattern (two blocks without selective-by-layer checkpointing),
    with the blocks left out a whole number of periods; never more than the stage holds."""
    period = checkpoint_period(ac_mode, ac_option)
    k = 1 + 2 * period
    k += (n_blocks - k) % period
    return min(n_blocks, k)


def simulate_micro_batch(model_package, args, *, batch: int, seq: int, dtype: torch.dtype, ac_mode: str = "none",
                         ac_option: str = "2", n_blocks: int | None = None, first: bool = True, last: bool = True,
                         cp: int = 1, document_masking: bool = False, simulate_blocks: int | None = None) -> Simulation:
    """Forward and backward of `batch` sequences of `seq` tokens through a stage of `n_blocks` blocks
    (default: the model's; with the embeddings if `first`, the norm, output and loss if `last`) on
    fake tensors.

    Only `simulate_blocks` blocks run (default: `blocks_to_simulate`); the others repeat the
    simulated ones, so their effect is added exactly: think of them as inserted after the first
    block and one period of the checkpointing pattern. From the end of that period's forward until
    its backward starts, each of them holds what one block of the period leaves alive; from then on
    they are done, their activations freed and their gradients stored. Over the inserted blocks,
    what is alive changes by the same amount every period, plus the same ups and downs within each
    period, so its highest point is in the first or the last of them, which look exactly like the
    simulated periods on either side of the insertion point: the simulated timeline holds it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from parallelisms.activation_checkpoint import apply_activation_checkpointing

    start = time.perf_counter()
    n_blocks = args.n_layers if n_blocks is None else n_blocks
    k = blocks_to_simulate(n_blocks, ac_mode, ac_option) if simulate_blocks is None else min(simulate_blocks, n_blocks)
    stage_args = type(args)(**vars(args))
    stage_args.n_layers = k
    loss_fn = _loss_fn() if last else None
    with FakeTensorMode():
        model = model_package.Transformer(stage_args)
        if not first:
            model.tok_embeddings = None
        if not last:
            model.norm = model.output = None
        if dtype != torch.float32:  # FSDP's mixed precision: parameters in the compute dtype, buffers as they are
            converted = {}
            for module in model.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None:
                        converted.setdefault(id(p), torch.nn.Parameter(p.detach().to(dtype)))
                        module._parameters[name] = converted[id(p)]
        if cp > 1:
            for module in model.modules():
                if hasattr(module, "sdpa"):
                    module.sdpa = _cp_attention(cp)
        apply_activation_checkpointing(model.layers, ac_mode, ac_option)
        model.train()
        tracker = StorageTracker()
        tracker.ignore([*model.parameters(), *model.buffers()])
        tracker.watch_grads(model)

        # Where the blocks left out would run (after the first block and one period), and how much
        # each block leaves alive when its forward is done.
        period = checkpoint_period(ac_mode, ac_option)
        marks, growth = {}, []

        def before(module, inputs):
            growth.append(-tracker.other)

        def after(module, inputs, output):
            growth[-1] += tracker.other

        def insertion_point(module, inputs, output):
            marks["forward"] = len(tracker.samples)
            output.register_hook(lambda grad: marks.setdefault("backward", len(tracker.samples)) and None)

        blocks = list(model.layers.values())
        for block in blocks:
            block.register_forward_pre_hook(before)
            block.register_forward_hook(after)
        if k < n_blocks:
            blocks[period].register_forward_hook(insertion_point)

        with tracker:
            if first:
                inputs = torch.zeros(batch, seq, dtype=torch.long)
            else:  # hidden states received from the previous stage, kept for its backward
                inputs = torch.zeros(batch, seq, stage_args.dim, dtype=dtype, requires_grad=True)
            documents = torch.zeros(batch, seq, dtype=torch.long) if document_masking and first else None
            if last:
                labels = torch.zeros(batch, seq, dtype=torch.long)
                out = loss_fn(model(inputs, documents), labels)
            else:
                out = model(inputs, documents)
            saved = tracker.other  # with a stage's output, which the pipeline keeps for its backward
            if last:
                out.backward()
            else:
                grad = torch.ones_like(out)  # the gradient received from the next stage
                out.backward(grad)
                del grad
            del out, inputs
        root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers.")) * dtype.itemsize
        block = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0.")) * dtype.itemsize
    samples = tracker.samples
    extra = n_blocks - k
    if extra:
        per_block = sum(growth[1 : 1 + period]) // period
        fwd, bwd = marks["forward"], marks["backward"]
        samples = (samples[:fwd] + [(o + extra * per_block, r, b) for o, r, b in samples[fwd:bwd]]
                   + [(o, r, b + extra * block) for o, r, b in samples[bwd:]])
        saved += extra * per_block
    return Simulation(saved, samples, root, block * n_blocks, time.perf_counter() - start)


# --------------------------------------------------------------------------------------------------
# Parameters per rank
# --------------------------------------------------------------------------------------------------


def _tp_shard_dims(model, model_name: str) -> dict[str, int | None]:
    """Parameter name -> the dim tensor parallelism splits (None: replicated), from the model's TP plan."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    try:
        plan = importlib.import_module(f"models.{model_name}.parallelize").tensor_parallel_plan(model, False)
    except (ImportError, AttributeError):
        plan = {}
    dims = {}
    for name, p in model.named_parameters():
        module_name = name.rpartition(".")[0]
        style = plan.get(module_name)
        if isinstance(style, ColwiseParallel):
            dims[name] = 0
        elif isinstance(style, RowwiseParallel):
            dims[name] = 0 if isinstance(model.get_submodule(module_name), torch.nn.Embedding) else 1
        elif plan or p.dim() < 2:
            dims[name] = None
        else:  # no plan known: assume every matrix is split
            dims[name] = 0
    return dims


def _local_numel(shape: tuple[int, ...], tp_dim: int | None, tp: int, fsdp: int) -> int:
    """Elements rank 0 holds: the TP shard (ceil), then FSDP's dim-0 chunk of it (ceil)."""
    shape = list(shape)
    if tp_dim is not None and tp > 1:
        shape[tp_dim] = math.ceil(shape[tp_dim] / tp)
    if fsdp > 1 and shape:
        shape[0] = math.ceil(shape[0] / fsdp)
    return math.prod(shape)


@dataclass
class StageParams:
    """Parameter element counts of a set of pipeline stages on one rank."""

    total: int = 0  # whole model, unsharded
    tp: int = 0  # this rank's stages after TP, before FSDP
    rank: int = 0  # after TP and FSDP: what this rank stores
    root_tp: int = 0  # embeddings, norm, output of these stages, after TP
    block_tp: int = 0  # one transformer block, after TP


# --------------------------------------------------------------------------------------------------
# The estimate
# --------------------------------------------------------------------------------------------------

PARTS = ("baseline", "parameters", "gradients", "optimizer", "activations", "fsdp_buffers", "temporary", "allocator")
LABELS = {
    "baseline": "baseline (process before training)",
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer": "optimizer state (AdamW)",
    "activations": "activations (saved for backward)",
    "fsdp_buffers": "FSDP buffers",
    "temporary": "temporary (working memory at the peak)",
    "allocator": "allocator slack",
}


@dataclass
class MemoryEstimate:
    parts: dict[str, int]
    """Bytes per PARTS entry; they add up to `total`."""
    notes: dict[str, str]
    """A short explanation per part."""
    header: list[str]
    remarks: list[str] = field(default_factory=list)
    target: str = "cpu"
    phase: str = "backward"
    """Where the peak is: forward/backward, or the optimizer step."""
    saved_activations: int = 0
    """Activation bytes of the forward/backward phase (also when the optimizer step is the peak)."""
    other_phase_total: int = 0
    n_params: int = 0
    params_on_rank: int = 0
    pp_rank: int = 0
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def total_gib(self) -> float:
        return self.total / GiB

    def format(self) -> str:
        width = max(len(LABELS[p]) for p in PARTS)
        lines = list(self.header) + [""]
        for part in PARTS:
            lines.append(f"  {LABELS[part]:<{width}}  {self.parts[part] / GiB:9.3f} GiB   {self.notes.get(part, '')}")
        lines.append(f"  {'total':<{width}}  {self.total / GiB:9.3f} GiB   peak in the {self.phase}")
        other = "optimizer step" if self.phase == "forward/backward" else "forward/backward"
        lines.append(f"  ({other}: {self.other_phase_total / GiB:.3f} GiB)")
        if self.remarks:
            lines += [""] + [f"note: {r}" for r in self.remarks]
        lines.append(f"(estimated in {self.seconds:.1f} s)")
        return "\n".join(lines)


def default_target(config: Config) -> str:
    """cuda when this machine has it or the config computes in a half-precision dtype, else cpu."""
    if torch.cuda.is_available() or config.training.mixed_precision_param != "float32":
        return "cuda"
    return "cpu"


def vocab_size(config: Config) -> tuple[int, str | None]:
    """The tokenizer's vocabulary, or Llama 3's when the tokenizer file is not on this machine."""
    if config.model.vocab_size is not None:
        return config.model.vocab_size, None
    from components.tokenizer import build_tokenizer

    if not Path(config.model.tokenizer_path).exists():
        return LLAMA3_VOCAB, f"tokenizer {config.model.tokenizer_path} not found: vocabulary of {LLAMA3_VOCAB} (Llama 3's) assumed"
    return build_tokenizer(config.model.tokenizer_path).vocab_size, None


def cpu_baseline_bytes(config: Config) -> int:
    """Peak resident memory of this process after importing what the trainer imports for this config."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    importlib.import_module("train")
    importlib.import_module(f"models.{config.model.name}")
    if config.training.dataset == "hf" or config.validation.enable:
        importlib.import_module("datasets")
    if config.metrics.enable_tensorboard:
        importlib.import_module("torch.utils.tensorboard")
    return peak_rss_bytes()


def _in_flight(schedule: str, multi: bool, n_mb: int, pp: int, pp_rank: int, stages_on_rank: int) -> int:
    """Micro-batches whose activations a stage of rank `pp_rank` holds at once (approximate for the
    multi-stage schedules: their warm-up depth spread over the rank's stages)."""
    if schedule in ("GPipe", "LoopedBFS"):
        return n_mb
    if not multi:  # 1F1B
        return max(1, min(n_mb, pp - pp_rank))
    warmup = (stages_on_rank - 1) * pp + 2 * (pp - 1 - pp_rank) + 1
    return max(1, min(n_mb, math.ceil(warmup / stages_on_rank)))


def estimate(config: Config, world_size: int | None = None, target: str | None = None,
             baseline_bytes: int | None = None) -> MemoryEstimate:
    """The peak memory of the most loaded rank for `config` on `world_size` processes (default: the
    product of the parallelism degrees, dp_shard = -1 counting as 1). `target`: cpu or cuda
    (default: `default_target`); on cpu `baseline_bytes` defaults to `cpu_baseline_bytes`."""
    start = time.perf_counter()
    target = target or default_target(config)
    if target not in ("cpu", "cuda"):
        raise ConfigError(f"target must be cpu or cuda, got {target!r}")
    remarks: list[str] = []
    if target == "cpu" and baseline_bytes is None:
        baseline_bytes = cpu_baseline_bytes(config)
    p = config.parallelism
    if world_size is None:
        others = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree
        world_size = others * max(p.data_parallel_shard_degree, 1)
    dims = ParallelDims.from_config(p, world_size)
    model_package = importlib.import_module(f"models.{config.model.name}")
    vocab, note = vocab_size(config)
    if note:
        remarks.append(note)
    args = model_package.build_model_args(config, vocab)
    training = config.training
    if training.seq_len % dims.cp or (dims.cp > 1 and training.seq_len % (2 * dims.cp)):
        raise ConfigError(f"training.seq_len {training.seq_len} must be divisible by 2 x cp ({2 * dims.cp})")

    # The same decisions train.py's parallelize and pipeline split make.
    parallelize_module = importlib.import_module(f"models.{config.model.name}.parallelize")
    pipeline_module = importlib.import_module(f"models.{config.model.name}.pipeline")
    fsdp_on = parallelize_module.uses_fsdp(config, dims)
    compute = DTYPES[training.mixed_precision_param] if fsdp_on else torch.float32
    reduce_dtype = DTYPES[training.mixed_precision_reduce]
    fsdp_degree = dims.dp_shard * dims.cp if fsdp_on else 1
    tp = dims.tp
    dp = dims.dp
    local_per_step = training.local_batch_size * dp
    global_batch = local_per_step if training.global_batch_size == -1 else training.global_batch_size
    if global_batch % local_per_step:
        raise ConfigError(f"training.global_batch_size {global_batch} must be a multiple of local_batch_size x dp = {local_per_step}")
    grad_accum = global_batch // local_per_step

    # Parameters of the whole model on meta: names, shapes, TP split.
    with torch.device("meta"):
        meta_model = model_package.Transformer(args)
    shapes = {n: tuple(t.shape) for n, t in meta_model.named_parameters()}
    tp_dims = _tp_shard_dims(meta_model, config.model.name)
    n_params = sum(math.prod(s) for s in shapes.values())
    del meta_model

    def count(names: list[str]) -> StageParams:
        keep = [n for n in shapes if any(n == m or n.startswith(m + ".") for m in names)]
        sp = StageParams()
        sp.total = sum(math.prod(shapes[n]) for n in keep)
        sp.tp = sum(_local_numel(shapes[n], tp_dims[n], tp, 1) for n in keep)
        sp.rank = sum(_local_numel(shapes[n], tp_dims[n], tp, fsdp_degree) for n in keep)
        sp.root_tp = sum(_local_numel(shapes[n], tp_dims[n], tp, 1) for n in keep if not n.startswith("layers."))
        block = [n for n in shapes if n.startswith("layers.0.")]
        sp.block_tp = sum(_local_numel(shapes[n], tp_dims[n], tp, 1) for n in block)
        return sp

    # Stages held by the ranks to estimate: one rank without PP; the first and last with PP.
    ac_mode, ac_option = config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option
    if dims.pp > 1:
        from parallelisms.pipeline import is_multi_stage, is_v_style, stage_ids_for_rank

        schedule = p.pipeline_parallel_schedule
        per_rank = pipeline_module.stages_per_rank(schedule, dims.pp, args.n_layers, p.pipeline_parallel_layers_per_stage)
        num_stages = dims.pp * per_rank
        names = pipeline_module.pipeline_module_names(args.n_layers, num_stages, p.pipeline_parallel_layers_per_stage)
        mb_size = p.pipeline_parallel_microbatch_size
        if training.local_batch_size % mb_size:
            raise ConfigError(f"training.local_batch_size must be a multiple of parallelism.pipeline_parallel_microbatch_size {mb_size}")
        n_mb = training.local_batch_size // mb_size
        multi = is_multi_stage(schedule)
        ranks = sorted({0, dims.pp - 1})
        layouts = {r: stage_ids_for_rank(r, dims.pp, per_rank, is_v_style(schedule)) for r in ranks}
        micro_batch = mb_size
    else:
        names, n_mb, multi, schedule = pipeline_module.pipeline_module_names(args.n_layers, 1), 1, False, ""
        layouts, micro_batch = {0: [0]}, training.local_batch_size

    sim_cache: dict[tuple, Simulation] = {}
    candidates = []
    for pp_rank, stage_ids in layouts.items():
        stage_names = [name for s in stage_ids for name in names[s]]
        params = count(stage_names)
        stages = []
        for s in stage_ids:
            blocks = sum(1 for n in names[s] if n.startswith("layers."))
            first, last = "tok_embeddings" in names[s], "output" in names[s]
            key = (blocks, first, last)
            if key not in sim_cache:
                sim_cache[key] = simulate_micro_batch(
                    model_package, args, batch=micro_batch, seq=training.seq_len // dims.cp, dtype=compute,
                    ac_mode=ac_mode, ac_option=ac_option, n_blocks=blocks, first=first, last=last, cp=dims.cp,
                    document_masking=training.document_masking,
                )
            in_flight = _in_flight(schedule, multi, n_mb, dims.pp, pp_rank, len(stage_ids)) if dims.pp > 1 else 1
            stages.append((sim_cache[key], in_flight, blocks))
        candidates.append(_rank_estimate(
            pp_rank, params, stages, config=config, dims=dims, fsdp_on=fsdp_on, fsdp_degree=fsdp_degree,
            compute=compute, reduce_dtype=reduce_dtype, grad_accum=grad_accum, n_mb=n_mb, micro_batch=micro_batch,
            args=args, target=target, baseline=baseline_bytes or 0,
        ))
    result = max(candidates, key=lambda e: e.total)
    result.n_params = n_params
    where = f", pipeline rank {result.pp_rank} (the larger of the first and last)" if dims.pp > 1 else ""
    dtype_name = str(compute).removeprefix("torch.")
    ac = ac_mode if ac_mode != "selective" else f"selective ({ac_option})"
    result.header = [
        f"Peak memory estimate per rank{where}: {config.model.name} {config.model.flavor}, "
        f"{n_params / 1e6:,.2f}M parameters, {result.params_on_rank / 1e6:,.2f}M on this rank",
        f"  layout: world size {world_size}: {dims.describe()}; FSDP {'over ' + str(fsdp_degree) + ' ranks' if fsdp_on else 'off'}; "
        f"target {target} ({'peak resident memory' if target == 'cpu' else 'torch.cuda.max_memory_reserved'})",
        f"  step: micro-batch {micro_batch} x {training.seq_len // dims.cp} tokens, compute {dtype_name}, "
        f"activation checkpointing {ac}, gradient accumulation {grad_accum}"
        + (f", {n_mb} pipeline micro-batches ({schedule})" if dims.pp > 1 else ""),
        f"  method: persistent state counted from shapes; activations and temporaries from a simulated "
        f"forward+backward on fake tensors ({sum(s.seconds for s in sim_cache.values()):.1f} s)",
    ]
    if config.compile.enable:
        remarks.append("compile.enable: the simulation is of eager mode; compiled blocks usually save less (an upper bound)")
    if config.float8.enable:
        remarks.append("float8.enable: float8 casts are not simulated (matmul inputs counted in the compute dtype)")
    if dims.pp > 1 and multi:
        remarks.append(f"{schedule}: the micro-batches in flight per stage are approximated from the schedule's warm-up depth")
    if target == "cuda":
        remarks.append("CUDA: the CUDA context, NCCL and cuBLAS workspaces are not included (nor in max_memory_reserved); "
                       "allocator fragmentation typically adds a few percent")
    result.remarks = remarks + result.remarks
    result.seconds = time.perf_counter() - start
    return result


def _rank_estimate(pp_rank, params: StageParams, stages, *, config, dims, fsdp_on, fsdp_degree, compute, reduce_dtype,
                   grad_accum, n_mb, micro_batch, args, target, baseline) -> MemoryEstimate:
    """Combine the exact parameter counts and the stage simulations into one rank's breakdown."""
    tp, cb, rb = dims.tp, compute.itemsize, reduce_dtype.itemsize
    training, p = config.training, config.parallelism
    parts = dict.fromkeys(PARTS, 0)
    notes: dict[str, str] = {}
    remarks: list[str] = []
    parts["parameters"] = params.rank * 4
    notes["parameters"] = f"{params.rank:,} fp32 (master copy" + (f", 1/{fsdp_degree} by FSDP" if fsdp_degree > 1 else "") + (f", 1/{tp} by TP" if tp > 1 else "") + ")"
    parts["optimizer"] = params.rank * 8
    notes["optimizer"] = "exp_avg + exp_avg_sq, fp32"
    full_grads = params.rank * 4

    # Activations: the saved tensors of each stage times its micro-batches in flight, / tp, plus the
    # full-sequence inputs that non-checkpointed blocks save for their column-parallel matmuls.
    ac_mode, ac_option = config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option
    activations = 0
    for sim, in_flight, blocks in stages:
        saved = sim.saved / tp
        if tp > 1:
            if ac_mode == "none":
                plain = blocks
            elif ac_mode == "selective" and ac_option.isdigit():
                plain = blocks - blocks // int(ac_option)
            else:
                plain = 0
            saved += plain * 2 * micro_batch * (training.seq_len // dims.cp) * args.dim * cb * (1 - 1 / tp)
        activations += saved * in_flight
    parts["activations"] = int(activations)
    notes["activations"] = f"{micro_batch} x {training.seq_len // dims.cp} tokens" + (
        f", micro-batches in flight: {'/'.join(str(s[1]) for s in stages)}" if dims.pp > 1 else "")

    # Gradient bytes per simulated byte: FSDP keeps the root's gradients unsharded in the compute
    # dtype until the end of backward and reduce-scatters each block's into fp32 shards; without
    # FSDP every gradient is fp32 and whole (/ tp).
    root_scale = 1 / tp
    block_scale = (4 / cb) / (tp * fsdp_degree) if fsdp_on else 1 / tp
    accumulating = grad_accum > 1 or (dims.pp > 1 and n_mb > 1)
    accumulated = 0
    if accumulating:
        # Gradients from earlier micro-batches are alive throughout: FSDP (no reduce-scatter until the
        # last micro-batch) keeps them unsharded in the reduce dtype, plain modules as .grad (fp32);
        # a micro-batch's new gradients are added into them (FSDP: one block at a time).
        accumulated = params.tp * (rb if reduce_dtype != compute else cb) if fsdp_on else full_grads
        block_scale = 0
        root_scale = root_scale if fsdp_on else 0
    # The peak of the forward/backward timeline, the last stage's sample weighted as scaled.
    best = (-1.0, 0.0, 0.0)
    for sim, in_flight, _ in stages:
        others_saved = activations - sim.saved / tp  # other micro-batches and stages stay alive meanwhile
        for other, root_g, block_g in sim.samples:
            grads = root_g * root_scale + block_g * block_scale
            value = other / tp + grads + others_saved
            if value > best[0]:
                best = (value, other / tp - sim.saved / tp, grads)
    _, working, grads_at_peak = best
    parts["gradients"] = int(grads_at_peak + accumulated)
    notes["gradients"] = (f"alive at the peak{', with the unsharded ones of the root' if fsdp_on else ''} "
                          f"(all, fp32{' sharded' if fsdp_on else ''}: {full_grads / GiB:.3f} GiB)" if not accumulating
                          else f"accumulated over micro-batches ({'unsharded, FSDP without reduce-scatter' if fsdp_on else 'fp32'})")
    parts["temporary"] = int(max(0.0, working))
    notes["temporary"] = "logits/loss in fp32, activation gradients, recomputation"
    if working < 0:  # the peak is late in backward: part of the activations is freed by then
        parts["activations"] = int(activations + working)
        notes["activations"] += f"; alive at the peak, late in backward (saved at the end of forward: {activations / GiB:.3f} GiB)"

    if fsdp_on:
        reshard = {"always": True, "never": False, "default": dims.pp == 1}[p.fsdp_reshard_after_forward]
        stage_blocks = sum(s[2] for s in stages)
        gathered_blocks = min(2, stage_blocks) if reshard else stage_blocks
        gathered = (params.root_tp + gathered_blocks * params.block_tp) * cb
        grad_buffer = params.block_tp * (cb + (rb if reduce_dtype != compute else 0))
        parts["fsdp_buffers"] = gathered + grad_buffer
        notes["fsdp_buffers"] = (f"all-gathered {str(compute).removeprefix('torch.')} params: root + "
                                 f"{gathered_blocks} block(s); one block's grads before reduce-scatter")
    if target == "cpu":
        parts["baseline"] = baseline + CPU_TRAINER_STATE
        notes["baseline"] = (f"peak resident memory here after importing the trainer's modules ({baseline / GiB:.3f} GiB) "
                             f"+ {CPU_TRAINER_STATE / GiB:.2f} GiB of trainer state")
        parts["allocator"] = int(CPU_HEAP_FRAGMENTATION * (parts["activations"] + parts["temporary"]))
        notes["allocator"] = f"glibc heap fragmentation: {CPU_HEAP_FRAGMENTATION:.0%} of activations + temporary"
    else:
        notes["baseline"] = "not part of max_memory_reserved"
        notes["allocator"] = "not modelled (caching allocator: typically a few %)"

    # The optimizer step: all parameters, gradients, states, and foreach AdamW's fp32 temporaries.
    impl = config.optimizer.implementation
    opt_temp = {"foreach": params.rank * 4, "fused": 0}.get(impl, max(_largest_param(args, tp, fsdp_degree), 0) * 4)
    opt_parts = dict.fromkeys(PARTS, 0) | {k: parts[k] for k in ("baseline", "parameters", "optimizer")}
    opt_parts["gradients"], opt_parts["temporary"] = full_grads, opt_temp
    if target == "cpu":
        opt_parts["allocator"] = int(CPU_HEAP_FRAGMENTATION * opt_temp)
    opt_total = sum(opt_parts.values())
    estimate = MemoryEstimate(parts, notes, [], remarks, target, "forward/backward", int(activations))
    if opt_total > estimate.total:
        fwd_total, parts = estimate.total, opt_parts
        notes = notes | {"gradients": "all, fp32", "temporary": f"{impl} AdamW temporaries", "activations": "none alive"}
        estimate = MemoryEstimate(parts, notes, [], remarks, target, "optimizer step", int(activations), fwd_total)
    else:
        estimate.other_phase_total = opt_total
    estimate.params_on_rank, estimate.pp_rank = params.rank, pp_rank
    return estimate


def _largest_param(args, tp: int, fsdp: int) -> int:
    return max(args.vocab_size * args.dim, args.dim * args.ffn_hidden_dim) // (tp * fsdp)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    world_size = target = None
    rest = []
    i = 0
    while i < len(argv):
        if argv[i] in ("--world-size", "--world_size", "--target"):
            if i + 1 >= len(argv):
                print(f"{argv[i]} needs a value", file=sys.stderr)
                return 2
            if argv[i] == "--target":
                target = argv[i + 1]
            elif argv[i + 1].isdigit() and int(argv[i + 1]) > 0:
                world_size = int(argv[i + 1])
            else:
                print(f"--world-size must be a positive integer, got {argv[i + 1]!r}", file=sys.stderr)
                return 2
            i += 2
        elif argv[i] in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            rest.append(argv[i])
            i += 1
    try:
        config = load_config(rest)
        # Before anything else is built: this process is then what the trainer is before training.
        baseline = cpu_baseline_bytes(config) if (target or default_target(config)) == "cpu" else None
        result = estimate(config, world_size, target, baseline)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
