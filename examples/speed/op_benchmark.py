"""Speed and memory of the fast-weight ops against causal softmax attention.

    .venv/bin/python examples/speed/op_benchmark.py                 # CPU, float32 (a few minutes on 2 cores)
    .venv/bin/python examples/speed/op_benchmark.py --quick         # CPU, T = 256 only
    .venv/bin/python examples/speed/op_benchmark.py --device cuda   # GPU, bfloat16: the cuda and fla backends
                                                                    # vs chunked vs flash SDPA (the GPU check:
                                                                    # --quick); "first call" is the warm-up's
                                                                    # time, Triton's compile and autotune

On the CPU every case runs in a fresh subprocess so that its peak memory (the
growth of the process's maximum resident set over the inputs) is its own; on
the GPU peak memory is torch's peak allocation during the case. Times are
medians of several forward+backward passes; the ratios printed at the end are
between cases of this one run.

--malloc-keep-memory sets glibc's MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_
in each case's environment, so that large tensors are recycled instead of
being mapped (and page-faulted) afresh: the usual CPU-training setting, like
preloading jemalloc. It applies to every method alike.
"""
import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the checkout's fairseq_fwp, also without `pip install -e .`

from fairseq_fwp.ops import fast_weight, fast_weight_delta, fast_weight_delta_product, fast_weight_sum, update_rule  # noqa: E402
from fairseq_fwp.ops.backends import Call, unfit_reason  # noqa: E402

METHODS = ("reference-sum", "reference-delta", "chunked-sum", "chunked-delta", "chunked-product2", "chunked-gated-delta",
           "chunked-kda", "softmax-sdpa")
# A method's time against another's of this run: (method, baseline, the goal's words).
COMPARED = {"chunked-product2": ("chunked-delta", "twice the writes of the delta rule: the goal is at most 2.2x"),
            "chunked-kda": ("chunked-gated-delta", "a decay per key channel: the goal is at most 2.5x")}
CONFIGS = {"B2-H4-D64": (2, 4, 64), "B1-H8-D64": (1, 8, 64)}
REFERENCE_MAX_T = 1024
# The GPU table: B = 8, H = 8, D = 64 and 256, bfloat16.
# Those that compile nothing first: the GPU check's part prints rows while Triton compiles fla's kernels.
GPU_METHODS = ("softmax-sdpa", "chunked-sum", "chunked-delta", "fla-sum", "fla-delta", "cuda-sum", "cuda-delta")
GPU_CONFIGS = {"B8-H8-D64": (8, 8, 64), "B8-H8-D256": (8, 8, 256)}
GPU_LENGTHS = (512, 2048, 8192)


