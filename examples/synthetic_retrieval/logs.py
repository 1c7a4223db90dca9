"""The CSV logs: one file per run, one row per evaluation.

Layout: ``LOG_DIR/setting{1,2}/MODEL/S0040.csv``. A run writes to
``S0040.csv.part`` while it trains and renames it when it stops, so a file
without ``.part`` is a finished run (the sweep skips it) and its last row
carries the stop reason. Every row repeats the run's settings, so files can
be concatenated.
"""
import csv
import glob
import math
import os

SOLVED_LOSS = 1e-3  # the paper's stopping criterion, and what "solved" means

COLUMNS = ("model", "setting", "num_keys", "seq_len", "lr", "batch_size", "seed", "d_key",
           "step", "eval_loss", "train_loss", "wall_s", "stop")
_TYPES = {"setting": int, "num_keys": int, "seq_len": int, "lr": float, "batch_size": int, "seed": int, "d_key": int,
          "step": int, "eval_loss": float, "train_loss": float, "wall_s": float, "stop": str}


def run_path(log_dir, setting, model, num_keys):
    return os.path.join(log_dir, f"setting{setting}", model, f"S{num_keys:04d}.csv")


class RunLog:
    """Writes one run's rows as they come; ``finish()`` publishes the file.

    Use it as a context manager: a run that raises leaves only its ``.part`` file.
    """

    def __init__(self, path, **run_settings):
        self.path = path
        self.run_settings = run_settings
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.file = open(path + ".part", "w", newline="")
        self.writer = csv.DictWriter(self.file, COLUMNS)
        self.writer.writeheader()

    def write(self, evaluation, stop):
        row = dict(self.run_settings, step=evaluation.step, eval_loss=evaluation.eval_loss,
                   train_loss=evaluation.train_loss, wall_s=round(evaluation.wall_s, 3), stop=stop or "")
        self.writer.writerow(row)
        self.file.flush()  # a running sweep can be watched

    def finish(self):
        self.file.close()
        os.replace(self.path + ".part", self.path)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.file.close()


def read_run(path):
    """The rows of one log file, with typed values."""
    with open(path, newline="") as f:
        return [{key: _TYPES.get(key, str)(value) for key, value in row.items()} for row in csv.DictReader(f)]


def read_runs(log_dir):
    """Every finished run under ``log_dir``: {(setting, model, num_keys): rows}."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "setting*", "*", "S*.csv"))):
        rows = read_run(path)
        if rows:
            first = rows[0]
            runs[first["setting"], first["model"], first["num_keys"]] = rows
    return runs


def best_loss(rows):
    """The best evaluation loss of a run (the paper's Figure 2 plots this); NaN if none was finite."""
    return min((row["eval_loss"] for row in rows if math.isfinite(row["eval_loss"])), default=math.nan)


def largest_solved(runs, setting, model, target_loss=SOLVED_LOSS):
    """The largest S whose run reached an evaluation loss <= target (None if none did)."""
    solved = [S for (s, m, S), rows in runs.items() if s == setting and m == model and best_loss(rows) <= target_loss]
    return max(solved, default=None)
