"""Train a small hybrid language model (Gated DeltaNet + dynamic mask attention blocks) on the
text bundled with this repository, byte by byte.

    python examples/train_tiny.py                    # one GPU, a few hundred steps
    python examples/train_tiny.py --cpu --steps 3    # Triton's CPU interpreter, a smoke run

Logs loss and tokens/s on a progress bar and writes <out>/train_tiny-<device>-<date>.json (the
run's settings, device, losses, throughput) and a .png of the loss curve.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=6, help="blocks, alternating GatedDeltaNet and attention")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--keep-window", type=int, default=256, help="keys kept per query (keep_window_size)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--cpu", action="store_true", help="run on the CPU in Triton's interpreter (tiny sizes)")
    args = p.parse_args(argv)
    if args.cpu:  # sizes the interpreter gets through in seconds
        for name, small in (("batch_size", 1), ("seq_len", 32), ("hidden_size", 32), ("layers", 2),
                            ("heads", 2), ("kv_heads", 1), ("keep_window", 8)):
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, small)
    for name in ("steps", "batch_size", "seq_len", "hidden_size", "layers", "heads", "kv_heads", "keep_window"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    return args


def bundled_text() -> bytes:
    """The repository's own documentation and sources: real text, no download."""
    parts = []
    for pattern in ("*.md", "docs/**/*.md", "flash_dma/**/*.py", "examples/*.py"):
        parts += [f.read_bytes() for f in sorted(REPO.glob(pattern)) if f.is_file()]
    data = b"\n".join(parts)
    if len(data) < 4096:
        raise SystemExit(f"bundled text: found only {len(data)} bytes under {REPO}")
    return data


def build_model(args, torch, nn):
    from flash_dma import DynamicMaskAttention, GatedDeltaNet

    class RMSNorm(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).to(x.dtype)

    class Block(nn.Module):
        def __init__(self, index):
            super().__init__()
            head_dim = args.hidden_size // args.heads
            if index % 2 == 0:
                self.mixer = GatedDeltaNet(hidden_size=args.hidden_size, expand_v=1, head_dim=head_dim,
                                           num_heads=args.heads, layer_idx=index)
            else:
                self.mixer = DynamicMaskAttention(args.hidden_size, args.heads, args.kv_heads,
                                                  keep_window_size=args.keep_window, layer_idx=index)
            self.norm1, self.norm2 = RMSNorm(args.hidden_size), RMSNorm(args.hidden_size)
            inner = 8 * args.hidden_size // 3
            self.up = nn.Linear(args.hidden_size, 2 * inner, bias=False)
            self.down = nn.Linear(inner, args.hidden_size, bias=False)

        def forward(self, x):
            x = x + self.mixer(self.norm1(x))
            gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
            return x + self.down(nn.functional.silu(gate) * up)

    class HybridLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(256, args.hidden_size)
            nn.init.normal_(self.embed.weight, std=0.02)  # tied head: logits start near 0
            self.blocks = nn.ModuleList(Block(i) for i in range(args.layers))
            self.norm = RMSNorm(args.hidden_size)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.norm(x) @ self.embed.weight.to(x.dtype).T  # tied output head

    return HybridLM()


def main(argv=None):
    args = parse_args(argv)
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch
    from torch import nn
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    if args.cpu:
        device, amp_dtype, device_name = torch.device("cpu"), torch.float16, platform.processor() or "cpu"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: run with --cpu for the interpreter smoke run")
        device, amp_dtype, device_name = torch.device("cuda"), torch.bfloat16, torch.cuda.get_device_name()

    data = torch.frombuffer(bytearray(bundled_text()), dtype=torch.uint8)
    if len(data) <= args.seq_len + 1:
        raise SystemExit(f"--seq-len: {args.seq_len} does not fit the {len(data)} bytes of bundled text")
    split = int(len(data) * 0.95)
    train, held_out = data[:split], data[split:]

    def sample(source, generator=None):
        starts = torch.randint(0, len(source) - args.seq_len - 1, (args.batch_size,), generator=generator)
        rows = torch.stack([source[s: s + args.seq_len + 1] for s in starts.tolist()]).long()
        return rows[:, :-1].to(device), rows[:, 1:].to(device)

    model = build_model(args, torch, nn).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(args.steps - args.warmup, 1)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def loss_of(inputs, targets):
        with torch.autocast(device.type, dtype=amp_dtype):
            logits = model(inputs)
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    losses, step_times = [], []
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(range(args.steps), desc="train_tiny", unit="step", dynamic_ncols=True)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        inputs, targets = sample(train)
        start = time.perf_counter()
        loss = loss_of(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = loss.item()  # waits for the step: the timing below covers its kernels
        step_times.append(time.perf_counter() - start)
        if not math.isfinite(value):
            raise SystemExit(f"step {step}: loss is {value}")
        losses.append(value)
        timed = step_times[min(5, len(step_times) - 1):]  # the first steps compile kernels
        rate = tokens_per_step * len(timed) / sum(timed)
        bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{rate:,.0f}")

    model.eval()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        batches = 1 if args.cpu else 8
        held_out_loss = sum(loss_of(*sample(held_out, generator)).item() for _ in range(batches)) / batches
    timed = step_times[min(5, len(step_times) - 1):]
    tokens_per_s = tokens_per_step * len(timed) / sum(timed)
    date = datetime.datetime.now().strftime("%Y%m%d")
    tag = "".join(c if c.isalnum() else "-" for c in device_name).strip("-")[:40] or "device"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"train_tiny-{tag}-{date}"
    tail = losses[-min(10, len(losses)):]
    result = {
        "device": device_name, "date": date, "torch": torch.__version__,
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "parameters": n_params, "tokens_per_step": tokens_per_step,
        "first_loss": losses[0], "final_loss": sum(tail) / len(tail), "held_out_loss": held_out_loss,
        "tokens_per_s": tokens_per_s, "tokens_per_s_excludes_first_steps": min(5, len(step_times) - 1),
        "losses": losses,
    }
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    _plot(losses, stem.with_suffix(".png"), f"train_tiny on {device_name}: {n_params / 1e6:.1f}M params, "
          f"{tokens_per_s:,.0f} tok/s")
    print(f"final loss {result['final_loss']:.3f} (held out {held_out_loss:.3f}), {tokens_per_s:,.0f} tokens/s; "
          f"wrote {stem}.json and .png", file=sys.stderr)
    return result


def _plot(losses, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
