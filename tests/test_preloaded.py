"""examples/recipes/preloaded.py: a fairseq command run by the preloaded server is the command its console
script runs: the same output, exit status, files, working folder and environment. The first test runs
fairseq-train and fairseq-generate as installed (new processes of the console scripts) in the fast lane too."""
import contextlib
import os
import re
import signal
import struct
import subprocess
import sys

import pytest

from examples.recipes import commands, preloaded
from examples.recipes.pipeline import train_translation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def launches(monkeypatch):
    """Runs `fairseq(...)` once as a new process and once through the server: (new, preloaded) outputs."""
    def both(*args, **kwargs):
        outputs = []
        for mode in ("0", "1"):
            monkeypatch.setenv("FAIRSEQ_FWP_PRELOAD", mode)
            outputs.append(commands.fairseq(*args, **kwargs))
        return outputs
    return both


def user_dir(folder, code):
    """A --user-dir whose import runs `code`: a probe of the process that runs the command."""
    folder.mkdir()
    (folder / "__init__.py").write_text(code)
    return folder


def probe_lines(output, prefix="probe"):
    return [line for line in output.splitlines() if line.startswith(prefix)]


def tensorboard_scalars(folder):
    """(subset, tag, step) of every scalar in the TensorBoard event files under `folder`, sorted (fairseq writes
    an update's in the order of a set); the files are TFRecords: a length and its checksum, an Event, its
    checksum."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = []
    for path in sorted(folder.rglob("events.out.tfevents*")):
        data = path.read_bytes()
        while data:
            length = struct.unpack("<Q", data[:8])[0]
            event = Event.FromString(data[12:12 + length])
            scalars += [(path.parent.name, value.tag, event.step) for value in event.summary.value]
            data = data[12 + length + 4:]
    return sorted(scalars)


def test_train_and_generate_log_write_and_print_the_same_either_way(corpora, tmp_path, monkeypatch):
    """fairseq-train: each log line's level, logger and words, in order (it configures logging when imported),
    the checkpoints' names and the TensorBoard scalars (which it writes out at exit); fairseq-generate: the
    hypotheses; fairseq-interactive and fairseq-validate, which configure logging when
    imported too: their log lines and outputs. As installed, each is a new process of its console script, in the
    fast lane too."""
    logs, checkpoints, scalars, hypotheses, interactive, validated = [], [], [], [], [], []
    with open(f"{corpora['raw_mt']}/test.src") as test:
        (tmp_path / "input.txt").write_text("".join(" ".join(line.split()[:5]) + "\n" for line in test.readlines()[:3]))
    for mode in ("0", "1"):
        monkeypatch.setenv("FAIRSEQ_FWP_PRELOAD", mode)
        run = tmp_path / mode
        logs.append(train_translation(corpora["mt"], run / "checkpoints", "--tensorboard-logdir", run / "tensorboard",
                                      max_update=2))
        checkpoints.append(sorted(os.listdir(run / "checkpoints")))
        scalars.append(tensorboard_scalars(run / "tensorboard"))
        checkpoint = tmp_path / "0" / "checkpoints" / "checkpoint_last.pt"
        generated = commands.fairseq("generate", corpora["mt"], "--user-dir", commands.PLUGIN_DIR, "--path",
                                     checkpoint, "--beam", 2, "--max-len-b", 5)
        hypotheses.append([line for line in generated.splitlines() if line.startswith("H-")])
        output = commands.fairseq("interactive", corpora["mt"], "--user-dir", commands.PLUGIN_DIR, "--path",
                                  checkpoint, "--beam", 2, "--max-len-b", 5, "--source-lang", "src", "--target-lang",
                                  "tgt", "--input", tmp_path / "input.txt")
        interactive.append((comparable(output, tmp_path), [line for line in output.splitlines() if line[:2] in ("H-", "S-")]))
        validated.append(comparable(commands.fairseq("validate", corpora["mt"], "--user-dir", commands.PLUGIN_DIR,
                                                     "--path", checkpoint, "--task", "translation", "--batch-size", 8), tmp_path))
    lines = [comparable(log, tmp_path / mode) for log, mode in zip(logs, ("0", "1"))]
    assert len(lines[0]) > 10 and lines[0] == lines[1]
    assert any("loss=" in message for _, logger, message in lines[0] if logger == "train_inner")
    assert checkpoints[0] and checkpoints[0] == checkpoints[1]
    assert scalars[0] and scalars[0] == scalars[1]
    assert hypotheses[0] and hypotheses[0] == hypotheses[1]
    assert len(interactive[0][1]) == 6 and interactive[0] == interactive[1]
    assert any("valid on 'valid' subset" in message for _, _, message in validated[0]) and validated[0] == validated[1]


# What differs between two runs of one command: how long things took, and where each run writes.
TIMINGS = re.compile(r"\b(wps|ups|train_wall|wall|gb_free|time:)([= ])[\d.]+|\b(took|in|time:) [\d.]+ seconds")


def comparable(log, run_folder):
    """Each log line's level, logger and message (in fairseq's format, or in Python's default one: where fairseq's
    own imports configure logging first), its timings and its run's folder masked: the losses, sizes, counts and
    every other number stay as logged."""
    lines = re.findall(r"^(?:\S+ \S+ \| (\w+) \| ([\w.]+) \| |(DEBUG|INFO|WARNING|ERROR):([\w.]+):)(.*)$", log,
                       re.MULTILINE)
    lines = [(level or default_level, logger or default_logger, message)
             for level, logger, default_level, default_logger, message in lines]
    mask = lambda m: f"{m.group(1)}{m.group(2)}*" if m.group(1) else f"{m.group(3)} * seconds"  # noqa: E731
    return [(level, logger, TIMINGS.sub(mask, message.replace(str(run_folder), "RUN")))
            for level, logger, message in lines]


def test_comparable_log_lines_keep_every_number_but_timings():
    log = ("2026-11-27 09:19:11 | INFO | train_inner | epoch 001:      2 / 3 loss=6.717, wps=6090.9, ups=3.51, "
           "num_updates=2, train_wall=0, wall=2\n2026-11-27 09:19:11 | INFO | fairseq_cli.train | done training in "
           "0.5 seconds\n")
    assert comparable(log, "/x") == [
        ("INFO", "train_inner", "epoch 001:      2 / 3 loss=6.717, wps=*, ups=*, num_updates=2, train_wall=*, wall=*"),
        ("INFO", "fairseq_cli.train", "done training in * seconds")]


@pytest.mark.slow
def test_a_failing_command_fails_the_same_way(tmp_path, monkeypatch):
    for mode in ("0", "1"):
        monkeypatch.setenv("FAIRSEQ_FWP_PRELOAD", mode)
        with pytest.raises(RuntimeError, match=r"fairseq-train failed \(2\):[\s\S]*--fwp-update-rule"):
            commands.fairseq("train", tmp_path, "--user-dir", commands.PLUGIN_DIR, "--arch", "fwp_lm_tiny",
                             "--task", "language_modeling", "--fwp-update-rule", "no-such-rule")


@pytest.mark.slow
def test_a_command_stopped_with_a_message_prints_it(tmp_path, monkeypatch):
    """SystemExit("...") ends the command with status 1 and the message on stderr, as the interpreter ends."""
    probe = user_dir(tmp_path / "probe", "raise SystemExit('probe: no data here')\n")
    for mode in ("0", "1"):
        monkeypatch.setenv("FAIRSEQ_FWP_PRELOAD", mode)
        with pytest.raises(RuntimeError, match=r"fairseq-generate failed \(1\):\s*probe: no data here"):
            commands.fairseq("generate", "--user-dir", probe)


@pytest.mark.slow
def test_a_command_reads_its_callers_stdin(tmp_path):
    """fairseq-score --sys - scores what its caller's stdin holds."""
    reference = tmp_path / "reference.txt"
    reference.write_text("a small red car drives home\n")
    caller = ("import sys\nfrom examples.recipes.commands import fairseq\n"
              "print(fairseq('score', '--sys', '-', '--ref', sys.argv[1]))\n")
    scores = []
    for mode in ("0", "1"):
        run = subprocess.run([sys.executable, "-c", caller, reference], input=reference.read_text(), cwd=ROOT,
                             env=dict(os.environ, FAIRSEQ_FWP_PRELOAD=mode), capture_output=True, text=True)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        scores.append(re.findall(r"BLEU4 = .*", run.stdout))
    assert scores[0] and scores[0] == scores[1]


