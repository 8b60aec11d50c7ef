"""The GPT example's model, data and training step: plain PyTorch, shared by ``train.py`` (under
trainguard) and ``train_plain.py`` (the same training without it). See ``train.py`` for the layout,
the schedule of a step, exact resume and the knobs."""

from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

Group = dist.ProcessGroup | None

SEED = 1234
VOCAB = 256  # byte-level
N_HEADS = 4
LR = 3e-3
MAX_GRAD_NORM = 1.0
CORPUS_BYTES = 1 << 20


# -- configuration -------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    micro_batches: int = 2
    micro_batch_size: int = 4
    seq_len: int = 64
    n_layers: int = 4
    d_model: int = 64
    step_sleep_s: float = 0.0
    bug_at_step: int = 0

    @classmethod
    def from_env(cls) -> Config:
        e = os.environ
        return cls(
            micro_batches=int(e.get("GPT_MICRO_BATCHES", cls.micro_batches)),
            micro_batch_size=int(e.get("GPT_MICRO_BATCH_SIZE", cls.micro_batch_size)),
            seq_len=int(e.get("GPT_SEQ_LEN", cls.seq_len)),
            n_layers=int(e.get("GPT_LAYERS", cls.n_layers)),
            d_model=int(e.get("GPT_D_MODEL", cls.d_model)),
            step_sleep_s=float(e.get("GPT_STEP_SLEEP_S", cls.step_sleep_s)),
            bug_at_step=int(e.get("GPT_BUG_AT_STEP", cls.bug_at_step)),
        )


@dataclass(frozen=True)
class Pipe:
    """This rank's place in its pipeline: stage index and neighbours' global ranks."""

    stage: int
    n_stages: int
    prev: int | None  # rank of stage - 1 in the same dp replica
    next: int | None  # rank of stage + 1 in the same dp replica

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.n_stages - 1


# -- data ------------------------------------------------------------------------


def load_corpus() -> torch.Tensor:
    """The stdlib's top-level sources, sorted by name, cut at CORPUS_BYTES, as int64 tokens."""
    chunks: list[bytes] = []
    size = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if size >= CORPUS_BYTES:
            break
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
    raw = b"".join(chunks)[:CORPUS_BYTES]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


Batch = tuple[torch.Tensor, torch.Tensor]


def get_batch(corpus: torch.Tensor, step: int, dp_index: int, cfg: Config) -> Batch:
    """Inputs and next-byte targets of shape (M, B, T) for one replica at one step.

    Depends only on (step, dp_index): no state carried between steps, so a resumed
    run reads exactly what an uninterrupted one would.
    """
    g = torch.Generator().manual_seed(SEED + step * 65_536 + dp_index)
    shape = (cfg.micro_batches, cfg.micro_batch_size)
    starts = torch.randint(0, corpus.numel() - cfg.seq_len - 1, shape, generator=g)
    idx = starts.unsqueeze(-1) + torch.arange(cfg.seq_len)
    return corpus[idx], corpus[idx + 1]


# -- model -----------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block, no dropout."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        hidden = 4 * d_model
        self.mlp = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Stage(nn.Module):
    """One pipeline stage: [embeddings] + blocks + [final LayerNorm + LM head].

    The first stage takes token ids (B, T); the others take activations (B, T, D).
    The last stage returns logits (B, T, VOCAB); the others return activations.
    """

    def __init__(self, cfg: Config, n_blocks: int, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, cfg.d_model) if first else None
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if first else None
        self.blocks = nn.ModuleList(Block(cfg.d_model, N_HEADS) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(cfg.d_model) if last else None
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False) if last else None
        self.apply(_init_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None and self.pos_emb is not None:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None and self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear | nn.Embedding):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def build_stage(cfg: Config, pipe: Pipe) -> Stage:
    if cfg.n_layers % pipe.n_stages:
        raise SystemExit(f"GPT_LAYERS={cfg.n_layers} is not divisible by pp={pipe.n_stages}")
    if cfg.d_model % N_HEADS:
        raise SystemExit(f"GPT_D_MODEL={cfg.d_model} is not divisible by {N_HEADS} heads")
    # The seed depends on the stage alone: every dp replica of a stage starts identical.
    torch.manual_seed(SEED + 1000 * pipe.stage)
    return Stage(cfg, cfg.n_layers // pipe.n_stages, pipe.first, pipe.last)


# -- one training step -------------------------------------------------------------


def forward_backward(
    model: Stage, pipe: Pipe, cfg: Config, inputs: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Run the GPipe schedule for one step; return the mean loss (0 except on the last stage)."""
    act_shape = (cfg.micro_batch_size, cfg.seq_len, cfg.d_model)
    stage_inputs: list[torch.Tensor] = []
    stage_outputs: list[torch.Tensor] = []  # activations, or the loss on the last stage

    device = next(model.parameters()).device
    for m in range(cfg.micro_batches):
        if pipe.first:
            x = inputs[m]
        else:
            x = torch.empty(act_shape, device=device)
            dist.recv(x, src=pipe.prev)
            x.requires_grad_()
        out = model(x)
        if pipe.last:
            out = F.cross_entropy(out.reshape(-1, VOCAB), targets[m].reshape(-1))
        else:
            dist.send(out.detach(), dst=pipe.next)
        stage_inputs.append(x)
        stage_outputs.append(out)

    for m in reversed(range(cfg.micro_batches)):
        if pipe.last:
            (stage_outputs[m] / cfg.micro_batches).backward()
        else:
            grad = torch.empty(act_shape, device=device)
            dist.recv(grad, src=pipe.next)
            stage_outputs[m].backward(grad)
        if not pipe.first:
            dist.send(stage_inputs[m].grad, dst=pipe.prev)

    if pipe.last:
        return torch.stack(stage_outputs).detach().mean()
    return torch.zeros((), device=device)


def sync_and_clip(
    model: Stage, loss: torch.Tensor, dp_group: Group, pp_group: Group, dp: int
) -> tuple[float, float]:
    """Average gradients (and the loss) over dp, clip to the global norm; return (loss, norm).
    A group is None where it would hold this rank alone."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    # One buffer, one all_reduce: every gradient, then the loss in the last slot.
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.reshape(1)])
    if dp_group is not None:
        dist.all_reduce(flat, group=dp_group)
        flat /= dp
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()

    # Squared norm of this stage's gradients plus the loss (non-zero on the last
    # stage only), summed over the pipeline: every rank learns both global values.
    totals = torch.stack([flat[:-1].pow(2).sum(), flat[-1]])
    if pp_group is not None:
        dist.all_reduce(totals, group=pp_group)
    grad_norm = math.sqrt(totals[0].item())
    coef = min(1.0, MAX_GRAD_NORM / (grad_norm + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return totals[1].item(), grad_norm


def scale_lr(opt: torch.optim.Optimizer, factor: float) -> None:
    for group in opt.param_groups:
        group["lr"] = group["lr"] * factor
