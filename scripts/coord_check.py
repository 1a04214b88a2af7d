"""Coordinate check of µP (docs/mup.md): train the Llama 3 model a few steps at several widths, under
the standard parametrization (SP) and under µP, and plot the RMS of each layer's activations against
the width at every step. Under µP the curves stay flat as the width grows; under SP the outputs that
the hidden and output weights' updates feed grow with it, the logits most.

    python -m scripts.coord_check --output docs/assets/mup_coord_check.png

The models are built directly (no train.py): the width grows by heads of a fixed size (the debug
model's 16), so that the attention scale 1/sqrt(head_dim) is the same at every width, and the
optimizers are components/training/optimizers.py's, so that what is checked is the param groups a run uses.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from components.config import REPO_ROOT, Optimizer as OptimizerConfig
from components.data.tokenizer import build_tokenizer
from components.training.optimizers import Optimizers
from models.llama3.model import ModelArgs, Transformer

CORPUS = REPO_ROOT / "tests/assets/shakespeare/train.jsonl"
TOKENIZER = REPO_ROOT / "tests/assets/tokenizers/shakespeare_bpe_4k.model"
HEAD_DIM = 16
PARAMETRIZATIONS = ("SP", "µP")


def corpus_batches(steps: int, batch_size: int, seq_len: int, seed: int) -> tuple[list[torch.Tensor], int]:
    """`steps` batches of random windows of seq_len + 1 tokens from the shipped corpus, and the vocabulary size."""
    tokenizer = build_tokenizer(TOKENIZER)
    tokens: list[int] = []
    with open(CORPUS) as f:
        for line in f:
            tokens += tokenizer.encode(json.loads(line)["text"])
            if len(tokens) > 4 * steps * batch_size * (seq_len + 1):
                break
    data = torch.tensor(tokens)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq_len - 1, (steps, batch_size), generator=generator)
    return [torch.stack([data[s:s + seq_len + 1] for s in row]) for row in starts.tolist()], tokenizer.vocab_size


def model_args(width: int, vocab_size: int, seq_len: int, n_layers: int, base_dim: int | None) -> ModelArgs:
    """The debug model's proportions at `width` (4 query heads per key/value head; a multiple_of
    small enough that the feed-forward size stays about 8/3 of the width); µP when base_dim is set."""
    n_heads = width // HEAD_DIM
    return ModelArgs(dim=width, n_layers=n_layers, n_heads=n_heads, n_kv_heads=max(1, n_heads // 4),
                     vocab_size=vocab_size, multiple_of=16, max_seq_len=seq_len, mup_base_dim=base_dim)


def sites(model: Transformer) -> dict[str, torch.nn.Module]:
    """The modules whose outputs are checked: the embedding, each block's attention and feed-forward
    (their outputs before the residual sums) and the output projection (the logits)."""
    modules = {"embedding": model.tok_embeddings}
    for index, block in model.layers.items():
        modules |= {f"attention {index}": block.attention, f"feed-forward {index}": block.feed_forward}
    return modules | {"logits": model.output}


@torch.no_grad()
def activations(model: Transformer, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    seen = {}
    hooks = [module.register_forward_hook(lambda _, __, output, name=name: seen.__setitem__(name, output))
             for name, module in sites(model).items()]
    model(tokens)
    for hook in hooks:
        hook.remove()
    return seen


def rms(x: torch.Tensor) -> float:
    return x.square().mean().sqrt().item()


def activation_rms(args: ModelArgs, batches: list[torch.Tensor], optimizer: OptimizerConfig,
                   seed: int = 0) -> list[dict[str, tuple[float, float]]]:
    """Train a fresh model one step per batch. Before the first step and after each, on the first
    batch's tokens: {site: (RMS of its output x_t, RMS of x_t - x_0)}. The second, the change since
    initialisation, is what µP keeps independent of width (Tensor Programs V's coordinate check):
    x_0 itself may shrink with width under µP (the logits, as 1/sqrt(m)) without harm."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    optimizers = Optimizers([model], optimizer)
    probe = batches[0][:, :-1]
    initial = activations(model, probe)
    history = [{name: (rms(x), 0.0) for name, x in initial.items()}]
    for batch in batches:
        optimizers.zero_grad()
        F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizers.step()
        now = activations(model, probe)
        history.append({name: (rms(x), rms(x - initial[name])) for name, x in now.items()})
    return history


def coord_check(widths: list[int], base_dim: int, steps: int = 5, lr: float = 3e-3, optimizer: str = "AdamW",
                n_layers: int = 2, seq_len: int = 128, batch_size: int = 8,
                seed: int = 0) -> dict[str, dict[int, list[dict[str, tuple[float, float]]]]]:
    """{parametrization: {width: activation_rms(...)}}: the same batches and seed at every width, a
    constant lr (no warmup, no clipping) and µP relative to base_dim."""
    batches, vocab_size = corpus_batches(steps, batch_size, seq_len, seed)
    config = OptimizerConfig(name=optimizer, lr=lr, implementation="foreach", muon_ns_dtype="float32")
    return {
        name: {width: activation_rms(model_args(width, vocab_size, seq_len, n_layers, base), batches, config, seed)
               for width in widths}
        for name, base in zip(PARAMETRIZATIONS, (None, base_dim))
    }


def growth(per_width: dict[int, list[dict[str, tuple[float, float]]]], site: str = "logits") -> float:
    """The RMS of `site`'s change since initialisation at the widest width over that at the
    narrowest, after the last step."""
    widths = sorted(per_width)
    return per_width[widths[-1]][-1][site][1] / per_width[widths[0]][-1][site][1]


def plot(results: dict, title: str, output: str) -> None:
    """One row per measure (x_t, then x_t - x_0) and parametrization, one column per site: the RMS
    against width, a line per step; SP and µP share the y axis of each measure and site."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    first = next(iter(results["SP"].values()))
    sites, steps = list(first[0]), len(first)
    fig, axes = plt.subplots(2 * len(results), len(sites), figsize=(2.2 * len(sites), 7.6), sharex=True)
    colors = plt.cm.viridis([i / (steps - 1) for i in range(steps)])
    for measure, label in enumerate(("RMS of x_t", "RMS of x_t - x_0")):
        for column, site in enumerate(sites):
            values = {name: {step: [per_width[w][step][site][measure] for w in sorted(per_width)]
                             for step in range(measure, steps)} for name, per_width in results.items()}
            high = max(max(line) for lines in values.values() for line in lines.values())
            low = min(min(line) for lines in values.values() for line in lines.values())
            for index, name in enumerate(results):
                ax = axes[2 * measure + index][column]
                for step, line in values[name].items():
                    ax.plot(sorted(results[name]), line, marker="o", ms=3, color=colors[step], label=f"step {step}")
                ax.set_xscale("log", base=2)
                ax.set(yscale="log", ylim=(min(low, high / 10) / 1.3, high * 1.3))
                ax.yaxis.set_minor_formatter(NullFormatter())
                ax.set_title(f"{name}: {site}", fontsize=8)
                ax.tick_params(labelsize=7)
                if column == 0:
                    ax.set_ylabel(label, fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("width (model.dim)", fontsize=8)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(output, dpi=64)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--base-dim", type=int, default=64, help="model.mup_base_dim (default: 64)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--optimizer", choices=("AdamW", "Muon"), default="AdamW")
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--output", default="coord_check.png", help="the PNG to write")
    args = parser.parse_args(argv)
    results = coord_check(args.widths, args.base_dim, args.steps, args.lr, args.optimizer, args.n_layers)
    widths = sorted(args.widths)
    for name, per_width in results.items():
        print(f"{name}: RMS of x_t - x_0 after step {args.steps}, widths {' '.join(map(str, widths))}, "
              "and the ratio of the widest's to the narrowest's")
        for site in per_width[widths[0]][-1]:
            print(f"  {site:<15}" + "".join(f"{per_width[w][-1][site][1]:>9.4f}" for w in widths)
                  + f"   x{growth(per_width, site):.2f}")
    plot(results, f"Coordinate check: {args.optimizer} lr {args.lr:g}, {args.n_layers} layers, "
                  f"µP base width {args.base_dim}", args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
