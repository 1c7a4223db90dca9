"""Plausible bugs, most of them one line, in the code that holds the math and the state: each is a mistake someone could
make while changing that code, written as the one line (or fragment) it would change. scripts/mutants.sh
applies each to a copy of the repository (copies.py) and runs the property harness against it, and the fast
lane where the harness misses it: the score is in docs/DEVELOPERS.md.

`harness`: the property tests that must catch it (pytest's -k over tests/properties), where it breaks one of
their invariants; None where only other tests can. `equivalent`: why no test can tell it from the original,
where none can.
"""
import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    edits: tuple  # (path relative to the repository's root, text the file holds exactly once, its replacement), ...
    why: str  # the mistake it stands for
    harness: Optional[str] = None
    equivalent: Optional[str] = None


def one_line(name, path, original, mutated, why, **kwargs):
    return Mutant(name, ((path, original, mutated),), why, **kwargs)


MUTANTS = (
    one_line("chunked-delta-beta-gradient-through-chunk-starts", "fairseq_fwp/ops/chunked.py",
           "            db -= (neg_dR_k * K).sum(-1)\n", "",
           "the delta rule's chunked backward drops beta's gradient through the chunk-start states",
           harness="test_every_call_of_the_ops and named_backend and delta"),
    one_line("reorder-skips-short-convolution-caches", "fairseq_fwp/modules/state.py",
           "        if self.convolutions:\n            self.convolutions = tuple(cache.index_select(0, new_order)",
           "        if False:\n            self.convolutions = tuple(cache.index_select(0, new_order)",
           "beam search's reorder moves the memory but not the short convolutions' caches",
           harness="test_every_combination_of_flags and decoding_equals"),
    Mutant("disjoint-supports-under-attention-normalisation", (
        ("fairseq_fwp/modules/fast_weight_attention.py",
         "    return torch.where(normalizer > 0, out / (normalizer + eps), 0.0)", "    return out / (normalizer + eps)"),
        ("fairseq_fwp/ops/chunked.py", "            later = qdo[:, :, 1:].flip(2).cumsum(2).flip(2)\n"
         "            dS_end = torch.cat([later, torch.zeros_like(qdo[:, :, :1])], 2)\n",
         "            dS_end = qdo.flip(2).cumsum(2).flip(2) - qdo\n")),
        "Eqs. 19, 28 divide by z . phi(q) + eps where z . phi(q) is 0 (disjoint DPFP supports), and the sum rule's "
        "chunked backward takes each chunk's own term from a reverse cumulative sum that holds it: the 1 / eps "
        "gradients' rounding reaches the other chunks",
        harness="test_every_combination_of_flags and the_backend_gives"),
)
