"""Running the fairseq command-line tools of the current environment."""
import os
import shlex
import subprocess
import sys

BIN_DIR = os.path.dirname(sys.executable)
PLUGIN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _command_line(command):
    """fairseq-<command> of this environment, or its module where fairseq is used from a source
    tree without console scripts (the GPU check's machine: scripts/gpu_check.sh)."""
    script = os.path.join(BIN_DIR, f"fairseq-{command}")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-m", f"fairseq_cli.{command.replace('-', '_')}"]


def fairseq(command, *args, cwd=None, echo=False, log=None):
    """Run fairseq-<command>; returns its combined output, raises with its tail on failure.

    echo=True prints the command line first (recipes: every step can be rerun
    by hand); log, a path, receives the output as it comes (long trainings).
    """
    argv = [*_command_line(command), *map(str, args)]
    if echo:
        print("+ " + shlex.join([f"fairseq-{command}", *argv[1:]]), flush=True)
    if log is None:
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
        output, returncode = proc.stdout + proc.stderr, proc.returncode
    else:
        with open(log, "w") as f:
            returncode = subprocess.run(argv, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, text=True).returncode
        with open(log) as f:
            output = f.read()
    if returncode != 0:
        raise RuntimeError(f"fairseq-{command} failed ({returncode}):\n{output[-4000:]}")
    return output
