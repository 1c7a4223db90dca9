"""fairseq's own options, as its tools declare them: what the option contract (test_fairseq_options.py) draws.

Each scenario is a fairseq tool run on one of the plugin's models (SCENARIOS: fairseq-generate, -interactive,
-eval-lm, -validate and -train, on translation and language models). Its options are read from the tool's own
parser after fairseq has added those of the scenario's task (and, for training, of the model and every
registry's choice), with each option's kind, type and choices; a draw is a few of them with values of their
kind. What cannot be drawn here is NOT_DRAWN, each with why: options that need the network, other machines,
GPUs or a TPU, that name the files a scenario gives itself, or that start other processes.

A run's verdict (verdict): it ran (exit status 0), or it was refused naming one of the drawn options (the last
line of its output, and nothing generated before it), or it failed: a traceback or an error that names none
of them, or no end within TIME_LIMIT.
"""
import argparse
import dataclasses
import functools
import re
from typing import Optional, Tuple

from hypothesis import strategies as st

TIME_LIMIT = 60

# Options that no draw here can run, by why: they reach beyond this machine, or take the files and processes
# the scenario sets itself.
NOT_DRAWN = {
    "the network or services": ("--wandb-project", "--azureml-logging", "--aim-repo", "--aim-run-hash",
                                "--use-plasma-view", "--plasma-path"),
    "GPUs, a TPU or other machines": ("--tpu", "--distributed-world-size", "--distributed-num-procs",
                                      "--distributed-rank", "--distributed-backend", "--distributed-init-method",
                                      "--distributed-port", "--device-id", "--distributed-no-spawn",
                                      "--nprocs-per-node", "--pipeline-model-parallel", "--pipeline-balance",
                                      "--pipeline-devices", "--pipeline-chunks", "--pipeline-encoder-balance",
                                      "--pipeline-encoder-devices", "--pipeline-decoder-balance",
                                      "--pipeline-decoder-devices", "--pipeline-checkpoint", "--model-parallel-size",
                                      "--fp16", "--memory-efficient-fp16", "--amp", "--profile",
                                      "--zero-sharding", "--ddp-backend", "--ddp-comm-hook", "--bucket-cap-mb",
                                      "--fix-batches-to-gpus", "--find-unused-parameters", "--fast-stat-sync",
                                      "--heartbeat-timeout", "--broadcast-buffers", "--slowmo-momentum",
                                      "--slowmo-base-algorithm", "--localsgd-frequency", "--cpu-offload",
                                      "--use-sharded-state", "--not-fsdp-flatten-parameters", "--fp32-reduce-scatter",
                                      "--no-reshard-after-forward", "--gradient-as-bucket-view"),
    "the scenario's own files, task and model": ("--user-dir", "--path", "--task", "--arch", "-a", "--input",
                                                  "--save-dir", "--restore-file", "--finetune-from-model",
                                                  "--results-path", "--log-file", "--tensorboard-logdir",
                                                  "--quantization-config-path", "--gen-subset", "--train-subset",
                                                  "--valid-subset", "--combine-valid-subsets", "--dataset-impl",
                                                  "--source-lang", "--target-lang", "-s", "-t",
                                                  "--checkpoint-shard-count", "--checkpoint-suffix",
                                                  "--load-checkpoint-on-all-dp-ranks", "--num-workers",
                                                  "--empty-cache-freq", "--write-checkpoints-asynchronously",
                                                  "--teacher-checkpoint", "--fwp-session-file"),
    "a help": ("-h", "--help"),
}
SKIPPED = {flag for flags in NOT_DRAWN.values() for flag in flags}


@dataclasses.dataclass(frozen=True)
class Option:
    flag: str
    kind: str  # "switch" (takes no value), "choice", "int", "float", "string", "optional" (a value or none)
    choices: Tuple[str, ...] = ()
    default: Optional[str] = None


