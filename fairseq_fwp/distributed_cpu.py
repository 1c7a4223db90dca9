"""Multi-process fairseq-train on CPUs: one process per rank over gloo.

    python -m fairseq_fwp.distributed_cpu --nprocs 2 -- DATA --user-dir fairseq_fwp --arch fwp_lm_tiny ...

fairseq spawns one process per GPU; without GPUs it refuses to spawn, but
ranks launched by hand work: each gets --distributed-rank r with
--distributed-no-spawn, a tcp:// rendezvous on localhost, the gloo backend and
fairseq's legacy_ddp (pass another --ddp-backend after `--` to override). The
ranks split the cores between them (OMP_NUM_THREADS, unless set). Every
batch goes to one rank and the gradients are summed, so N processes compute
what one process computes with --update-freq N (tests/test_reliability.py).
The exit status is the first failing rank's; when one rank fails the others
are stopped.
"""
import argparse
import os
import socket
import subprocess
import sys
import time

# fairseq-train of this environment: beside this interpreter, or where FAIRSEQ_BIN says (the GPU check's).
BIN_DIR = os.environ.get("FAIRSEQ_BIN") or os.path.dirname(sys.executable)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_command(train_args, nprocs, rank, port):
    return [os.path.join(BIN_DIR, "fairseq-train"), "--cpu", "--distributed-world-size", str(nprocs),
            "--distributed-rank", str(rank), "--distributed-no-spawn", "--distributed-backend", "gloo",
            "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--ddp-backend", "legacy_ddp",
            *map(str, train_args)]


def launch(train_args, nprocs, port=None, stdout=None):
    """Run the ranks to completion; returns 0 or the first non-zero exit status."""
    port = port or free_port()
    threads = str(max(1, (os.cpu_count() or 1) // nprocs))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads))
    ranks = [subprocess.Popen(rank_command(train_args, nprocs, r, port), env=env, stdout=stdout,
                              stderr=subprocess.STDOUT if stdout else None) for r in range(nprocs)]
    while True:
        codes = [p.poll() for p in ranks]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or None not in codes:
            break
        time.sleep(0.2)
    for p in ranks:
        if p.poll() is None:  # a rank failed: the others would wait for it forever
            p.terminate()
        p.wait()
    return failed[0] if failed else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, required=True, help="number of ranks (processes)")
    parser.add_argument("--port", type=int, help="rendezvous port on 127.0.0.1 (default: a free one)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then fairseq-train's arguments")
    args = parser.parse_args(argv)
    if args.nprocs < 1:
        parser.error(f"--nprocs must be >= 1, got {args.nprocs}")
    train_args = [a for a in args.train_args if a != "--"]
    if not train_args:
        parser.error("give fairseq-train's arguments after --")
    sys.exit(launch(train_args, args.nprocs, args.port))


if __name__ == "__main__":
    main()
