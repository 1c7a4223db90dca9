"""fairseq's command-line tools launched from a process that has imported them once.

Every fairseq-* command spends about 4 s of one core importing torch and fairseq (fairseq imports all its
tasks, and with them scipy and scikit-learn) before it reads its first argument. A run of many short
commands (the test suite, the quickstart) pays that per command. With FAIRSEQ_FWP_PRELOAD=1,
commands.fairseq sends each command to a server that imported torch and fairseq's command-line modules
once (one per calling process, started at its first command) and forks a fresh child per command. The
child is the command as its console script runs it: the module's cli_main(), with the caller's argv, stdin,
stdout, stderr (launch: one pipe for both, as a new process's with stderr=STDOUT), working folder and
environment; the --user-dir is imported in the child, as fairseq-train does; it seeds its random number
generators afresh and exits as the interpreter exits; its caller's Ctrl-C interrupts it (forward) unless its
caller ignores Ctrl-C (a shell's background job), whatever the server started with; and it ends when its
caller goes. A caller whose environment differs from the server's in what a new process reads
at its start (READ_AT_START) gets its command as installed, a new process, and so do commands that must start as
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
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMANDS = ("preprocess", "train", "generate", "eval_lm", "score", "interactive", "validate")
PYTHON = "python"  # `python -m MODULE ...`, `python SCRIPT ...`, `python -c CODE ...`: run_python
# The modules that configure logging first thing when imported (logging.basicConfig before their imports):
# the child runs them again on an unconfigured root logger, as a new process would. The others (whose
# basicConfig comes after fairseq's import, and does nothing) find the root logger as importing fairseq leaves
# it in a new process: some of fairseq's modules configure it when imported (DEBUG, on stderr).
CONFIGURE_LOGGING = ("preprocess", "train", "eval_lm")
# What a new process reads from its environment before the child can take its caller's: the interpreter
# (PYTHON*), the thread pools of OpenMP, MKL and OpenBLAS (loaded with torch and numpy), fairseq when imported
# (LOCAL_RANK, its cache folders, its world size: the device count, which the distributed setup it is held
# to at start-up must match). A caller whose values differ from the server's gets a new process.
READ_AT_START = re.compile(r"(PYTHON|OMP_|MKL_|OPENBLAS_|SLURM_)\w*|LOCAL_RANK|TORCH_HOME|XDG_CACHE_HOME|"
                           r"PYTORCH_FAIRSEQ_CACHE|CUDA_VISIBLE_DEVICES|WORLD_SIZE|RANK|MASTER_(ADDR|PORT)")
_server = {}  # the calling process's server: {"pid": the caller, "path": socket path, "process": Popen}
_server_lock = threading.Lock()


def enabled():
    return os.environ.get("FAIRSEQ_FWP_PRELOAD") == "1"


# -- the caller's side ----------------------------------------------------------------------------------

def launch(command, args, cwd=None):
    """fairseq-<command> args, run by the server: (its output lines, stdout and stderr together, a function
    that returns its exit status once they are read, a function that kills it: the end of its connection)."""
    read, write = os.pipe()
    connection = _request(command, args, cwd, [0, write, write])
    os.close(write)  # the output ends when the command's copies close
    output = open(read, encoding="utf-8", errors="replace")

    def wait():
        with connection, output:
            for _ in output:  # what the caller did not read
                pass
            return _status(connection)

    def stop():
        try:
            connection.shutdown(socket.SHUT_WR)  # the child's follower sees the end, and kills it
        except OSError:  # already ended
            pass
    return output, wait, stop


def forward(command, args):
    """A stand-in for fairseq-<command>'s console script (stand_ins): runs it on the server whose socket
    FAIRSEQ_FWP_PRELOAD_SOCKET names, on this process's stdin, stdout and stderr; returns its exit status, or
    ends this process by the signal that ended the command."""
    # The command may start, and print, before this process waits on it: a Ctrl-C held back until then is the
    # command's too (unblocking raises it in the try below).
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    with _request(command, args, None, [0, 1, 2]) as connection:
        while True:
            try:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
                status = _status(connection)
                break
            except KeyboardInterrupt:  # Ctrl-C: the command's to handle, as its console script's is
                connection.sendall(bytes([signal.SIGINT]))
    if status < 0:  # what a shell reads as 128 + the signal (130 for Ctrl-C)
        if status != -signal.SIGKILL:  # Python's own handler set aside (Ctrl-C's)
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


def run_python(args, cwd=None, env=None, input=None, timeout=None):
    """`python ARGS` (-m MODULE, -c CODE or SCRIPT, then its arguments) as a new interpreter runs it, run by the
    server (no import of torch and fairseq of its own: about 4 s less); a subprocess.CompletedProcess with its
    stdout and stderr apart. env: the environment it runs in (default: this one's); input: its stdin's text."""
    args = [str(arg) for arg in args]
    stdin_read, stdin_write = os.pipe()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    connection = _request(PYTHON, args, cwd, [stdin_read, out_write, err_write], env=env)
    for fd in (stdin_read, out_write, err_write):
        os.close(fd)
    captured = {}

    def read(name, fd):
        with open(fd, encoding="utf-8", errors="replace") as stream:
            captured[name] = stream.read()
    readers = [threading.Thread(target=read, args=pair) for pair in (("stdout", out_read), ("stderr", err_read))]
    for reader in readers:
        reader.start()
    with open(stdin_write, "w") as stdin:
        try:
            stdin.write(input or "")
        except BrokenPipeError:  # it ended without reading its stdin
            pass
    timer = threading.Timer(timeout, lambda: connection.shutdown(socket.SHUT_WR)) if timeout else None
    if timer is not None:
        timer.start()
    with connection:
        for reader in readers:
            reader.join()
        status = _status(connection)
    if timer is not None:
        timer.cancel()
    return subprocess.CompletedProcess([sys.executable, *args], status, captured["stdout"], captured["stderr"])


def run_python_here(args):
    """`python ARGS`, run by the server on this process's stdin, stdout and stderr; returns its exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    with _request(PYTHON, [str(arg) for arg in args], None, [0, 1, 2]) as connection:
        return _status(connection)


def _request(command, args, cwd, fds, env=None):
    """Sends fairseq-<command> args (or `python args`: PYTHON) to the server, to run on `fds` as its stdin, stdout
    and stderr, in `env` (default: this process's environment); returns the connection that then gives its exit
    status (_status) and outlives it (the child ends when it closes)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(_server_path())
    socket.send_fds(connection, [b"\0"], fds)
    program = PYTHON if command == PYTHON else f"fairseq-{command}"
    request = dict(command=command.replace("-", "_"), argv=[program, *args],
                   cwd=os.path.abspath(cwd or os.getcwd()), env=dict(os.environ if env is None else env),
                   ignores_ctrl_c=signal.getsignal(signal.SIGINT) == signal.SIG_IGN)
    connection.sendall(json.dumps(request).encode() + b"\n")
    return connection


def _status(connection):
    """The command's exit status once it ends (negative: the signal that killed it)."""
    with connection.makefile("rb") as stream:
        reply = stream.read()
    return int(reply) if reply else -signal.SIGKILL  # the child died without saying how (killed, crashed)


def stand_ins(folder, commands=("preprocess", "train", "generate", "eval-lm", "interactive", "validate"),
              python=True):
    """Writes fairseq-<command> scripts into `folder` that run their command on this process's server
    (forward), and with `python` a `python` that runs `python -m MODULE ...` and `python SCRIPT ...` there
    (run_python_here; anything else as the interpreter itself): a folder to put first on PATH, for commands run by
    other programs (bash). Returns the environment variables that go with it."""
    os.makedirs(folder, exist_ok=True)
    scripts = {f"fairseq-{command}": f"from examples.recipes.preloaded import forward\n"
                                     f"sys.exit(forward({command!r}, sys.argv[1:]))\n" for command in commands}
    if python:
        scripts["python"] = (f"from examples.recipes.preloaded import _runs_here, run_python_here\n"
                             f"if not _runs_here(sys.argv[1:]):\n    os.execv({sys.executable!r}, [{sys.executable!r}, "
                             f"*sys.argv[1:]])\nsys.exit(run_python_here(sys.argv[1:]))\n")
    for name, body in scripts.items():
        script = os.path.join(folder, name)
        with open(script, "w") as f:
            f.write(f"#!{sys.executable}\nimport os, sys\nsys.path.insert(0, {ROOT!r})\n{body}")
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

    import fairseq  # noqa: F401  (on the unconfigured root logger, as a new process's first fairseq import)

    after_fairseq = _root_logger()
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
            _child(connection, modules, start_environment, after_fairseq)
        connection.close()
    os.unlink(path)
    os.rmdir(os.path.dirname(path))


def _child(connection, modules, start_environment, after_fairseq):
    """Runs one command in this forked child, its output on the connection; never returns."""
    status = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the command's own subprocesses are waited for
        request = _take_request(connection)
        _follow_caller(connection)
        argv = request["argv"]
        if request["command"] == PYTHON and _read_at_start(os.environ) == start_environment and _runs_here(argv[1:]):
            status = _run_python(argv[1:], after_fairseq)
        elif request["command"] == PYTHON:  # interpreter options, or another start-up environment: a new one
            status = _call([sys.executable, *argv[1:]])
        elif _read_at_start(os.environ) == start_environment:
            status = _run(modules, request["command"], argv, after_fairseq)
        else:  # the server started under other values: the command as installed
            status = _call([_console_script(argv[0]), *argv[1:]])
    except BaseException as error:  # a Ctrl-C before the command's own code runs (forward) among them
        status = _uncaught(error)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        try:
            connection.sendall(f"{status}\n".encode())
        finally:
            os._exit(status)


def _take_request(connection):
    """The command's request, read from the connection, and its process as its caller's: the caller's stdin,
    stdout and stderr, working folder, environment and Ctrl-C (ignored where the caller's is, as a new process
    inherits it, else Python's KeyboardInterrupt)."""
    _, fds, _, _ = socket.recv_fds(connection, 1, 3)
    # unbuffered, so as not to read ahead: what follows the request is the caller's Ctrl-C (_follow_caller)
    with connection.makefile("rb", buffering=0) as stream:
        request = json.loads(stream.readline())
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=sys.stdout.isatty())  # as a new process buffers this stdout
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.SIG_IGN if request["ignores_ctrl_c"] else signal.default_int_handler)
    return request