def _kind(action):
    if action.nargs == 0:
        return "switch"
    if action.choices:
        return "choice"
    if action.nargs == "?":
        return "optional"
    return {int: "int", float: "float"}.get(action.type, "string")


def options_of(parser):
    """Every option `parser` declares that a draw may take (not NOT_DRAWN), as Options."""
    found = {}
    for action in parser._actions:
        flags = [flag for flag in action.option_strings if flag.startswith("--")]
        if not flags or any(flag in SKIPPED for flag in action.option_strings) or action.help == argparse.SUPPRESS \
                and not flags[0].startswith("--fwp-"):
            continue
        default = action.default if isinstance(action.default, (str, int, float)) and \
            not isinstance(action.default, bool) else None
        found[flags[0]] = Option(flags[0], _kind(action), tuple(map(str, action.choices or ())),
                                 None if default is None else str(default))
    return tuple(found[flag] for flag in sorted(found))


@functools.lru_cache(maxsize=None)
def tool_options(tool, args):
    """The Options of fairseq-<tool> given `args` (its data, task, model: what adds their options)."""
    from fairseq import options

    parser = {"generate": options.get_generation_parser, "interactive": options.get_interactive_generation_parser,
              "eval-lm": options.get_eval_lm_parser, "validate": options.get_validation_parser,
              "train": options.get_training_parser}[tool]()
    options.parse_args_and_arch(parser, list(args), parse_known=True)
    return options_of(parser)


# Options whose value is a file of the scenario's (FILES: the keys of test_fairseq_options.files)
FILES = {"--lm-path": "lm_model"}


def values(option, files=None):
    """A strategy of the command-line words for `option`: its flag and a value of its kind (`files`: the scenario's
    files, for an option that names one)."""
    flag = [option.flag]
    if option.flag in FILES:
        return st.just(flag + [str(files[FILES[option.flag]])])
    if option.kind == "switch":
        return st.just(flag)
    if option.kind == "choice":
        return st.sampled_from(option.choices).map(lambda choice: flag + [choice])
    if option.kind == "optional":
        return st.one_of(st.just(flag), *([st.just(flag + [option.default])] if option.default else []))
    if option.kind == "int":
        return st.sampled_from([0, 1, 2, 3, 8]).map(lambda value: flag + [str(value)])
    if option.kind == "float":
        return st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0]).map(lambda value: flag + [str(value)])
    # a string without choices: its default given explicitly, where it has one (paths, expressions and names
    # have no value to draw but their own)
    return st.just(flag + [option.default]) if option.default else st.nothing()


def drawable(options):
    """The options that have values to draw."""
    return [option for option in options if option.kind != "string" or option.default]


# What a program raises only by mistake: a traceback that ends in one is a crash, whatever its message says.
CRASHES = ("AttributeError", "IndexError", "KeyError", "TypeError", "NameError", "UnboundLocalError",
           "ZeroDivisionError", "RecursionError", "UnicodeDecodeError", "OverflowError", "FloatingPointError")


def verdict(status, output, drawn):
    """"ran", "refused" (naming one of the `drawn` flags, before anything was generated) or "failed: ..."."""
    if status == 0:
        return "ran"
    if status < 0:
        return f"failed: ended by signal {-status} (past {TIME_LIMIT} s, or killed)"
    lines = [line for line in output.strip().splitlines() if line.strip()]
    message = lines[-1] if lines else ""
    if "Traceback (most recent call last)" in output and message.split(":")[0].split(".")[-1] in CRASHES:
        return f"failed: a crash: {message[:300]}"
    named = [flag for flag in drawn if re.search(rf"{re.escape(flag)}\b|\b{flag[2:].replace('-', '_')}\b", message)]
    if not named:
        return f"failed: {message[:300]}"
    if re.search(r"^[HP]-\d", output, re.M):
        return f"failed: refused ({message[:200]}) after generating"
    return "refused"
