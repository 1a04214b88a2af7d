"""float8 training with torchao: Linear layers compute their matmuls in float8 with dynamic scales
(tensorwise: one scale per tensor; rowwise: one per row, more accurate, slower).

Real float8 matmuls need an SM 8.9+ GPU (H100 and newer); elsewhere torchao's emulation computes the
same casts and scaling in high precision, which is how the CPU tests exercise this path."""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from components.config import Float8

logger = logging.getLogger(__name__)


def float8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def gathers_float8(float8: Float8, tp_mesh: DeviceMesh, device: torch.device) -> bool:
    """Whether tensor parallelism's all-gathers move float8 rather than bf16 activations (torchao's float8 TP plan):
    with float8 on, tensorwise scales, over a process group whose backend for `device` all-gathers float8 (NCCL, and
    torch's fake one under scripts/preflight, which stands for it), which gloo cannot. (ProcessGroup._get_backend,
    private, asks the group itself for the device's backend; the public get_backend_config reads a registry of the
    configs that groups were made with.)"""
    if not (float8.enable and float8.recipe_name == "tensorwise"):
        return False
    return not isinstance(tp_mesh.get_group()._get_backend(device), dist.ProcessGroupGloo)


def pays_in_float8(out_features: int, in_features: int, recipe_name: str) -> bool:
    """Whether a Linear layer of this shape trains faster with float8 matmuls than in bf16: below these sizes
    the casts and scales cost more than the faster matmul saves. The thresholds follow torchao's measurements
    of each recipe on H100 (torchao/float8's README); on the H200, Llama 3 1B (dim 2048) ran 0.84x of bf16
    with every layer in float8 rowwise."""
    n, k = out_features, in_features
    if recipe_name == "rowwise":
        return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)
    return not (k <= 4096 and n <= 1024)


def convert_to_float8(model: nn.Module, recipe_name: str, skip_fqns: list[str], device: torch.device,
                      enable_fsdp_float8_all_gather: bool = False, skip_small_layers: bool = True) -> nn.Module:
    """Swap eligible nn.Linear layers for torchao's Float8Linear.

    A layer stays in high precision when its name contains one of `skip_fqns` (e.g. the output
    projection, whose accuracy matters most), its dimensions are not multiples of 16, which the
    float8 matmul kernels need, or, with `skip_small_layers` on a GPU with float8 matmuls, float8 would
    not pay for its shape (`pays_in_float8`). Emulated (CPU), every eligible layer converts: there only
    the numerics are tested."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe_name),
        emulate=not float8_supported(device),
        # float8 all-gather exists for tensorwise scales only.
        enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather and recipe_name == "tensorwise",
    )

    too_small: list[str] = []

    def convertible(module: nn.Module, fqn: str) -> bool:
        if any(skip in fqn for skip in skip_fqns) or not isinstance(module, nn.Linear):
            return False
        if module.in_features % 16 or module.out_features % 16:
            return False
        if skip_small_layers and not config.emulate and not pays_in_float8(module.out_features, module.in_features,
                                                                             recipe_name):
            too_small.append(fqn)
            return False
        return True

    converted = convert_to_float8_training(model, module_filter_fn=convertible, config=config)
    layers = sum(type(m).__name__ == "Float8Linear" for m in converted.modules())
    how = "emulated (this device has no float8 matmuls: numerics only, no speed-up)" if config.emulate else "on"
    logger.info(f"float8 {recipe_name}: {how} for {layers} linear layers; kept in high precision: {skip_fqns}")
    if too_small:
        shapes = sorted({f"{m.out_features}x{m.in_features}" for name, m in model.named_modules() if name in too_small})
        logger.info(f"float8 {recipe_name}: {len(too_small)} more linear layers kept in bf16, too small for float8 to "
                    f"pay (out x in: {', '.join(shapes)}; float8.skip_small_layers false converts them)"
                    + ("" if layers else ": float8 will not speed this model up"))
    return converted


def precompute_float8_scales(model: nn.Module) -> None:
    """With float8 all-gather under FSDP, compute every weight's scale in one go after the optimizer
    step instead of one small reduction per layer in the next forward."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


class Float8ScalePrecompute:
    """precompute_float8_scales after every optimizer step, as a feature of the training loop
    (components/training/loop_features.py): float8.precompute_float8_dynamic_scale_for_fsdp."""

    def __init__(self, model_parts: list[nn.Module]):
        self.model_parts = model_parts

    def after_step(self, step: int, skipped, log: bool) -> dict[str, float]:
        for part in self.model_parts:
            precompute_float8_scales(part)
        return {}
