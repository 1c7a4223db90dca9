"""fairseq's command-line tools launched from a process that has imported them once.

Every fairseq-* command spends about 4 s of one core importing torch and fairseq (fairseq imports all its
tasks, and with them scipy and scikit-learn) before it reads its first argument. A run of many short
commands (the test suite, the quickstart) pays that per command. With FAIRSEQ_FWP_PRELOAD=1,
commands.fairseq sends each command to a server that imported torch and fairseq's command-line modules
once (one per calling process, started at its first command) and forks a fresh child per command. The
child is the command as its console script runs it: the module's cli_main(), with the caller's argv, working
folder and environment, its output streamed back line by line; the --user-dir is imported in the child, as
fairseq-train does. Commands that must start as `python -m fairseq_cli.<command>` still launch a new
interpreter. For commands that other programs run (the docs test's bash), stand_ins writes fairseq-*
scripts to put first on PATH, which send their command to one server (FAIRSEQ_FWP_PRELOAD_SOCKET).

    python -m examples.recipes.preloaded SOCKET   # the server; commands.fairseq starts it
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# fairseq-interactive is not among them: it reads its caller's stdin, which a forked child does not have.
COMMANDS = ("preprocess", "train", "generate", "eval_lm", "score")
# The modules that configure logging first thing when imported (logging.basicConfig before their imports):
# the child runs them again on an unconfigured root logger, as a new process would. The others find the root
# logger as importing fairseq leaves it, in the server as in a new process.
CONFIGURE_LOGGING = ("preprocess", "train", "eval_lm")
EXIT = b"\0fairseq-fwp exit "  # the line after a command's output that gives its exit status
_server = {}  # the calling process's server: {"pid": the caller, "path": socket path, "process": Popen}
_server_lock = threading.Lock()


def enabled():
    return os.environ.get("FAIRSEQ_FWP_PRELOAD") == "1"


# -- the caller's side ----------------------------------------------------------------------------------

def launch(command, args, cwd=None):
    """fairseq-<command> args, run by the server: (its output lines, a function that returns its exit
    status once they are read)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(_server_path())
    request = dict(command=command.replace("-", "_"), argv=[f"fairseq-{command}", *args],
                   cwd=os.path.abspath(cwd or os.getcwd()), env=dict(os.environ))
    connection.sendall(json.dumps(request).encode() + b"\n")
    status = [-signal.SIGKILL]  # where the child dies without saying how (killed, crashed)

    def lines():
        with connection, connection.makefile("rb") as stream:
            for line in stream:
                if line.startswith(EXIT):
                    status[0] = int(line[len(EXIT):])
                    return
                yield line.decode(errors="replace")

    def wait():
        for _ in output:  # what the caller did not read
            pass
        return status[0]
    output = lines()
    return output, wait


def forward(command, args):
    """A stand-in for fairseq-<command>'s console script (stand_ins): runs it on the server whose socket
    FAIRSEQ_FWP_PRELOAD_SOCKET names, its output on this process's stdout; returns its exit status."""
    lines, wait = launch(command, args)
    for line in lines:
        sys.stdout.write(line)
        sys.stdout.flush()
    return wait()


def stand_ins(folder, commands=("preprocess", "train", "generate", "eval-lm")):
    """Writes fairseq-<command> scripts into `folder` that run their command on this process's server
    (forward): a folder to put first on PATH, for commands run by other programs (bash). Returns the
    environment variables that go with it. fairseq-interactive keeps its console script: it reads stdin."""
    os.makedirs(folder, exist_ok=True)
    for command in commands:
        script = os.path.join(folder, f"fairseq-{command}")
        with open(script, "w") as f:
            f.write(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {ROOT!r})\n"
                    f"from examples.recipes.preloaded import forward\nsys.exit(forward({command!r}, sys.argv[1:]))\n")
        os.chmod(script, 0o755)
    return {"FAIRSEQ_FWP_PRELOAD_SOCKET": _server_path()}


def _server_path():
    """The socket of the server that FAIRSEQ_FWP_PRELOAD_SOCKET names, or of this process's own, started
    (and waited for) at its first command."""
    if os.environ.get("FAIRSEQ_FWP_PRELOAD_SOCKET"):
        return os.environ["FAIRSEQ_FWP_PRELOAD_SOCKET"]
    with _server_lock:
        if _server.get("pid") != os.getpid() or _server["process"].poll() is not None:
            folder = tempfile.mkdtemp(prefix="fairseq-fwp-preload-")
            path = os.path.join(folder, "socket")
            process = subprocess.Popen([sys.executable, "-m", "examples.recipes.preloaded", path], cwd=ROOT,
                                       stdin=subprocess.DEVNULL)
            while not os.path.exists(path):
                if process.poll() is not None:
                    raise RuntimeError(f"the preloaded fairseq server exited ({process.returncode})")
                time.sleep(0.05)
            _server.update(pid=os.getpid(), path=path, process=process)
        return _server["path"]


# -- the server's side ----------------------------------------------------------------------------------

def serve(path):
    import importlib

    import torch  # noqa: F401  (what every command imports first)

    modules = {name: importlib.import_module(f"fairseq_cli.{name}") for name in COMMANDS}
    caller = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reap themselves
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    listener.settimeout(1.0)
    os.rename(path + ".tmp", path)  # ready: the caller waits for this name
    while os.getppid() == caller:  # the caller gone, the server goes too
        try:
            connection, _ = listener.accept()
        except socket.timeout:
            continue
        if os.fork() == 0:
            listener.close()
            _child(connection, modules)
        connection.close()
    os.unlink(path)
    os.rmdir(os.path.dirname(path))


def _child(connection, modules):
    """Runs one command in this forked child, its output on the connection; never returns."""
    status = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the command's own subprocesses are waited for
        with connection.makefile("rb") as stream:
            request = json.loads(stream.readline())
        os.dup2(connection.fileno(), 1)
        os.dup2(connection.fileno(), 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            import torch
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        module = modules[request["command"]]
        if request["command"] in CONFIGURE_LOGGING:
            import importlib
            import logging
            for handler in logging.root.handlers[:]:
                logging.root.removeHandler(handler)
            logging.root.setLevel(logging.WARNING)
            module = importlib.reload(module)
        sys.argv = request["argv"]
        sys.path[0] = os.path.dirname(sys.executable)  # a console script's first path: its own folder
        try:
            module.cli_main()
            status = 0
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        try:
            os.write(1, EXIT + f"{status}\n".encode())
        finally:
            os._exit(status)


if __name__ == "__main__":
    serve(sys.argv[1])
