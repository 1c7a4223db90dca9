import os
import shutil
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repo: tests run without `pip install -e .`

# Without a GPU, fla's Triton kernels run through Triton's CPU interpreter
# (tests/test_fla_interpreted.py). Triton reads this when a kernel is defined,
# so it must be set before fla (and with it triton) is first imported. With a
# GPU, fla's tests run its real kernels, and the GPU check runs the interpreted
# ones in a process of their own.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Side by side (pytest-xdist, one worker per core: scripts/test.sh), every worker and every fairseq
# command it starts computes on one thread: two workers of two threads on two cores wait on each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# The fairseq commands that tests launch through examples/recipes/commands.py run as children of a server
# that imported fairseq once (examples/recipes/preloaded.py): about 4 s less per command. The docs test sends
# its commands there too, through stand-ins of the console scripts on PATH. tests/test_preloaded.py holds the
# two launches to the same output; its first test, in the fast lane too, runs fairseq-train and
# fairseq-generate as installed (new processes of the console scripts).
os.environ.setdefault("FAIRSEQ_FWP_PRELOAD", "1")


def pytest_collection_modifyitems(config, items):
    """The GPU tests are the ones named test_gpu_*, each run where its `gpu` fixture says: on a GPU, marked gpu
    (scripts/gpu_check.py runs `-m gpu`) and skipped without CUDA; on the CPU's stand-in of CUDA, in CI (where
    a GPU runs the test itself, the stand-in skips)."""
    for item in items:
        if not item.name.startswith("test_gpu_"):
            continue
        if "gpu" not in item.fixturenames:
            raise pytest.UsageError(f"{item.nodeid} takes no `gpu` fixture: every GPU test's own code runs on the "
                                    "CPU's stand-in of CUDA too (tests/cuda_stand_in.py)")
        if item.callspec.params["gpu"] == "cuda":
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="on a GPU the test itself runs"))


@pytest.fixture(params=["cuda", "stand-in"])
def gpu(request, monkeypatch):
    """Where a GPU test runs: "cuda", a CUDA GPU; or "stand-in", the CPU standing in for CUDA
    (tests/cuda_stand_in.py): the test's own code as on a GPU, tensors sent to CUDA kept apart from the CPU's,
    the kernels computed by their CPU stand-ins. A test parametrizes it with on_gpu_and_stand_in to run
    other cases on each."""
    if request.param == "cuda":
        yield request.param
        return
    from cuda_stand_in import cuda_stood_in_for

    with cuda_stood_in_for(monkeypatch):
        yield request.param


@pytest.fixture(scope="session", autouse=True)
def one_preloaded_server_per_worker(tmp_path_factory):
    """The programs that tests run as new processes (the recipes, the quickstart) send their fairseq commands
    to this worker's preloaded server too, rather than each starting a server of its own (about 4 s each)."""
    if os.environ.get("FAIRSEQ_FWP_PRELOAD") == "1" and not os.environ.get("FAIRSEQ_FWP_PRELOAD_SOCKET"):
        from examples.recipes import preloaded

        os.environ.update(preloaded.stand_ins(str(tmp_path_factory.mktemp("stand-ins"))))


@pytest.fixture
def own_server(monkeypatch):
    """This test's own preloaded server, started by its first command under the environment the test sets
    before (what a new process reads at its start: a cache folder, thread counts): {"process": the server,
    ...} once started."""
    from examples.recipes import preloaded

    monkeypatch.delenv("FAIRSEQ_FWP_PRELOAD_SOCKET", raising=False)
    server = {}
    monkeypatch.setattr(preloaded, "_server", server)
    yield server
    if server:
        server["process"].terminate()
        server["process"].wait()
        shutil.rmtree(os.path.dirname(server["path"]))


@pytest.fixture(scope="session")
def corpora(tmp_path_factory):
    """The built-in synthetic corpora (600 training pairs and lines, 43 of each evaluation split), written
    and preprocessed once per session (per worker): {"mt": binarised translation, "lm": binarised LM,
    "raw_mt": raw translation text, "raw_lm": raw LM text}."""
    from examples.recipes.pipeline import preprocess_lm, preprocess_translation
    from examples.recipes.synthetic_data import write_corpora

    root = tmp_path_factory.mktemp("corpora")
    raw_mt, raw_lm = write_corpora(root / "raw", n_train=600, n_eval=43, seed=3)
    preprocess_translation(raw_mt, root / "mt")
    preprocess_lm(raw_lm, root / "lm")
    return {"mt": root / "mt", "lm": root / "lm", "raw_mt": raw_mt, "raw_lm": raw_lm}
