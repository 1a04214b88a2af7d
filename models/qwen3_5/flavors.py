"""Qwen3.5's published sizes, dense and mixture-of-experts, and CPU debug models, by flavor name (model.flavor)."""

from models.moe import MoEArgs
from models.qwen3_5.model import ModelArgs

# The published configs have head_dim 256 with a quarter of it rotated, rope_theta 1e7, a full-attention layer
# every 4, DeltaNet heads of 128 channels with 16 key heads and a window-4 convolution (the ModelArgs defaults),
# and 248320 tokens, which the tokenizer's vocabulary replaces in training.
_DEBUG = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, linear_n_key_heads=4, linear_n_value_heads=8,
              linear_key_head_dim=32, linear_value_head_dim=32, ffn_dim=768)

flavors = {
    "debugmodel": ModelArgs(**_DEBUG),
    "debugmodel_moe": ModelArgs(**_DEBUG, moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256, num_shared_experts=1,
                                                      shared_gate=True)),
    "27B": ModelArgs(dim=5120, n_layers=64, n_heads=24, n_kv_heads=4, linear_n_value_heads=48, ffn_dim=17408),
    "35B-A3B": ModelArgs(dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, linear_n_value_heads=32, ffn_dim=512,
                         moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=512, num_shared_experts=1,
                                     shared_gate=True)),
}