def _inputs(B, H, T, D, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    # Sum-normalised positive features, as the layers feed the ops.
    q = F.softmax(torch.randn(B, H, T, D, generator=g), -1)
    k = F.softmax(torch.randn(B, H, T, D, generator=g), -1)
    v = torch.randn(B, H, T, D, generator=g)
    beta = torch.sigmoid(torch.randn(B, H, T, generator=g))
    return [x.to(device, dtype).requires_grad_() for x in (q, k, v, beta)]


def _forward(method, q, k, v, beta):
    if method == "softmax-sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    backend, rule = method.split("-", 1)
    if rule in ("gated-delta", "kda"):  # decays in (0.9, 1), one per head or per key channel, as log a
        shape = q.shape if rule == "kda" else q.shape[:3]
        log_decay = torch.log(0.9 + 0.1 * torch.rand(shape, generator=torch.Generator().manual_seed(1))).to(q)
        log_decay.requires_grad_()  # its gradient, as training computes it
        return fast_weight(rule, q, k, v, beta, log_decay=log_decay, backend=backend)[0]
    if rule == "sum":
        return fast_weight_sum(q, k, v, backend=backend)[0]
    if rule == "product2":  # DeltaProduct, N = 2 writes per token: the second from the previous token's inputs
        two = lambda x: torch.stack([x, x.roll(1, 2)], dim=3)  # noqa: E731
        return fast_weight_delta_product(q, two(k), two(v), two(beta), backend=backend)[0]
    return fast_weight_delta(q, k, v, beta, backend=backend)[0]


def _median_time(fn, reps, synchronize=lambda: None, first=None):
    """The median of `reps` timed calls after a warm-up call; `first` (a dict), if given, receives the
    warm-up's seconds as "first_s": on a GPU, Triton's compile and autotune happen there."""
    start = time.perf_counter()
    fn()  # warm-up
    synchronize()
    if first is not None:
        first.setdefault("first_s", time.perf_counter() - start)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_case(method, B, H, T, D):
    """Time one method in this process; returns a dict of measurements."""
    inputs = _inputs(B, H, T, D)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reps = 3 if method.startswith("reference") else 7

    def fwd_bwd():
        for x in inputs:
            x.grad = None
        _forward(method, *inputs).sum().backward()

    def fwd():
        with torch.no_grad():
            _forward(method, *inputs)

    result = {"fwd_bwd_s": _median_time(fwd_bwd, reps), "fwd_s": _median_time(fwd, reps)}
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result["peak_mb"] = max(rss_after - rss_before, 0) / 1024  # ru_maxrss is in KiB on Linux
    return result


def run_gpu_case(method, B, H, T, D):
    """Time one method on the GPU in bfloat16; peak memory is torch's peak allocation."""
    inputs = _inputs(B, H, T, D, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        for x in inputs:
            x.grad = None
        _forward(method, *inputs).float().sum().backward()

    def fwd():
        with torch.no_grad():
            _forward(method, *inputs)

    result = {}
    for name, fn in (("fwd_s", fwd), ("fwd_bwd_s", fwd_bwd)):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result[name] = _median_time(fn, 10, torch.cuda.synchronize, first=result)
        result["peak_mb" if name == "fwd_bwd_s" else "fwd_peak_mb"] = (
            (torch.cuda.max_memory_allocated() - base) / 2**20)
    return result


def gpu_main(lengths):
    print(f"# fast-weight ops benchmark, bfloat16, {torch.cuda.get_device_name()}: "
          f"{machine_description(torch.get_num_threads())}")
    print("| config | T | method | fwd (ms) | fwd+bwd (ms) | fwd peak (MB) | fwd+bwd peak (MB) | first call (s) |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    results = {}
    for name, (B, H, D) in GPU_CONFIGS.items():
        call = Call(rule=update_rule("delta"), dtype=torch.bfloat16, device=torch.device("cuda"), D=D, Dv=D, T=2,
                    needs_grad=True)
        unfit = {name: unfit_reason(name, call) for name in ("cuda", "fla")}
        for backend, reason in unfit.items():
            if reason is not None:
                print(f"| {name} | | {backend}-* | not run: {reason} | | | | |", flush=True)
        methods = [m for m in GPU_METHODS if unfit.get(m.split("-")[0]) is None]
        for T in lengths:
            for method in methods:
                try:
                    r = run_gpu_case(method, B, H, T, D)
                except Exception as err:  # e.g. out of memory, or a D or signature fla does not take
                    print(f"| {name} | {T} | {method} | failed: {str(err).splitlines()[0][:80]} | | | | |", flush=True)
                    torch.cuda.empty_cache()
                    continue
                results[name, T, method] = r
                print(f"| {name} | {T} | {method} | {1e3 * r['fwd_s']:.2f} | {1e3 * r['fwd_bwd_s']:.2f} | "
                      f"{r['fwd_peak_mb']:.0f} | {r['peak_mb']:.0f} | {r['first_s']:.2f} |", flush=True)
    print("\nRatios of time (higher = first method faster), same run: fwd+bwd (fwd)")
    for (name, T, method), r in results.items():
        backend, rule = method.split("-")
        if backend not in ("cuda", "fla"):
            continue
        for base in (f"chunked-{rule}", "softmax-sdpa") + (("fla-delta",) if method == "cuda-delta" else ()):
            if (name, T, base) in results:
                ratios = [results[name, T, base][key] / r[key] for key in ("fwd_bwd_s", "fwd_s")]
                print(f"  {name} T={T}: {method} vs {base}: {ratios[0]:.2f}x ({ratios[1]:.2f}x)")


KEEP_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}


def _run_in_subprocess(method, B, H, T, D, threads, keep_memory):
    cmd = [sys.executable, os.path.abspath(__file__), "--case",
           json.dumps([method, B, H, T, D]), "--threads", str(threads)]
    env = dict(os.environ, **(KEEP_MEMORY_ENV if keep_memory else {}))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def machine_description(threads):
    return (f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {threads} threads, Python {platform.python_version()}, "
            f"{datetime.date.today().isoformat()}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the shortest T (256 on CPU, 512 on GPU)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--malloc-keep-memory", action="store_true",
                        help="run every case with glibc's mmap/trim thresholds raised (see above)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.case:
        print(json.dumps(run_case(*json.loads(args.case))))
        return
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is visible to torch")
        gpu_main(GPU_LENGTHS[:1] if args.quick else GPU_LENGTHS)
        return

    lengths = [256] if args.quick else [256, 1024, 4096]
    print(f"# fast-weight ops benchmark, float32, CPU: {machine_description(args.threads)}")
    print(f"# glibc malloc: {'thresholds raised' if args.malloc_keep_memory else 'default'}")
    print("| config | T | method | fwd (ms) | fwd+bwd (ms) | peak mem (MB) |")
    print("|---|---|---|---|---|---|")
    results = {}
    for name, (B, H, D) in CONFIGS.items():
        for T in lengths:
            for method in METHODS:
                if method.startswith("reference") and T > REFERENCE_MAX_T:
                    continue
                r = _run_in_subprocess(method, B, H, T, D, args.threads, args.malloc_keep_memory)
                results[name, T, method] = r
                print(f"| {name} | {T} | {method} | {1e3 * r['fwd_s']:.1f} | "
                      f"{1e3 * r['fwd_bwd_s']:.1f} | {r['peak_mb']:.0f} |", flush=True)

    print("\nRatios of fwd+bwd time (higher = chunked faster), same run:")
    for (name, T, method), r in results.items():
        if not method.startswith("chunked"):
            continue
        rule = method.split("-", 1)[1]
        if method in COMPARED:
            base, goal = COMPARED[method]
            ratio = r["fwd_bwd_s"] / results[name, T, base]["fwd_bwd_s"]
            print(f"  {name} T={T}: {method} takes {ratio:.2f}x the time of {base} ({goal})")
            continue
        for base in (f"reference-{rule}", "softmax-sdpa"):
            if (name, T, base) in results:
                ratio = results[name, T, base]["fwd_bwd_s"] / r["fwd_bwd_s"]
                print(f"  {name} T={T}: {method} vs {base}: {ratio:.1f}x")


if __name__ == "__main__":
    main()
