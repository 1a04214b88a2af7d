"""Qwen3's published sizes, dense and mixture-of-experts, and CPU debug models, by flavor name (model.flavor)."""

from models.moe import MoEArgs
from models.qwen3.model import ModelArgs

# The published Qwen3 configs; every one has head_dim 128, rope_theta 1e6, rms_norm_eps 1e-6 (the
# ModelArgs defaults) and 151936 tokens, which the tokenizer's vocabulary replaces in training.
_QWEN3_MOE = dict(num_experts=128, top_k=8, norm_topk_prob=True)

flavors = {
    "debugmodel": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=768),
    "debugmodel_moe": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=768,
                                moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256, norm_topk_prob=True)),
    "0.6B": ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072, tie_embeddings=True),
    "1.7B": ModelArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144, tie_embeddings=True),
    "4B": ModelArgs(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728, tie_embeddings=True),
    "8B": ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288),
    "14B": ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17408),
    "32B": ModelArgs(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600),
    "30B-A3B": ModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144,
                         moe=MoEArgs(hidden_dim=768, **_QWEN3_MOE)),
    "235B-A22B": ModelArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_dim=12288,
                           moe=MoEArgs(hidden_dim=1536, **_QWEN3_MOE)),
}
