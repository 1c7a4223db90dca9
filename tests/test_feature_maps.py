"""Feature maps against their definitions (paper Eqs. 29-32, 37 and Appendix C)."""
import math

import pytest
import torch
import torch.nn.functional as F

from fairseq_fwp.modules.feature_maps import FEATURE_MAPS, build_feature_map, sum_normalize


def appendix_c_dpfp(x, nu=1):
    """The paper's Listing 1, verbatim in behaviour."""
    x = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
    x_rolled = torch.cat([x.roll(shifts=j, dims=-1) for j in range(1, nu + 1)], dim=-1)
    x_repeat = torch.cat([x] * nu, dim=-1)
    return x_repeat * x_rolled


@pytest.mark.parametrize("nu, d", [(1, 1), (1, 4), (2, 4), (3, 4), (1, 16), (3, 16)])
def test_dpfp_matches_appendix_c_and_eq37(nu, d):
    fm = build_feature_map("dpfp", d, nu=nu)
    x = torch.randn(3, 5, d, dtype=torch.float64)
    phi = fm(x)
    assert fm.out_dim == 2 * nu * d == phi.shape[-1]
    torch.testing.assert_close(phi, appendix_c_dpfp(x, nu))
    # Eq. 37 element by element: phi_{i,nu'} = r_i * r_{(i - nu') mod 2d}
    r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
    for shift in range(1, nu + 1):
        for i in range(2 * d):
            want = r[..., i] * r[..., (i - shift) % (2 * d)]
            torch.testing.assert_close(phi[..., (shift - 1) * 2 * d + i], want)


def test_dpfp_rejects_bad_nu():
    for nu in (0, -1, 1.5):
        with pytest.raises(ValueError, match="nu"):
            build_feature_map("dpfp", 8, nu=nu)


def test_linear_is_elu_plus_one():
    fm = build_feature_map("linear", 6)
    x = torch.randn(4, 6)
    torch.testing.assert_close(fm(x), F.elu(x) + 1)
    assert fm.out_dim == 6 and (fm(x) > 0).all()


def test_performer_estimates_exp_dot_product():
    d, m = 8, 8192
    fm = build_feature_map("performer", d, num_features=m, seed=0, input_scaling=False).eval()
    assert fm.out_dim == 2 * m
    g = torch.Generator().manual_seed(0)
    x = 0.3 * torch.randn(16, d, generator=g)
    y = 0.3 * torch.randn(16, d, generator=g)
    estimate = (fm(x) * fm(y)).sum(-1)
    exact = torch.exp((x * y).sum(-1))
    # 1e-4 offset adds 2m * 1e-8 / (2m) ~ 1e-8; the rest is Monte-Carlo error.
    assert ((estimate - exact).abs() / exact).max() < 0.03


def test_performer_projection_is_orthogonal_in_blocks():
    fm = build_feature_map("performer", 8, num_features=20, seed=3)
    P = fm.projection
    block = P[:, :8] / P[:, :8].norm(dim=0)
    torch.testing.assert_close(block.T @ block, torch.eye(8), atol=1e-5, rtol=0)


def test_performer_redraw_changes_features_and_forward_is_pure():
    fm = build_feature_map("performer", 8, num_features=16, seed=1)
    x = torch.randn(2, 8)
    a, b = fm(x), fm(x)
    torch.testing.assert_close(a, b)  # q and k of one forward share P
    fm.redraw()
    assert not torch.allclose(fm(x), a)
    for name in ("linear", "dpfp"):  # deterministic maps: a training step changes nothing
        det = build_feature_map(name, 8)
        before = det(x)
        det.training_step()
        torch.testing.assert_close(det(x), before)


@pytest.mark.parametrize("interval, draws_at", [(1, [2, 3, 4, 5, 6]), (3, [4]), (0, [])])
def test_performer_redraws_on_its_schedule(interval, draws_at):
    """Training step s (from 1) uses new features when s - 1 is a positive multiple of the interval."""
    fm = build_feature_map("performer", 8, num_features=16, seed=1, redraw_interval=interval)
    new_features = []
    for step in range(1, 7):
        before = fm.projection.clone()
        fm.training_step()
        if not torch.equal(before, fm.projection):
            new_features.append(step)
    assert new_features == draws_at and int(fm.num_steps) == 6