def _follow_caller(connection):
    """While the command runs, a byte from its caller is a signal for it (Ctrl-C: forward), and the
    connection's end (the caller killed) ends it: it runs for its caller alone."""
    main = threading.get_ident()

    def follow():
        try:
            for signum in iter(lambda: connection.recv(1), b""):
                signal.pthread_kill(main, signum[0])  # the main thread's: its wait breaks, as a console script's
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=follow, daemon=True).start()


def _call(argv):
    """The command as installed, a new process, which the caller's Ctrl-C reaches (_follow_caller)."""
    with subprocess.Popen(argv) as process:
        while True:
            try:
                return process.wait()
            except KeyboardInterrupt:
                process.send_signal(signal.SIGINT)


def _read_at_start(environment):
    return {name: value for name, value in environment.items() if READ_AT_START.fullmatch(name)}


def _console_script(name):
    return os.path.join(os.path.dirname(sys.executable), name)


def _run(modules, command, argv, after_fairseq):
    """The command as its console script runs it, `sys.exit(cli_main())`, to the interpreter's exit; returns its
    exit status. `after_fairseq`: the root logger as importing fairseq left it (_root_logger)."""
    _reseed()
    module = modules[command]
    if command in CONFIGURE_LOGGING:
        module = _imported_again(module)
    else:
        _set_root_logger(after_fairseq)
    sys.argv = argv
    sys.path[0] = os.path.dirname(_console_script(argv[0]))  # a console script's first path: its own folder
    return _to_its_exit(lambda: sys.exit(module.cli_main()))


