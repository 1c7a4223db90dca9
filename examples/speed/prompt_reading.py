"""Time to the first new token, and then per token, of LM generation after a long prompt: the prompt read in
one decoder call (FastWeightSequenceGenerator), against fairseq's SequenceGenerator, which forces it one token
per step, and against the softmax original as fairseq generates from it (to its positions).

    OMP_NUM_THREADS=2 .venv/bin/python examples/speed/prompt_reading.py --model small
    OMP_NUM_THREADS=2 .venv/bin/python examples/speed/prompt_reading.py --model wiki103 --lengths 512 2048 4096

Models, random weights, batch 1, greedy:
- small: 4 layers of 128 (4 heads, FFN 512), the delta rule, no positions, 1,000 words: its weights stay in
  the CPU's caches, and forcing pays fairseq's per-step overhead once per prompt token;
- wiki103: transformer_lm_wiki103's shape (16 layers of 1024, 8 heads, FFN 4096, adaptive input and softmax
  over 267,744 types, tied; about 247M parameters) converted to the delta rule, its positions restarting
  every 512 tokens (--fwp-position-period, as fwp_stream_lm's finetuning leaves it); its softmax original is
  fairseq's transformer_lm_wiki103, 3,072 positions.

One generate() call writes 32 tokens after the prompt: the time to the first new token runs to the start of
the step after it, and the time per token is the median step after that. The bound of the ratio forcing / reading at a long prompt is about 2F/B (a forced step reads every
weight, 4 bytes, for 2 FLOPs of it; the prompt read in one call is matrix products): F, the float32 matrix
product rate, and B, the memory read rate, are measured here and printed beside it.
"""
import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.recipes.decoding_cost import build_random_model, numbered_dictionary  # noqa: E402

SHAPES = {
    "small": ("fwp_lm_tiny", ["--decoder-layers", 4, "--decoder-embed-dim", 128, "--decoder-ffn-embed-dim", 512,
                                     "--decoder-attention-heads", 4, "--fwp-update-rule", "delta"], 1000),
    "wiki103": ("fwp_lm_wiki103_small", ["--decoder-layers", 16, "--decoder-embed-dim", 1024, "--decoder-ffn-embed-dim",
                                       4096, "--decoder-attention-heads", 8, "--adaptive-input", "--tie-adaptive-weights",
                                       "--tie-adaptive-proj", "--adaptive-input-cutoff", "20000,60000",
                                       "--adaptive-softmax-cutoff", "20000,60000", "--adaptive-input-factor", 4,
                                       "--adaptive-softmax-factor", 4, "--no-decoder-final-norm",
                                       "--decoder-normalize-before", "--max-target-positions", 3072,
                                       "--fwp-positions", "on", "--fwp-position-period", 512,
                                       "--fwp-update-rule", "delta"], 267740),
}
SOFTMAX_ORIGINAL = {"wiki103": ("transformer_lm_wiki103", ["--max-target-positions", 3072], 3072)}
NEW_TOKENS = 32