def test_performer_input_scaling_estimates_the_softmax_kernel():
    """With x scaled by d^-1/4, phi(q) . phi(k) estimates exp(q . k / sqrt(d)): the median relative error
    over 10 pairs (seeded; a single pair's error is a random variable that reaches 0.2)."""
    d, m = 16, 4096
    g = torch.Generator().manual_seed(0)
    fm = build_feature_map("performer", d, num_features=m, seed=2, input_scaling=True)
    exps = lambda x: fm(x) * math.sqrt(2 * m) - 1e-4  # noqa: E731  the exponentials, without the stabiliser
    errors = []
    for _ in range(10):
        q, k = torch.randn(d, generator=g) * 0.7, torch.randn(d, generator=g) * 0.7
        errors.append(abs((exps(q) * exps(k)).mean().item() / math.exp(q @ k / math.sqrt(d)) - 1))
    assert sorted(errors)[5] < 0.05, errors


def test_performer_checkpoints_without_a_step_count_still_load():
    fm = build_feature_map("performer", 8, num_features=16, seed=1)
    old = {name: value for name, value in fm.state_dict().items() if name != "num_steps"}
    restored = build_feature_map("performer", 8, num_features=16, seed=7)
    restored.load_state_dict(old)
    torch.testing.assert_close(restored.projection, fm.projection)
    assert int(restored.num_steps) == 0


def test_performer_is_reproducible_under_a_seed_and_round_trips():
    x = torch.randn(2, 8)
    a = build_feature_map("performer", 8, num_features=16, seed=5)
    b = build_feature_map("performer", 8, num_features=16, seed=5)
    for _ in range(3):  # same seed, same sequence of training draws
        a.redraw(), b.redraw()
        torch.testing.assert_close(a(x), b(x))
    torch.manual_seed(0)
    c = build_feature_map("performer", 8, num_features=16)
    torch.manual_seed(0)
    d = build_feature_map("performer", 8, num_features=16)
    torch.testing.assert_close(c.projection, d.projection)

    a.redraw()  # advance a's draw count
    restored = build_feature_map("performer", 8, num_features=16, seed=99)
    restored.load_state_dict(a.state_dict())
    torch.testing.assert_close(restored(x), a(x))
    assert int(restored.num_draws) == int(a.num_draws)
    a.redraw(), restored.redraw()  # a resumed run continues the same draws
    torch.testing.assert_close(restored(x), a(x))


def test_performer_rejects_bad_num_features():
    with pytest.raises(ValueError, match="num_features"):
        build_feature_map("performer", 8, num_features=0)


def test_unknown_feature_map_lists_choices():
    with pytest.raises(ValueError, match="linear, performer, dpfp, silu"):
        build_feature_map("relu", 8)
    assert tuple(FEATURE_MAPS)[:4] == ("linear", "performer", "dpfp", "silu")  # then any a --user-dir registered


def test_silu_and_l2_normalisation():
    from fairseq_fwp.modules.feature_maps import l2_normalize, normalize_features

    x = torch.randn(3, 4, 8, dtype=torch.float64)
    torch.testing.assert_close(build_feature_map("silu", 8)(x), x * torch.sigmoid(x))
    phi = l2_normalize(x)
    torch.testing.assert_close(phi.norm(dim=-1), torch.ones(3, 4, dtype=torch.float64))
    torch.testing.assert_close(phi * x.norm(dim=-1, keepdim=True), x)
    assert torch.equal(l2_normalize(torch.zeros(2, 5)), torch.zeros(2, 5))  # no 0/0
    torch.testing.assert_close(normalize_features(x.abs(), "sum"), sum_normalize(x.abs()))
    assert normalize_features(x, "none") is x


def test_sum_normalize_never_nan():
    fm = build_feature_map("dpfp", 4, nu=1)
    x = torch.zeros(2, 4, requires_grad=True)  # DPFP of zero is an all-zero vector
    phi = sum_normalize(fm(x))
    assert torch.equal(phi, torch.zeros(2, 8))
    phi.sum().backward()
    assert torch.isfinite(x.grad).all()

    y = torch.rand(3, 5) + 0.1
    torch.testing.assert_close(sum_normalize(y).sum(-1), torch.ones(3))
    torch.testing.assert_close(sum_normalize(y), y / y.sum(-1, keepdim=True))
    assert not math.isnan(sum_normalize(torch.zeros(1, 3)).sum().item())


def test_sum_normalised_features_sum_to_one_however_small_their_sum():
    """Eq. 29 divides by the sum itself: eps only bounds the sum of an all-zero vector from below (DPFP's features
    are products of ReLUs: a small input's sum is its square)."""
    y = torch.rand(3, 5, dtype=torch.float64) * 1e-4
    torch.testing.assert_close(sum_normalize(y).sum(-1), torch.ones(3, dtype=torch.float64), rtol=1e-12, atol=1e-12)