# Draws from the random number generators, then leaves a thread and an atexit handler to end the process: the
# thread prints once the interpreter's exit has begun (it joins the main thread), which it must wait for.
DRAWS_AND_EXITS = """
import atexit, random, threading
import numpy, torch
print("probe draws:", random.random(), numpy.random.random(), torch.rand(1).item())
threading.Thread(target=lambda: (threading.main_thread().join(), print("probe: a thread's last line"))).start()
atexit.register(print, "probe: at exit")
"""


@pytest.mark.slow
def test_each_command_draws_its_own_random_numbers_and_exits_as_a_new_process(tmp_path, launches):
    """Python's, numpy's and torch's generators: two commands draw different numbers where two new processes
    do; at exit the interpreter waits for the threads and runs the atexit handlers (loggers flush there)."""
    command = ("train", "--user-dir", user_dir(tmp_path / "probe", DRAWS_AND_EXITS), "--help")
    (new, served), (new_again, served_again) = launches(*command), launches(*command)
    draws = [probe_lines(out, "probe draws:")[0].split()[2:] for out in (new, new_again, served, served_again)]
    assert [a != b for a, b in zip(*draws[2:])] == [a != b for a, b in zip(*draws[:2])] == [True] * 3
    exits = [probe_lines(out, "probe:") for out in (new, served)]
    assert len(exits[0]) == 2 and exits[0] == exits[1]