def _runs_here(args):
    """Whether `python ARGS` is one that _run_python runs: a module, code or a script, no interpreter options."""
    return bool(args) and (args[0] in ("-m", "-c") and len(args) > 1 or not args[0].startswith("-"))


def _run_python(args, after_fairseq):
    """`python ARGS` as the interpreter runs it, to its exit (a module's or a script's __main__, with sys.argv and
    sys.path[0] as the interpreter sets them); returns its exit status. The root logger: as importing fairseq left
    it, which every program here imports (the server imported it once)."""
    _reseed()
    _set_root_logger(after_fairseq)

    def program():
        if args[0] == "-m":
            sys.argv, sys.path[0] = [args[1], *args[2:]], os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *args[2:]], ""
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv, sys.path[0] = list(args), os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    return _to_its_exit(program)


def _to_its_exit(program):
    """Runs program() as the interpreter runs a program, to its exit (SystemExit's status, or an uncaught error's
    traceback and status), and ends as the interpreter does; returns the exit status."""
    try:
        program()
        status = 0
    except SystemExit as stop:
        status = _exit_status(stop)
    except BaseException as error:
        status = _uncaught(error)
    _exit_as_the_interpreter()
    return status


def _uncaught(error):
    """Prints the traceback of `error`, uncaught, and returns the interpreter's exit status for it: killed by
    Ctrl-C's signal for a KeyboardInterrupt (a shell's 130), else 1."""
    traceback.print_exc()
    return -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1


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


def _root_logger():
    """The root logger's level and handlers (what logging.basicConfig sets)."""
    return logging.root.level, list(logging.root.handlers)


def _set_root_logger(saved):
    level, handlers = saved
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    for handler in handlers:
        logging.root.addHandler(handler)
    logging.root.setLevel(level)


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
