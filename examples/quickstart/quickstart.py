"""The quickstart: what fast weights are for, measured in about five minutes on 2 CPU cores.

Three parts, run side by side (two jobs at a time, one thread each):

- capacity: the associative-retrieval task of the paper's Sec. 6.1 (examples/synthetic_retrieval)
  at S = 8, 16 and 32 keys, key size 16: the sum rule against the delta rule with linear
  (D = 16) and DPFP-1 (D = 32) features, and softmax attention as the reference. Setting 1
  writes every key once; setting 2 writes 2S pairs, keys reassigned, and asks for the latest
  value. Plot: capacity.png.
- cost: time and state memory per generated token against the position (16 to 2,048) through
  fairseq's SequenceGenerator, softmax against fast-weight language models with random weights
  (examples/speed/decoding_cost.py). Plot: cost.png.
- pipeline: the built-in synthetic translation and language-modelling corpora through
  fairseq-preprocess, fairseq-train, fairseq-generate (beam 4, sacreBLEU) and fairseq-eval-lm
  (sliding window), with the paper's rows (examples/recipes/rows.py). Each row says whether
  it converged: whether its best validation loss still fell by 1% or more over its last 200
  updates.

    bash scripts/quickstart.sh [--out quickstart_out]
"""
import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ["OMP_NUM_THREADS"] = "1"  # every job is one process of one thread
os.environ.setdefault("FAIRSEQ_FWP_PRELOAD", "1")  # fairseq imported once for its 14 commands (recipes/preloaded.py)

from examples.recipes import rows  # noqa: E402
from examples.recipes.parallel import Job, JobFailed, clock, run_jobs  # noqa: E402
from examples.recipes.pipeline import (  # noqa: E402
    bleu, eval_lm, generate, improvement, perplexity, preprocess_lm, preprocess_translation, train_lm,
    train_translation, train_words_per_second)
from examples.recipes.synthetic_data import write_corpora  # noqa: E402
from examples.synthetic_retrieval.sweep import positive, step_count  # noqa: E402

EXAMPLES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPACITY_MODELS = ("softmax", "sum-linear", "delta-linear", "sum-dpfp1", "delta-dpfp1")
CAPACITY_SIZES = (8, 16, 32)
CAPACITY_D_KEY = 16  # D = 16 for linear features, 32 for DPFP-1
FEATURE_SIZES = {"linear": CAPACITY_D_KEY, "dpfp1": 2 * CAPACITY_D_KEY}
COST_POSITIONS = (16, 256, 1024, 2016)  # the last one's window ends at token 2,048
MT_ROWS = {"softmax": rows.MULTI30K["softmax"], "linear, sum rule": rows.MULTI30K["linear"],
           "DPFP-1, sum rule": rows.MULTI30K["dpfp-128"]}  # Table 1's setting (DPFP-1: D = 32 at these heads)
LM_ROWS = {"softmax": rows.WIKITEXT103["table2", "transformer"], "linear, sum rule": rows.WIKITEXT103["table2", "linear-sum"],
           "linear, delta rule": rows.WIKITEXT103["table2", "delta"]}
VALIDATE_EVERY = 100
CONVERGED_BELOW = 0.01  # relative fall of the best validation loss over the last 200 updates
# Seconds on one thread of the 2-core machine the README's times come from, for the time left: each job
# (capacity at --capacity-steps 2000; a fairseq row's launches and evaluation), plus each row's updates.
ESTIMATES = {"data": 7, "capacity-1": 45, "capacity-2": 57, "cost": 25, "mt": 10, "lm": 10}
SECONDS_PER_UPDATE = {"mt": 0.085, "lm": 0.035}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="quickstart_out", help="where the plots, logs and summary go")
    parser.add_argument("--workers", type=positive(int), default=2, help="jobs at a time (one thread each)")
    parser.add_argument("--mt-updates", type=positive(int), default=900)
    parser.add_argument("--lm-updates", type=positive(int), default=700)
    parser.add_argument("--capacity-steps", type=step_count, default=1500,
                        help="most training steps per retrieval run: a positive multiple of 100 (the evaluation "
                             "interval)")
    parser.add_argument("--cost-length", type=cost_length, default=2048,
                        help=f"tokens generated per model (at least {COST_POSITIONS[0] + 32}: the first position's "
                             "window)")
    return parser.parse_args(argv)


