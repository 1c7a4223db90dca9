"""The price of ``decay=`` (a_t itself, exact gradients where a_t is small: ops/decay.py) against ``log_decay=``.

The per-channel rules KDA and GLA at T = 512, with one fast-forgetting key channel: a_t below sqrt(eps) of the
dtype at every step (log a = -9 in float32, -20 in float64), the other channels' decays in (0.9, 1). Times are
medians of forward + backward (every input gets its gradient) on the chunked backend, the two forms taking
turns; the ratios are of this one run.

    OMP_NUM_THREADS=1 .venv/bin/python examples/speed/decay_gradient.py [--reps 5]
"""
import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from fairseq_fwp.ops import fast_weight  # noqa: E402

B, H, T, D = 1, 2, 512, 32
FAST_LOG_DECAY = {torch.float32: -9.0, torch.float64: -20.0}  # below log sqrt(eps): -8.0 and -18.0
GOAL = 3.0  # decay= within this factor of log_decay=


def inputs(rule, dtype):
    """q, k, v, beta (None for GLA) and the log-decays ``[B, H, T, D]``, channel 0 fast-forgetting."""
    g = torch.Generator().manual_seed(0)
    q = F.softmax(torch.randn(B, H, T, D, generator=g), -1)
    k = F.normalize(torch.randn(B, H, T, D, generator=g), dim=-1)
    v = torch.randn(B, H, T, D, generator=g)
    beta = None if rule == "gla" else torch.sigmoid(torch.randn(B, H, T, generator=g))
    log_decay = torch.log(0.9 + 0.1 * torch.rand(B, H, T, D, generator=g))
    log_decay[..., 0] = FAST_LOG_DECAY[dtype]
    return [None if x is None else x.to(dtype) for x in (q, k, v, beta, log_decay)]


def run(rule, dtype, form):
    """A function that runs forward + backward once with the gate given as `form` ("decay" or "log_decay")."""
    q, k, v, beta, log_decay = inputs(rule, dtype)
    gate = log_decay.exp() if form == "decay" else log_decay
    tensors = [x.requires_grad_() for x in (q, k, v, beta, gate) if x is not None]

    def forward_backward():
        out, W = fast_weight(rule, q, k, v, beta, decay=gate if form == "decay" else None,
                             log_decay=gate if form == "log_decay" else None, backend="chunked")
        torch.autograd.grad(out.sum() + W.sum(), tensors)

    return forward_backward


def seconds(rule, dtype, reps):
    """{form: the median time of forward + backward}; the two forms take turns, so that both meet the same
    load of the machine."""
    runs = {form: run(rule, dtype, form) for form in ("log_decay", "decay")}
    times = {form: [] for form in runs}
    for rep in range(reps + 1):
        for form, forward_backward in runs.items():
            start = time.perf_counter()
            forward_backward()
            if rep:  # the first is a warm-up
                times[form].append(time.perf_counter() - start)
    return {form: statistics.median(t) for form, t in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"# decay= against log_decay=, B{B}-H{H}-D{D}, T = {T}, one fast-forgetting channel: "
          f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {datetime.date.today().isoformat()}")
    print("| rule | dtype | log_decay= (ms) | decay= (ms) | decay= / log_decay= |")
    print("|---|---|---|---|---|")
    for rule in ("kda", "gla"):
        for dtype in (torch.float32, torch.float64):
            measured = seconds(rule, dtype, args.reps)
            log_s, decay_s = measured["log_decay"], measured["decay"]
            print(f"| {rule} | {str(dtype).split('.')[1]} | {1e3 * log_s:.1f} | {1e3 * decay_s:.1f} | "
                  f"{decay_s / log_s:.2f}x (goal: at most {GOAL:.0f}x) |", flush=True)


if __name__ == "__main__":
    main()
