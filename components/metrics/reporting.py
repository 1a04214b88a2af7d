"""What a run reports: one readable log line per logged step, the same numbers as JSON lines in
<dump_folder>/metrics.jsonl, TensorBoard events under <dump_folder>/tb/ and, with metrics.enable_wandb, the same
scalars in a Weights & Biases run (components/metrics/wandb_logging.py).

Throughput is per device (process): tokens/s = tokens of the step across all ranks / seconds /
world size, which is what MFU is computed from."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from components.checkpoint.durable import NO_SPACE, append_whole
from components.config import DTYPES
from components.metrics import wandb_logging

logger = logging.getLogger(__name__)

# Dense peak TFLOP/s (no sparsity) of the GPUs we know by the dtype of the matmuls, matched against
# the device name, first match wins (PCIe and NVL cards before the SXM ones of the same name); fp32
# matmuls run as TF32.
GPU_PEAK_TFLOPS = {
    "B200": {"float8": 4500.0, "bfloat16": 2250.0, "float32": 1100.0},
    "H200 NVL": {"float8": 1671.0, "bfloat16": 835.0, "float32": 418.0},
    "H200": {"float8": 1979.0, "bfloat16": 989.0, "float32": 494.0},
    "H100 PCIe": {"float8": 1513.0, "bfloat16": 756.0, "float32": 378.0},
    "H100 NVL": {"float8": 1671.0, "bfloat16": 835.0, "float32": 418.0},
    "H100": {"float8": 1979.0, "bfloat16": 989.0, "float32": 494.0},
    "H800": {"float8": 1979.0, "bfloat16": 989.0, "float32": 494.0},
    "A100": {"bfloat16": 312.0, "float32": 156.0},
    "A800": {"bfloat16": 312.0, "float32": 156.0},
}


def peak_flops(device: torch.device, configured: float, dtype: str = "bfloat16") -> tuple[float | None, str]:
    """Peak FLOP/s of one device for MFU with matmuls in `dtype` (float8, bfloat16, float32), and
    where the figure comes from; None where there is no trustworthy figure.

    A CPU has no datasheet peak we could look up, and a peak measured at start-up undercuts the
    training matmuls whenever the machine was busy while it was measured (MFU above 100%): without
    `metrics.peak_flops`, CPU runs and unknown GPUs log no MFU at all."""
    if configured > 0:
        return configured, "metrics.peak_flops"
    if device.type != "cuda":
        return None, f"no MFU on {device.type}: its peak FLOP/s is unknown; set metrics.peak_flops for one"
    name = torch.cuda.get_device_name(device)
    for key, by_dtype in GPU_PEAK_TFLOPS.items():
        if key in name:
            dtype = dtype if dtype in by_dtype else "bfloat16"
            return by_dtype[dtype] * 1e12, f"{name} {dtype} datasheet"
    return None, f"no MFU on {name!r}: its peak FLOP/s is not in the table; set metrics.peak_flops for one"


SLOW_STEP_SECONDS = 180
FAST_CPU_FLOPS = 5e12
"""More FLOP/s than a CPU's matmuls reach: a step under SLOW_STEP_SECONDS at this rate needs no measurement."""


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 1024, repeats: int = 3) -> float:
    """FLOP/s of an n x n matmul on `device`, measured now. Filled with a constant, not random numbers,
    so that the run's random stream (its initial weights) stays the same."""
    a = torch.full((n, n), 0.5, device=device, dtype=dtype)
    a @ a
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return repeats * 2 * n**3 / (time.perf_counter() - start)


