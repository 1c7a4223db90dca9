"""Perplexity at long contexts: how much of the text before a token a language model can use.

    python -m examples.recipes.long_context --data DATA/bin --subset test --out runs/context \\
        --model original=ORIGINAL/model.pt --model converted=CKPT.pt --model scratch=CKPT.pt \\
        --contexts 512 1024 2048 3072 4096 8192 16384

Two protocols at each context C, each scoring every token of the split once:

- carried: the text in blocks of C tokens, each read from its start in segments of --segment tokens, a
  fast-weight model's state carried from one segment to the next (as fwp_stream_lm carries it): a token sees
  the tokens before it in its block.
- sliding: fairseq-eval-lm's context window: blocks of --stride tokens scored, each read after up to
  C - stride tokens of the text before it (eval-lm's --tokens-per-sample C --context-window C-stride), a
  fast-weight model reading each window in segments with its state carried.

A model without fast weights to carry (softmax attention) reads each block or window in one forward, so
only where it fits its positions (model.max_positions(): the published WikiText-103 model's 3,072): past
them it has no point. A fast-weight model's positions, where it has any, restart in every segment, as in
fwp_stream_lm; its cost per token does not grow with the context. Writes OUT/context.json (perplexity and
tokens per second of each model, protocol and context) and OUT/context.png, and prints them as a table.
"""
import argparse
import json
import math
import os
import time

import torch

PROTOCOLS = ("carried", "sliding")


def load(checkpoint, data):
    """(the model, its task) as fairseq-eval-lm loads them, in eval mode."""
    import fairseq_fwp  # noqa: F401  (the plugin's models, and torch.load of fairseq's checkpoints)
    from fairseq import checkpoint_utils

    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([checkpoint], arg_overrides={"data": data})
    return model.eval(), task


def split_tokens(data, subset, dictionary):
    """The split as one text (every line ends with </s>), as fwp_stream_lm reads it."""
    from fairseq_fwp.tasks.stream_lm import TokenStream

    return TokenStream(os.path.join(data, subset), dictionary).tokens


def windows(n, context, stride=None):
    """(start, end, first scored) of the windows over n tokens: blocks of `context` tokens (stride None), or
    eval-lm's context windows: blocks of `stride` tokens scored, each after up to context - stride before it."""
    if stride is None:
        return [(a, min(a + context, n), a) for a in range(0, n, context)]
    return [(max(0, a + stride - context), min(a + stride, n), a) for a in range(0, n, stride)]


def carrying_layers(model):
    """The causal fast-weight layers, set to carry their state from one segment to the next."""
    from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention

    layers = [m for m in model.modules() if isinstance(m, FastWeightAttention) and m.causal]
    for layer in layers:
        if layer.streams is None:
            layer.enable_carry_over()
    return layers


class Reader:
    """Scores windows of a token stream with one model: sum of log-probabilities (nats) and the count."""

    def __init__(self, model, tokens, eos, segment, batch_size, device):
        self.model, self.segment, self.batch_size, self.device = model, segment, batch_size, device
        self.layers = carrying_layers(model)
        self.targets = tokens
        self.inputs = torch.cat([tokens.new_tensor([eos]), tokens[:-1]])  # the first token follows </s>

    def fits(self, length):
        """Whether the model can read a window of `length` tokens: in segments where it carries its state,
        else in one forward within its positions."""
        limit = self.model.max_positions()
        return (self.segment if self.layers else length) <= (limit if limit is not None else math.inf)

    @torch.no_grad()
    def score(self, spans):
        total, count = 0.0, 0
        groups = {}
        for start, end, scored in spans:  # one batch per window length and scored offset
            groups.setdefault((end - start, scored - start), []).append(start)
        for (length, offset), starts in groups.items():
            for i in range(0, len(starts), self.batch_size):
                part = starts[i:i + self.batch_size]
                src = torch.stack([self.inputs[a:a + length] for a in part]).to(self.device)
                tgt = torch.stack([self.targets[a:a + length] for a in part]).to(self.device)
                total += self._window_log_prob(src, tgt, offset)
                count += len(part) * (length - offset)
        return total, count

    def _window_log_prob(self, src, tgt, offset):
        segment = self.segment if self.layers else src.shape[1]
        total = 0.0
        for position, s in enumerate(range(0, src.shape[1], segment)):
            for layer in self.layers:  # position 0 starts from zero: every window from its own start
                layer.start_segment(position, training=False)
            target = tgt[:, s:s + segment].contiguous()
            output = self.model(src[:, s:s + segment])
            log_probs = self.model.get_normalized_probs(output, log_probs=True, sample={"target": target})
            picked = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            total += picked[:, max(0, offset - s):].double().sum().item()
        return total