def set_environment(monkeypatch, **variables):
    """Sets each variable, or removes it where its value is None."""
    for name, value in variables.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


# What the interpreter, the thread pools (torch's, and numpy's OpenBLAS) and fairseq read when they start, and
# who started this process.
READS_AT_START = """
import os
import threadpoolctl, torch
from fairseq import file_utils
from fairseq.dataclass.configs import DistributedTrainingConfig
print("probe:", hash("probe"), torch.get_num_threads(), sorted((pool["internal_api"], pool["num_threads"])
      for pool in threadpoolctl.threadpool_info()), DistributedTrainingConfig().device_id,
      file_utils.PYTORCH_FAIRSEQ_CACHE)
print("parent:", os.getppid())
"""


@pytest.mark.slow
def test_a_caller_whose_start_up_environment_differs_gets_what_a_new_process_gets(tmp_path, monkeypatch,
                                                                                 launches, own_server):
    """The hash seed, the thread count, LOCAL_RANK and fairseq's cache are read before the child can take the
    caller's environment: a caller that differs from the server there gets a new process, the rest a fork."""
    command = ("train", "--user-dir", user_dir(tmp_path / "probe", READS_AT_START), "--help")
    set_environment(monkeypatch, FAIRSEQ_FWP_PRELOAD="1", PYTHONHASHSEED="1", OMP_NUM_THREADS="1", LOCAL_RANK="1",
                    PYTORCH_FAIRSEQ_CACHE=str(tmp_path / "cache-1"))
    assert probe_lines(commands.fairseq(*command), "parent:") == [f"parent: {own_server['process'].pid}"]
    set_environment(monkeypatch, PYTHONHASHSEED="2", OMP_NUM_THREADS=None, LOCAL_RANK="2",
                    PYTORCH_FAIRSEQ_CACHE=str(tmp_path / "cache-2"))
    new, served = launches(*command)
    assert probe_lines(new) == probe_lines(served)


@pytest.mark.slow
def test_the_child_has_the_callers_folder_and_environment(tmp_path, monkeypatch, corpora):
    """fairseq-preprocess writes where the caller stands, and the caller's variables reach the command's
    --user-dir, imported in the child as fairseq-train imports it."""
    monkeypatch.setenv("FAIRSEQ_FWP_PRELOAD", "1")
    monkeypatch.setenv("PROBE_VARIABLE", "seen")
    monkeypatch.chdir(tmp_path)
    out = commands.fairseq("preprocess", "--only-source", "--trainpref", os.path.join(corpora["raw_lm"], "train.txt"),
                           "--destdir", "here", "--workers", 1)
    assert (tmp_path / "here" / "dict.txt").is_file() and "Wrote preprocessed data" in out
    probe = user_dir(tmp_path / "probe", "import os\nprint('probe:', os.environ['PROBE_VARIABLE'], os.getcwd())\n")
    lines, wait, _ = preloaded.launch("train", ["--user-dir", str(probe), "--help"])
    assert f"probe: seen {tmp_path}" in "".join(lines) and wait() == 0
    lines, wait, _ = preloaded.launch("train", ["--user-dir", str(tmp_path / "nowhere")])
    assert wait() != 0  # fails the command, not the server
    lines, wait, _ = preloaded.launch("preprocess", ["--help"])
    assert "usage: fairseq-preprocess" in "".join(lines) and wait() == 0


