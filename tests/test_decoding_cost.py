"""The generation-cost measurement (the quickstart's cost plot, examples/speed/decoding_cost.py) sees
the decoder's real state at every step of fairseq's SequenceGenerator."""
import pytest

from examples.recipes.decoding_cost import build_random_model, generation_cost, numbered_dictionary

LENGTH = 40


@pytest.fixture(scope="module")
def dictionary():
    return numbered_dictionary(50)


def cost_of(dictionary, *flags, batch=2):
    model = build_random_model("language_modeling", "fwp_lm_tiny", ["--tokens-per-sample", 64, *flags], dictionary)
    return model, generation_cost(model, dictionary, LENGTH, batch=batch)


def test_a_softmax_cache_grows_by_one_key_and_value_per_layer_and_token(dictionary):
    model, cost = cost_of(dictionary, "--fwp-feature-map", "softmax", "--fwp-positions", "on")
    cfg = model.decoder.layers[0].self_attn
    per_token = model.decoder.num_layers * 2 * cfg.embed_dim * 2 * 4  # layers, K and V, d_model, batch 2, float32
    assert len(cost.seconds) == len(cost.state_bytes) == LENGTH + 1 and all(t > 0 for t in cost.seconds)
    assert [b - a for a, b in zip(cost.state_bytes, cost.state_bytes[1:])] == [per_token] * LENGTH


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_a_fast_weight_state_stops_growing_once_it_is_held_as_W(dictionary, backend):
    # 4 heads of 16: W is 16 x 16, smaller than the factors (keys and writes) from 8 tokens on, with the rule's
    # own step (reference) and with the fused step (auto)
    model, cost = cost_of(dictionary, "--fwp-feature-map", "linear", "--fwp-update-rule", "delta", "--fwp-backend",
                          backend)
    W_bytes = model.decoder.num_layers * 2 * 4 * 16 * 16 * 4  # layers, batch, heads, D x Dv, float32
    read_bytes = (1 + 2) * 8  # the decoder's count of tokens read: its length and each row's, int64
    assert cost.state_bytes[8:] == [W_bytes + read_bytes] * (LENGTH + 1 - 8)
    assert cost.state_bytes[0] < W_bytes


def test_the_measurement_leaves_the_model_as_it_was(dictionary):
    model, cost = cost_of(dictionary, "--fwp-feature-map", "linear")
    assert "forward" not in vars(model.decoder)  # the timing wrapper is gone
    seconds, size = cost.at(16, window=8)
    assert seconds == sorted(cost.seconds[16:24])[4] and size == cost.state_bytes[16]