def slow_step_warning(flops_per_device: float, device: torch.device, configured: float, dtype: str) -> str | None:
    """A warning when one optimizer step of `flops_per_device` would take more than SLOW_STEP_SECONDS at the
    device's peak: its datasheet's or metrics.peak_flops, else a matmul measured now. The measured figure
    serves this estimate only, never MFU (see peak_flops); the estimate is a lower bound."""
    peak, source = peak_flops(device, configured, dtype)
    if peak is None:
        if device.type == "cpu" and flops_per_device < SLOW_STEP_SECONDS * FAST_CPU_FLOPS:
            return None
        peak, source = matmul_flops(device, DTYPES.get(dtype, torch.bfloat16)), "a matmul measured at start-up"
    seconds = flops_per_device / peak
    if seconds <= SLOW_STEP_SECONDS:
        return None
    return (f"one optimizer step will take at least {seconds / 60:,.0f} minutes: {flops_per_device:.2e} FLOPs per "
            f"device at {peak / 1e12:.2f} TFLOP/s ({source}); shorten training.seq_len or the batch, or use a "
            "smaller model")


def peak_rss_bytes() -> int:
    """Peak resident memory of this process. On Linux, VmHWM of /proc/self/status: ru_maxrss
    carries over across execve, so a process started by a large one (pytest, a notebook) would
    report its parent's peak until it exceeds it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


IDENTIFIERS = ("step", "data_hash", "slowest_rank")
"""Fields of a step's record that name something rather than measure it: in metrics.jsonl, not plotted as scalars."""


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return peak_rss_bytes() / 2**30


