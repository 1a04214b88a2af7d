"""gpt-oss's published shapes and a CPU debug model, by flavor name (model.flavor)."""

from models.gpt_oss.model import ModelArgs
from models.moe import MoEArgs


def _experts(num_experts: int, hidden_dim: int = 2880) -> MoEArgs:
    """gpt-oss routes each token to 4 experts by a softmax over the 4 chosen logits, its router biased."""
    return MoEArgs(num_experts=num_experts, top_k=4, hidden_dim=hidden_dim, norm_topk_prob=True, router_bias=True)


flavors = {
    # For a CPU: a window shorter than the debug configs' sequences, both layer types, YaRN on.
    "debugmodel": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=4096,
                            sliding_window=64, moe=_experts(8, hidden_dim=256)),
    "20B": ModelArgs(n_layers=24, moe=_experts(32)),
    "120B": ModelArgs(n_layers=36, moe=_experts(128)),
}
"""The published ones: dim 2880, 64 query heads and 8 key/value heads of 64, experts of 2880, window 128,
YaRN factor 32 over 4096 tokens, theta 150000, 201088 tokens (o200k_harmony)."""
