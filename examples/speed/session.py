"""A 20-turn session (fairseq_fwp/session.py) against re-reading the whole history at every turn: the time to the
first new token, and the state's size, at each turn.

    OMP_NUM_THREADS=2 .venv/bin/python examples/speed/session.py [--turns 20 --input 200 --reply 16]

The small LM of prompt_reading.py (4 layers of 128, the delta rule, 1,000 words, random weights), batch 1,
greedy; each turn an input of --input random tokens, then a reply of --reply tokens (its </s> forced there), kept.
Per turn:
- session: the turn read from the state the turns before left (History), in one call;
- re-read: the same model given the whole history (every input and reply so far, each reply's </s>) as one prompt,
  read in one call (FastWeightSequenceGenerator): what a session equals, and what it costs without one;
- softmax re-read: the softmax model of the same shape (--fwp-feature-map softmax) given the whole history so;
- softmax session: the softmax model keeping its key/value caches between turns (a session of it), whose state
  grows with the history.
The time to the first new token runs from the generate() call to the start of the step after that token. "same
replies": each model's session replied what it replied given the whole history (greedy, float32).
"""
import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.recipes.decoding_cost import build_random_model, numbered_dictionary  # noqa: E402
from examples.speed.prompt_reading import SHAPES, timed_generation  # noqa: E402


def first_token(model, dictionary, prompt, reply, history=None):
    """(seconds to the first new token, the hypothesis) of a greedy generate() that writes `reply` tokens and
    </s> after `prompt` ``[P]``, as a turn of `history` where given."""
    from fairseq_fwp.sequence_generator import FastWeightSequenceGenerator

    options = {} if history is None else {"history": history}
    steps, began, hypothesis = timed_generation(FastWeightSequenceGenerator, model, dictionary, prompt, reply + 1,
                                                **options)
    return steps[1] - began, hypothesis


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--input", type=int, default=200, help="tokens of each turn's input")
    parser.add_argument("--reply", type=int, default=16, help="tokens of each turn's reply")
    args = parser.parse_args(argv)
    from fairseq_fwp.session import History

    arch, flags, words = SHAPES["small"]
    dictionary = numbered_dictionary(words)
    models = {name: build_random_model("language_modeling", arch, [*flags, *extra, "--dropout", 0], dictionary)
              for name, extra in (("fast weights", []), ("softmax", ["--fwp-feature-map", "softmax"]))}
    histories = {name: History([model], dictionary) for name, model in models.items()}
    kept = {name: torch.zeros(0, dtype=torch.long) for name in models}  # each model's whole history
    print(f"# a session of {args.turns} turns ({args.input} tokens in, {args.reply} out): the small LM, "
          f"{sum(p.numel() for p in models['fast weights'].parameters()) / 1e6:.1f}M parameters; {platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| turn | history (tokens) | session: first token (ms) | state (KB) | re-read: first token (ms) | "
          "re-read / session | softmax re-read (ms) | softmax re-read / session | softmax session (ms) | "
          "its state (KB) | same replies |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for number in range(1, args.turns + 1):
        tokens = torch.randint(dictionary.nspecial, len(dictionary), (args.input,), generator=generator)
        cells, seconds, same = [f"{number}", f"{len(kept['fast weights']):,}"], {}, {}
        for name, model in models.items():
            whole = torch.cat([kept[name], tokens])
            seconds[name, "re-read"], re_read = first_token(model, dictionary, whole, args.reply)
            seconds[name, "session"], hypothesis = first_token(model, dictionary, tokens, args.reply, histories[name])
            same[name] = torch.equal(re_read["tokens"][len(kept[name]):], hypothesis["tokens"])
            kept[name] = torch.cat([kept[name], hypothesis["tokens"]])
        session = seconds["fast weights", "session"]
        cells += [f"{1e3 * session:.0f}", f"{histories['fast weights'].state_bytes() / 1e3:.0f}",
                  f"{1e3 * seconds['fast weights', 're-read']:.0f}",
                  f"{seconds['fast weights', 're-read'] / session:.1f}x",
                  f"{1e3 * seconds['softmax', 're-read']:.0f}", f"{seconds['softmax', 're-read'] / session:.1f}x",
                  f"{1e3 * seconds['softmax', 'session']:.0f}", f"{histories['softmax'].state_bytes() / 1e3:.0f}",
                  "yes" if all(same.values()) else "no"]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
