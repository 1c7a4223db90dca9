"""What every combination of flags (flag_combos.Combination) must satisfy, each a function that raises
AssertionError, on the tiny translation model and the tiny LM:

- it builds, or is refused when its arguments are parsed, with a message that names one of its flags (the
  other invariants take the combination with the flags its refusals name dropped: flag_combos.taken);
- training: a forward and a backward pass give finite outputs, and every parameter gets a finite gradient;
- decoding: token by token, with beam reorders at random steps (rows reordered, duplicated and dropped
  within one source, the encoder's output with them, as fairseq's beam search does), equals the
  teacher-forced full forward; on W and on its factors (the decoder's memories switch at `factors`
  tokens), with the fused step and with the rule's own (--fwp-decoding-step is drawn);
- the fused step decodes as the rule's own step, in float32 and in float64;
- a prompt given to each causal fast-weight layer in one call, then single tokens, equals its full forward;
- carry-over: two carried segments of each causal fast-weight layer equal one long one;
- a left-padded source computes what it computes alone;
- the combination's backend gives the reference's outputs and training gradients;
- a checkpoint (the state dict) reloads into a fresh model that decodes the same.

Comparisons are float32 against float32, relative to the largest value compared.
"""
import contextlib
import io
import re
from unittest import mock

import torch

from fairseq_fwp.modules import fast_weight_attention
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention
from fairseq_fwp.ops import BackendUnavailableError, memory
from flag_combos import named_flags, refusal
from helpers import build_lm_model, build_translation_model, random_tokens

TOLERANCE = 2e-4
BUILD = {"translation": build_translation_model, "lm": build_lm_model}


class Refused(Exception):
    """The combination was refused as it should be, naming one of its flags: a backend that cannot run on
    this machine, at the first forward."""


def build(combination, seed=0, extra=()):
    """The model (in eval mode) and its dictionary of a combination that is taken (flag_combos.taken)."""
    return BUILD[combination.arch](*combination.flags, *extra, seed=seed)


def refused_naming_a_flag_or_built(combination, seed):
    """A combination is refused when its arguments are parsed, naming one of its flags, or builds."""
    message = refusal(combination)
    if message is not None:
        assert named_flags(combination, message), f"refused without naming one of its flags: {message}"
        return
    build(combination, seed=seed)


def close(got, want, what):
    scale = want.detach().abs().max().item() if want.numel() else 1.0
    error = (got.detach() - want.detach()).abs().max().item() if want.numel() else 0.0
    assert torch.isfinite(got).all(), f"{what}: not finite"
    assert error <= TOLERANCE * max(scale, 1e-6), f"{what}: {error:.3g} off, of {scale:.3g} (tolerance {TOLERANCE})"


def sources(d, rows, seed):
    """Left-padded sources of random lengths (fairseq's translation pads sources left)."""
    lengths = torch.randint(2, 9, (rows,), generator=torch.Generator().manual_seed(seed)).tolist()
    src = random_tokens(d, lengths, seed=seed)
    return src, src.ne(d.pad()).sum(1)


def forward(model, d, tokens, src=None, encoder_out=None, incremental_state=None):
    """The decoder's logits for `tokens` (teacher-forced prefixes), after the encoder for translation."""
    if src is not None and encoder_out is None:
        encoder_out = model.encoder(src[0], src_lengths=src[1])
    return model.decoder(tokens, encoder_out=encoder_out, incremental_state=incremental_state)[0]


def runs_here(function):
    """A first forward whose backend cannot run here (--fwp-backend cuda on a machine without a GPU) is
    refused naming the flag: Refused, as a refusal at parse time."""
    def checked(combination, *args):
        try:
            return function(combination, *args)
        except BackendUnavailableError as err:
            assert re.search(r"--fwp-backend \S+", str(err)), f"a backend's refusal without its flag: {err}"
            raise Refused(str(err)) from err
    checked.__name__ = function.__name__
    return checked


@runs_here
def training_gives_finite_gradients_to_every_parameter(combination, seed):
    model, d = build(combination)
    model.train()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(d.nspecial, len(d), (3, 7), generator=g)
    if combination.arch == "translation":
        src = sources(d, 3, seed)
        logits = model(src[0], src[1], tokens)[0]
    else:
        logits = model(tokens)[0]
    assert torch.isfinite(logits).all(), "training outputs not finite"
    (logits * torch.randn(logits.shape, generator=g)).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient: {missing}"
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"gradients not finite: {bad}"


