"""``hispec train``: train the bundled tiny model from scratch on the standard library's sources.

The recipe follows DeepSeek-V3.2 at small scale, in phases run one after the other:

1. ``dense``: dense causal attention; the whole model learns the LM (+ MTP) loss while the indexer,
   reading detached inputs, learns to imitate the dense attention distribution (KL, detached target);
2. ``sparse``: every layer attends only to its indexer top-k (``index_topk``) positions; the indexer
   keeps learning the KL over the selected set;
3. ``long``: sparse training on long windows, so the model works at the context lengths it serves.

The MTP layer is trained for chain drafting (``--mtp-steps`` chained passes) in every phase.

The defaults are the bundled model's recipe (dense 400 x 12 x 256, sparse 900 x 3 x 1024, long
60 x 1 x 4096, 3 MTP chain steps throughout); with ``--corpus stdlib-v1`` (its data) they reproduce
its weights (``docs/model-card.md``). Two options change the recipe, both off by default:
``--long-every N`` makes every N-th sparse step take long windows instead, and ``--dense-mtp-steps``
trains a different number of chain steps in the dense warm-up. Everything is seeded (model init,
window sampling); the expert score-correction biases follow DeepSeek-V3's loss-free balancing rule
(``bias += gamma * sign(mean load - load)`` after each step). Training is never part of the tests.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import attrs
import torch
from tqdm import tqdm

from pipeline.model.checkpoint import save_model
from pipeline.model.config import ModelConfig
from pipeline.model.corpus import DEFAULT_SELECTION, SELECTIONS, build_corpus
from pipeline.model.model import DeepseekV32, init_weights
from pipeline.model.moe import MoE
from pipeline.model.tokenizer import ByteTokenizer
from pipeline.model.training import DENSE, SPARSE, SPARSE_STABLE, TrainOutput, train_forward


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec train", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="checkpoint directory to write (required: the bundled model is never overwritten by default)",
    )
    p.add_argument("--log", type=Path, default=None, help="JSON-lines metrics file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--corpus",
        choices=SELECTIONS,
        default=DEFAULT_SELECTION,
        help="corpus selection (pipeline/model/corpus.py); stdlib-v1 is the bundled model's data",
    )
    # architecture
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dense-layers", type=int, default=1, help="leading layers with a dense MLP")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--q-lora", type=int, default=128)
    p.add_argument("--kv-lora", type=int, default=64)
    p.add_argument("--rope-dim", type=int, default=16)
    p.add_argument("--nope-dim", type=int, default=32)
    p.add_argument("--v-dim", type=int, default=32)
    p.add_argument("--inter", type=int, default=640, help="dense MLP width")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--experts-per-tok", type=int, default=2)
    p.add_argument("--moe-inter", type=int, default=160)
    p.add_argument("--index-heads", type=int, default=4)
    p.add_argument("--index-dim", type=int, default=32)
    p.add_argument("--index-topk", type=int, default=64)
    p.add_argument("--max-pos", type=int, default=4096)
    # schedule: steps x batch x window per phase (defaults: the bundled model's recipe)
    p.add_argument("--dense-steps", type=int, default=400)
    p.add_argument("--sparse-steps", type=int, default=900)
    p.add_argument("--long-steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=12, help="dense phase")
    p.add_argument("--seq-len", type=int, default=256, help="dense phase")
    p.add_argument("--sparse-batch", type=int, default=3)
    p.add_argument("--sparse-seq-len", type=int, default=1024)
    p.add_argument(
        "--long-every",
        type=int,
        default=0,
        help="sparse phase: every n-th step uses long windows instead (0: never)",
    )
    p.add_argument("--long-batch", type=int, default=1)
    p.add_argument("--long-seq-len", type=int, default=4096)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--mtp-weight", type=float, default=0.3, help="loss weight of each MTP chain step")
    p.add_argument("--mtp-steps", type=int, default=3, help="chain steps the MTP layer is trained for")
    p.add_argument(
        "--dense-mtp-steps",
        type=int,
        default=None,
        help="the same, in the dense warm-up (default: --mtp-steps)",
    )
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--bias-gamma", type=float, default=1e-3, help="loss-free balancing step")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--eval-len", type=int, default=512)
    return p


def model_config(args: argparse.Namespace, eos_id: int) -> ModelConfig:
    dense = min(args.dense_layers, args.layers)
    return ModelConfig(
        vocab_size=eos_id + 1,
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        moe_intermediate_size=args.moe_inter,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        n_shared_experts=1,
        n_routed_experts=args.experts,
        routed_scaling_factor=1.0,
        kv_lora_rank=args.kv_lora,
        q_lora_rank=args.q_lora,
        qk_rope_head_dim=args.rope_dim,
        v_head_dim=args.v_dim,
        qk_nope_head_dim=args.nope_dim,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=args.experts_per_tok,
        norm_topk_prob=True,
        mlp_layer_types=tuple(["dense"] * dense + ["sparse"] * (args.layers - dense)),
        hidden_act="silu",
        max_position_embeddings=args.max_pos,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        index_topk=args.index_topk,
        index_head_dim=args.index_dim,
        index_n_heads=args.index_heads,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        num_nextn_predict_layers=1,
    )


def sample_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, total - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def update_expert_biases(counts: dict[MoE, torch.Tensor], gamma: float) -> None:
    """Loss-free balancing: raise the bias of under-loaded experts, lower it for over-loaded ones."""
    for moe, count in counts.items():
        load = count.to(moe.gate.e_score_correction_bias.dtype)
        moe.gate.e_score_correction_bias.add_(gamma * torch.sign(load.mean() - load))


@torch.no_grad()
def evaluate(model: DeepseekV32, windows: torch.Tensor, mode: str) -> dict[str, float]:
    """Held-out losses (nats per byte-level token) over fixed windows."""
    model.eval()
    lm, mtp = 0.0, 0.0
    for w in windows.split(4):
        out = train_forward(model, w, mode=mode)
        lm += out.lm_loss.item() * len(w)
        mtp += out.mtp_loss.item() * len(w)
    model.train()
    return {"lm": lm / len(windows), "mtp": mtp / len(windows)}


@attrs.frozen
class Phase:
    name: str
    steps: int
    mode: str  # attention mode (DENSE / SPARSE)
    batch: int  # windows per step
    seq_len: int  # bytes per window
    mtp_steps: int  # chained MTP passes trained
    long_every: int = 0  # every n-th step uses (long_batch, long_seq_len) windows; 0 = never

    def shape(self, i: int, args: argparse.Namespace) -> tuple[int, int]:
        """(batch, window) of the phase's i-th step."""
        if self.long_every and (i + 1) % self.long_every == 0:
            return args.long_batch, args.long_seq_len
        return self.batch, self.seq_len