def cost_length(text):
    value = int(text)
    if value < COST_POSITIONS[0] + 32:
        raise argparse.ArgumentTypeError(f"must be at least {COST_POSITIONS[0] + 32}; got {text!r}")
    return value


# ------------------------------------------------------------------------------------------- jobs

def capacity_job(setting, args):
    logs = os.path.join(args.out, "capacity")
    total = len(CAPACITY_MODELS) * len(CAPACITY_SIZES)

    def run(progress):
        argv = [sys.executable, "-m", "examples.synthetic_retrieval.sweep", "--setting", str(setting),
                "--models", ",".join(CAPACITY_MODELS), "--sizes", ",".join(map(str, CAPACITY_SIZES)),
                "--d-key", str(CAPACITY_D_KEY), "--max-steps", str(args.capacity_steps), "--patience", "5",
                "--out", logs]
        done = 0

        def see(line):
            nonlocal done
            if line.startswith(f"setting {setting} "):
                done += 1
                progress(done / total, f"capacity, setting {setting}: {done}/{total} runs")
        run_logged(argv, os.path.join(args.out, "logs", f"capacity-{setting}.log"), see)
        return f"capacity, setting {setting}: {total} runs trained"
    return Job(f"capacity-{setting}", run, ESTIMATES[f"capacity-{setting}"] * args.capacity_steps / 2000)


def cost_job(args):
    positions = [p for p in COST_POSITIONS if p + 32 <= args.cost_length]

    def run(progress):
        argv = [sys.executable, os.path.join(EXAMPLES, "speed", "decoding_cost.py"), "--batch", "4", "--dim", "128",
                "--positions", *map(str, positions), "--json", os.path.join(args.out, "cost.json"),
                "--models", "softmax", "linear-delta", "dpfp-delta"]
        done = 0

        def see(line):
            nonlocal done
            if line.startswith("| ") and not line.startswith("| decoder"):
                done += 1
                progress(done / 3, f"cost: {done}/3 decoders")
        run_logged(argv, os.path.join(args.out, "logs", "cost.log"), see)
        return "cost: 3 decoders measured"
    return Job("cost", run, ESTIMATES["cost"])


def data_job(args):
    def run(progress):
        progress(0, "preparing the synthetic corpora")
        mt_raw, lm_raw = write_corpora(os.path.join(args.out, "raw"), n_train=3000, n_eval=203)
        preprocess_translation(mt_raw, os.path.join(args.out, "bin-mt"))
        preprocess_lm(lm_raw, os.path.join(args.out, "bin-lm"))
        return "corpora written and preprocessed (fairseq-preprocess)"
    return Job("data", run, ESTIMATES["data"])


def update_watch(progress, label, max_update):
    def see(line):
        match = re.search(r"num_updates[= ](\d+)", line)
        if match:
            updates = int(match.group(1))
            progress(updates / max_update, f"{label}: update {updates}/{max_update}")
    return see


def convergence(log):
    fall = improvement(log, 2 * VALIDATE_EVERY)
    if fall is None:
        return "too short to tell"
    return "converged" if fall < CONVERGED_BELOW else f"no: -{100 * fall:.1f}% in its last 200 updates"


VALIDATION = ["--validate-interval-updates", VALIDATE_EVERY, "--validate-interval", 10 ** 6,
              "--save-interval-updates", VALIDATE_EVERY, "--keep-interval-updates", 1]


def mt_job(name, row, args, results):
    save = os.path.join(args.out, "checkpoints", "mt-" + slug(name))
    data = os.path.join(args.out, "bin-mt")

    def run(progress):
        label = f"translation, {name}"
        log = train_translation(data, save, *row.flags, *VALIDATION, "--dropout", 0, "--clip-norm", 1.0,
                                max_update=args.mt_updates, lr=0.002, warmup=100,
                                log=os.path.join(args.out, "logs", f"mt-{slug(name)}.train.log"),
                                watch=update_watch(progress, label, args.mt_updates))
        progress(1, f"{label}: fairseq-generate")
        # The task's targets are as long as their sources: the cap keeps a row that has not learnt to stop
        # from generating fairseq's default of 200 tokens per sentence.
        score = bleu(generate(data, os.path.join(save, "checkpoint_best.pt"), "--max-len-a", 1.2, "--max-len-b", 10,
                              log=os.path.join(args.out, "logs", f"mt-{slug(name)}.generate.log")))
        results[label] = (f"BLEU {score:.1f}", convergence(log), train_words_per_second(log))
        return f"{label}: BLEU {score:.1f} ({results[label][1]})"
    return Job("mt " + name, run, ESTIMATES["mt"] + SECONDS_PER_UPDATE["mt"] * args.mt_updates, after=("data",))