@contextlib.contextmanager
def factors_until(limit):
    """The decoder's memories held as W's factors for `limit` tokens (None: the layers' own limit)."""
    if limit is None:
        yield
        return
    with mock.patch.object(memory, "factored_length_limit", lambda D, Dv: limit), \
            mock.patch.object(fast_weight_attention, "factored_length_limit", lambda D, Dv: limit):
        yield


def beam_order(rows, beam, seed, t):
    """fairseq's reorder at step t: each source's rows from its own rows (duplicates too), and sometimes a
    finished source's rows dropped."""
    g = torch.Generator().manual_seed(seed * 101 + t)
    groups = [torch.arange(i, i + beam)[torch.randint(0, beam, (beam,), generator=g)] for i in range(0, rows, beam)]
    if len(groups) > 1 and torch.rand((), generator=g) < 0.3:
        groups.pop(int(torch.randint(0, len(groups), (), generator=g)))
    return torch.cat(groups)


def decoded(model, d, combination, seed, check_each_step=None):
    """The logits of 7 decoding steps of 2 sources x 2 beams (or 4 LM rows), with beam reorders after steps
    1 and 4 (beam_order), [steps, rows, vocabulary] (rows dropped later are zeros); check_each_step(step,
    full): a check of each step's logits against the teacher-forced full forward's."""
    beam, n_sources, steps = 2, 2, 7
    rows = beam * n_sources
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    encoder_out = None
    if combination.arch == "translation":
        src = sources(d, n_sources, seed)
        encoder_out = model.encoder(src[0], src_lengths=src[1])
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, torch.arange(n_sources).repeat_interleave(beam))
    history = torch.full((rows, 1), d.eos(), dtype=torch.long)
    state, logits = {}, torch.zeros(steps, rows, len(d), dtype=dtype)
    for t in range(steps):
        step = forward(model, d, history, encoder_out=encoder_out, incremental_state=state)[:, -1]
        logits[t, :len(step)] = step
        if check_each_step is not None:
            check_each_step(t, step, forward(model, d, history, encoder_out=encoder_out)[:, -1])
        history = torch.cat([history, torch.randint(d.nspecial, len(d), (len(history), 1), generator=g)], 1)
        if t in (1, 4):
            order = beam_order(len(history), beam, seed, t)
            model.decoder.reorder_incremental_state_scripting(state, order)
            if encoder_out is not None:
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, order)
            history = history[order]
    return logits


@runs_here
def decoding_equals_the_full_forward(combination, seed, factors):
    model, d = build(combination)
    with torch.no_grad(), factors_until(factors):
        decoded(model, d, combination, seed, lambda t, step, full: close(step, full, f"decoding step {t}"))


@runs_here
def the_fused_step_decodes_as_the_rules_own(combination, seed, dtype):
    """Where the fused step runs (a built-in map and rule), in float32 and float64, on W and its factors."""
    models = [build(combination, extra=("--fwp-decoding-step", step))[0].to(dtype) for step in ("fused", "own")]
    d = build(combination)[1]
    if not any(getattr(m, "fused_step", None) for m in models[0].modules()):
        return
    with torch.no_grad(), factors_until(3):
        fused, own = (decoded(model, d, combination, seed) for model in models)
    close(fused, own, f"the fused step against the rule's own, {dtype}")


def causal_layers(model):
    return [m for m in model.decoder.modules() if isinstance(m, FastWeightAttention) and m.causal]