def phases(args: argparse.Namespace) -> list[Phase]:
    dense_mtp_steps = args.mtp_steps if args.dense_mtp_steps is None else args.dense_mtp_steps
    return [
        Phase("dense", args.dense_steps, DENSE, args.batch, args.seq_len, dense_mtp_steps),
        Phase(
            "sparse",
            args.sparse_steps,
            SPARSE,
            args.sparse_batch,
            args.sparse_seq_len,
            args.mtp_steps,
            args.long_every,
        ),
        Phase("long", args.long_steps, SPARSE, args.long_batch, args.long_seq_len, args.mtp_steps),
    ]


def make_optimizer(model: DeepseekV32, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms, biases, 1-d tensors)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def train_step(
    model: DeepseekV32,
    opt: torch.optim.Optimizer,
    windows: torch.Tensor,
    phase: Phase,
    args: argparse.Namespace,
) -> TrainOutput:
    out = train_forward(
        model,
        windows,
        mode=phase.mode,
        mtp_weight=args.mtp_weight,
        mtp_steps=phase.mtp_steps,
        kl_weight=args.kl_weight,
    )
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    with torch.no_grad():
        update_expert_biases(out.expert_counts, args.bias_gamma)
    return out


def save(model: DeepseekV32, out_dir: Path) -> None:
    save_model(model, out_dir, dtype="float32")
    ByteTokenizer().write_hf_files(out_dir)


def report(record: dict, log: Path | None) -> None:
    tqdm.write(json.dumps(record))
    if log is not None:
        with log.open("a") as f:
            f.write(json.dumps(record) + "\n")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    corpus = build_corpus(eos_id=ByteTokenizer().eos_token_id, selection=args.corpus)
    model = init_weights(
        DeepseekV32(model_config(args, ByteTokenizer().eos_token_id)), seed=args.seed
    ).train()
    num_params = sum(p.numel() for p in model.parameters())
    tqdm.write(
        f"params {num_params:,}  corpus {args.corpus}  train tokens {corpus.train.numel():,}  "
        f"held-out {corpus.held_out.numel():,}"
    )
    opt = make_optimizer(model, args)
    gen = torch.Generator().manual_seed(args.seed + 1)  # window sampling
    eval_windows = sample_windows(
        corpus.held_out, args.eval_windows, args.eval_len, torch.Generator().manual_seed(args.seed + 2)
    )
    plan = phases(args)
    total = sum(p.steps for p in plan)
    step, started = 0, time.perf_counter()
    bar = tqdm(total=total, desc="train", dynamic_ncols=True)
    for phase in plan:
        for i in range(phase.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, args)
            out = train_step(
                model, opt, sample_windows(corpus.train, *phase.shape(i, args), gen), phase, args
            )
            step += 1
            bar.update(1)
            bar.set_postfix(
                phase=phase.name,
                lm=f"{out.lm_loss.item():.3f}",
                mtp="/".join(f"{m.item():.2f}" for m in out.mtp_losses),
                kl=f"{out.kl_loss.item():.3f}",
            )
            if step % args.eval_every == 0 or step == total:
                held = evaluate(model, eval_windows, DENSE if phase.mode == DENSE else SPARSE_STABLE)
                report(
                    {
                        "step": step,
                        "phase": phase.name,
                        "wall_s": round(time.perf_counter() - started, 1),
                        "train_lm": out.lm_loss.item(),
                        "train_mtp": [round(m.item(), 4) for m in out.mtp_losses],
                        "held_lm": held["lm"],
                        "held_mtp": held["mtp"],
                        "kl": out.kl_loss.item(),
                    },
                    args.log,
                )
                save(model, args.out)
    bar.close()
    report(
        {
            "wall_s": round(time.perf_counter() - started, 1),
            "params": num_params,
            "held_lm_sparse": evaluate(model, eval_windows, SPARSE_STABLE)["lm"],
            "held_lm_dense": evaluate(model, eval_windows, DENSE)["lm"],
        },
        args.log,
    )
    save(model, args.out)
    return 0
