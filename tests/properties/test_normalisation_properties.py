"""Every feature map's normalisation as the layers run it (FeatureMap.normalized: the fused forms,
feature_maps.normalized_features, and the linear map's fused map and sum) errs no more than the composition it
fuses (normalize_features of the map's own forward, in the same dtype), both against float64 on the same rounded
inputs: outputs and the input's gradient, in float32 and the half types, on heads whose pre-activations sit far
from 0 (means from -8 to 8), where a fused form's cancellations would show (elu(x) near -1, plus 1)."""
import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from conftest import assert_reached, examples, own_examples
from fairseq_fwp.modules.feature_maps import FEATURE_MAPS, build_feature_map, feature_map_class, normalize_features

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# what a fused form may err beyond 4 times its composition's error, per vector, relative to the vector's largest
# value: a few units in the last place of the dtype (float32: 1e-6, a performer's exp included)
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 4 * 2.0 ** -8, torch.float16: 4 * 2.0 ** -11}


def normalisations(name):
    return ("l2", "none") if feature_map_class(name).signed else ("sum", "l2", "none")


def values_and_gradient(phi, x, g, how, fused):
    x = x.clone().requires_grad_()
    out = phi.normalized(x, how) if fused else normalize_features(phi(x), how)
    return out.detach().double(), torch.autograd.grad(out, x, g.to(out.dtype))[0].double()


def vector_error(got, want):
    """The largest error of any vector (the last dimension), relative to its largest value."""
    return max(((a - b).abs().amax(-1) / b.abs().amax(-1).clamp_min(1e-30)).max().item() for a, b in zip(got, want))


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
def test_a_normalisation_errs_as_the_composition_it_fuses(name):
    checked = []

    @own_examples(f"normalisation-{name}")
    @settings(max_examples=examples(12))
    @given(how=st.sampled_from(normalisations(name)), dtype=st.sampled_from(DTYPES), mean=st.floats(-8, 8),
           spread=st.floats(0.05, 3), seed=st.integers(0, 2**16))
    def holds(how, dtype, mean, spread, seed):
        generator = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            phi = build_feature_map(name, 16)
        x = (mean + spread * torch.randn(64, 16, generator=generator, dtype=torch.float64)).to(dtype)
        g = torch.randn(64, phi.out_dim, generator=generator, dtype=torch.float64).to(dtype).double()
        want = values_and_gradient(phi.double(), x.double(), g, how, False)
        phi.to(dtype)
        fused, composed = (vector_error(values_and_gradient(phi, x, g, how, f), want) for f in (True, False))
        note(f"{name} {how} {dtype} mean {mean} spread {spread}: fused {fused:.2e}, composition {composed:.2e}")
        assert fused <= 4 * composed + FLOOR[dtype], (fused, composed)
        checked.append((how, dtype, mean))

    holds()
    assert_reached(checked, f"{name}'s normalisations", lambda e: e[2] < -4, lambda e: e[1] != torch.float32,
                   minimum=6)
