import math

import torch
import torch.nn.functional as F
from conftest import build_model, tiny_model_args

from components.config import load_config
from components.model.attention import apply_rope
from models.families import model_config_class
from models.llama3 import Transformer, build_model_args, flavors
from models.llama3.model import rope_frequencies


def test_forward_shape_and_causality():
    model = build_model(tiny_model_args())
    tokens = torch.randint(0, 97, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 97) and torch.isfinite(logits).all()
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 97
    other = model(changed)
    assert torch.equal(logits[:, :10], other[:, :10])  # the past never sees the future
    assert not torch.allclose(logits[:, 10:], other[:, 10:])


def test_meta_init_matches_between_builds_and_has_depth_scaled_outputs():
    a, b = build_model(tiny_model_args(n_layers=4)), build_model(tiny_model_args(n_layers=4))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    stds = [a.layers[str(i)].attention.wo.weight.std().item() for i in range(4)]
    assert all(s1 > s2 for s1, s2 in zip(stds, stds[1:]))
    assert math.isclose(stds[0], 0.02 / math.sqrt(2), rel_tol=0.15)
    assert not torch.isnan(a.rope).any()


def test_tiny_model_overfits_one_batch():
    model = build_model(tiny_model_args())
    tokens = torch.randint(0, 97, (4, 17))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 4.0 and losses[-1] < 0.2, losses[::10]


def test_rope_rotates_halves_and_keeps_norms():
    args = tiny_model_args()
    rope = rope_frequencies(args)
    x = torch.randn(2, 8, 4, args.head_dim)
    rotated = apply_rope(x, rope[:8])
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.equal(rotated[:, 0], x[:, 0])  # position 0 is not rotated
    # Hugging Face's rotate-half layout: dimension i turns with dimension i + head_dim/2, as the
    # complex number x[i] + 1j * x[i + head_dim/2].
    half = args.head_dim // 2
    angles = torch.atan2(rope[:8, :, 1], rope[:8, :, 0])[None, :, None]
    expected = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angles), angles)
    assert torch.allclose(rotated, torch.cat([expected.real, expected.imag], dim=-1), atol=1e-5)
    # Relative positions: <q_m, k_n> depends on m - n only.
    q, k = torch.randn(args.head_dim), torch.randn(args.head_dim)
    def at(v, pos):
        return apply_rope(v.expand(1, 8, 1, -1).contiguous(), rope[:8])[0, pos, 0]
    assert torch.allclose(at(q, 5) @ at(k, 3), at(q, 4) @ at(k, 2), atol=1e-5)


def test_llama31_rope_scaling_slows_only_low_frequencies():
    plain = rope_frequencies(tiny_model_args(rope_theta=500000.0, max_seq_len=2))
    scaled = rope_frequencies(tiny_model_args(rope_theta=500000.0, max_seq_len=2, use_rope_scaling=True))
    def angle(r):
        return torch.atan2(r[1, :, 1], r[1, :, 0])
    assert torch.allclose(angle(plain)[:2], angle(scaled)[:2])  # the highest frequencies are kept
    assert torch.allclose(angle(scaled)[-1], angle(plain)[-1] / 8, rtol=1e-4)  # the lowest are divided by 8


def test_flavors_have_published_sizes():
    sizes = {"1B": 1.236, "3B": 3.213, "8B": 8.030, "70B": 70.554, "405B": 405.853}
    for flavor, billions in sizes.items():
        with torch.device("meta"):
            model = Transformer(flavors[flavor])
        assert round(sum(p.numel() for p in model.parameters()) / 1e9, 3) == billions, flavor


def test_cli_overrides_model_shape():
    config = load_config(["--model.n_layers", "3", "--model.dim", "128", "--model.n_heads", "8",
                          "--model.n_kv_heads", "2"], model_config_class)
    args = build_model_args(config, vocab_size=100)
    assert (args.n_layers, args.dim, args.n_heads, args.n_kv_heads, args.vocab_size) == (3, 128, 8, 2, 100)
    assert args.max_seq_len == config.training.seq_len


def test_tied_embeddings_stay_one_matrix_after_meta_build_and_init():
    """to_empty() gives each module its own parameter; init_weights shares the matrix again."""
    with torch.device("meta"):
        model = Transformer(tiny_model_args(tie_embeddings=True))
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.std() > 0.01
