"""`kvferry bench codec-accuracy`: the fp8 codec's error on KV with realistic outliers, per scale granularity.

KV of one llama3-8b-shaped layer chunk (8 KV heads x 128, 256 tokens): Student-t values (3 degrees of freedom: heavy
tails) times per-channel magnitudes, with a few channels 20x larger (as real K caches have). Relative error
(||x - x_hat|| / ||x||) of the dequantised K and V, and of a causal attention output of 32 query heads computed from
them against the same attention on the bf16 KV; per token and head (the codec's layout) and per head and chunk.
"""

from __future__ import annotations

import argparse

import torch

from kvferry.bench.harness import Outcome, Steps, add_json_argument, description_of
from kvferry.bench.report import new_table
from kvferry.formats.codec import FP8_MAX

HEADS, HS, TOKENS, QUERY_HEADS = 8, 128, 256, 32
GRANULARITIES = {"per token and head (the codec)": (2,), "per head and chunk": (0, 2)}  # the dims one scale spans

DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench codec-accuracy
  kvferry bench codec-accuracy --seed 1 --json bench-out/codec_accuracy.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="of the random KV and queries (default: 0)")
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    return  # any seed runs, on any machine


def outlier_kv(gen: torch.Generator) -> torch.Tensor:
    """[tokens, heads, hs] bf16: heavy tails and a few large channels."""
    t = torch.distributions.StudentT(3.0).sample((TOKENS, HEADS, HS))
    channels = torch.rand(HEADS, HS, generator=gen) + 0.5
    channels[:, torch.randperm(HS, generator=gen)[:4]] *= 20
    return (t * channels).bfloat16()


def fp8_round_trip(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """`x` quantised with one scale per slice over `dims` (amax / 448), then read back in bf16."""
    xf = x.float()
    amax = xf.abs().amax(dim=dims, keepdim=True)
    q = (xf * (torch.full_like(amax, FP8_MAX) / amax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * (amax / FP8_MAX)).bfloat16()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = QUERY_HEADS // HEADS
    k, v = (t.float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    steps.expect(len(GRANULARITIES))
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)  # StudentT samples from torch's default generator
    k, v = outlier_kv(gen), outlier_kv(gen)
    q = torch.randn(TOKENS, QUERY_HEADS, HS, generator=gen) * (k.float().std() ** -0.5)
    exact = attention(q, k, v)
    rows = []
    for name, dims in GRANULARITIES.items():
        k8, v8 = fp8_round_trip(k, dims), fp8_round_trip(v, dims)
        rows.append({"scales": name, "k": rel(k8, k), "v": rel(v8, v), "attention": rel(attention(q, k8, v8), exact)})
        steps.done(name)
    table = new_table(
        f"relative error of fp8 KV against bf16 ({HEADS} KV heads x {HS}, {TOKENS} tokens, Student-t with outlier "
        "channels)",
        ("scale granularity", "K", "V", "attention output"),
    )
    for r in rows:
        table.add_row(str(r["scales"]), f"{r['k']:.4f}", f"{r['v']:.4f}", f"{r['attention']:.4f}")
    config = {"seed": args.seed, "kv_heads": HEADS, "head_size": HS, "tokens": TOKENS, "query_heads": QUERY_HEADS}
    return Outcome(config, {"rows": rows}, [table])