def causal_layers_on_one_input(combination, seed, length):
    """(index, layer, x, the layer's full forward of x) for each causal fast-weight layer of the combination's
    model, x ``[length, 2, embed_dim]`` drawn from `seed`; under no_grad."""
    model, _ = build(combination)
    x = torch.randn(length, 2, model.decoder.embed_dim, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for index, layer in enumerate(causal_layers(model)):
            yield index, layer, x, layer(x, None, None)[0]


@runs_here
def a_prompt_in_one_call_then_single_tokens_equals_the_full_forward(combination, seed, prompt):
    for index, layer, x, full in causal_layers_on_one_input(combination, seed, 8):
        state = {}
        first = layer(x[:prompt], None, None, incremental_state=state)[0]
        rest = [layer(x[t:t + 1], None, None, incremental_state=state)[0] for t in range(prompt, len(x))]
        close(torch.cat([first, *rest]), full, f"layer {index}, a prompt of {prompt}")


@runs_here
def two_carried_segments_equal_one_long_one(combination, seed, cut):
    for index, layer, x, full in causal_layers_on_one_input(combination, seed, 9):
        layer.enable_carry_over()
        parts = []
        for position, segment in enumerate((x[:cut], x[cut:])):
            layer.start_segment(position, training=False)
            parts.append(layer(segment, None, None)[0])
        close(torch.cat(parts), full, f"layer {index}, segments cut at {cut}")


@runs_here
def a_left_padded_source_computes_what_it_computes_alone(combination, seed):
    if combination.arch != "translation":
        return
    model, d = build(combination)
    src = random_tokens(d, [3, 8], seed=seed)  # the first row left-padded by 5
    prev = torch.randint(d.nspecial, len(d), (2, 5), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        batched = model(src, src.ne(d.pad()).sum(1), prev)[0]
        alone = model(src[:1, 5:], torch.tensor([3]), prev[:1])[0]
    close(batched[:1], alone, "a left-padded source")


def outputs_and_gradients(model, d, combination, seed):
    """A full forward's outputs in eval mode, then one training step's parameter gradients (the same random
    draws for every model: a feature map's redraw included), as {name: tensor}."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(d.nspecial, len(d), (2, 9), generator=g)
    src = sources(d, 2, seed) if combination.arch == "translation" else None
    with torch.no_grad():
        outputs = forward(model, d, tokens, src)
    model.train()
    torch.manual_seed(seed)
    logits = forward(model, d, tokens, src)
    (logits * torch.randn(logits.shape, generator=g)).sum().backward()
    model.eval()
    return outputs, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@runs_here
def the_backend_gives_the_references_outputs_and_gradients(combination, seed):
    model, d = build(combination)
    reference, _ = build(combination, extra=("--fwp-backend", "reference"))
    (out, grads), (want_out, want_grads) = (outputs_and_gradients(m, d, combination, seed) for m in (model, reference))
    close(out, want_out, "outputs against --fwp-backend reference")
    assert grads.keys() == want_grads.keys()
    if grads:  # all gradients against the largest: some are about 0 in exact arithmetic
        close(torch.cat([g.flatten() for g in grads.values()]), torch.cat([g.flatten() for g in want_grads.values()]),
              "gradients against --fwp-backend reference")


@runs_here
def a_checkpoint_reloads_and_decodes_the_same(combination, seed):
    model, d = build(combination)
    fresh, _ = build(combination, seed=seed + 1)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict()}, saved)  # as fairseq saves a checkpoint's weights
    saved.seek(0)
    fresh.load_state_dict(torch.load(saved)["model"], strict=True)  # torch's default: weights only
    tokens = torch.randint(d.nspecial, len(d), (2, 6), generator=torch.Generator().manual_seed(seed))
    src = sources(d, 2, seed) if combination.arch == "translation" else None
    with torch.no_grad():
        decoded = []
        for m in (model, fresh):
            encoder_out = None if src is None else m.encoder(src[0], src_lengths=src[1])
            state = {}
            decoded.append(torch.stack([forward(m, d, tokens[:, :t], encoder_out=encoder_out, incremental_state=state)[:, -1]
                                        for t in range(1, tokens.shape[1] + 1)], 1))
    close(decoded[1], decoded[0], "decoded by the reloaded model")


MODEL_INVARIANTS = (refused_naming_a_flag_or_built, training_gives_finite_gradients_to_every_parameter, decoding_equals_the_full_forward,
                    the_fused_step_decodes_as_the_rules_own,
                    a_prompt_in_one_call_then_single_tokens_equals_the_full_forward,
                    two_carried_segments_equal_one_long_one, a_left_padded_source_computes_what_it_computes_alone,
                    the_backend_gives_the_references_outputs_and_gradients, a_checkpoint_reloads_and_decodes_the_same)