def evaluate(reader, n, context, protocol, stride):
    """{"perplexity", "tokens", "tokens_per_s"} of one protocol at one context, or None where the model
    cannot read it."""
    spans = windows(n, context, stride if protocol == "sliding" else None)
    if not all(reader.fits(end - start) for start, end, _ in spans):
        return None
    began = time.time()
    total, count = reader.score(spans)
    seconds = time.time() - began
    return {"perplexity": math.exp(-total / count), "tokens": count, "tokens_per_s": count / seconds}


def table(results):
    """The results as a markdown table: a row per model and protocol, a column per context, each cell the
    perplexity (tokens scored per second), a dash beyond the model's positions."""
    contexts = list(next(iter(results["models"].values()))["carried"])
    lines = ["| model | protocol | " + " | ".join(contexts) + " |", "|---|---|" + "---|" * len(contexts)]
    for name, by_protocol in results["models"].items():
        for protocol in PROTOCOLS:
            cells = [f"{r['perplexity']:.1f} ({r['tokens_per_s']:.0f})" if r else "-"
                     for r in by_protocol[protocol].values()]
            lines.append(f"| {name} | {protocol} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ppl, speed) = plt.subplots(1, 2, figsize=(11, 4))
    for name, by_protocol in results["models"].items():
        for protocol, style in zip(PROTOCOLS, ("-o", "--s")):
            points = [(int(c), r) for c, r in by_protocol[protocol].items() if r is not None]
            if not points:
                continue
            contexts = [c for c, _ in points]
            line, = ppl.plot(contexts, [r["perplexity"] for _, r in points], style, label=f"{name}, {protocol}")
            speed.plot(contexts, [r["tokens_per_s"] for _, r in points], style, color=line.get_color(),
                       label=f"{name}, {protocol}")
    for axes, label in ((ppl, f"{results['subset']} perplexity"), (speed, "tokens scored per second")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("context (tokens)")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
    ppl.legend(fontsize=8)
    figure.suptitle(f"segments of {results['segment']} tokens; sliding windows move by {results['stride']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the binarised data (fairseq-preprocess --only-source)")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--model", action="append", required=True, metavar="NAME=CHECKPOINT")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 3072, 4096, 8192, 16384])
    parser.add_argument("--segment", type=int, default=512, help="tokens a fast-weight model reads per forward")
    parser.add_argument("--stride", type=int, default=512, help="the sliding window's step: tokens scored per window")
    parser.add_argument("--batch-size", type=int, default=8, help="windows read side by side")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if any("=" not in m for m in args.model):
        parser.error("--model takes NAME=CHECKPOINT")
    if any(c < args.stride for c in args.contexts):
        parser.error(f"no context may be shorter than --stride {args.stride}: the sliding window reads context - "
                     "stride tokens before the ones it scores (none where they are equal: blocks)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"subset": args.subset, "segment": args.segment, "stride": args.stride, "device": device, "models": {}}
    for spec in args.model:
        name, checkpoint = spec.split("=", 1)
        model, task = load(checkpoint, args.data)
        tokens = split_tokens(args.data, args.subset, task.source_dictionary)
        reader = Reader(model.to(device), tokens, task.source_dictionary.eos(), args.segment, args.batch_size, device)
        results["models"][name] = {protocol: {} for protocol in PROTOCOLS}
        for protocol in PROTOCOLS:
            for context in args.contexts:
                result = evaluate(reader, len(tokens), context, protocol, args.stride)
                results["models"][name][protocol][str(context)] = result
                shown = "beyond its positions" if result is None else \
                    f"perplexity {result['perplexity']:.2f}, {result['tokens_per_s']:.0f} tokens/s"
                print(f"{name} {protocol} {context}: {shown}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "context.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out, "context.png"))
    print(table(results))
    print(f"wrote {os.path.join(args.out, 'context.json')} and context.png", flush=True)


if __name__ == "__main__":
    main()