@pytest.mark.slow
def test_a_stand_in_on_path_runs_its_command_on_the_server(tmp_path, monkeypatch):
    """What bash runs as fairseq-preprocess is the command, its output and exit status included."""
    monkeypatch.delenv("FAIRSEQ_FWP_PRELOAD_SOCKET", raising=False)
    env = dict(os.environ, **preloaded.stand_ins(str(tmp_path / "bin")))
    env["PATH"] = os.pathsep.join([str(tmp_path / "bin"), env["PATH"]])
    ok = subprocess.run(["bash", "-c", "fairseq-preprocess --help | head -1"], env=env, capture_output=True, text=True)
    assert ok.stdout.startswith("usage: fairseq-preprocess") and ok.returncode == 0
    failed = subprocess.run(["bash", "-c", "fairseq-train --user-dir nowhere"], env=env, cwd=tmp_path,
                            capture_output=True, text=True)
    assert failed.returncode != 0 and "nowhere" in failed.stderr


@pytest.fixture
def train_scripts(tmp_path):
    """fairseq-train as installed (a new process) and its stand-in (a fork of the server), and the environment that
    runs both."""
    env = dict(os.environ, **preloaded.stand_ins(str(tmp_path / "bin"), commands=("train",)))
    return [preloaded._console_script("fairseq-train"), str(tmp_path / "bin" / "fairseq-train")], env


@pytest.mark.slow
def test_stdout_and_stderr_stay_apart(tmp_path, train_scripts):
    """`fairseq-train ... 2>/dev/null` prints the command's stdout alone, forked as installed."""
    probe = user_dir(tmp_path / "probe", "import sys\nprint('probe: out')\nprint('probe: err', file=sys.stderr)\n")
    scripts, env = train_scripts
    runs = [subprocess.run([script, "--user-dir", probe, "--help"], env=env, capture_output=True, text=True)
            for script in scripts]
    assert [(probe_lines(run.stdout), probe_lines(run.stderr), run.returncode) for run in runs] == [
        (["probe: out"], ["probe: err"], 0)] * 2


