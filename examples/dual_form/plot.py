"""PNG of the attention of one test position over the training data (cf. the paper's Figs. 4-7, per token)."""
import numpy as np

BINS = 1500  # the stream is drawn as a min/max envelope per bin: readable and small on disk
TOP_DOCUMENTS = 12


def _envelope(values, bins):
    edges = np.linspace(0, len(values), bins + 1).astype(int)
    lows = np.minimum.reduceat(values, edges[:-1])
    highs = np.maximum.reduceat(values, edges[:-1])
    return edges[:-1], lows, highs


def plot_attention(explanation, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report, per_token = explanation.report, explanation.per_token
    fig, (stream_ax, hist_ax, doc_ax) = plt.subplots(
        1, 3, figsize=(15, 3.8), gridspec_kw={"width_ratios": [2.2, 1, 1.3]})

    x, lows, highs = _envelope(per_token, min(BINS, len(per_token)))
    stream_ax.fill_between(x - 1, lows, highs, step="post", color="tab:blue", linewidth=0)
    for start in explanation.doc_starts:
        stream_ax.axvline(start, color="0.85", linewidth=0.5, zorder=0)
    for top in report["top"]:
        stream_ax.annotate(str(top["rank"]), (top["token_offset"], top["attention"]), color="tab:red",
                           fontsize=8, ha="center", va="bottom")
    stream_ax.set(xlabel="training token (stream offset; grey lines: documents)", ylabel="attention  x_t . x",
                  title=f"{report['layer']}: query '{report['query']['token']}'")

    hist_ax.hist(per_token, bins=100, color="tab:blue", log=True)
    hist_ax.set(xlabel="attention per training token", ylabel="tokens", title="distribution")

    docs = report["documents"][:TOP_DOCUMENTS]
    labels = [d["document"][:30] for d in docs]
    doc_ax.barh(range(len(docs)), [d["attention"] for d in docs], color="tab:green")
    doc_ax.set_yticks(range(len(docs)), labels, fontsize=7)
    doc_ax.invert_yaxis()
    doc_ax.set(xlabel="total attention", title="top documents")

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
