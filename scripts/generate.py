"""Sample text from a trained checkpoint, to see what the model has learned.

    python -m scripts.generate --checkpoint DUMP/checkpoint/step-N --prompt "ROMEO:" [--max-tokens 100] \\
        [--temperature 0] [--top-k 0] [--top-p 1.0] [--seed 0] [--num-samples 1] [--device cpu|cuda]

The checkpoint is a DCP step-N folder saved under any layout (its run's config.toml gives the model and
tokenizer) or a Hugging Face folder; any other `--section.key value` overrides that config, and
`--job.config_file CFG` replaces it. The prompt starts with BOS, as every training document does.
Temperature 0 is greedy decoding; otherwise tokens are drawn from softmax(logits / temperature), cut
to the top-k tokens, then to the nucleus of probability top-p. Without a KV cache each new token
recomputes the whole sequence (its last training.seq_len tokens): simple, and fast enough for a look.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from torch import nn

from components.config import ConfigError
from scripts.checkpoint_model import model_from_checkpoint


def sampling_probabilities(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
                           ) -> torch.Tensor:
    """The distribution that a next token is drawn from, given the logits (vocab,) of the last
    position: softmax(logits / temperature), zero outside the top_k most likely tokens (0: no
    limit), then zero outside the nucleus, the fewest most likely tokens whose probabilities add up
    to at least top_p (measured after the top-k cut); renormalized. temperature must be > 0."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if 0 < top_k < probs.numel():
        kept = torch.zeros_like(probs).scatter_(0, probs.topk(top_k).indices, 1.0)
        probs = probs * kept / (probs * kept).sum()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True, stable=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens
        kept = torch.zeros_like(probs).scatter_(0, order, (before < top_p).float())
        probs = probs * kept / (probs * kept).sum()
    return probs


def next_token(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
               generator: torch.Generator | None = None) -> int:
    """The next token for the logits (vocab,) of the last position: the most likely at temperature
    0, otherwise drawn from sampling_probabilities with `generator` (on the CPU, so that a seed gives
    the same draws whatever device computed the logits)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = sampling_probabilities(logits, temperature, top_k, top_p).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate(model: nn.Module, tokens: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, generator: torch.Generator | None = None, eos_id: int | None = None,
             max_seq_len: int | None = None) -> list[int]:
    """The tokens that follow `tokens`: up to max_new_tokens, ending early with eos_id if the model
    emits it (included). The model sees at most the last max_seq_len tokens."""
    check_sampling(temperature, top_k, top_p)
    device = next(model.parameters()).device
    sequence, new = list(tokens), []
    for _ in range(max_new_tokens):
        window = sequence[-max_seq_len:] if max_seq_len else sequence
        logits = model(torch.tensor([window], device=device))[0, -1]
        token = next_token(logits, temperature, top_k, top_p, generator)
        sequence.append(token)
        new.append(token)
        if token == eos_id:
            break
    return new


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top-k must be >= 0 (0: no limit), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top-p must be in (0, 1], got {top_p}")


# --- Command line ---------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m scripts.generate", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False,
                                     epilog="Any other --section.key value argument overrides the run's config.")
    parser.add_argument("--checkpoint", type=Path, required=True, help="a step-N checkpoint folder or an HF folder")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-tokens", type=int, default=100, help="new tokens at most (default 100)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample within this probability mass (nucleus)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--num-samples", type=int, default=1, help="continuations to print (default 1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    options, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_sampling(options.temperature, options.top_k, options.top_p)
        if options.max_tokens < 0 or options.num_samples < 1:
            raise ValueError("--max-tokens must be >= 0 and --num-samples >= 1")
        model, config, tokenizer = model_from_checkpoint(options.checkpoint, overrides, options.device)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    has_bos = tokenizer.bos_id >= 0
    prompt = tokenizer.encode(options.prompt, bos=has_bos)
    if not prompt:
        print("error: the prompt is empty and the tokenizer has no BOS token to start from", file=sys.stderr)
        return 2
    eos_id = tokenizer.eos_id if tokenizer.eos_id >= 0 else None
    generator = torch.Generator().manual_seed(options.seed)
    for i in range(options.num_samples):
        new = generate(model, prompt, options.max_tokens, options.temperature, options.top_k, options.top_p,
                       generator, eos_id, config.training.seq_len)
        if new and new[-1] == eos_id:
            new = new[:-1]
        text = tokenizer.decode(prompt[1:] + new if has_bos else prompt + new)
        if options.num_samples > 1:
            print(f"{'-' * 30} sample {i + 1} of {options.num_samples} {'-' * 30}")
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
