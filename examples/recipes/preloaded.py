"""fairseq's command-line tools launched from a process that has imported them once.

Every fairseq-* command spends about 4 s of one core importing torch and fairseq (fairseq imports all its
tasks, and with them scipy and scikit-learn) before it reads its first argument. A run of many short
commands (the test suite, the quickstart) pays that per command. With FAIRSEQ_FWP_PRELOAD=1,
commands.fairseq sends each command to a server that imported torch and fairseq's command-line modules
once (one per calling process, started at its first command) and forks a fresh child per command. The
child is the command as its console script runs it: the module's cli_main(), with the caller's argv, stdin,
working folder and environment, its output streamed back line by line; the --user-dir is imported in the
child, as fairseq-train does; it seeds its random number generators afresh and exits as the interpreter
exits. A caller whose environment differs from the server's in what a new process reads at its start
(READ_AT_START) gets its command as installed, a new process, and so do commands that must start as
`python -m fairseq_cli.<command>`. For commands that other programs run (the docs test's bash), stand_ins
writes fairseq-* scripts to put first on PATH, which send their command to one server
(FAIRSEQ_FWP_PRELOAD_SOCKET).

    python -m examples.recipes.preloaded SOCKET   # the server; commands.fairseq starts it
"""
import atexit
import importlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# fairseq-interactive is not among them: no test holds a forked run of it to its console script's.
COMMANDS = ("preprocess", "train", "generate", "eval_lm", "score")
# The modules that configure logging first thing when imported (logging.basicConfig before their imports):
# the child runs them again on an unconfigured root logger, as a new process would. The others find the root
# logger as importing fairseq leaves it, in the server as in a new process.
CONFIGURE_LOGGING = ("preprocess", "train", "eval_lm")
# What a new process reads from its environment before the child can take its caller's: the interpreter
# (PYTHON*), the thread pools of OpenMP, MKL and OpenBLAS (loaded with torch and numpy), fairseq when imported
# (LOCAL_RANK, its cache folders). A caller whose values differ from the server's gets a new process.
READ_AT_START = re.compile(r"(PYTHON|OMP_|MKL_|OPENBLAS_)\w*|LOCAL_RANK|TORCH_HOME|XDG_CACHE_HOME|"
                           r"PYTORCH_FAIRSEQ_CACHE")
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
    socket.send_fds(connection, [b"\0"], [0])  # the caller's stdin (fairseq-score --sys -)
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
    environment variables that go with it."""
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
    import torch  # noqa: F401  (what every command imports first)
    import torch._dynamo  # noqa: F401  (what torch.optim imports when fairseq-train builds its optimizer: 2 s)

    modules = {name: importlib.import_module(f"fairseq_cli.{name}") for name in COMMANDS}
    start_environment = _read_at_start(os.environ)
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
            _child(connection, modules, start_environment)
        connection.close()
    os.unlink(path)
    os.rmdir(os.path.dirname(path))


def _child(connection, modules, start_environment):
    """Runs one command in this forked child, its output on the connection; never returns."""
    status = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the command's own subprocesses are waited for
        request = _take_request(connection)
        if _read_at_start(os.environ) == start_environment:
            status = _run(modules, request["command"], request["argv"])
        else:  # the server started under other values: the command as installed
            status = subprocess.call([_console_script(request["argv"][0]), *request["argv"][1:]])
    except BaseException:
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


def _take_request(connection):
    """The command's request, read from the connection, and its process as its caller's: the caller's stdin,
    the connection as stdout and stderr, the caller's working folder and environment."""
    _, (stdin,), _, _ = socket.recv_fds(connection, 1, 1)
    with connection.makefile("rb") as stream:
        request = json.loads(stream.readline())
    os.dup2(stdin, 0)
    os.close(stdin)
    os.dup2(connection.fileno(), 1)
    os.dup2(connection.fileno(), 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    return request


def _read_at_start(environment):
    return {name: value for name, value in environment.items() if READ_AT_START.fullmatch(name)}


def _console_script(name):
    return os.path.join(os.path.dirname(sys.executable), name)


def _run(modules, command, argv):
    """The command as its console script runs it, `sys.exit(cli_main())`, to the interpreter's exit; returns its
    exit status."""
    _reseed()
    module = modules[command]
    if command in CONFIGURE_LOGGING:
        module = _imported_again(module)
    sys.argv = argv
    sys.path[0] = os.path.dirname(_console_script(argv[0]))  # a console script's first path: its own folder
    try:
        sys.exit(module.cli_main())
    except SystemExit as stop:
        status = _exit_status(stop)
    except BaseException:
        traceback.print_exc()
        status = 1
    _exit_as_the_interpreter()
    return status


def _reseed():
    """The random states of a new process: numpy's and torch's generators seeded from the system's entropy, as
    each seeds itself when it starts (Python's reseeds itself in a forked child)."""
    import numpy
    import torch

    numpy.random.seed()
    torch.seed()


def _imported_again(module):
    """`module` imported again on an unconfigured root logger, as a new process imports it."""
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    return importlib.reload(module)


def _exit_status(stop):
    """The interpreter's exit status for SystemExit `stop`; a message (a code that is no number) goes to stderr,
    as the interpreter prints it."""
    if stop.code is None or isinstance(stop.code, int):
        return int(stop.code or 0)
    print(stop.code, file=sys.stderr)
    return 1


def _exit_as_the_interpreter():
    """What the interpreter does at exit: waits for the threads that are not daemons, then runs the atexit
    handlers (fairseq closes its TensorBoard writers there)."""
    threading._shutdown()  # the interpreter's own call at exit
    atexit._run_exitfuncs()


if __name__ == "__main__":
    serve(sys.argv[1])
