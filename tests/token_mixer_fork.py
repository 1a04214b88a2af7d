"""A fork of Llama 3 whose blocks mix tokens besides attention (docs/models.md, other ways to mix tokens), chosen by
its key `model.token_mixer`:

- `inline_shift`: the token shift written inline in the block's forward, declared nowhere (issue 61's fork);
- `shift`: the same shift declared, a causal convolution of window 2 with fixed weights (docs/models.md's fork);
- `conv`: a depthwise causal convolution of window 4 with learned weights (Canon layers, Mamba's short convolution);
- `recurrence`: a gated linear recurrence over the heads of the residual stream, with its own projections.

Each one's output is added to the residual stream at the start of every block."""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MIXERS = '''

class TokenShift(nn.Module):
    """Half of the previous token's features: a causal convolution of window 2 with fixed weights, declared."""

    conv_window = 2

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.conv = causal_conv

    def init_weights(self) -> None:
        pass

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.conv(x, x.new_tensor([0.5, 0.0]).expand(x.shape[-1], 2), document_ids)


class ShortConv(nn.Module):
    """A depthwise causal convolution of window 4 with learned weights, declared."""

    conv_window = 4

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.conv = causal_conv
        self.weight = nn.Parameter(torch.empty(args.dim, self.conv_window))

    def init_weights(self) -> None:
        nn.init.normal_(self.weight, std=0.2)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.conv(x, self.weight, document_ids)


class Recurrence(nn.Module):
    """A gated linear recurrence over the heads of the residual stream, declared."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.recurrence = gated_linear_recurrence
        self.n_heads = args.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(4))
        self.wg = nn.Linear(args.dim, args.n_heads, bias=False)

    def init_weights(self) -> None:
        for linear in (self.wq, self.wk, self.wv, self.wo, self.wg):
            nn.init.normal_(linear.weight, std=0.05)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, self.n_heads, -1) for w in (self.wq, self.wk, self.wv))
        log_decay = F.logsigmoid(self.wg(x) + 2.0)
        return self.wo(self.recurrence(q, k, v, log_decay, document_ids=document_ids).flatten(2))


TOKEN_MIXERS = {"shift": TokenShift, "conv": ShortConv, "recurrence": Recurrence}
'''

EDITS = {
    "model.py": [
        ("from components.model.attention import", "import torch.nn.functional as F\n\n"
         "from components.model.token_mixing import causal_conv, gated_linear_recurrence\n"
         "from components.model.attention import"),
        ('    mup_base_dim: int | None = None\n',
         '    mup_base_dim: int | None = None\n    token_mixer: str = "none"\n'),
        ("\n\nclass TransformerBlock(DecoderBlock):", MIXERS + "\n\nclass TransformerBlock(DecoderBlock):"),
        ("                         width_scale=args.mup_width**-0.5)  # 1 without µP\n",
         "                         width_scale=args.mup_width**-0.5)  # 1 without µP\n"
         "        self.inline_shift = args.token_mixer == 'inline_shift'\n"
         "        if args.token_mixer in TOKEN_MIXERS:\n"
         "            self.mixer = TOKEN_MIXERS[args.token_mixer](args)\n\n"
         "    def init_weights(self) -> None:\n"
         "        super().init_weights()\n"
         "        if hasattr(self, 'mixer'):\n"
         "            self.mixer.init_weights()\n\n"
         "    def forward(self, x, rope, mask=None, document_ids=None):\n"
         "        if self.inline_shift:\n            x = x + 0.5 * F.pad(x, (0, 0, 1, 0))[:, :-1]\n"
         "        if hasattr(self, 'mixer'):\n            x = x + self.mixer(x, document_ids=document_ids)\n"
         "        return super().forward(x, rope, mask=mask)\n"),
    ],
    "config.py": [("    qk_norm: bool = False\n",
                   '    qk_norm: bool = False\n    token_mixer: str = "none"\n'
                   '    """none, inline_shift, shift, conv or recurrence (tests/token_mixer_fork.py)."""\n')],
    "__init__.py": [("    args.qk_norm = config.model.qk_norm\n",
                     "    args.qk_norm = config.model.qk_norm\n    args.token_mixer = config.model.token_mixer\n")],
}


def token_mixer_fork(root: Path, name: str = "mixers") -> Path:
    """models/llama3 copied to `root`/models/<name> with the edits above; returns `root`, the folder to put on the
    path (`import_fork`, torchrun_runs' `forks`)."""
    fork = root / "models" / name
    shutil.copytree(REPO / "models" / "llama3", fork, ignore=shutil.ignore_patterns("__pycache__"))
    for path in fork.glob("*.py"):
        text = path.read_text().replace("models.llama3", f"models.{name}")
        for old, new in EDITS.get(path.name, []):
            assert old in text, (path.name, old)
            text = text.replace(old, new, 1)
        path.write_text(text)
    return root
