"""Has a change slowed the ops down? Times the chunked sum and delta rules (forward + backward, no decay)
in this checkout and in another one, alternating between them, and prints the ratios of the medians.

    git worktree add /tmp/before COMMIT
    .venv/bin/python examples/speed/ops_against_checkout.py /tmp/before [--rounds 4] [--T 1024]

Each round times both checkouts once, each in a fresh 1-thread process, so slow drifts of a shared
machine fall on both alike.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def time_ops(checkout, T, repeats=10):
    """{rule: median ms of one forward + backward} of the ops in `checkout`; runs in the child process.

    The timing loop lives here rather than in either checkout's op benchmark, so that both checkouts
    are timed by the same code."""
    sys.path.insert(0, checkout)
    import torch
    import fairseq_fwp
    from fairseq_fwp.ops import fast_weight_delta, fast_weight_sum

    if os.path.dirname(fairseq_fwp.__file__) != os.path.join(checkout, "fairseq_fwp"):
        raise RuntimeError(f"timed {fairseq_fwp.__file__}, not the checkout {checkout}")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    B, H, D = 2, 4, 64
    q, k = (torch.rand(B, H, T, D).div(D / 2).requires_grad_() for _ in range(2))  # sum-normalised scale
    v = torch.randn(B, H, T, D, requires_grad=True)
    beta = torch.rand(B, H, T, requires_grad=True)
    rules = {"sum": lambda: fast_weight_sum(q, k, v, backend="chunked"),
             "delta": lambda: fast_weight_delta(q, k, v, beta, backend="chunked")}
    medians = {}
    for rule, run in rules.items():
        times = []
        for _ in range(repeats + 2):  # the first two warm up
            start = time.perf_counter()
            run()[0].sum().backward()
            times.append(time.perf_counter() - start)
        medians[rule] = statistics.median(times[2:]) * 1e3
    return medians


def time_checkout(checkout, T):
    child = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
             f"import json, ops_against_checkout as m; print(json.dumps(m.time_ops({checkout!r}, {T})))")
    output = subprocess.run([sys.executable, "-c", child], check=True, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    return json.loads(output.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("baseline", help="the other checkout's root (it must contain fairseq_fwp/)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--T", type=int, default=1024)
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(args.baseline, "fairseq_fwp")):
        parser.error(f"baseline {args.baseline!r} has no fairseq_fwp/ directory")
    runs = {"baseline": [], "this checkout": []}
    for _ in range(args.rounds):
        runs["baseline"].append(time_checkout(os.path.abspath(args.baseline), args.T))
        runs["this checkout"].append(time_checkout(ROOT, args.T))
    print(f"# chunked ops, B=2 H=4 T={args.T} D=64, forward+backward, 1 thread, {args.rounds} rounds; "
          f"{platform.machine()} {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    print("| rule | baseline ms (median of rounds) | this checkout ms | this / baseline |")
    print("|---|---|---|---|")
    for rule in runs["baseline"][0]:
        before, now = (statistics.median(r[rule] for r in runs[name]) for name in runs)
        print(f"| {rule} | {before:.1f} | {now:.1f} | {now / before:.2f}x |")


if __name__ == "__main__":
    main()
