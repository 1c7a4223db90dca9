"""The property harness's float32 comparison on the long run's examples, where attention normalisation divides
by a small z . phi: the reference's own rounding was the only one a backend was held to, and another rounding of
the same ops may land 40 times further off float64 (tests/properties/rounding.py)."""
import os
import sys

import pytest

pytest.importorskip("fairseq")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "properties"))
from flag_combos import Combination  # noqa: E402
from model_invariants import the_backend_gives_the_references_outputs_and_gradients  # noqa: E402

# DeltaProduct's gated form with DPFP features unnormalised but in the decoder's self-attention (where
# --fwp-decoder-qk-norm auto sum-normalises a delta rule's): the cross-attention divides by z . phi(q) at
# cosines down to 3e-5
GATED_PRODUCT_UNDER_UNNORMALISED_DPFP = Combination("translation", (
    "--fwp-householder-steps", "3", "--fwp-performer-features", "0", "--fwp-qk-norm", "none",
    "--share-all-embeddings", "--fwp-update-rule", "gated-delta", "--fwp-feature-map", "dpfp"))


@pytest.mark.parametrize("seed", [409, 441])
def test_the_backend_is_held_to_the_roundings_of_the_reference(seed):
    """The chunked backend's float32 gradients were 1.9e-3 of the largest off float64 (seed 409) where the
    reference's were 8.5e-4, and 4.4e-5 where they were 1.1e-6 (seed 441): over 4 times the reference's own. Yet
    both ops are within float32's rounding of float64 on these inputs (1e-7 relative, the chunked one the
    closer), and only the rounding differs: with chunks of 4 to 128 steps the chunked backend is off by 1.2e-4
    to 1.9e-3 at seed 409, and the reference with its ops rounded once more by 8.6e-4 to 1.3e-3 (seed 441: 3e-6
    to 4e-5). The cross-attention's smallest normaliser, a cosine of 3e-5 at seed 409, amplifies whichever
    rounding reaches its query; with it floored to 0.05, both backends are off by 2.7e-6."""
    the_backend_gives_the_references_outputs_and_gradients(GATED_PRODUCT_UNDER_UNNORMALISED_DPFP, seed)
