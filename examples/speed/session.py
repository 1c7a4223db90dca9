"""What a session's turn costs (fairseq_fwp/session.py): the whole turn, at each turn of a 20-turn session, against
re-reading the whole history and against the softmax model's own session.

    OMP_NUM_THREADS=1 .venv/bin/python examples/speed/session.py [--turns 20 --input 200 --reply 16 --repeats 3]

The small LM of prompt_reading.py (4 layers of 128, the delta rule, 1,000 words, random weights), batch 1,
greedy, one thread; each turn an input of --input random tokens, then a reply of --reply tokens (its </s> forced
there), kept. Per turn, each the fastest of --repeats runs from the same state:
- fast-weight session: the whole turn (Session's generate(): the input read from the state the turns before left,
  in one call, the reply generated, and the reply read into the state), and of it the time to the first new token;
- re-read: the same model given the whole history (every input and reply so far, each reply's </s>) as one
  prompt, read in one call (FastWeightSequenceGenerator): what the session equals, and what it costs without one;
- softmax session: the softmax model of the same shape (--fwp-feature-map softmax) keeping its key/value caches
  between turns, whose state grows with the history: the fair competitor;
- softmax re-read: the softmax model given the whole history.
"same replies": each model's session replied what it replied given the whole history (float32).
"""
import argparse
import copy
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.recipes.decoding_cost import build_random_model, numbered_dictionary  # noqa: E402
from examples.speed.prompt_reading import SHAPES, timed_generation  # noqa: E402


def timed_turn(model, dictionary, prompt, reply, history=None, repeats=1):
    """(seconds of the whole generate() call, seconds to its first new token, the hypothesis): the fastest of
    `repeats` greedy generate() calls that write `reply` tokens and </s> after `prompt` ``[P]``, each as a turn
    of `history` where given, from the state it holds now; the last call's turn is kept."""
    from fairseq_fwp.sequence_generator import FastWeightSequenceGenerator

    best = (float("inf"), float("inf"))
    for repeat in range(repeats):
        options = {}
        if history is not None:
            options["history"] = history if repeat == repeats - 1 else _copy(history)
        began = time.perf_counter()
        steps, _, hypothesis = timed_generation(FastWeightSequenceGenerator, model, dictionary, prompt, reply + 1,
                                                **options)
        best = min(best, (time.perf_counter() - began, steps[1] - began))
    return (*best, hypothesis)


def _copy(history):
    """A history that continues from where `history` is, sharing no state with it."""
    from fairseq_fwp.session import _copied

    twin = copy.copy(history)
    twin.states = [_copied(state) for state in history.states]
    return twin


def crossover(session, competitor):
    """The first turn from which `session` is faster than `competitor` at every later turn, or None."""
    faster = [s < c for s, c in zip(session, competitor)]
    for turn in range(len(faster)):
        if all(faster[turn:]):
            return turn + 1
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--input", type=int, default=200, help="tokens of each turn's input")
    parser.add_argument("--reply", type=int, default=16, help="tokens of each turn's reply")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement, the fastest kept")
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
          f"{time.strftime('%Y-%m-%d')}; the fastest of {args.repeats} runs")
    print("| turn | history (tokens) | session: turn (ms) | first token (ms) | state (KB) | re-read (ms) | "
          "re-read / session | softmax session (ms) | softmax session / session | its cache (KB) | "
          "softmax re-read (ms) | same replies |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    turns = {"session": [], "softmax session": [], "re-read": []}
    for number in range(1, args.turns + 1):
        tokens = torch.randint(dictionary.nspecial, len(dictionary), (args.input,), generator=generator)
        seconds, same = {}, {}
        for name, model in models.items():
            whole = torch.cat([kept[name], tokens])
            seconds[name, "re-read"], _, re_read = timed_turn(model, dictionary, whole, args.reply,
                                                              repeats=args.repeats)
            seconds[name, "session"], seconds[name, "first"], hypothesis = timed_turn(
                model, dictionary, tokens, args.reply, histories[name], args.repeats)
            same[name] = torch.equal(re_read["tokens"][len(kept[name]):], hypothesis["tokens"])
            kept[name] = torch.cat([kept[name], hypothesis["tokens"]])
        session = seconds["fast weights", "session"]
        turns["session"].append(session)
        turns["softmax session"].append(seconds["softmax", "session"])
        turns["re-read"].append(seconds["fast weights", "re-read"])
        cells = [f"{number}", f"{len(kept['fast weights']) - len(tokens) - args.reply - 1:,}", f"{1e3 * session:.1f}",
                 f"{1e3 * seconds['fast weights', 'first']:.1f}", f"{histories['fast weights'].state_bytes() / 1e3:.0f}",
                 f"{1e3 * seconds['fast weights', 're-read']:.1f}",
                 f"{seconds['fast weights', 're-read'] / session:.1f}x",
                 f"{1e3 * seconds['softmax', 'session']:.1f}", f"{seconds['softmax', 'session'] / session:.2f}x",
                 f"{histories['softmax'].state_bytes() / 1e3:.0f}", f"{1e3 * seconds['softmax', 're-read']:.1f}",
                 "yes" if all(same.values()) else "no"]
        print("| " + " | ".join(cells) + " |", flush=True)
    if args.turns >= 2:
        print(f"\nturn {args.turns} / turn 2 of the session: {turns['session'][-1] / turns['session'][1]:.2f}x; "
              f"re-reading / the session at turn {args.turns}: {turns['re-read'][-1] / turns['session'][-1]:.1f}x")
    over = crossover(turns["session"], turns["softmax session"])
    print("the fast-weight session's turn is faster than the softmax session's "
          + (f"from turn {over} on" if over else "at no turn from some turn on"))


if __name__ == "__main__":
    main()
