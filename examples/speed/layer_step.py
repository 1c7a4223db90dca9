"""The fixed cost of one decoding step: one decoder layer of the Multi30k translation shape at batch 1.

Each model is examples/speed/beam_search.py's (2+2 layers, d_model 128, 2 heads of 64, FFN 512; random
weights); its first decoder layer decodes 30 steps after a 20-token source (self-attention step,
encoder-decoder attention step, feed-forward, a beam reorder per step). Times are per step, the minimum
over --runs runs of the 30 steps; the fast-weight rows run with the fused step (fused_step.py) and, for
the comparison, with each rule's own step. Ratios are to softmax attention's step in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python examples/speed/layer_step.py [--runs 20] [--device cuda]

On a GPU (--device cuda) the fused step is the extension's CUDA kernel (csrc/fast_weight_step_cuda.cu), where
it has its CUDA kernels; times are then of the GPU, synchronised at the start and the end of each run.
"""
import argparse
import datetime
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from examples.recipes.decoding_cost import numbered_dictionary  # noqa: E402
from examples.speed.beam_search import MODELS, SOURCE_LENGTH, VOCAB, build_model  # noqa: E402
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention  # noqa: E402

STEPS = 30


def step_seconds(model, dictionary, runs, device):
    """The minimum over `runs` of the first decoder layer's time per step, over STEPS steps at batch 1."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(dictionary.nspecial, len(dictionary), (1, SOURCE_LENGTH), generator=g).to(device)
    layer = model.decoder.layers[0]
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=torch.tensor([SOURCE_LENGTH], device=device))
        memory, padding = encoder_out["encoder_out"][0], None
        x = torch.randn(STEPS, 1, model.decoder.embed_dim, generator=g).to(device)
        order = torch.zeros(1, dtype=torch.long, device=device)
        best = float("inf")
        for _ in range(runs):
            state = {}
            synchronize()
            start = time.perf_counter()
            for t in range(STEPS):
                layer(x[t:t + 1], memory, padding, incremental_state=state)
                layer.self_attn.reorder_incremental_state(state, order)
                layer.encoder_attn.reorder_incremental_state(state, order)
            synchronize()
            best = min(best, (time.perf_counter() - start) / STEPS)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["softmax", "linear", "dpfp-256"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dictionary = numbered_dictionary(VOCAB)
    where = (torch.cuda.get_device_name() if device.type == "cuda" else
             f"{platform.machine()} {os.cpu_count()} cores, {torch.get_num_threads()} thread(s)")
    print(f"# one decoder layer's step at batch 1 (Multi30k shape), {STEPS} steps, minimum of {args.runs} runs; "
          f"{where}, torch {torch.__version__}, {datetime.date.today().isoformat()}")
    print("| model | step | us per step | vs softmax |")
    print("|---|---|---|---|")
    softmax = None
    for name in args.models:
        model = build_model(MODELS[name][0], dictionary).eval().to(device)
        attentions = [m for m in model.modules() if isinstance(m, FastWeightAttention)]
        fused = [m.fused_step for m in attentions]
        for label, steps in (("fused", fused), ("the rule's own", [None] * len(attentions))):
            if not attentions and label != "fused":
                continue
            for attention, step in zip(attentions, steps):
                attention.fused_step = step
            seconds = step_seconds(model, dictionary, args.runs, device)
            softmax = seconds if name == "softmax" else softmax
            shown = "softmax attention" if not attentions else label
            print(f"| {name} | {shown} | {1e6 * seconds:.0f} | {softmax / seconds:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
