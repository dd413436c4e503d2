"""The peer autoshard's one-GPU step is measured against: what a PyTorch user writes today.

A nanoGPT-style GPT with autoshard's GPT architecture and sizes (learned token and
position embeddings, pre-LayerNorm blocks with biases, causal attention, GELU (tanh) MLP
of width 4h, a final LayerNorm, the LM head tied to the token embedding), trained the way
a PyTorch user trains it: ``F.scaled_dot_product_attention(is_causal=True)`` (flash
attention), bf16 autocast over float32 master weights, ``torch.optim.AdamW(fused=True)``,
``torch.compile`` of the model.  Same batch, sequence and vocabulary as
``benchmarks/gpu_single.py measure``; step = forward, cross-entropy, backward, AdamW
step, zero grad.  Records the step time (median of ``--steps`` after warm-up, each
synchronised), MFU (Megatron's formula over ``--peak-tflops``), and the allocator's peak;
then ``--rounds`` rounds of ``--steps`` steps dispatched back to back with one
synchronisation at the end (what a training loop does), the median over rounds of the
time over the count (``back_to_back_s``), as ``benchmarks/gpu_ab.py`` times autoshard's.

torch is not a dependency of autoshard; this script is run where torch is installed.

    python benchmarks/gpu_peer_torch.py --out peer.json [--configs gpt-1.3b:24:8 ...]
        [--steps 10] [--no-compile] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# model -> (hidden, heads); vocabulary 51200 and sequence 1024 (autoshard's GPT presets)
SIZES = {"gpt-tiny": (64, 4), "gpt-350m": (1024, 16), "gpt-1.3b": (2048, 32)}
CONFIGS = (("gpt-1.3b", 24, 8), ("gpt-350m", 24, 8))


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """72 B s L h^2 (1 + s/6h + V/12Lh): forward + backward matmul FLOPs of one step."""
    return (
        72.0
        * batch
        * seq
        * layers
        * hidden**2
        * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
    )


def build(hidden: int, heads: int, layers: int, vocab: int, seq: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)
            self.ln_2 = nn.LayerNorm(hidden)
            self.fc = nn.Linear(hidden, 4 * hidden)
            self.fc_out = nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            B, S, h = x.shape
            q, k, v = self.qkv(self.ln_1(x)).split(hidden, dim=2)
            q, k, v = (t.view(B, S, heads, h // heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).contiguous().view(B, S, h))
            return x + self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, hidden)
            self.wpe = nn.Embedding(seq, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(hidden)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, tokens, labels):
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.wte(tokens) + self.wpe(pos)[None]
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T  # tied head
            return F.cross_entropy(logits.float().view(-1, vocab), labels.view(-1))

    return GPT()


def measure_one(
    model: str, layers: int, batch: int, steps: int, compile_: bool, rounds: int = 0
) -> dict:
    import numpy as np
    import torch

    hidden, heads = SIZES[model]
    vocab, seq = (256, 32) if model == "gpt-tiny" else (51200, 1024)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    net = build(hidden, heads, layers, vocab, seq).to(device)
    params = sum(p.numel() for p in net.parameters())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda)
    fwd = torch.compile(net) if compile_ else net
    tokens = torch.randint(0, vocab, (batch, seq), device=device)
    labels = torch.randint(0, vocab, (batch, seq), device=device)
    amp = torch.autocast(device_type=device, dtype=torch.bfloat16)

    def step():
        with amp:
            loss = fwd(tokens, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    losses = [float(step().detach())]  # compiles
    first_s = time.perf_counter() - t0
    for _ in range(2):
        losses.append(float(step().detach()))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    back_to_back = []
    for _ in range(rounds):  # back to back: the host runs ahead, one synchronisation a round
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step()
        sync()
        back_to_back.append((time.perf_counter() - t0) / steps)
    losses.append(float(loss.detach()))
    med = float(np.median(times))
    flops = megatron_flops(batch, seq, layers, hidden, vocab)
    return {
        "model": model,
        "layers": layers,
        "batch": batch,
        "seq_len": seq,
        "vocab": vocab,
        "hidden": hidden,
        "heads": heads,
        "params": params,
        "torch": torch.__version__,
        "compiled": compile_,
        "first_step_s": first_s,
        "step_times_s": times,
        "step_time_s": med,
        "step_time_spread": (max(times) - min(times)) / med,
        "back_to_back_round_s": back_to_back,
        "back_to_back_s": float(np.median(back_to_back)) if back_to_back else None,
        "model_flops_per_step": flops,
        "losses": losses,
        "peak_bytes": int(torch.cuda.max_memory_allocated()) if cuda else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", nargs="+", help="model:layers:batch, e.g. gpt-1.3b:24:8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--rounds", type=int, default=0, help="rounds of --steps steps back to back (0: none)"
    )
    ap.add_argument("--no-compile", action="store_true", help="eager (no torch.compile)")
    ap.add_argument("--quick", action="store_true", help="gpt-tiny, 2 layers (a CPU check)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense, for MFU")
    args = ap.parse_args(argv)
    configs = (("gpt-tiny", 2, 8),) if args.quick else CONFIGS
    if args.configs:
        configs = [(m, int(n), int(b)) for m, n, b in (c.split(":") for c in args.configs)]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["benchmarks/gpu_peer_torch.py", *(argv or sys.argv[1:])]),
        "peak_tflops": args.peak_tflops,
        "runs": [],
    }
    try:
        import torch

        result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        ap.error("torch is not installed here (it is not a dependency of autoshard)")
    for model, layers, batch in configs:
        try:
            run = measure_one(
                model, layers, batch, args.steps, not args.no_compile, rounds=args.rounds
            )
            run["mfu"] = (
                run["model_flops_per_step"] / run["step_time_s"] / (args.peak_tflops * 1e12)
            )
            if run["back_to_back_s"]:
                run["back_to_back_mfu"] = (
                    run["model_flops_per_step"] / run["back_to_back_s"] / (args.peak_tflops * 1e12)
                )
            peak = run["peak_bytes"]
            print(
                f"torch {model} L{layers} B{batch}: step {run['step_time_s'] * 1e3:.1f} ms "
                f"(spread {run['step_time_spread']:.1%}), MFU {run['mfu']:.1%}, peak "
                + (f"{peak / 2**30:.2f} GiB" if peak else "n/a")
                + f", loss {run['losses'][0]:.3f} -> {run['losses'][-1]:.3f}"
                + (
                    f"; back to back: step {run['back_to_back_s'] * 1e3:.1f} ms, MFU "
                    f"{run['back_to_back_mfu']:.1%}"
                    if run["back_to_back_s"]
                    else ""
                ),
                flush=True,
            )
        except Exception as err:  # noqa: BLE001 - recorded; the next configuration still runs
            run = {"model": model, "layers": layers, "batch": batch, "error": repr(err)[-2000:]}
            print(f"torch {model} L{layers} B{batch}: FAILED {err!r}"[:500], flush=True)
        result["runs"].append(run)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        if "error" not in run:
            import torch

            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
