"""DeepSeek-V3's published shapes and a CPU debug model, by flavor name (model.flavor)."""

from models.deepseek_v3.model import ModelArgs
from models.moe import MoEArgs

flavors = {
    # For a CPU: q LoRA, values narrower than queries/keys, groups, a shared expert, one dense block first.
    "debugmodel": ModelArgs(
        dim=256, n_layers=4, n_heads=8, ffn_dim=768, vocab_size=4096, q_lora_rank=128, kv_lora_rank=128,
        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, rope_factor=1.0, first_dense_layers=1,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256, num_shared_experts=1, score_func="sigmoid",
                    norm_topk_prob=True, route_scale=2.5, n_groups=4, topk_groups=2),
    ),
    # DeepSeek-V2-Lite's shape, as TorchTitan names it: softmax routing without groups, plain query projection.
    "16B": ModelArgs(
        dim=2048, n_layers=27, n_heads=16, ffn_dim=10944, vocab_size=102400, q_lora_rank=0, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_mscale=0.707, rope_mscale_all_dim=0.707,
        first_dense_layers=1,
        moe=MoEArgs(num_experts=64, top_k=6, hidden_dim=1408, num_shared_experts=2, score_func="softmax",
                    norm_topk_prob=False),
    ),
    "671B": ModelArgs(
        dim=7168, n_layers=61, n_heads=128, ffn_dim=18432, vocab_size=129280, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_dense_layers=3,
        moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=2048, num_shared_experts=1, score_func="sigmoid",
                    norm_topk_prob=True, route_scale=2.5, n_groups=8, topk_groups=4),
    ),
    # Kimi K2 (Moonshot AI's release, model_type kimi_k2): DeepSeek-V3's architecture with 384 experts, 64 heads, one
    # dense block and one group; RoPE base 50000, YaRN to 128K tokens.
    "kimi_k2": ModelArgs(
        dim=7168, n_layers=61, n_heads=64, ffn_dim=18432, vocab_size=163840, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_dense_layers=1, rope_theta=50000.0,
        rope_factor=32.0, rope_beta_fast=1.0, rope_beta_slow=1.0,
        moe=MoEArgs(num_experts=384, top_k=8, hidden_dim=2048, num_shared_experts=1, score_func="sigmoid",
                    norm_topk_prob=True, route_scale=2.827, n_groups=1, topk_groups=1),
    ),
}
"""The published ones keep YaRN's context extension as their config.json states it (factor 40 over 4096 tokens);
`--model.rope_factor 1` trains with plain RoPE, as DeepSeek pretrained before extending."""
