"""Fast-weight layers over long streams: does anything blow up?

One FastWeightAttention layer (fairseq's attention interface, random
weights) reads a stream of T tokens in segments with its state carried from
segment to segment (the carry-over of paper Table 4), and we watch the fast
weight W, the key sum z (attention normalisation) and the outputs.

    .venv/bin/python examples/reliability/long_streams.py [--tokens 100000] [--segment 1000]

Cases: the delta rule (sum-normalised phi, the LM default), the sum rule with
and without attention normalisation, and the delta rule with attention
normalisation (Eqs. 26-28, which the paper had to drop: "the accumulator
blows up"); inputs random, or adversarial: one input repeated (the same key
every step), and the same with beta near 1 and values 10x larger. float32
and bfloat16 inputs (the ops accumulate in float32).
"""
import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fairseq_fwp.modules.attention_options import AttentionOptions
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention  # noqa: E402

RULES = {  # name: (update rule, attention normalisation)
    "delta": ("delta", False),
    "sum": ("sum", False),
    "sum+attn-norm": ("sum", True),
    "delta+attn-norm": ("delta", True),
}
INPUTS = ("random", "repeated", "repeated+beta~1+10x values")
CHECKPOINTS = (1_000, 10_000, 100_000)


def build_layer(rule, attn_norm, inputs, dim, heads, seed):
    torch.manual_seed(seed)
    layer = FastWeightAttention(AttentionOptions(dim, heads, causal=True, feature_map="linear", update_rule=rule,
                                attention_normalization=attn_norm)).eval()
    if "beta~1" in inputs and layer.beta_proj is not None:
        with torch.no_grad():
            layer.beta_proj.bias.fill_(7.0)  # sigmoid(7) = 0.999
            layer.v_proj.weight.mul_(10)
    layer.enable_carry_over()
    return layer


def segment_inputs(inputs, length, dim, generator):
    if inputs == "random":
        return torch.randn(length, 1, dim, generator=generator)
    return torch.ones(length, 1, 1) * torch.linspace(-1, 1, dim)  # the same token at every step


@torch.no_grad()
def run(rule_name, inputs, dtype, tokens, segment, dim=64, heads=4, seed=0):
    """Returns {"W@N": max |W| after N tokens, ..., "max|out|", "max z", "finite", "seconds"}."""
    rule, attn_norm = RULES[rule_name]
    layer = build_layer(rule, attn_norm, inputs, dim, heads, seed).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    result, max_out, max_z, finite = {}, 0.0, 0.0, True
    start = time.time()
    for position, done in enumerate(range(segment, tokens + 1, segment)):
        layer.start_segment(position, training=False)
        out = layer(segment_inputs(inputs, segment, dim, generator).to(dtype), None, None)[0].float()
        state = layer.streams.last(False)
        W = state.memory.fast_weight
        finite &= bool(torch.isfinite(out).all() and torch.isfinite(W).all())
        max_out = max(max_out, out.abs().max().item())
        if state.key_sum is not None:
            max_z = max(max_z, state.key_sum.abs().max().item())
        for checkpoint in CHECKPOINTS:
            if done == checkpoint or (checkpoint > tokens and done == tokens):
                result[f"W@{checkpoint}"] = W.abs().max().item()
    result.update({"max|out|": max_out, "max z": max_z, "finite": finite, "seconds": time.time() - start})
    return result


def cases():
    """(rule, inputs, dtype) of every case: the adversarial betas and values only where a beta exists."""
    return [(rule, inputs, dtype) for rule in RULES for inputs in INPUTS for dtype in (torch.float32, torch.bfloat16)
            if "beta" not in inputs or "delta" in rule]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--segment", type=int, default=1_000)
    parser.add_argument("--json", action="store_true", help="one JSON line per case instead of the table")
    args = parser.parse_args()
    if args.tokens % args.segment:
        parser.error("--tokens must be a multiple of --segment")
    columns = [f"W@{c}" for c in CHECKPOINTS if c <= args.tokens]
    if not args.json:
        print(f"# {args.tokens} tokens in segments of {args.segment}, one layer d=64, 4 heads, linear phi, "
              f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
        print("| rule | inputs | dtype | " + " | ".join(f"max abs {c}" for c in columns)
              + " | max abs out | max z | finite |")
        print("|---" * (6 + len(columns)) + "|")
    for rule_name, inputs, dtype in cases():
        r = run(rule_name, inputs, dtype, args.tokens, args.segment)
        if args.json:
            print(json.dumps({"rule": rule_name, "inputs": inputs, "dtype": str(dtype)[6:], **r}), flush=True)
            continue
        cells = " | ".join(f"{r[c]:.3g}" if math.isfinite(r[c]) else str(r[c]) for c in columns)
        print(f"| {rule_name} | {inputs} | {str(dtype)[6:]} | {cells} | {r['max|out|']:.3g} | "
              f"{r['max z']:.3g} | {r['finite']} |", flush=True)


if __name__ == "__main__":
    main()