def machine_rates(seconds=2.0):
    """(F: float32 matrix products, FLOP/s; B: memory read, bytes/s), measured now, on every thread."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    count, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        a @ b
        count += 1
    flops = count * 2 * 2048 ** 3 / (time.perf_counter() - began)
    big = torch.randn(256 * 2 ** 20 // 4 * 4)  # 1 GiB: far past the caches
    big.sum()
    count, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        big.sum()
        count += 1
    return flops, count * big.numel() * 4 / (time.perf_counter() - began)


@torch.no_grad()
def timed_generation(generator_class, model, dictionary, prompt, new_tokens=NEW_TOKENS, **generate_options):
    """(the start of each of the generator's steps, the time generate() was called, the best hypothesis) of one
    greedy generate() that writes `new_tokens` after `prompt` ``[P]`` (the last, </s>, forced by the length limit);
    generate_options go to generate() (a session's history: whose limits count the reply alone)."""
    length = new_tokens if "history" in generate_options else len(prompt) + new_tokens
    generator = generator_class([model], dictionary, beam_size=1, max_len_a=0, max_len_b=length, min_len=length)
    sample = {"net_input": {"src_tokens": torch.cat([prompt.new_tensor([dictionary.eos()]), prompt]).unsqueeze(0),
                            "src_lengths": torch.tensor([len(prompt) + 1])}}
    starts, forward_decoder = [], generator.model.forward_decoder

    def timed(tokens, *args, **kwargs):
        starts.append(time.perf_counter())
        return forward_decoder(tokens, *args, **kwargs)

    generator.model.forward_decoder = timed
    began = time.perf_counter()
    hypothesis = generator.generate([model], sample, prefix_tokens=prompt.unsqueeze(0), **generate_options)[0][0]
    return starts[-new_tokens:], began, hypothesis  # the steps after the prompt's


def first_and_per_token(generator_class, model, dictionary, prompt):
    """(seconds to the first new token, median seconds per token after it) of one greedy generate() that writes
    NEW_TOKENS after `prompt` ``[P]``: the first token is written when the step after it begins, and each
    later token takes one step (the generator's model is timed at the start of each step)."""
    steps, began, _ = timed_generation(generator_class, model, dictionary, prompt)
    gaps = sorted(b - a for a, b in zip(steps[1:], steps[2:]))
    return steps[1] - began, gaps[len(gaps) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="small")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 16384])
    parser.add_argument("--no-forcing-past", type=int, default=None,
                        help="leave forcing out at prompts longer than this (minutes per length at full size)")
    args = parser.parse_args()
    from fairseq.sequence_generator import SequenceGenerator

    from fairseq_fwp.sequence_generator import FastWeightSequenceGenerator

    arch, flags, words = SHAPES[args.model]
    dictionary = numbered_dictionary(words)
    model = build_random_model("language_modeling", arch, [*flags, "--dropout", 0], dictionary)
    parameters = sum(p.numel() for p in model.parameters())
    softmax = None
    if args.model in SOFTMAX_ORIGINAL:
        softmax_arch, softmax_flags, softmax_positions = SOFTMAX_ORIGINAL[args.model]
        softmax = build_random_model("language_modeling", softmax_arch, [*softmax_flags, "--dropout", 0], dictionary)
    flops, read = machine_rates()
    print(f"# prompt reading: {args.model}, {parameters / 1e6:.1f}M parameters; {platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d')}; F = {flops / 1e9:.0f} GFLOP/s (float32 matmul), B = {read / 1e9:.1f} GB/s "
          f"(read), 2F/B = {2 * flops / read:.1f}")
    print("| prompt | read in one call: first token (s) | then per token (ms) | forced: first token (s) | "
          "then per token (ms) | forced / read, first token | softmax original: first token (s) | then per token (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for length in args.lengths:
        prompt = torch.randint(dictionary.nspecial, len(dictionary), (length,), generator=generator)
        read_first, read_each = first_and_per_token(FastWeightSequenceGenerator, model, dictionary, prompt)
        cells = [f"{length:,}", f"{read_first:.2f}", f"{1e3 * read_each:.1f}"]
        if args.no_forcing_past is None or length <= args.no_forcing_past:
            forced_first, forced_each = first_and_per_token(SequenceGenerator, model, dictionary, prompt)
            cells += [f"{forced_first:.2f}", f"{1e3 * forced_each:.1f}", f"{forced_first / read_first:.1f}x"]
        else:
            cells += ["not run", "", ""]
        if softmax is not None and length + NEW_TOKENS < softmax_positions:
            softmax_first, softmax_each = first_and_per_token(SequenceGenerator, softmax, dictionary, prompt)
            cells += [f"{softmax_first:.2f}", f"{1e3 * softmax_each:.1f}"]
        else:
            cells += ["past its positions" if softmax is not None else "", ""]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
