"""Decoding speed with fairseq's own SequenceGenerator: fast weights against softmax, in one run.

The Multi30k model shape (2+2 layers, d_model 128, 2 heads of 64, FFN 512,
6,000 types, shared embeddings) with random weights; 32 sentences of 20
source tokens; every hypothesis exactly 30 target tokens (min = max length),
so every model does the same number of decoder steps. Beam 4 and greedy
(beam 1). Times are medians of --repeats runs of SequenceGenerator.generate;
ratios are softmax time / model time (higher = faster than softmax).

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
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from fairseq import options  # noqa: E402
from fairseq.data import Dictionary  # noqa: E402
from fairseq.sequence_generator import SequenceGenerator  # noqa: E402

MODELS = {  # name: (flags, feature size D)
    "softmax": (["--fwp-feature-map", "softmax"], "-"),
    "linear": (["--fwp-feature-map", "linear"], 64),
    "dpfp-128": (["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "1"], 128),
    "dpfp-256": (["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2"], 256),
    "dpfp-256-delta": (["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2", "--fwp-update-rule", "delta"], 256),
}
SHAPE = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
         "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512", "--encoder-attention-heads", "2",
         "--decoder-attention-heads", "2", "--share-all-embeddings", "--dropout", "0"]
VOCAB, SENTENCES, SOURCE_LENGTH, TARGET_LENGTH = 6000, 32, 20, 30


def build_model(flags, dictionary, seed=0):
    from fairseq_fwp.models.fwp_transformer import FastWeightTransformerModel

    argv = ["/nonexistent", "--task", "translation", "--arch", "fwp_transformer_tiny", "--user-dir",
            os.path.join(ROOT, "fairseq_fwp"), *SHAPE, *flags]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    torch.manual_seed(seed)
    task = types.SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    return FastWeightTransformerModel.build_model(args, task).eval()


def make_batch(dictionary, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (SENTENCES, SOURCE_LENGTH), generator=g)
    tokens[:, -1] = dictionary.eos()
    return {"net_input": {"src_tokens": tokens, "src_lengths": torch.full((SENTENCES,), SOURCE_LENGTH)},
            "id": torch.arange(SENTENCES)}


def generator(model, dictionary, beam):
    return SequenceGenerator([model], dictionary, beam_size=beam, max_len_a=0, max_len_b=TARGET_LENGTH,
                             min_len=TARGET_LENGTH)


def time_generation(gen, sample, repeats):
    with torch.no_grad():
        gen.generate([], sample)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            hypos = gen.generate([], sample)
            times.append(time.perf_counter() - start)
    return statistics.median(times), hypos


def nbest(hypos):
    return [[{"tokens": h["tokens"].tolist(), "score": round(float(h["score"]), 4)} for h in sentence]
            for sentence in hypos]


def same_nbest(a, b, tolerance=1e-3):
    return a is not None and len(a) == len(b) and all(
        len(x) == len(y) and all(h["tokens"] == g["tokens"] and abs(h["score"] - g["score"]) <= tolerance
                                 for h, g in zip(x, y)) for x, y in zip(a, b))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--nbest-out", help="write the beam-4 n-best lists of every model as JSON")
    parser.add_argument("--nbest-compare", help="check the n-best lists against such a file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dictionary = Dictionary()
    for i in range(VOCAB - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    sample = make_batch(dictionary)
    print(f"# beam search and greedy decoding, {SENTENCES} sentences x {SOURCE_LENGTH} source tokens, "
          f"{TARGET_LENGTH} target steps; {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.threads} thread(s), {time.strftime('%Y-%m-%d')}")
    print("| model | D | beam 4 (ms) | tokens/s | vs softmax | greedy (ms) | tokens/s | vs softmax |")
    print("|---|---|---|---|---|---|---|---|")
    times, lists = {}, {}
    for name in args.models:
        flags, D = MODELS[name]
        model = build_model(flags, dictionary)
        for beam in (4, 1):
            times[name, beam], hypos = time_generation(generator(model, dictionary, beam), sample, args.repeats)
            if beam == 4:
                lists[name] = nbest(hypos)
        row = []
        for beam in (4, 1):
            t = times[name, beam]
            ratio = f"{times['softmax', beam] / t:.2f}x" if ("softmax", beam) in times else "-"
            row += [f"{1e3 * t:.0f}", f"{SENTENCES * TARGET_LENGTH / t:.0f}", ratio]
        print(f"| {name} | {D} | " + " | ".join(row) + " |", flush=True)
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
