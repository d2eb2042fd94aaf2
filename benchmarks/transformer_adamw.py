"""Which compressor, at which level, keeps a small GPT-style transformer trained with AdamW close to dense training?

Two gloo worker processes train a small decoder-only transformer (GPT-2's block: pre-norm causal self-attention and
a 4x MLP with GELU, learned positions, the output layer tied to the token embedding) on the package's own offline
language task (``TextDataModule``: bytes of the Python standard library's sources, next-byte prediction), through DDP
with lightning-gradcomp's communication hook, the code path of ``CompressedDDP``. Each worker trains on its own half
of the sequences; every configuration starts from the same weights and sees the same batches. The optimizer is AdamW
(learning rate 1e-3, betas (0.9, 0.95), weight decay 0.1), for every configuration.

The table reports the held-out loss (nats per byte, cross-entropy on a fixed set of held-out sequences) at the end,
its difference from dense training, and the compression ratio. ``-warmupN`` averages densely for the first N steps
(what ``DenseWarmup(steps=N)`` does) and compresses after.

Examples::

    python benchmarks/transformer_adamw.py --help
    python benchmarks/transformer_adamw.py --steps 60
    python benchmarks/transformer_adamw.py --steps 60 --configs dense powersgd-r2 powersgd-r2-warmup20
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import CompressionState, compression_hook
from lightning_gradcomp.compressors import BF16, DGC, FP16, Compressor, EFSignSGD, Identity, PowerSGD, SignSGD, TopK
from lightning_gradcomp.demo.ports import free_port
from lightning_gradcomp.tasks import TextDataModule

# name -> (compressor factory, dense steps first)
CONFIGS: dict[str, tuple[Callable[[], Compressor], int]] = {
    "dense": (Identity, 0),
    "bf16": (BF16, 0),
    "fp16": (FP16, 0),
    "powersgd-r2": (lambda: PowerSGD(rank=2), 0),
    "powersgd-r8": (lambda: PowerSGD(rank=8), 0),
    "powersgd-r32": (lambda: PowerSGD(rank=32), 0),
    "powersgd-r2-warmup20": (lambda: PowerSGD(rank=2), 20),
    "powersgd-r8-warmup20": (lambda: PowerSGD(rank=8), 20),
    "topk-1%": (lambda: TopK(ratio=0.01), 0),
    "topk-10%": (lambda: TopK(ratio=0.1), 0),
    "dgc": (DGC, 0),
    "signsgd": (SignSGD, 0),
    "efsignsgd": (EFSignSGD, 0),
}
BATCH = 16
SEQ_LEN = 64


class Block(nn.Module):
    """GPT-2's transformer block: pre-norm causal self-attention, then a 4x MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A decoder-only transformer over bytes: ``layers`` GPT-2 blocks of ``width``, output tied to the embedding."""

    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 2, heads: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(SEQ_LEN, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2's
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.norm(self.blocks(self.embed(tokens) + self.position(positions))))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def train(rank: int, world_size: int, config: str, steps: int, seed: int = 0) -> dict:
    """Train one configuration on this rank; return the held-out loss at the end and the compression ratio."""
    factory, dense_steps = CONFIGS[config]
    data = TextDataModule(max_bytes=1_000_000, seq_len=SEQ_LEN, batch_size=BATCH)
    data.setup()
    x, y = data.train_set.tensors
    x_val, y_val = (t[:256] for t in data.val_set.tensors)
    shard_x, shard_y = x[rank::world_size], y[rank::world_size]
    model = TinyGPT(seed=seed)
    ddp = DDP(model)
    state = CompressionState(factory())
    state.attach(ddp)
    ddp.register_comm_hook(state, compression_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    order = torch.randperm(len(shard_y), generator=torch.Generator().manual_seed(rank + 1000 * seed))
    sent = dense = 0
    for step in range(steps):
        batch = order[(step * BATCH) % len(order) :][:BATCH]
        state.step = step
        state.enabled = step >= dense_steps
        optimizer.zero_grad()
        _loss(ddp, shard_x[batch], shard_y[batch]).backward()
        optimizer.step()
        stats = state.telemetry.pop_step()
        if step >= dense_steps:
            sent += stats.bytes_sent
            dense += stats.bytes_dense
    with torch.no_grad():
        val_loss = _loss(model, x_val, y_val).item()
    return {"val_loss": val_loss, "ratio": dense / sent if sent else 1.0, "steps": steps}


def _worker(rank: int, world_size: int, port: int, configs: list[str], steps: int, seed: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {config: train(rank, world_size, config, steps, seed) for config in configs}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run(configs: list[str], steps: int, seed: int = 0) -> dict[str, dict]:
    """Every configuration on 2 spawned gloo processes; rank 0's results."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(2, free_port(), configs, steps, seed, out), nprocs=2)
        return copy.deepcopy(torch.load(os.path.join(out, "rank0.pt")))


def table(results: dict[str, dict], steps: int) -> str:
    """Held-out loss at the end against dense, and the compression ratio of the compressed steps."""
    base = results.get("dense", {}).get("val_loss", math.nan)
    lines = [
        f"| configuration | held-out loss after {steps} steps (nats/byte) | vs dense | compression ratio |",
        "|---|---|---|---|",
    ]
    for config, r in results.items():
        lines.append(f"| {config} | {r['val_loss']:.3f} | {r['val_loss'] - base:+.3f} | {r['ratio']:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(table(run(args.configs, args.steps, args.seed), args.steps))


if __name__ == "__main__":
    main()
