"""The bundled model's figures (the model card's numbers): ``python -m pipeline.model.evaluation [tiny]``.

* held-out loss (nats per byte) with the indexer's top-k sparse attention and with dense attention;
* the MTP head's top-1 agreement with the target (MTP's guess for token t+2 vs the target's argmax at
  t+1, both given the true text up to t+1), and its top-1 accuracy against the text;
* accept length of the reference chain speculative decoder (greedy) with 1, 2, 3 draft steps on
  held-out prompts, the MTP layer attending over its own draft-extend KV; over all verify rounds and
  over the rounds that produced something other than whitespace;
* the reference decoder's tokens/s (batch 1, float32, greedy).

Held-out windows and prompts are drawn with fixed seeds from the held-out split of the corpus
(``--corpus``: the default selection, or ``stdlib-v1``, the bundled model's training data, whose
held-out split the model card's first figures were measured on).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from pipeline.model.corpus import DEFAULT_SELECTION, SELECTIONS, build_corpus
from pipeline.model.loader import load_model
from pipeline.model.model import DeepseekV32
from pipeline.model.reference import ReferenceDecoder, ReferenceSpecDecoder
from pipeline.model.training import DENSE, SPARSE_STABLE, mtp_hidden, target_hidden


def sample_windows(stream: torch.Tensor, count: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - length, (count,), generator=gen).tolist()
    return torch.stack([stream[s : s + length] for s in starts])


@torch.no_grad()
def held_out_metrics(model: DeepseekV32, windows: torch.Tensor, mode: str) -> dict[str, float]:
    """LM loss, MTP loss, MTP/target top-1 agreement and MTP accuracy over ``windows [N, T]``."""
    totals = {"lm": 0.0, "mtp": 0.0, "agree": 0.0, "mtp_acc": 0.0}
    for batch in windows.split(4):
        hidden = target_hidden(model, batch, mode)  # [B, T, D]
        logits = model.logits(hidden).float()
        totals["lm"] += F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten()).item() * len(
            batch
        )
        if len(model.mtp):
            mtp_logits = model.logits(mtp_hidden(model, batch, hidden, mode)[:, :-1]).float()  # slot t -> t+2
            truth = batch[:, 2:]
            totals["mtp"] += F.cross_entropy(mtp_logits.flatten(0, 1), truth.flatten()).item() * len(batch)
            guess = mtp_logits.argmax(-1)
            totals["agree"] += (guess == logits[:, 1:-1].argmax(-1)).float().mean().item() * len(batch)
            totals["mtp_acc"] += (guess == truth).float().mean().item() * len(batch)
    return {k: v / len(windows) for k, v in totals.items()}


@torch.no_grad()
def loss_by_position(
    model: DeepseekV32, windows: torch.Tensor, mode: str, edges: list[int]
) -> dict[str, float]:
    """LM loss over predicted positions ``[edges[i], edges[i+1])`` of long windows ``[N, T]``."""
    losses = []
    for window in windows.split(1):
        logits = model.logits(target_hidden(model, window, mode)[0, :-1]).float()
        losses.append(F.cross_entropy(logits, window[0, 1:], reduction="none"))  # [T-1]
    per_pos = torch.stack(losses).mean(0)
    return {f"{lo}-{hi}": per_pos[lo:hi].mean().item() for lo, hi in itertools.pairwise(edges)}


_WHITESPACE = frozenset(b" \t\r\n")


def accept_stats(
    model: DeepseekV32, prompts: torch.Tensor, num_steps: int, max_new_tokens: int
) -> dict[str, float]:
    """Accepted tokens per verify (bonus included) over all prompts' verify rounds.

    A byte model's greedy output often ends in runs of spaces, where every draft is trivially
    right; ``non_blank`` leaves out the verify rounds whose tokens are all whitespace.
    """
    rounds: list[tuple[int, bool]] = []  # (accept length, produced only whitespace)
    blank_tokens, num_tokens = 0, 0
    decoder = ReferenceSpecDecoder(model, num_steps)
    for prompt in prompts.tolist():
        out = decoder.generate(prompt, max_new_tokens, stop_at_eos=False)
        tokens = list(out.token_ids)
        start = 1  # token 0 is the prefill's bonus; each verify then produces accept_length tokens
        for a in out.accept_lengths:
            rounds.append((a, all(t in _WHITESPACE for t in tokens[start : start + a])))
            start += a
        blank_tokens += sum(t in _WHITESPACE for t in tokens)
        num_tokens += len(tokens)
    kept = [a for a, blank in rounds if not blank]
    return {
        "all": sum(a for a, _ in rounds) / len(rounds),
        "non_blank": sum(kept) / max(1, len(kept)),
        "blank_round_fraction": 1 - len(kept) / len(rounds),
        "whitespace_token_fraction": blank_tokens / num_tokens,
    }


def tokens_per_second(model: DeepseekV32, prompt: list[int], max_new_tokens: int) -> float:
    decoder = ReferenceDecoder(model)
    decoder.generate(prompt, 8, stop_at_eos=False)  # warm-up
    started = time.perf_counter()
    out = decoder.generate(prompt, max_new_tokens, stop_at_eos=False)
    return len(out.token_ids) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.model.evaluation", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("model", nargs="?", default="tiny")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--corpus",
        choices=SELECTIONS,
        default=DEFAULT_SELECTION,
        help="corpus selection whose held-out split is measured (pipeline/model/corpus.py)",
    )
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--window-len", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--long-windows", type=int, default=8)
    p.add_argument("--skip-loss", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32)
    held = build_corpus(eos_id=model.cfg.eos_token_id or 256, selection=args.corpus).held_out
    report: dict[str, object] = {
        "params": sum(t.numel() for t in model.parameters()),
        "corpus": args.corpus,
        "held_out_tokens": held.numel(),
    }
    if not args.skip_loss:
        windows = sample_windows(held, args.windows, args.window_len, seed=100)
        report["sparse"] = held_out_metrics(model, windows, SPARSE_STABLE)
        report["dense"] = held_out_metrics(model, windows, DENSE)
        print(json.dumps(report), flush=True)
        long = sample_windows(held, args.long_windows, model.cfg.max_position_embeddings, seed=300)
        edges = [0, 512, 1024, 2048, model.cfg.max_position_embeddings - 1]
        report["sparse_by_position"] = loss_by_position(model, long, SPARSE_STABLE, edges)
        report["dense_by_position"] = loss_by_position(model, long, DENSE, edges)
        print(json.dumps(report), flush=True)
    prompts = sample_windows(held, args.prompts, args.prompt_len, seed=200)
    for steps in args.steps:
        report[f"accept_{steps}"] = accept_stats(model, prompts, steps, args.new_tokens)
        print(json.dumps(report), flush=True)
    report["tokens_per_s"] = tokens_per_second(model, prompts[0].tolist(), 256)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
