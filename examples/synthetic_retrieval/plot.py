"""Figures in the style of the paper's Figures 2, 3 and 5, and a results table, from the sweep's CSVs.

    python -m examples.synthetic_retrieval.plot --logs runs/synthetic_retrieval --out runs/synthetic_retrieval/figures

Writes, for whatever finished runs the log directory holds:
- ``figure2_capacity.png``: setting 1, best evaluation loss against S for
  the sum-rule models and softmax (Figure 2).
- ``figure2_delta.png``: setting 1, every model that was run, log scale (beyond
  the paper; only if setting-1 runs of other rules exist).
- ``figure3_learning_curves.png``: setting 2, evaluation loss against
  training step at one S (``--curve-size``, default 20: Figure 3).
- ``figure5_update_rules.png``: setting 2, best evaluation loss against S,
  log scale (Figure 5).
- ``summary.md``: the largest S solved per model (setting 1, with the
  authors' numbers), the best loss per model and S (setting 2), and how many
  times lower the delta rule's best loss is than the sum rule's, per phi
  and S (setting 2; the goal is >= 10x at every S <= 100).
"""
import argparse
import os
from functools import partial

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .data import sequence_length  # noqa: E402
from .logs import SOLVED_LOSS, best_loss, largest_solved, read_runs  # noqa: E402
from .names import label, parse_model_name  # noqa: E402

# Largest S solved in the authors' setting-1 logs (the paper's Figure 2).
PAPER_LARGEST_SOLVED = {"sum-linear": "40", "sum-dpfp1": "100", "sum-dpfp2": "240", "sum-dpfp3": "340",
                        "softmax": "about 480", "sum-favor64": "never", "sum-favor128": "never",
                        "sum-favor512": "never"}
PHI_ORDER = ("softmax", "linear", "dpfp1", "dpfp2", "dpfp3", "favor64", "favor128", "favor512", "tanh")
RULE_STYLE = {"softmax": ("-", "o"), "sum": ("-", "o"), "delta": ("--", "s"), "gated": (":", "^"),
              "gdelta": ("-.", "s"),
              "fwm": ("-.", "D")}


def style(model):
    """Colour by phi (the same in every figure), line style and marker by update rule."""
    rule, phi = parse_model_name(model)
    linestyle, marker = RULE_STYLE[rule]
    key = phi or "softmax"
    color = f"C{PHI_ORDER.index(key)}" if key in PHI_ORDER else "C9"
    return dict(color=color, linestyle=linestyle, marker=marker, markersize=4, label=label(model))


def models_of(runs, setting, rules=None):
    found = {m for (s, m, _) in runs if s == setting}
    return sorted(m for m in found if rules is None or parse_model_name(m)[0] in rules)


def save(fig, ax, path, legend_columns):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=legend_columns)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def capacity_figure(runs, setting, models, path, title, log_y):
    """Best evaluation loss against the number of keys S, one line per model."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw_capacity(ax, runs, setting, models, title, log_y)
    save(fig, ax, path, legend_columns=2)


def draw_capacity(ax, runs, setting, models, title, log_y, label_of=label):
    """capacity_figure's lines, on `ax`; label_of(model) names each in the legend."""
    for model in models:
        sizes = sorted(S for (s, m, S) in runs if s == setting and m == model)
        ax.plot(sizes, [best_loss(runs[setting, model, S]) for S in sizes], **dict(style(model), label=label_of(model)))
    if log_y:
        ax.set_yscale("log")
        ax.axhline(SOLVED_LOSS, color="grey", linewidth=0.8, linestyle=":")
    ax.set(xlabel="number of unique keys S", ylabel="best evaluation loss", title=title)