def lm_job(name, row, args, results):
    save = os.path.join(args.out, "checkpoints", "lm-" + slug(name))
    data = os.path.join(args.out, "bin-lm")

    def run(progress):
        label = f"language model, {name}"
        log = train_lm(data, save, *row.flags, *VALIDATION, max_update=args.lm_updates,
                       log=os.path.join(args.out, "logs", f"lm-{slug(name)}.train.log"),
                       watch=update_watch(progress, label, args.lm_updates))
        progress(1, f"{label}: fairseq-eval-lm")
        # windows of the training length, stride 1: the paper's protocol
        ppl = perplexity(eval_lm(data, os.path.join(save, "checkpoint_best.pt"), "--context-window", 63,
                                 log=os.path.join(args.out, "logs", f"lm-{slug(name)}.eval.log")))
        results[label] = (f"perplexity {ppl:.2f}", convergence(log), train_words_per_second(log))
        return f"{label}: perplexity {ppl:.2f} ({results[label][1]})"
    return Job("lm " + name, run, ESTIMATES["lm"] + SECONDS_PER_UPDATE["lm"] * args.lm_updates, after=("data",))


def slug(name):
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def run_logged(argv, log, watch):
    """Run a Python command (this interpreter's: the preloaded server's fork where it runs one, as the fairseq
    commands are), its output into `log`, every line to `watch`; raises with the log's tail on failure."""
    from examples.recipes import preloaded

    with open(log, "w") as sink:
        if preloaded.enabled():
            lines, wait, _ = preloaded.launch(preloaded.PYTHON, argv[1:], cwd=ROOT)
        else:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
            lines, wait = proc.stdout, proc.wait
        for line in lines:
            sink.write(line)
            watch(line)
    if wait() != 0:
        with open(log) as f:
            raise RuntimeError(f"{argv[1:3]} failed; the end of {log}:\n{f.read()[-3000:]}")


# ---------------------------------------------------------------------------------------- results

def capacity_label(model):
    from examples.synthetic_retrieval.names import parse_model_name, phi_label

    rule, phi = parse_model_name(model)
    return "softmax" if phi is None else f"{phi_label(phi)} {rule} (D = {FEATURE_SIZES[phi]})"


def reading(solved):
    """What one setting's largest solved S ({model: S or None}) say, in words."""
    def best(rule):
        sizes = [S for model, S in solved.items() if model.startswith(rule + "-") and S is not None]
        return f"up to S = {max(sizes)}" if sizes else "no S"

    softmax = "no S" if solved["softmax"] is None else f"up to S = {solved['softmax']}"
    beyond = [capacity_label(model) for model, S in solved.items()
              if model != "softmax" and S is not None and S > FEATURE_SIZES[model.split("-")[1]]]
    return (f"the sum rule solves {best('sum')}, the delta rule {best('delta')}, softmax {softmax}; "
            + (f"beyond their D: {', '.join(beyond)}" if beyond else "no fast-weight model solves an S above its D"))


