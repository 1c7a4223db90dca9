"""Training steps of a GPT-2-small-sized language model: fairseq's own transformer_lm against the fwp rows.

    python examples/speed/train_step.py            # a GPU: 12 layers, d 768, 12 heads of 64, FFN 3072,
                                                   # vocabulary 32k; T = 2048 and 8192, 32,768 tokens a step
    python examples/speed/train_step.py --tiny     # the CPU: the same rows at a tiny shape (the tests run it)

Every row is one model at one length, built as fairseq-train builds it (random weights, fairseq's own
argument parsing), and trained for --steps steps on random tokens: bf16 autocast, AdamW (fused on a GPU),
the next-token cross-entropy. Each row runs its lengths in a process of its own under --row-limit seconds
(a length past it is reported as stopped), each printed as it finishes: tokens per second over the timed
steps, the ratio to fairseq's transformer_lm at the same length in this run, peak memory (torch's peak
allocation on a GPU, the growth of the process's resident set on the CPU), the first step's time (Triton's
compile and autotune happen in the row's first length) against a later step's, and the backend that
--fwp-backend auto ran. --profile N adds, per row and length, the N ops that took the most GPU time in one
more step (torch.profiler), printed after the table.
"""
import argparse
import datetime
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

BASELINE = "fairseq-softmax"
# Name -> (arch, flags): fairseq's own softmax LM first (every ratio is to it), then the fwp rows.
ROWS = {
    BASELINE: ("transformer_lm_gpt", []),  # fairseq's transformer_lm; the shape is given below, as for every row
    "fwp-softmax": ("fwp_lm_tiny", ["--fwp-feature-map", "softmax", "--fwp-positions", "on"]),
    "linear-delta": ("fwp_lm_tiny", ["--fwp-feature-map", "linear", "--fwp-update-rule", "delta"]),
    "gated-deltanet": ("fwp_lm_tiny", ["--fwp-feature-map", "silu", "--fwp-qk-norm", "l2", "--fwp-update-rule",
                                       "gated-delta", "--fwp-short-conv", "4", "--fwp-output-gate", "on"]),
    "linear-sum": ("fwp_lm_tiny", ["--fwp-feature-map", "linear", "--fwp-update-rule", "sum"]),
    "dpfp-delta": ("fwp_lm_tiny", ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "1", "--fwp-update-rule", "delta"]),
    "deltaproduct-2-negative": (  # DeltaProduct, N = 2, with negative eigenvalues (unit keys)
        "fwp_lm_tiny", ["--fwp-feature-map", "silu", "--fwp-qk-norm", "l2", "--fwp-update-rule", "delta",
                        "--fwp-householder-steps", "2", "--fwp-negative-eigenvalues", "on"]),
}
# (layers, d_model, heads, FFN, vocabulary, lengths, tokens per step)
SHAPES = {"gpt2-small": (12, 768, 12, 3072, 32000, (2048, 8192), 32768),
          "tiny": (2, 64, 4, 256, 1000, (64, 256), 1024)}


def model_flags(shape, length, layers=None):
    """fairseq's flags for the shape; layers: fewer layers than the shape's (warm_up)."""
    shape_layers, dim, heads, ffn, _, _, _ = SHAPES[shape]
    return ["--decoder-layers", layers or shape_layers, "--decoder-embed-dim", dim, "--decoder-attention-heads", heads,
            "--decoder-ffn-embed-dim", ffn, "--activation-fn", "gelu", "--dropout", 0.1, "--attention-dropout", 0.1,
            "--share-decoder-input-output-embed", "--tokens-per-sample", length, "--max-target-positions", length]