def keep_records_up_to(path: Path, step: int) -> None:
    """Rewrite a metrics.jsonl without the records of steps after `step`, and without a last line
    that a killed process left unfinished."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        if json.loads(line).get("step", 0) <= step:
            kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(training records, validation records) of a metrics.jsonl, in step order. A line cut short
    by a killed run is skipped; where a step was logged twice, the later record wins."""
    train, val = {}, {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in record:
                train[record["step"]] = record
            elif any(key.startswith("val_loss") for key in record):
                val[record["step"]] = record
    return [train[s] for s in sorted(train)], [val[s] for s in sorted(val)]


def open_for_appending(path: Path) -> int:
    """A file descriptor that appends to `path` (created if absent), for append_whole."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


class MetricsLogger:
    """Rank 0 writes; other ranks only keep time so that all of them agree on what was measured."""

    def __init__(self, dump_folder: Path, cfg, device: torch.device, flops_per_token: float, world_size: int,
                 is_writer: bool, config_text: str = "", matmul_dtype: str = "float32", resume_step: int | None = 0):
        """`resume_step`: the step a resumed run continues after; what an earlier attempt logged for
        later steps is dropped from metrics.jsonl and TensorBoard, as those steps are run again. None for a replica
        group, which learns it at its first quorum (continue_after)."""
        self.device, self.flops_per_token, self.world_size = device, flops_per_token, world_size
        self.log_freq, self.is_writer = cfg.log_freq, is_writer
        self.peak_flops, source = peak_flops(device, cfg.peak_flops, matmul_dtype)
        self.jsonl = self.tb = self.wandb = None
        if is_writer:
            if cfg.enable_wandb:  # first: a run W&B refuses (not logged in) has written nothing yet
                self.wandb = wandb_logging.start_run(dump_folder, cfg, config_text, resume_step or 0)
            logger.info(f"MFU against {self.peak_flops / 1e12:.2f} TFLOP/s per device ({source})"
                        if self.peak_flops else source)
            self.jsonl_path, self.tb_folder = dump_folder / "metrics.jsonl", dump_folder / cfg.save_tb_folder
            if resume_step is not None:
                keep_records_up_to(self.jsonl_path, resume_step)
            self.jsonl = open_for_appending(self.jsonl_path)
            if cfg.enable_tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.tb_folder), purge_step=resume_step + 1 if resume_step else None)
                # The first write imports most of TensorBoard (seconds): do it now, not inside a step.
                self.to_tensorboard(lambda tb: tb.add_text("config", f"```\n{config_text}\n```"))
        self.unwritten: list[str] = []
        """metrics.jsonl lines that found no space yet (write)."""
        self.reset_timer()

    def write(self, record: dict) -> None:
        """One metrics.jsonl line, whole or not at all. Where the disk is full the lines wait in memory (said once)
        and go out in order with the first that finds room: a full disk neither stops the run nor loses a record
        while it lasts (a checkpoint that found no space frees its room: components/checkpoint/dcp.py)."""
        self.unwritten.append(json.dumps(record) + "\n")
        self.write_unwritten()

    def write_unwritten(self) -> None:
        try:
            while self.unwritten:
                append_whole(self.jsonl, self.unwritten[0])
                del self.unwritten[0]
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise
            if len(self.unwritten) == 1:
                logger.warning(f"no space left for {self.jsonl_path}: its records wait in memory and are written, "
                               "in order, once there is room")

    def to_tensorboard(self, write: Callable[[Any], None]) -> None:
        """write(SummaryWriter), unless TensorBoard is off; a full disk turns it off for the rest of the run, said
        in one line (metrics.jsonl keeps every record)."""
        if self.tb is None:
            return
        try:
            write(self.tb)
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise
            logger.warning(f"no space left for the TensorBoard events in {self.tb_folder}: TensorBoard stops here for "
                           "this run (metrics.jsonl keeps every record)")
            self.tb = None

    def continue_after(self, step: int, took_state: bool) -> None:
        """A replica group goes on after `step`: what it logged for later steps goes (they are run again); where it
        took a live group's state (`took_state`), the steps it did not train since its last record are marked as
        such, and its earlier records stay."""
        if not self.is_writer:
            return
        lines = self.jsonl_path.read_text().splitlines(keepends=True)
        records = [json.loads(line) for line in lines if line.endswith("\n")]  # not a line a killed run left unfinished
        if any(record.get("step", 0) > step for record in records):
            os.close(self.jsonl)
            keep_records_up_to(self.jsonl_path, step)
            self.jsonl = open_for_appending(self.jsonl_path)
            if self.tb is not None:
                from torch.utils.tensorboard import SummaryWriter

                self.tb.close()
                self.tb = SummaryWriter(str(self.tb_folder), purge_step=step + 1)
        last = max((r["step"] for r in records if "loss" in r and r["step"] <= step), default=0)
        if took_state and last < step:
            note = f"steps {last + 1} to {step} trained by the other replica groups: this group took their state"
            self.write({"step": step, "not_trained_here": [last + 1, step], "note": note})
            self.to_tensorboard(lambda tb: tb.add_text("replica_group", note, step))

    def reset_timer(self) -> None:
        self.tokens, self.start = 0, time.perf_counter()

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0

    def count_tokens(self, tokens: int) -> None:
        """Tokens a step consumed on all ranks; the logged rate covers every step since the last log."""
        self.tokens += tokens

    def log(self, step: int, loss: float, grad_norm: float, lr: float, counters: dict[str, int] | None = None) -> None:
        """One step's figures; `counters` (e.g. skipped steps) are added to the record as they are."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self.start
        tps = self.tokens / seconds / self.world_size
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_second": tps,
            "mfu": 100 * tps * self.flops_per_token / self.peak_flops if self.peak_flops else None,
            "memory_gib": peak_memory_gib(self.device),
            **(counters or {}),
        }
        if self.is_writer:
            mfu = f"mfu {record['mfu']:5.2f}%  " if record["mfu"] is not None else ""
            logger.info(
                f"step {step:>6}  loss {loss:8.4f}  grad_norm {grad_norm:7.3f}  lr {lr:.2e}  "
                f"tokens/s {tps:9,.0f}  {mfu}memory {record['memory_gib']:6.2f}GiB"
                + (f"  skipped {record['skipped_steps']}" if record.get("skipped_steps") else "")
                + (f"  moe max load {record['moe_max_load']:.2f}" if "moe_max_load" in record else "")
                + (f"  z_loss {record['z_loss']:.4f}" if "z_loss" in record else "")
                + (f"  mtp_loss {record['mtp_loss']:.4f}" if "mtp_loss" in record else "")
                + (f"  rank step time {record['rank_step_time_min']:.3f}-{record['rank_step_time_max']:.3f}s "
                   f"(slowest rank {record['slowest_rank']})" if "slowest_rank" in record else "")
            )
            self.write(record)
            self.scalars(step, {f"train/{key}": value for key, value in record.items()
                                if key not in IDENTIFIERS and value is not None})
        self.reset_timer()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Scalars by their tag, to TensorBoard and W&B where enabled."""
        self.to_tensorboard(lambda tb: [tb.add_scalar(tag, value, step) for tag, value in values.items()])
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def log_validation(self, step: int, losses: dict[str | None, float], seconds: float) -> None:
        """Log the validation loss of each source (None: the one unnamed source, logged as val_loss;
        others as val_loss/<name>); the seconds it took do not count against training throughput."""
        self.start += seconds
        if not self.is_writer:
            return
        record, scalars = {"step": step}, {}
        for name, loss in losses.items():
            suffix = "" if name is None else f"/{name}"
            perplexity = math.exp(min(loss, 100.0))
            logger.info(f"validation at step {step}{' on ' + name if name else ''}: loss {loss:8.4f}  "
                        f"perplexity {perplexity:10.2f}")
            record |= {f"val_loss{suffix}": loss, f"val_perplexity{suffix}": perplexity}
            scalars |= {f"validation/loss{suffix}": loss, f"validation/perplexity{suffix}": perplexity}
        logger.info(f"validation took {seconds:.1f}s")
        self.write(record)
        self.scalars(step, scalars)

    def log_evaluation(self, step: int, results: dict[str, dict[str, float]], seconds: float) -> None:
        """Log each task's acc and acc_norm (eval/<task>/<metric>); the seconds it took do not count
        against training throughput."""
        self.start += seconds
        if not self.is_writer:
            return
        record = {"step": step, "eval_seconds": seconds}
        for task, figures in results.items():
            logger.info(f"evaluation at step {step}: {task}  acc {figures['acc']:.4f}  acc_norm "
                        f"{figures['acc_norm']:.4f}  ({figures['examples']} examples)")
            record |= {f"eval/{task}/acc": figures["acc"], f"eval/{task}/acc_norm": figures["acc_norm"]}
        logger.info(f"evaluation took {seconds:.1f}s")
        self.write(record)
        self.scalars(step, {key: value for key, value in record.items() if key != "step"})

    def log_layers(self, step: int, layers: dict[int, dict[str, float]] | None) -> None:
        """Per-block statistics (components/metrics/per_layer.py): one metrics.jsonl record, and
        scalars layers/<field>/<layer>; nothing for a step without them (None)."""
        if not self.is_writer or not layers:
            return
        self.write({"step": step, "layers": layers})
        self.scalars(step, {f"layers/{field}/{layer}": value
                            for layer, fields in layers.items() for field, value in fields.items()})

    def log_expert_load(self, step: int, load: dict[int, torch.Tensor]) -> None:
        """Each MoE layer's tokens per expert over their mean, as histograms moe/expert_load/<layer>."""
        if not self.is_writer:
            return
        self.to_tensorboard(lambda tb: [tb.add_histogram(f"moe/expert_load/{layer}", values, step)
                                        for layer, values in load.items()])
        if self.wandb is not None:
            self.wandb.log({f"moe/expert_load/{layer}": wandb_logging.histogram(values)
                            for layer, values in load.items()}, step=step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.write_unwritten()
            if self.unwritten:
                logger.warning(f"{len(self.unwritten)} record(s) of {self.jsonl_path} lost: still no space left")
            os.close(self.jsonl)
        self.to_tensorboard(lambda tb: tb.close())
        if self.wandb is not None:
            self.wandb.finish()
