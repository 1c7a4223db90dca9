"""Built-in synthetic corpora for the quickstart and the integration tests.

- translation: a word-by-word "language" pair. Each source word has one
  target word, and the target reverses the order of every 3-word block. A
  model has to learn a lexicon and a local reordering, so BLEU measures
  real learning; chance is near zero.
- language modelling: sentences from a small grammar (subject, verb,
  object, with number agreement and a long-range closing word), so a model
  must learn agreement across positions.

    python -m examples.recipes.synthetic_data OUT_DIR [--train N] [--seed S]

writes OUT_DIR/translation/{train,valid,test}.{src,tgt} and
OUT_DIR/lm/{train,valid,test}.txt, one sentence per line, space-tokenised.
"""
import argparse
import os
import random

SOURCE_WORDS = [f"s{i}" for i in range(24)]
TARGET_WORDS = [f"T{(7 * i + 3) % 24}" for i in range(24)]  # a fixed bijection
LEXICON = dict(zip(SOURCE_WORDS, TARGET_WORDS))


def translate(source_words):
    """The reference translation: map every word, reverse each 3-word block."""
    mapped = [LEXICON[w] for w in source_words]
    return [w for i in range(0, len(mapped), 3) for w in reversed(mapped[i:i + 3])]


def translation_pairs(n, rng, min_len=3, max_len=9):
    for _ in range(n):
        src = [rng.choice(SOURCE_WORDS) for _ in range(rng.randint(min_len, max_len))]
        yield " ".join(src), " ".join(translate(src))


SUBJECTS = {"sg": ["the cat", "a dog", "the bird", "my friend"], "pl": ["the cats", "some dogs", "the birds", "my friends"]}
VERBS = {"sg": ["sees", "likes", "follows", "finds"], "pl": ["see", "like", "follow", "find"]}
OBJECTS = ["the ball", "a tree", "the house", "a river", "the garden", "some food"]
CLOSERS = {"sg": "alone", "pl": "together"}


def lm_sentence(rng):
    number = rng.choice(["sg", "pl"])
    words = [rng.choice(SUBJECTS[number]), rng.choice(VERBS[number]), rng.choice(OBJECTS)]
    for _ in range(rng.randint(0, 2)):  # filler that separates subject and closer
        words.append(rng.choice(["near", "behind", "under"]) + " " + rng.choice(OBJECTS))
    words.append(CLOSERS[number])
    return " ".join(words) + " ."


def write_corpora(out_dir, n_train=4000, n_eval=200, seed=1):
    rng = random.Random(seed)
    mt_dir, lm_dir = os.path.join(out_dir, "translation"), os.path.join(out_dir, "lm")
    os.makedirs(mt_dir, exist_ok=True)
    os.makedirs(lm_dir, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_eval), ("test", n_eval)):
        pairs = list(translation_pairs(n, rng))
        with open(os.path.join(mt_dir, f"{split}.src"), "w") as fs, open(os.path.join(mt_dir, f"{split}.tgt"), "w") as ft:
            for src, tgt in pairs:
                fs.write(src + "\n")
                ft.write(tgt + "\n")
        with open(os.path.join(lm_dir, f"{split}.txt"), "w") as f:
            for _ in range(n):
                f.write(lm_sentence(rng) + "\n")
    return mt_dir, lm_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=4000, help="training sentences per corpus")
    parser.add_argument("--eval", type=int, default=200, help="valid/test sentences per corpus")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    write_corpora(args.out_dir, args.train, args.eval, args.seed)


if __name__ == "__main__":
    main()
