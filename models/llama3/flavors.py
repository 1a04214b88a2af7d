"""Llama 3's published sizes (3.1 8B/70B/405B, 3.2 1B/3B) and a CPU debug model, by flavor name (model.flavor)."""

from models.llama3.model import ModelArgs

_LLAMA31_ROPE = dict(rope_theta=500000.0, use_rope_scaling=True, rope_scaling_factor=8.0)
_LLAMA32_ROPE = dict(rope_theta=500000.0, use_rope_scaling=True, rope_scaling_factor=32.0)

flavors = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=4, rope_theta=500000.0),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
                    tie_embeddings=True, **_LLAMA32_ROPE),
    "3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256,
                    tie_embeddings=True, **_LLAMA32_ROPE),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
                    **_LLAMA31_ROPE),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096,
                     **_LLAMA31_ROPE),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096,
                      **_LLAMA31_ROPE),
}