def curves_figure(runs, setting, num_keys, path):
    """Evaluation loss against training step at one S (Figure 3)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in models_of(runs, setting):
        rows = runs.get((setting, model, num_keys))
        if rows:
            ax.plot([r["step"] for r in rows], [r["eval_loss"] for r in rows], **dict(style(model), marker=None))
    ax.set_yscale("log")
    ax.axhline(SOLVED_LOSS, color="grey", linewidth=0.8, linestyle=":")
    ax.set(xlabel="training step", ylabel="evaluation loss",
           title=f"Setting {setting}: learning curves, S = {num_keys} (L = {sequence_length(setting, num_keys)})")
    save(fig, ax, path, legend_columns=1)


def setting1_table(runs):
    """Markdown: the largest S solved per model, beside the authors' numbers."""
    lines = ["## Setting 1: largest S solved (best evaluation loss <= 1e-3)", "",
             "| model | S run | largest S solved | authors' logs |", "|---|---|---|---|"]
    for model in models_of(runs, 1):
        sizes = sorted(S for (s, m, S) in runs if s == 1 and m == model)
        solved = largest_solved(runs, 1, model)
        lines.append(f"| {label(model)} | {sizes[0]}..{sizes[-1]} ({len(sizes)} runs) | "
                     f"{solved if solved is not None else 'none'} | {PAPER_LARGEST_SOLVED.get(model, '-')} |")
    return lines


def setting2_table(runs):
    """Markdown: the best evaluation loss per S (rows) and model (columns)."""
    models = models_of(runs, 2)
    lines = ["## Setting 2: best evaluation loss", "", "| S | " + " | ".join(map(label, models)) + " |",
             "|---" * (len(models) + 1) + "|"]
    for S in sorted({S for (s, _, S) in runs if s == 2}):
        cells = [f"{best_loss(runs[2, m, S]):.1e}" if (2, m, S) in runs else "" for m in models]
        lines.append(f"| {S} | " + " | ".join(cells) + " |")
    return lines


def ratio_text(ratio):
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"  # a decimal where it decides against 10x


def delta_vs_sum_table(runs, setting=2):
    """Markdown: sum-rule best loss / delta-rule best loss per S (rows) and phi (columns)."""
    phis = sorted({parse_model_name(m)[1] for m in models_of(runs, setting, ("delta",))}
                  & {parse_model_name(m)[1] for m in models_of(runs, setting, ("sum",))}, key=PHI_ORDER.index)
    if not phis:
        return []
    lines = [f"## Setting {setting}: sum-rule loss / delta-rule loss (how many times lower the delta rule is)", "",
             "| S | " + " | ".join(phis) + " |", "|---" * (len(phis) + 1) + "|"]
    for S in sorted({S for (s, _, S) in runs if s == setting}):
        pairs = [(runs.get((setting, f"sum-{phi}", S)), runs.get((setting, f"delta-{phi}", S))) for phi in phis]
        cells = [ratio_text(best_loss(sum_rows) / best_loss(delta_rows)) if sum_rows and delta_rows else ""
                 for sum_rows, delta_rows in pairs]
        lines.append(f"| {S} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logs", required=True, help="the sweep's --out directory")
    parser.add_argument("--out", required=True, help="directory for the PNGs and summary.md")
    parser.add_argument("--curve-size", type=int, default=20, help="S of the Figure 3 learning curves (default 20)")
    args = parser.parse_args(argv)
    runs = read_runs(args.logs)
    if not runs:
        parser.error(f"--logs: no finished runs under {args.logs!r}")
    os.makedirs(args.out, exist_ok=True)
    figures, tables = {}, []
    if models_of(runs, 1, ("softmax", "sum")):
        figures["figure2_capacity.png"] = partial(capacity_figure, runs, 1, models_of(runs, 1, ("softmax", "sum")),
                                                  title="Setting 1 (L = S, no replacement): capacity", log_y=False)
    if models_of(runs, 1, ("delta", "gated", "gdelta", "fwm")):
        figures["figure2_delta.png"] = partial(capacity_figure, runs, 1, models_of(runs, 1),
                                               title="Setting 1: update rules", log_y=True)
    if any(s == 2 and S == args.curve_size for (s, _, S) in runs):
        figures["figure3_learning_curves.png"] = partial(curves_figure, runs, 2, args.curve_size)
    if models_of(runs, 2):
        figures["figure5_update_rules.png"] = partial(capacity_figure, runs, 2, models_of(runs, 2),
                                                      title="Setting 2 (L = 2S, with replacement): update rules",
                                                      log_y=True)
    for name, draw in figures.items():
        draw(path=os.path.join(args.out, name))
        print("wrote", os.path.join(args.out, name))
    if models_of(runs, 1):
        tables += setting1_table(runs) + [""]
    if models_of(runs, 2):
        tables += setting2_table(runs) + [""] + delta_vs_sum_table(runs) + [""]
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(tables))
    print("\n".join(tables))


if __name__ == "__main__":
    main()