class BackendsSeen(logging.Handler):
    """What --fwp-backend auto logs that it runs (modules/backend_log.py)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def emit(self, record):
        name = record.getMessage().removeprefix("--fwp-backend auto runs ").split(" ")[0]
        if name not in self.names:
            self.names.append(name)


def run_row(row, shape, length, steps, device, profile_ops=0, small=False):
    """One row at one length in this process: {tokens_per_s, peak_mb, first_step_s, step_s, backends}, and
    with profile_ops > 0 the profile of one more step (profiled_step); small: one layer and a vocabulary of
    1,000 (the attention's kernels see the same shapes)."""
    from examples.recipes.decoding_cost import build_random_model, numbered_dictionary

    arch, flags = ROWS[row]
    vocabulary, tokens_per_step = (1000 if small else SHAPES[shape][4]), SHAPES[shape][6]
    seen = BackendsSeen()
    logging.getLogger("fairseq_fwp.backend").addHandler(seen)
    logging.getLogger("fairseq_fwp.backend").setLevel(logging.INFO)
    dictionary = numbered_dictionary(vocabulary - 4)  # with fairseq's four special symbols
    model = build_random_model("language_modeling", arch, model_flags(shape, length, 1 if small else None) + flags,
                               dictionary).train()
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (tokens_per_step // length, length + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])[0]
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        return loss.detach()

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, losses = [], []
    for _ in range(steps + 1):
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda"
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024)
    later = times[1:] or times  # a warm-up (steps = 0) has its first step only
    result = {"tokens_per_s": tokens_per_step * len(later) / sum(later), "peak_mb": peak, "first_step_s": times[0],
              "step_s": statistics.median(later), "backends": seen.names or ["softmax attention"],
              "losses": [float(x) for x in losses]}  # the same batch at every step: they fall
    if profile_ops:
        result["profile"] = profiled_step(step, device, profile_ops)
    logging.getLogger("fairseq_fwp.backend").removeHandler(seen)
    return result


def profiled_step(step, device, top):
    """One more step under torch.profiler: {"device_ms": the time of every op on the device (the CPU's, on a
    CPU), "wall_ms", "ops": the `top` ops by their own time there, [name, calls, ms, share of device_ms]}."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    own = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, own) > 0]
    total = sum(getattr(e, own) for e in events)  # microseconds
    events.sort(key=lambda e: getattr(e, own), reverse=True)
    return {"device_ms": total / 1e3, "wall_ms": 1e3 * wall,
            "ops": [[e.key, e.count, getattr(e, own) / 1e3, getattr(e, own) / total] for e in events[:top]]}


def run_lengths(row, shape, lengths, steps, device, profile_ops, small=False):
    """The child's work: each length of the row in turn, one JSON line each as it finishes (a later length
    reuses the kernels the first compiled and autotuned)."""
    for length in lengths:
        result = run_row(row, shape, length, steps, device, profile_ops, small)
        print(json.dumps({"length": length, **result}), flush=True)


def describe_machine(device):
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {os.cpu_count()} cores"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return (f"{name}, torch {torch.__version__}, Triton {triton_version}, Python {platform.python_version()}, "
            f"{datetime.date.today().isoformat()}")


def warm_up(rows, shape, length, device, limit):
    """Compiles and autotunes the Triton kernels of `rows` into Triton's cache (a step of a small model each,
    run_row's small, at the shape's batch and length; fla's autotuning keys have neither T nor the batch), all
    rows at once, one process each: Triton compiles one kernel at a time per process. Returns {row: seconds,
    or why it did not end}."""
    start, children = time.time(), {}
    for row in rows:
        case = json.dumps([row, shape, [length], 0, device, 0, True])
        children[row] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--case", case], cwd=ROOT,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    results = {}
    for row, child in children.items():
        try:
            _, errors = child.communicate(timeout=max(1.0, start + limit - time.time()))
            lines = errors.strip().splitlines()
            results[row] = round(time.time() - start) if child.returncode == 0 else f"failed: {lines[-1][:200]}"
        except subprocess.TimeoutExpired:
            child.kill()
            results[row] = f"stopped at its time limit ({limit:.0f} s)"
    return results


def run_in_child(row, shape, lengths, steps, device, limit, profile_ops=0):
    """The row's lengths in one child process under `limit` seconds in all: {length: its result, or
    {"stopped": why}}, each yielded as (length, result) the moment it is known."""
    argv = [sys.executable, os.path.abspath(__file__), "--case",
            json.dumps([row, shape, list(lengths), steps, device, profile_ops])]
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, text=True, cwd=ROOT)
        timer = threading.Timer(limit, proc.kill)
        timer.start()
        done = []
        for line in proc.stdout:
            if line.startswith("{"):
                result = json.loads(line)
                done.append(result.pop("length"))
                yield done[-1], result
        code = proc.wait()
        timed_out = not timer.is_alive()
        timer.cancel()
        errors.seek(0)
        lines = errors.read().strip().splitlines()
    why = (f"stopped at its time limit ({limit:.0f} s)" if timed_out else
           f"failed: {lines[-1][:200] if lines else f'exit status {code}'}")
    for length in lengths:
        if length not in done:
            yield length, {"stopped": why}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (for the CPU and the tests)")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS),
                        help=f"rows to run, in this order ({BASELINE!r} is the baseline of every ratio)")
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default: the shape's)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row, after the first")
    parser.add_argument("--row-limit", type=float, default=300,
                        help="seconds per row (all its lengths), in a process of its own")
    parser.add_argument("--deadline", type=float, help="Unix time by which every row has ended")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after each row's timed steps, profile one more step and print its N costliest ops")
    parser.add_argument("--warm-up", action="store_true",
                        help="only compile and autotune the rows' Triton kernels, all rows at once (warm_up)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        row, shape, lengths, steps, device, profile_ops, *small = json.loads(args.case)
        return run_lengths(row, shape, lengths, steps, torch.device(device), profile_ops, *small)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch (--tiny runs on the CPU)")
    shape = "tiny" if args.tiny else "gpt2-small"
    layers, dim, heads, ffn, vocabulary, lengths, tokens_per_step = SHAPES[shape]
    lengths = args.lengths or lengths
    if args.warm_up:
        seconds = warm_up(args.rows, shape, lengths[0], args.device, args.row_limit)
        print("warm-up (compile and autotune, rows at once): " + ", ".join(f"{r} {s}" for r, s in seconds.items()))
        return
    print(f"# training steps, {layers} layers, d {dim}, {heads} heads of {dim // heads}, FFN {ffn}, vocabulary "
          f"{vocabulary}, {tokens_per_step} tokens a step, bf16 autocast, AdamW; {args.steps} timed steps after the "
          f"first (a row's later lengths run in the process of its first, with its compiled kernels); "
          f"{describe_machine(torch.device(args.device))}")
    print(f"| T | row | tokens/s | vs {BASELINE} | peak memory (MiB) | first step (s) | later steps (s) | auto runs |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    baseline, profiles = {}, []
    for row in args.rows:
        limit = args.row_limit if args.deadline is None else min(args.row_limit, args.deadline - time.time())
        if limit < 1:
            for length in lengths:
                print(f"| {length} | {row} | not run: no time left before the deadline | | | | | |", flush=True)
            continue
        for length, result in run_in_child(row, shape, lengths, args.steps, args.device, limit, args.profile):
            if "stopped" in result:
                print(f"| {length} | {row} | {result['stopped']} | | | | | |", flush=True)
                continue
            if row == BASELINE:
                baseline[length] = result["tokens_per_s"]
            ratio = f"{result['tokens_per_s'] / baseline[length]:.2f}x" if length in baseline else "no baseline"
            print(f"| {length} | {row} | {result['tokens_per_s']:,.0f} | {ratio} | {result['peak_mb']:,.0f} | "
                  f"{result['first_step_s']:.2f} | {result['step_s']:.3f} | {', '.join(result['backends'])} |",
                  flush=True)
            if "profile" in result:
                profiles.append((row, length, result["profile"]))
    for row, length, profile in profiles:
        print(f"\n### Profile: {row}, T = {length}: one step, {profile['device_ms']:.1f} ms of "
              f"{'GPU' if args.device == 'cuda' else 'CPU'} time in all ops, {profile['wall_ms']:.1f} ms wall\n")
        print("| op | calls | ms | share |\n|---|---|---|---|")
        for name, calls, ms, share in profile["ops"]:
            print(f"| `{name[:90]}` | {calls} | {ms:.2f} | {100 * share:.1f}% |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