def capacity_results(args):
    """The plot, and one line per setting that says what it shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from examples.synthetic_retrieval.logs import largest_solved, read_runs
    from examples.synthetic_retrieval.plot import draw_capacity

    runs = read_runs(os.path.join(args.out, "capacity"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    titles = {1: "Setting 1: each key written once", 2: "Setting 2: keys reassigned, the latest value asked"}
    lines = []
    for ax, setting in zip(axes, (1, 2)):
        draw_capacity(ax, runs, setting, CAPACITY_MODELS, titles[setting], log_y=True, label_of=capacity_label)
        ax.grid(alpha=0.3)
        solved = {model: largest_solved(runs, setting, model) for model in CAPACITY_MODELS}
        lines.append(f"setting {setting}, largest S solved: " + "; ".join(
            f"{capacity_label(model)} {'none' if S is None else f'S <= {S}'}" for model, S in solved.items()))
        lines.append(f"  so: {reading(solved)}")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"Associative retrieval, key size {CAPACITY_D_KEY}: best evaluation loss (solved below 1e-3)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "capacity.png"), dpi=110)
    plt.close(fig)
    return lines


def cost_results(args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(args.out, "cost.json")) as f:
        steps = json.load(f)
    fig, (time_ax, size_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    lines = []
    for name, cost in steps.items():
        window = 32
        smooth = [sorted(cost["seconds"][i:i + window])[window // 2] * 1e3
                  for i in range(0, len(cost["seconds"]) - window + 1, 8)]
        time_ax.plot(range(0, 8 * len(smooth), 8), smooth, label=name)
        size_ax.plot([b / 2 ** 20 for b in cost["state_bytes"]], label=name)
        last = len(smooth) - 1
        lines.append(f"{name}: {smooth[2]:.1f} ms/token at position 16, {smooth[last]:.1f} at {8 * last}; "
                     f"state {cost['state_bytes'][16] / 2 ** 20:.2f} MiB at 16, "
                     f"{cost['state_bytes'][-1] / 2 ** 20:.2f} MiB at {len(cost['state_bytes']) - 1}")
    time_ax.set(xlabel="position of the generated token", ylabel="ms per token (median of 32)",
                title="Time per token (batch 4, 2 layers, d_model 128)")
    size_ax.set(xlabel="position of the generated token", ylabel="MiB",
                title="Decoder state (key/value cache or fast weights)")
    for ax in (time_ax, size_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "cost.png"), dpi=110)
    plt.close(fig)
    return lines


def pipeline_table(results):
    lines = ["| task, model | test score | converged | train words/s |", "|---|---|---|---|"]
    for label in [f"translation, {name}" for name in MT_ROWS] + [f"language model, {name}" for name in LM_ROWS]:
        score, converged, wps = results[label]
        lines.append(f"| {label} | {score} | {converged} | {'-' if wps is None else f'{wps:.0f}'} |")
    if any(converged != "converged" for _, converged, _ in results.values()):
        lines += ["", "Rows not marked converged were still improving when their budget ran out: against the "
                      "others they compare budgets, not models (--mt-updates and --lm-updates raise it)."]
    return lines


def main(argv=None):
    args = parse_args(argv)
    logging.getLogger().setLevel(logging.WARNING)  # importing fairseq sets DEBUG: matplotlib would fill the screen
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    results = {}
    # the longest first, as far as what they wait for allows
    jobs = ([data_job(args)] + [mt_job(name, row, args, results) for name, row in MT_ROWS.items()]
            + [capacity_job(2, args), capacity_job(1, args), cost_job(args)]
            + [lm_job(name, row, args, results) for name, row in LM_ROWS.items()])
    start = time.time()
    print(f"{len(jobs)} jobs, {args.workers} at a time: capacity (synthetic retrieval), cost per generated token, "
          f"and {len(MT_ROWS)} translation + {len(LM_ROWS)} language models through fairseq; logs in "
          f"{os.path.join(args.out, 'logs')}", flush=True)
    try:
        run_jobs(jobs, workers=args.workers, echo=lambda line: print(line, flush=True))
    except JobFailed as error:
        sys.exit(f"quickstart stopped: {error}")
    summary = (["## Capacity", ""] + capacity_results(args) + ["", "## Cost per generated token", ""]
               + cost_results(args) + ["", f"## The fairseq pipeline ({args.mt_updates} translation and "
                                           f"{args.lm_updates} LM updates per row at most)", ""]
               + pipeline_table(results))
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(summary) + "\n")
    print("\n" + "\n".join(summary))
    print(f"\nDone in {clock(time.time() - start)}. Plots: {os.path.join(args.out, 'capacity.png')}, "
          f"{os.path.join(args.out, 'cost.png')}; summary: {os.path.join(args.out, 'summary.md')}; "
          f"logs and checkpoints: {os.path.join(args.out, 'logs')}, {os.path.join(args.out, 'checkpoints')}.\n"
          "Next: train a fast-weight model on your own data (README, \"Train a fast-weight model on your data\"), "
          "or the paper's "
          "feature maps on real data:\n"
          "  .venv/bin/python -m examples.recipes.small_real_data multi30k --download --out runs/multi30k "
          "--rows softmax linear dpfp-256")


if __name__ == "__main__":
    main()
