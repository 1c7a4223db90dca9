"""Running the fairseq command-line tools of the current environment."""
import os
import re
import shlex
import subprocess
import sys
import threading
import time

from . import preloaded

# Where the fairseq-* console scripts are: beside this interpreter, or where FAIRSEQ_BIN says (the GPU
# check, whose fairseq runs from a source tree, writes its own: scripts/gpu_check.sh).
BIN_DIR = os.environ.get("FAIRSEQ_BIN") or os.path.dirname(sys.executable)
# The plugin's folder, what --user-dir names: this checkout's (the recipes run from the repository root).
PLUGIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fairseq_fwp")


def _command_line(command, as_module=False):
    """fairseq-<command> of this environment; with as_module, or where there is no console script, its
    module."""
    script = os.path.join(BIN_DIR, f"fairseq-{command}")
    if os.path.exists(script) and not as_module:
        return [script]
    return [sys.executable, "-m", f"fairseq_cli.{command.replace('-', '_')}"]


def fairseq(command, *args, cwd=None, echo=False, log=None, as_module=False, watch=None):
    """Run fairseq-<command>; returns its combined output, raises with its tail on failure.

    echo=True prints the command line first (recipes: every step can be rerun
    by hand); log, a path, receives the output as it comes (long trainings).
    as_module=True launches `python -m fairseq_cli.<command>` even where the
    console script exists (users launch both ways).
    watch(line) sees every output line as it comes; without it, fairseq-train
    with --max-update prints its progress (TrainingProgress).
    """
    launcher = _command_line(command, as_module)
    argv = [*launcher, *map(str, args)]
    if echo:
        print("+ " + shlex.join([f"fairseq-{command}", *argv[len(launcher):]]), flush=True)
    if watch is None and command == "train":
        progress = TrainingProgress.for_arguments(argv)
        watch = progress.see if progress is not None else None
    returncode, output = completed(command, *args, cwd=cwd, log=log, as_module=as_module, watch=watch)
    if returncode != 0:
        raise RuntimeError(f"fairseq-{command} failed ({returncode}):\n{output[-4000:]}")
    return output


def completed(command, *args, cwd=None, log=None, as_module=False, watch=None, timeout=None):
    """Run fairseq-<command>, stopped (killed) after `timeout` seconds where given; returns (its exit status,
    negative for the signal that ended it, and its combined output), whatever it is."""
    launcher = _command_line(command, as_module)
    lines = []
    with open(log or os.devnull, "w") as sink:
        output_lines, wait, stop = _launch(command, launcher, list(map(str, args)), as_module, cwd)
        timer = threading.Timer(timeout, stop) if timeout else None
        if timer is not None:
            timer.start()
        try:
            for line in output_lines:
                lines.append(line)
                sink.write(line)
                if watch is not None:
                    watch(line)
            returncode = wait()
        finally:
            if timer is not None:
                timer.cancel()
    return returncode, "".join(lines)


def python(*args, cwd=None, env=None, input=None):
    """`python ARGS` (-m MODULE, -c CODE or SCRIPT, then its arguments) with this interpreter: a
    subprocess.CompletedProcess, its stdout and stderr as text, apart; with FAIRSEQ_FWP_PRELOAD=1, run by the
    preloaded server (preloaded.run_python: no import of torch and fairseq of its own)."""
    if preloaded.enabled():
        return preloaded.run_python(args, cwd, env, input)
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, input=input, capture_output=True,
                          text=True)


def python_module(module, *args):
    """`python -m MODULE ARGS` with this interpreter, its output this process's; raises CalledProcessError where it
    fails. With FAIRSEQ_FWP_PRELOAD=1, run by the preloaded server (preloaded.run_python_here)."""
    command = [sys.executable, "-m", module, *map(str, args)]
    status = (preloaded.run_python_here(command[1:]) if preloaded.enabled()
              else subprocess.run(command).returncode)
    if status != 0:
        raise subprocess.CalledProcessError(status, command)


def _launch(command, launcher, args, as_module, cwd):
    """(the command's output lines, a function that returns its exit status once they are read, a function that
    kills it): a new process, or, with FAIRSEQ_FWP_PRELOAD=1, a child of the preloaded server (preloaded.py)."""
    if preloaded.enabled() and not as_module and command.replace("-", "_") in preloaded.COMMANDS:
        return preloaded.launch(command, args, cwd)
    proc = subprocess.Popen([*launcher, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc.stdout, proc.wait, proc.kill


class TrainingProgress:
    """Prints "update U / MAX, elapsed, ~left" from fairseq-train's log lines, at most every `every` s."""

    def __init__(self, max_update, every=30.0):
        self.max_update, self.every = max_update, every
        self.start = self.last = time.time()
        self.first_update = None  # updates before this run (a resumed run), for the rate

    @classmethod
    def for_arguments(cls, argv):
        if "--max-update" not in argv:
            return None
        return cls(int(argv[argv.index("--max-update") + 1]))

    def see(self, line):
        match = re.search(r"num_updates[= ](\d+)", line)
        if not match:
            return
        updates, now = int(match.group(1)), time.time()
        if self.first_update is None:
            self.first_update, self.start = updates, now
        if now - self.last < self.every and updates < self.max_update:
            return
        self.last = now
        done = updates - self.first_update
        left = (now - self.start) / done * (self.max_update - updates) if done else float("nan")
        print(f"  update {updates} / {self.max_update}, {_minutes(now - self.start)} elapsed, "
              f"~{_minutes(left)} left", flush=True)


def _minutes(seconds):
    return "?" if seconds != seconds else f"{int(seconds // 60)}:{int(seconds % 60):02d}"