def test_the_devices_and_the_distributed_setup_are_read_at_start():
    """fairseq's world size defaults to the device count at import: a caller with other devices or another
    distributed setup gets a new process."""
    names = ["CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "LOCAL_RANK"]
    assert list(preloaded._read_at_start(dict.fromkeys([*names, "PATH", "RANKS"], "1"))) == names


@pytest.mark.slow
def test_output_that_ends_without_a_newline_keeps_its_exit_status(tmp_path, launches):
    probe = user_dir(tmp_path / "probe", "import atexit, sys\natexit.register(sys.stdout.write, 'probe: no newline')\n")
    new, served = launches("train", "--user-dir", probe, "--help")
    assert new.endswith("\nprobe: no newline") and served == new


@contextlib.contextmanager
def ctrl_c(handler):
    """This process's Ctrl-C handler while the block runs, as the processes it starts inherit it: SIG_IGN (a
    shell's background job; pytest itself may have been started so) or Python's KeyboardInterrupt."""
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# Says how the command takes a Ctrl-C.
TAKES_CTRL_C = "import signal\nprint('probe:', repr(signal.getsignal(signal.SIGINT)))\n"


@pytest.mark.slow
def test_the_command_takes_ctrl_c_as_its_caller_does(tmp_path, own_server):
    """A new process inherits an ignored Ctrl-C (a shell's background job), else takes it as a KeyboardInterrupt;
    so does the child, whichever way its server started (here, ignoring it)."""
    probe = user_dir(tmp_path / "probe", TAKES_CTRL_C)
    with ctrl_c(signal.SIG_IGN):
        preloaded._server_path()  # this test's own server starts here
    for caller in (signal.SIG_IGN, signal.default_int_handler):
        with ctrl_c(caller):
            output, wait, _ = preloaded.launch("train", ["--user-dir", str(probe), "--help"])
            assert probe_lines(output.read()) == [f"probe: {caller!r}"] and wait() == 0


# Says that the command runs, then waits for a signal (or ends by itself, with fairseq-train's --help, after 30 s).
SLEEPS = "import time\nprint('probe: sleeps', flush=True)\ntime.sleep(30)\n"


def start_sleeping(script, probe, env):
    """`script` on the SLEEPS probe as a terminal's foreground job (its Ctrl-C not ignored), returned once the
    command runs the probe."""
    with ctrl_c(signal.default_int_handler):
        process = subprocess.Popen([script, "--user-dir", probe, "--help"], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
    ready = process.stdout.readline()
    if ready != "probe: sleeps\n":
        process.kill()
        pytest.fail(f"{script} never ran the probe: {ready!r}, then {process.communicate()}")
    return process


@pytest.mark.slow
def test_ctrl_c_interrupts_the_command_as_its_console_script(tmp_path, train_scripts):
    """SIGINT to fairseq-train: the command's KeyboardInterrupt, its traceback (the probe interrupted, in its
    print or its sleep), and death by SIGINT (a shell's 130)."""
    probe = user_dir(tmp_path / "probe", SLEEPS)
    scripts, env = train_scripts
    for script in scripts:
        process = start_sleeping(script, probe, env)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
        innermost = re.findall(r'File "(.*)"', err)[-1:]
        assert (process.returncode, innermost, err.splitlines()[-1:]) == (
            -signal.SIGINT, [str(probe / "__init__.py")], ["KeyboardInterrupt"]), f"{script}'s stderr:\n{err[-3000:]}"


# A stand-in (forward) that gets a Ctrl-C the moment its command has gone out, before it waits on the command.
CTRL_C_AS_THE_COMMAND_GOES_OUT = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from examples.recipes import preloaded
send = preloaded._request
def send_then_ctrl_c(*args):
    connection = send(*args)
    os.kill(os.getpid(), signal.SIGINT)
    return connection
preloaded._request = send_then_ctrl_c
preloaded.forward("train", sys.argv[2:])
"""


@pytest.mark.slow
def test_a_ctrl_c_before_the_stand_in_waits_is_the_commands(tmp_path, train_scripts):
    """The command may start (and print) before its stand-in waits on it: a Ctrl-C then is the command's, as a
    Ctrl-C at a console script's start is the script's: the command's traceback, none of the stand-in's."""
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(CTRL_C_AS_THE_COMMAND_GOES_OUT)
    _, env = train_scripts
    with ctrl_c(signal.default_int_handler):
        run = subprocess.run([sys.executable, stand_in, ROOT, "--user-dir", user_dir(tmp_path / "probe", SLEEPS),
                              "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stderr.splitlines()[-1:], str(stand_in) in run.stderr) == (
        -signal.SIGINT, ["KeyboardInterrupt"], False), run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
def test_a_command_ends_with_its_killed_caller(tmp_path, train_scripts, stop):
    scripts, env = train_scripts
    process = start_sleeping(scripts[1], user_dir(tmp_path / "probe", SLEEPS), env)
    process.send_signal(stop)
    process.wait()
    # The caller's stdout is the command's: it ends when the command ends, or the command goes on to its --help.
    rest = process.stdout.read()
    assert rest == "", f"the command outlived its caller: {rest[:300]!r}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["0", "1"])
def test_a_command_past_its_time_limit_is_stopped(tmp_path, monkeypatch, mode):
    """commands.completed(timeout=...) kills a command that runs past it, a new process or the server's child, and
    gives what it printed with the signal that ended it."""
    import time

    monkeypatch.setenv("FAIRSEQ_FWP_PRELOAD", mode)
    probe = user_dir(tmp_path / "probe", SLEEPS)
    began = time.time()
    # A new process imports torch and fairseq first: on a busy 2-core machine that alone can take seconds.
    limit = {"0": 10, "1": 5}[mode]
    status, output = commands.completed("train", "--user-dir", probe, "--help", timeout=limit)
    assert status == -signal.SIGKILL and "probe: sleeps" in output and time.time() - began < limit + 10


@pytest.mark.slow
def test_python_run_by_the_server_is_the_interpreters(tmp_path, monkeypatch):
    """commands.python: `python -c CODE`, `python -m MODULE` and `python SCRIPT` with their arguments, stdin, stdout,
    stderr, exit status, sys.argv and working folder, as a new interpreter runs them."""
    script = tmp_path / "script.py"
    script.write_text("import os, sys\nprint(sys.argv[1:], os.path.basename(os.getcwd()), sys.path[0] == os.path.dirname("
                      "os.path.abspath(__file__)))\nsys.exit(2)\n")
    runs = []
    for mode in ("0", "1"):
        monkeypatch.setenv("FAIRSEQ_FWP_PRELOAD", mode)
        code = commands.python("-c", "import sys; print(sys.argv); print('to stderr', file=sys.stderr); "
                                     "sys.exit(int(sys.stdin.read()))", "a", "b", input="3", cwd=tmp_path)
        module = commands.python("-m", "json.tool", input='{"b": 1, "a": [2]}')
        ran = commands.python(script, "x", cwd=tmp_path)
        runs.append([(run.returncode, run.stdout, run.stderr) for run in (code, module, ran)])
    assert runs[0] == runs[1]
    assert runs[0][0] == (3, "['-c', 'a', 'b']\n", "to stderr\n") and runs[0][2][0] == 2
