"""Generate text from a run's final weights: what did the model actually learn?

    python compare/sample.py step1                          # runs/step1_torch_ddp, prompt "ROMEO:"
    python compare/sample.py runs/x --prompt "JULIET:" --tokens 200 --seed 7
    python compare/sample.py step4 --temperature 0          # greedy: always the most likely token

Runs are named as in parity.py (short step names, step folders or run folders). The model is
rebuilt from the config in the run's metrics.json with common/model.py, its weights loaded from
the run's safetensors file, and the tokenizer is the one the run trained with. Sampling draws from
a generator seeded with --seed: the same flags give the same text, run after run.
"""

import argparse
import hashlib
import sys
from pathlib import Path

import torch

# config.py, model.py, data.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
import parity  # noqa: E402
from config import OneLineParser, UserError, exit_on_user_error  # noqa: E402
from data import load_tokenizer  # noqa: E402
from model import build_model  # noqa: E402
from moe_setup import moe_model  # noqa: E402


def load_trained_model(name: str):
    """(model in eval mode, tokenizer, config) of a finished run."""
    run, metrics = parity.load_run(name)
    config = metrics["config"]
    tokenizer_path = Path(config["tokenizer"])
    if not tokenizer_path.is_file():
        raise UserError(
            f"the tokenizer {tokenizer_path} that {run} trained with does not exist "
            "any more; put it "
            "back, or run the step again"
        )
    if hashlib.sha256(tokenizer_path.read_bytes()).hexdigest() != metrics["env"].get(
        "tokenizer_sha256"
    ):
        raise UserError(
            f"{tokenizer_path} has changed since {run} was trained, and its token ids "
            "would mean other "
            "text; put the file back as it was, or run the step again"
        )
    tokenizer = load_tokenizer(tokenizer_path)
    weights = parity.load_weights(run, metrics)
    # the architecture (a mixture of experts where the run trained one); the weights follow
    model = moe_model(build_model(config, tokenizer.get_vocab_size(), seed=config["seed"]), config)
    params = dict(model.named_parameters())  # a tied weight once, as the trainers saved it
    if sorted(params) != sorted(weights) or any(
        params[n].shape != weights[n].shape for n in params
    ):
        raise UserError(
            f"{run}: its weights do not fit the model its metrics.json describes (a "
            "tensor missing, extra "
            "or of another shape); run the step again"
        )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(weights[name])
    return model.eval(), tokenizer, config  # eval: no dropout while generating


def next_token(
    logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator
) -> int:
    """Greedy at temperature 0;
    otherwise sample from the ``top_k`` most likely tokens (0: all of them)."""
    if temperature == 0:
        return int(logits.argmax())
    if top_k:
        cutoff = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    probabilities = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))


@torch.no_grad()
def generate(
    model, ids: list[int], tokens: int, temperature: float, top_k: int, seed: int, context: int
) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    ids = list(ids)
    for _ in range(tokens):
        # the model has seen sequences of at most seq_len tokens
        window = torch.tensor([ids[-context:]])
        logits = model(window)[0, -1].float()
        ids.append(next_token(logits, temperature, top_k, generator))
    return ids


def main() -> int:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", help="step name (step1), step folder or run folder")
    parser.add_argument("--prompt", default="ROMEO:", help="text to continue")
    parser.add_argument("--tokens", type=int, default=100, help="tokens to generate")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="0 = greedy (the most likely token)"
    )
    parser.add_argument(
        "--top-k", type=int, default=40, help="sample among the k most likely tokens (0 = all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    args = parser.parse_args()
    if args.tokens < 1:
        raise UserError(f"--tokens must be at least 1, got {args.tokens}")
    if args.temperature < 0 or args.top_k < 0:
        raise UserError("--temperature and --top-k cannot be negative")
    model, tokenizer, config = load_trained_model(args.run)
    prompt = tokenizer.encode(args.prompt).ids
    if not prompt:
        raise UserError("--prompt is empty: give the model some text to continue")
    ids = generate(
        model, prompt, args.tokens, args.temperature, args.top_k, args.seed, config["seq_len"]
    )
    print(tokenizer.decode(ids))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
