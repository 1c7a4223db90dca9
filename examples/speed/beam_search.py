"""Decoding speed with fairseq's own SequenceGenerator: fast weights against softmax, in one run.

Translation (beam 4 and greedy) and, with --lm, language-model generation
(beam 4 and top-k sampling, from a 4-token prompt).

The Multi30k model shape (2+2 layers, d_model 128, 2 heads of 64, FFN 512,
6,000 types, shared embeddings) with random weights; 32 sentences of 20
source tokens; every hypothesis exactly 30 target tokens (min = max length; --target-length),
so every model does the same number of decoder steps. Beam 4 and greedy
(beam 1). Times are medians of --repeats runs of SequenceGenerator.generate,
taken in turns (each model once, then again); ratios are softmax time /
model time (higher = faster than softmax).

    OMP_NUM_THREADS=1 .venv/bin/python examples/speed/beam_search.py [--threads 1] [--nbest-out FILE]

--nbest-out writes every model's n-best lists (tokens and scores, beam 4)
as JSON: two runs of different code on the same seed must write the same
lists (--nbest-compare FILE checks that: the same tokens, scores within
1e-3, since an equal computation in another order rounds differently).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from fairseq import search  # noqa: E402
from fairseq.sequence_generator import SequenceGenerator  # noqa: E402
from examples.recipes.decoding_cost import build_random_model, numbered_dictionary  # noqa: E402

MODELS = {  # name: (flags, feature size D)
    "softmax": (["--fwp-feature-map", "softmax"], "-"),
    "linear": (["--fwp-feature-map", "linear"], 64),
    "dpfp-128": (["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "1"], 128),
    "dpfp-256": (["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2"], 256),
    "dpfp-256-delta": (["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2", "--fwp-update-rule", "delta"], 256),
}
LM_MODELS = {
    "softmax": (["--fwp-feature-map", "softmax", "--fwp-positions", "on"], "-"),
    "linear-delta": ([], 64),
    "dpfp-256-delta": (["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2"], 256),
}
LM_SHAPE = ["--decoder-layers", "2", "--decoder-embed-dim", "128", "--decoder-ffn-embed-dim", "512",
            "--decoder-attention-heads", "2", "--share-decoder-input-output-embed", "--dropout", "0",
            "--tokens-per-sample", "512"]
PROMPT = 4
SHAPE = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
         "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512", "--encoder-attention-heads", "2",
         "--decoder-attention-heads", "2", "--share-all-embeddings", "--dropout", "0"]
VOCAB, SENTENCES, SOURCE_LENGTH = 6000, 32, 20


def build_model(flags, dictionary):
    return build_random_model("translation", "fwp_transformer_tiny", SHAPE + flags, dictionary)


def build_lm(flags, dictionary):
    return build_random_model("language_modeling", "fwp_lm_tiny", LM_SHAPE + flags, dictionary)


def make_batch(dictionary, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (SENTENCES, SOURCE_LENGTH), generator=g)
    tokens[:, -1] = dictionary.eos()
    return {"net_input": {"src_tokens": tokens, "src_lengths": torch.full((SENTENCES,), SOURCE_LENGTH)},
            "id": torch.arange(SENTENCES)}


def generator(model, dictionary, beam, length):
    return SequenceGenerator([model], dictionary, beam_size=beam, max_len_a=0, max_len_b=length, min_len=length)


def time_generations(gens, sample, repeats, **kwargs):
    """{name: (median seconds, hypotheses)} of SequenceGenerator.generate for every generator in `gens`,
    the repeats taken in turns (one of each, then again), so that a slow moment of the machine hits
    every model alike."""
    times, hypos = {name: [] for name in gens}, {}
    with torch.no_grad():
        for gen in gens.values():
            gen.generate([], sample, **kwargs)  # warm-up
        for _ in range(repeats):
            for name, gen in gens.items():
                torch.manual_seed(0)  # the same samples every run
                start = time.perf_counter()
                hypos[name] = gen.generate([], sample, **kwargs)
                times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]), hypos[name]) for name in gens}


def nbest(hypos):
    return [[{"tokens": h["tokens"].tolist(), "score": round(float(h["score"]), 4)} for h in sentence]
            for sentence in hypos]


def same_nbest(a, b, tolerance=1e-3):
    return a is not None and len(a) == len(b) and all(
        len(x) == len(y) and all(h["tokens"] == g["tokens"] and abs(h["score"] - g["score"]) <= tolerance
                                 for h, g in zip(x, y)) for x, y in zip(a, b))


def print_table(title, columns, rows, times, tokens):
    print(f"\n{title}\n| model | D | " + " | ".join(f"{c} (ms) | tokens/s | vs softmax" for c in columns) + " |")
    print("|---|---|" + "---|---|---|" * len(columns))
    for name, D in rows:
        cells = []
        for column in columns:
            t = times[name, column]
            cells += [f"{1e3 * t:.0f}", f"{tokens / t:.0f}", f"{times['softmax', column] / t:.2f}x"
                      if ("softmax", column) in times else "-"]
        print(f"| {name} | {D} | " + " | ".join(cells) + " |", flush=True)


def run_translation(args, dictionary):
    sample = make_batch(dictionary)
    models = {name: build_model(MODELS[name][0], dictionary) for name in args.models}
    times, lists = {}, {}
    for column, beam in (("beam 4", 4), ("greedy", 1)):
        gens = {name: generator(model, dictionary, beam, args.target_length) for name, model in models.items()}
        for name, (seconds, hypos) in time_generations(gens, sample, args.repeats).items():
            times[name, column] = seconds
            if beam == 4:
                lists[name] = nbest(hypos)
    print_table(f"Translation, {SENTENCES} sentences x {SOURCE_LENGTH} source tokens, {args.target_length} steps",
                ["beam 4", "greedy"], [(name, MODELS[name][1]) for name in args.models], times,
                SENTENCES * args.target_length)
    return lists


def run_language_models(args, dictionary):
    prompt = make_batch(dictionary)["net_input"]["src_tokens"][:, :PROMPT]
    sample = {"net_input": {"src_tokens": prompt, "src_lengths": torch.full((SENTENCES,), PROMPT)},
              "id": torch.arange(SENTENCES)}
    length = PROMPT + args.target_length
    times = {}
    models = {name: build_lm(flags, dictionary) for name, (flags, _) in LM_MODELS.items()}
    sampling = search.Sampling(dictionary, sampling_topk=10)
    for column, options_ in (("beam 4", dict(beam_size=4)), ("sampling", dict(beam_size=1,
                                                                             search_strategy=sampling))):
        gens = {name: SequenceGenerator([model], dictionary, max_len_a=0, max_len_b=length, min_len=length,
                                        **options_) for name, model in models.items()}
        for name, (seconds, _) in time_generations(gens, sample, args.repeats, prefix_tokens=prompt,
                                                   bos_token=dictionary.eos()).items():
            times[name, column] = seconds
    print_table(f"Language-model generation, {SENTENCES} sequences, a {PROMPT}-token prompt, "
                f"{args.target_length} new tokens", ["beam 4", "sampling"],
                [(name, D) for name, (_, D) in LM_MODELS.items()], times, SENTENCES * args.target_length)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--target-length", type=int, default=30, help="decoder steps of every hypothesis")
    parser.add_argument("--lm", action="store_true", help="also language-model generation")
    parser.add_argument("--nbest-out", help="write the beam-4 n-best lists of every model as JSON")
    parser.add_argument("--nbest-compare", help="check the n-best lists against such a file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dictionary = numbered_dictionary(VOCAB - 4)  # fairseq's 4 special symbols make VOCAB types
    print(f"# decoding with fairseq's SequenceGenerator; {platform.machine()} {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {args.threads} thread(s), {time.strftime('%Y-%m-%d')}")
    lists = run_translation(args, dictionary)
    if args.lm:
        run_language_models(args, dictionary)
    if args.nbest_out:
        with open(args.nbest_out, "w") as f:
            json.dump(lists, f)
    if args.nbest_compare:
        with open(args.nbest_compare) as f:
            before = json.load(f)
        same = {name: same_nbest(before.get(name), lists[name]) for name in lists}
        print("n-best lists equal to " + args.nbest_compare + ": "
              + ", ".join(f"{name} {'yes' if ok else 'NO'}" for name, ok in same.items()))
        return 0 if all(same.values()) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
