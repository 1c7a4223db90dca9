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
- (LMs) generation with prompts read in one call gives forcing's hypotheses and the teacher-forced scores, with a
  temperature, an adaptive softmax, prompts past a log-probability chunk, holding <unk> or </s> (read as context),
  and a beam of the vocabulary's size;
- carry-over: two carried segments of each causal fast-weight layer equal one long one;
- a left-padded source computes what it computes alone;
- after a training step, on rows with padding: the combination's backend gives the reference's outputs and
  gradients in float64 (to float64's rounding), and in float32 within float32's tolerance of them;
- a checkpoint (the state dict) reloads into a fresh model that decodes the same.

An example with nothing to check (no fast-weight layer where an invariant is about one, no fused step) is
rejected (nothing_to_check.py), not passed. Comparisons are float32 against float32 but where said, relative
to the largest value compared.
"""
import contextlib
import io
import re
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fairseq_fwp import sequence_generator
from fairseq_fwp.modules import source_attention
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention
from fairseq_fwp.ops import BackendUnavailableError, memory
from flag_combos import named_flags, refusal
from helpers import (assert_generates_what_forcing_does, assert_reads_eos_as_context, assert_turns_equal_the_whole_history,
                     build_lm_model, build_translation_model, prompts, random_tokens, softmax_in_the_models_dtype)
from nothing_to_check import NothingToCheck, require
from rounding import rounded_again

TOLERANCE = 2e-4
FLOAT64_TOLERANCE = 1e-9  # the reference and the chunked forms in float64: about 1e-14 apart
# In float32 a backend is held to the reference's own float32 error (against float64), or to that of the reference
# with its ops rounded once more (ROUNDINGS draws, rounding.py) where larger, times this, or to FLOAT32_TOLERANCE
# where that is smaller: how far float32 is from float64 depends on the combination's conditioning (an output
# gate's RMS norm of a head's small output, attention normalisation's z . phi near 0 at nearly disjoint DPFP
# supports: up to 2e-3 of the largest gradient, on every backend alike, tests/conditioning.py), not on the
# backend, whose faults went past 1e-3 (0/eps at disjoint DPFP supports rounding into the chunked backward: 4e-3
# where the reference kept 3e-6, 1.4e-3 where its roundings kept 6e-6). There the reference's own rounding is one
# draw: the chunked backend's, as close to float64 in the op, was 40 times further off (4.4e-5, roundings 4e-5)
FLOAT32_TOLERANCE, TIMES_THE_REFERENCES, ROUNDINGS = 2e-5, 4, 3
# ... and the reference in float32 to this: the layer's own float32 faults (d_t from z_t - phi(k_t), whose
# cancellation lost its small values: 2e-2) are shared by every backend
REFERENCE_FLOAT32_TOLERANCE = 1e-3
BUILD = {"translation": build_translation_model, "lm": build_lm_model}


class Refused(NothingToCheck):
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


def close(got, want, what, tolerance=TOLERANCE):
    scale = want.detach().abs().max().item() if want.numel() else 1.0
    error = (got.detach().double() - want.detach().double()).abs().max().item() if want.numel() else 0.0
    assert torch.isfinite(got).all(), f"{what}: not finite"
    assert error <= tolerance * max(scale, 1e-6), f"{what}: {error:.3g} off, of {scale:.3g} (tolerance {tolerance})"


def fast_weight_layers(model):
    return [m for m in model.modules() if isinstance(m, FastWeightAttention)]


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


# what the glue's differential invariant runs the model under, beside the plain forward and backward
GLUE_VARIANTS = ("plain", "a subclass of its feature map", "hooks", "a gradient penalty")


@runs_here
def the_fused_glue_computes_its_composition(combination, seed, variant):
    """The layers' fused glue (modules/layouts.py: the batch-first layout, the shared-input projections, the fused
    feature normalisations) against its composition (layouts.unfused(): the modules called one by one on
    fairseq's [T, B, C], each feature map's own forward, then normalize_features), in float64: a training
    forward (dropout off) and every parameter's gradient; also with every fast-weight layer's feature map a
    subclass of its own that computes another function (its own forward must run), under hooks (a global
    forward hook and a full backward hook on the projections, which must see their calls on [T, B, C]), and
    for a gradient penalty's second derivatives (the op on the reference backend)."""
    from fairseq_fwp.modules.layouts import unfused

    # a second derivative through the op: the reference's (the kernels' backward passes differentiate once)
    model, d = build(combination, extra=("--fwp-backend", "reference") if variant == "a gradient penalty" else ())
    model.double()
    layers = fast_weight_layers(model)
    require(layers, "no fast-weight layer")
    if variant == "a subclass of its feature map":
        for layer in layers:
            parent = type(layer.feature_map)
            layer.feature_map.__class__ = type(f"Scaled{parent.__name__}", (parent,), {
                "forward": lambda self, x, parent=parent: parent.forward(self, 1.5 * x - 0.25)})
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(d.nspecial, len(d), (3, 7), generator=g)
    src = sources(d, 3, seed) if combination.arch == "translation" else None
    weights = None
    parameters = [p for p in model.parameters() if p.requires_grad]

    def run():
        nonlocal weights
        logits = model(src[0], src[1], tokens)[0] if src is not None else model(tokens)[0]
        weights = torch.randn(logits.shape, generator=g, dtype=logits.dtype) if weights is None else weights
        loss = (logits * weights).sum()
        grads = torch.autograd.grad(loss, parameters, create_graph=variant == "a gradient penalty", allow_unused=True)
        if variant == "a gradient penalty":
            penalty = sum((grad ** 2).sum() for grad in grads if grad is not None)
            grads = torch.autograd.grad(penalty, parameters, allow_unused=True)
        return [logits] + [grad for grad in grads if grad is not None]

    seen = {"shapes": set(), "backward": 0}
    # a gradient penalty through fairseq's softmax layers: SDPA's math form, which has second derivatives
    def math_attention():
        return sdpa_kernel([SDPBackend.MATH]) if variant == "a gradient penalty" else contextlib.nullcontext()

    with math_attention(), _hooks(layers, seen) if variant == "hooks" else contextlib.nullcontext():
        fused = run()
    with math_attention(), unfused():
        composed = run()
    close(fused[0], composed[0], "logits", FLOAT64_TOLERANCE)
    got, want = (torch.cat([grad.flatten() for grad in run[1:]]) for run in (fused, composed))
    # a composition's second derivatives may be infinite (a norm's at 0): the same ones are, in the same places
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), "the fused glue's gradients are not finite where its composition's are"
    assert torch.equal(got[~finite].nan_to_num(), want[~finite].nan_to_num())
    close(got[finite], want[finite], "the parameters' gradients", FLOAT64_TOLERANCE)
    if variant == "hooks":
        shapes = {shape for shape in seen["shapes"] if len(shape) == 3}
        assert shapes and all(shape[1] == 3 for shape in shapes), f"the projections' hooks saw {shapes}, not [T, B, C]"
        assert seen["backward"], "a full backward hook on a projection was not called"


@runs_here
def attention_weights_reproduce_the_output(combination, seed):
    """Every fast-weight layer's attention weights (need_weights, need_head_weights, in eval mode) reproduce its
    output from its values, out = finish(A V), in float64: a causal layer's over a whole sequence with padding (the
    rule run on one-hot values: the dual form), a non-causal one's over a padded source, and encoder-decoder
    attention's at every decoding step too."""
    model, _ = build(combination)
    model.double()
    layers = fast_weight_layers(model)
    require(layers, "no fast-weight layer")
    g = torch.Generator().manual_seed(seed)
    for index, layer in enumerate(layers):
        T, S, B = 6, 9, 3
        query = torch.randn(T, B, layer.embed_dim, generator=g, dtype=torch.float64)
        key = query if layer.causal else torch.randn(S, B, layer.k_proj.in_features, generator=g, dtype=torch.float64)
        padding = torch.zeros(B, key.shape[0], dtype=torch.bool)
        padding[1, -2:] = True  # a row's last two positions
        with torch.no_grad():
            out, weights = layer(query, key, key, key_padding_mask=padding, need_weights=True, need_head_weights=True)
            values = layer.values(key, padding)
            values = values.flatten(2, 3) if values.dim() == 5 else values  # DeltaProduct: each write's value
            close(out, layer._finish(torch.einsum("hbts,bhsd->bhtd", weights, values), query),
                  f"layer {index}: out against A V")
            if layer.causal or combination.arch != "translation":
                continue
            state = {}
            for t in range(T):  # decoding: the source memory cached, a query per step
                step, weights = layer(query[t:t + 1], key, key, key_padding_mask=padding, incremental_state=state,
                                      static_kv=True, need_weights=True, need_head_weights=True)
                close(step, layer._finish(torch.einsum("hbts,bhsd->bhtd", weights, values), query[t:t + 1]),
                      f"layer {index}: decoding step {t}, out against A V")


@contextlib.contextmanager
def _hooks(layers, seen):
    """A global forward hook that notes the input shape of every fast-weight layer's projection it sees, and a full
    backward hook on each layer's k_proj that counts its calls."""
    projections = {id(getattr(layer, name)) for layer in layers for name in ("q_proj", "k_proj", "v_proj")}
    handles = [torch.nn.modules.module.register_module_forward_hook(
        lambda module, inputs, output: seen["shapes"].add(tuple(inputs[0].shape)) if id(module) in projections
        else None)]
    handles += [layer.k_proj.register_full_backward_hook(
        lambda module, grad_input, grad_output: seen.__setitem__("backward", seen["backward"] + 1)) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def factors_until(limit):
    """The decoder's memories held as W's factors for `limit` tokens (None: the layers' own limit)."""
    if limit is None:
        yield
        return
    with mock.patch.object(memory, "factored_length_limit", lambda D, Dv: limit), \
            mock.patch.object(source_attention, "factored_length_limit", lambda D, Dv: limit):
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
    require(fast_weight_layers(model.decoder), "no fast-weight layer in the decoder")
    with torch.no_grad(), factors_until(factors):
        decoded(model, d, combination, seed, lambda t, step, full: close(step, full, f"decoding step {t}"))


@runs_here
def the_fused_step_decodes_as_the_rules_own(combination, seed, dtype):
    """Where the fused step runs (a built-in map and rule), in float32 and float64, on W and its factors."""
    models = [build(combination, extra=("--fwp-decoding-step", step))[0].to(dtype) for step in ("fused", "own")]
    d = build(combination)[1]
    require(any(getattr(m, "fused_step", None) for m in models[0].modules()), "no fused step")
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
    require(causal_layers(model), "no causal fast-weight layer")
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


# the searches a generation invariant draws from (a beam of the vocabulary's size: its own)
SEARCHES = {"greedy": {"beam_size": 1}, "beam": {"beam_size": 3},
            "sampling": {"beam_size": 2, "sampling": True, "sampling_topk": 4}, "beam of the vocabulary": {}}
# ... the special words its prompts may hold, a temperature, and an adaptive softmax
SPECIALS = ("none", "unk", "eos", "eos and unk")
TEMPERATURES = (1.0, 0.6, 1.7)
ADAPTIVE_SOFTMAX = ("--adaptive-softmax-cutoff", "10,20")
LOG_PROB_CHUNK = 4  # the generator's positions per log-probability chunk, so that these prompts cross chunks


@runs_here
def a_prompt_read_in_one_call_generates_what_forcing_does(combination, seed, search, specials="none",
                                                          temperature=1.0, adaptive_softmax=0):
    """(LM only: test_model_properties.ONLY) Prompts of 0 to 12 tokens, several of them past a log-probability
    chunk, read in one call (FastWeightSequenceGenerator): the hypotheses of fairseq's forcing (tokens, positional
    scores, scores), the positional scores the model's teacher-forced log-probabilities at temperature 1, in
    float64. A prompt may hold <unk> (forced, less --unkpen) and </s> (read as context, where forcing would end:
    then every hypothesis holds its prompt and goes on, and a sentence generates what it does alone)."""
    model, d = build(combination, extra=ADAPTIVE_SOFTMAX if adaptive_softmax else ())
    model.double()
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 13, (3,), generator=g).tolist()
    sample, prefix = prompts(d, lengths, seed)
    words = {"unk": d.unk(), "eos": d.eos()}
    for name in specials.split(" and "):
        for row in [row for row, length in enumerate(lengths) if length][:2] if name in words else ():
            prefix[row, int(torch.randint(0, lengths[row], (), generator=g))] = words[name]
    sample["net_input"]["src_tokens"][:, 1:] = prefix
    options = dict(search_options=SEARCHES[search] or {"beam_size": len(d) - 1}, max_len_b=20, seed=seed,
                   temperature=temperature, unk_penalty=0.5 if "unk" in specials else 0.0)
    holds_eos = bool(prefix.eq(d.eos()).any())
    check = assert_reads_eos_as_context if holds_eos else assert_generates_what_forcing_does
    with softmax_in_the_models_dtype(), mock.patch.object(sequence_generator, "LOG_PROB_CHUNK", LOG_PROB_CHUNK):
        check(model, d, sample, prefix, scores_are_the_models=temperature == 1 and "unk" not in specials,
              **options)


# options that would see only a session's turn: a turn given one is refused before any work
TURN_ONLY_OPTIONS = ("none", "an LM fused in", "n-gram blocking", "diverse beam", "diverse siblings", "constraints")


@runs_here
def a_session_generates_what_the_whole_history_does(combination, seed, beam, reply_budget, min_reply=1,
                                                    long_input=0, turn_only="none"):
    """(LM only: test_model_properties.ONLY) Three turns of a session (session.History), inputs of 1 to 6 tokens
    (with long_input, one of 20 to 30: past the reply's limit), replies of min_reply (--min-len) to reply_budget
    + 1 tokens (--max-len-b: the reply's limit): each turn's hypotheses are those of generating with the whole
    history (every input and kept reply before it, each reply with its </s>) as one prompt, its limits counted
    from there: tokens, positional scores and scores, in float64. A turn given an option that would see only the
    turn (turn_only) is refused before any work, and the session goes on as it was."""
    from fairseq import search

    from fairseq_fwp.session import History, SessionRefusal
    from helpers import session_turn

    model, d = build(combination)
    model.double()
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (3,), generator=g)
    if long_input:
        lengths[int(torch.randint(0, 3, (), generator=g))] = int(torch.randint(20, 31, (), generator=g))
    turns = [torch.randint(d.nspecial, len(d), (int(n),), generator=g) for n in lengths]
    history, options = History([model], d), dict(beam_size=beam, max_len_b=reply_budget, min_len=min_reply)
    with softmax_in_the_models_dtype():
        kept = assert_turns_equal_the_whole_history(model, d, history, turns[:1], **options)
        if turn_only != "none":
            refused = {"an LM fused in": dict(lm_model=model, lm_weight=0.5), "n-gram blocking": dict(
                no_repeat_ngram_size=2), "diverse beam": dict(beam_size=2, diverse=(2, 0.5)), "diverse siblings": dict(
                search_strategy=search.DiverseSiblingsSearch(d, 0.5)), "constraints": dict(
                search_strategy=search.LexicallyConstrainedBeamSearch(d, "ordered"))}[turn_only]
            read, states = history.tokens_read, history.states
            try:
                session_turn(model, d, history, turns[1], **{**options, **refused})
            except SessionRefusal:
                pass
            else:
                raise AssertionError(f"a turn with {turn_only} (which sees only the turn) was not refused")
            assert history.tokens_read == read and history.states is states, f"the refused turn ({turn_only}) " \
                                                                             "changed the session"
        assert_turns_equal_the_whole_history(model, d, history, turns[1:], kept=kept, **options)


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
    """(translation only: test_model_properties.ARCHS)"""
    model, d = build(combination)
    require(fast_weight_layers(model.encoder), "no fast-weight layer in the encoder")
    src = random_tokens(d, [3, 8], seed=seed)  # the first row left-padded by 5
    prev = torch.randint(d.nspecial, len(d), (2, 5), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        batched = model(src, src.ne(d.pad()).sum(1), prev)[0]
        alone = model(src[:1, 5:], torch.tensor([3]), prev[:1])[0]
    close(batched[:1], alone, "a left-padded source")


def padded_batch(d, combination, seed, length=40):
    """(source or None, tokens ``[2, length]``, the loss's weights ``[2, length, vocabulary]``): the second row's
    last quarter is padding, which writes nothing and has no loss. 40 tokens cross the chunked forms' chunk
    borders (32 tokens for D <= 32, 64 above)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(d.nspecial, len(d), (2, length), generator=g)
    tokens[:, 0] = d.eos()
    tokens[1, length - length // 4:] = d.pad()
    weights = torch.randn(2, length, len(d), generator=g, dtype=torch.float64) * tokens.ne(d.pad()).unsqueeze(-1)
    return sources(d, 2, seed) if combination.arch == "translation" else None, tokens, weights


def outputs_and_gradients(model, batch, seed):
    """A full forward's outputs in eval mode, then one training forward's parameter gradients (the same random
    draws for every model: a feature map's redraw included), as {name: tensor}."""
    src, tokens, weights = batch
    with torch.no_grad():
        outputs = forward(model, None, tokens, src)
    model.train()
    torch.manual_seed(seed)
    model.zero_grad()
    (forward(model, None, tokens, src).double() * weights).sum().backward()
    model.eval()
    return outputs, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@torch.no_grad()
def trained_once(model, batch, seed, lr=1e-3):
    """The model's state dict after one training step on the batch, Adam's first (lr sign(g): torch.optim would
    import torch._dynamo, seconds in a fresh process): gates and norms away from their initial values."""
    with torch.enable_grad():
        outputs_and_gradients(model, batch, seed)
    for p in model.parameters():
        if p.grad is not None:
            p.sub_(lr * p.grad.sign())
    return model.state_dict()


@contextlib.contextmanager
def relu_signs(model):
    """Yields the signs of every ReLU input (DPFP's, the FFN's), appended in the order of the calls: F.relu
    and the layers' activation_fn where it is F.relu, replaced for the while (a TorchFunctionMode, which sees
    every op, took 40% of the invariant's time)."""
    signs, relu = [], F.relu

    def noted(x, *args, **kwargs):
        signs.append(x.detach() > 0)
        return relu(x, *args, **kwargs)

    layers = [m for m in model.modules() if getattr(m, "activation_fn", None) is relu]
    with mock.patch.object(F, "relu", noted):
        for layer in layers:
            layer.activation_fn = noted
        try:
            yield signs
        finally:
            for layer in layers:
                layer.activation_fn = relu


def with_relu_signs(model, run):
    """(run(), the signs of the ReLU inputs of the model's run)."""
    with relu_signs(model) as signs:
        return run(), signs


def differences(got, want):
    """(the outputs', all gradients') largest difference relative to the largest value of `want`'s."""
    (out, grads), (want_out, want_grads) = got, want
    assert grads.keys() == want_grads.keys()
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads.values()), "not finite"
    pairs = [(out, want_out)] + ([(torch.cat([g.flatten() for g in grads.values()]),
                                   torch.cat([g.flatten() for g in want_grads.values()]))] if grads else [])
    # all gradients against the largest: some are about 0 in exact arithmetic
    return tuple(((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
                 for a, b in pairs)


def agree(got, want, tolerances, what):
    for kind, difference, tolerance in zip(("outputs", "gradients"), differences(got, want), tolerances):
        assert difference <= tolerance, f"{kind} {what}: {difference:.3g} off (tolerance {tolerance:.3g})"


@runs_here
def the_backend_gives_the_references_outputs_and_gradients(combination, seed):
    model, d = build(combination)
    require(fast_weight_layers(model), "no fast-weight layer")
    batch = padded_batch(d, combination, seed)
    weights = trained_once(model, batch, seed)
    reference, _ = build(combination, extra=("--fwp-backend", "reference"))
    reference.load_state_dict(weights)
    want, signs = with_relu_signs(reference, lambda: outputs_and_gradients(reference.double(), batch, seed))
    agree(outputs_and_gradients(model.double(), batch, seed), want, (FLOAT64_TOLERANCE,) * 2,
          "against --fwp-backend reference, both in float64")
    runs32 = [with_relu_signs(m, lambda: outputs_and_gradients(m.float(), batch, seed)) for m in (reference, model)]
    # A ReLU input that rounds to the other side of 0 in float32 changes the gradients by its unit's whole
    # contribution: a sign flip, not a fault
    same_signs = lambda signs32: all(torch.equal(a, b) for a, b in zip(signs, signs32))  # noqa: E731
    require(all(same_signs(signs32) for _, signs32 in runs32), "a ReLU input changes sign in float32")
    references_own = differences(runs32[0][0], want)
    agree(runs32[0][0], want, (REFERENCE_FLOAT32_TOLERANCE,) * 2,
          "of --fwp-backend reference in float32 against float64")
    tolerances = lambda errors: [max(FLOAT32_TOLERANCE, TIMES_THE_REFERENCES * e) for e in errors]  # noqa: E731
    backends_own, largest = differences(runs32[1][0], want), references_own
    for draw in range(ROUNDINGS):  # drawn only while the backend is further off: they can only widen the tolerance
        if all(e <= t for e, t in zip(backends_own, tolerances(largest))):
            break
        with rounded_again(draw):
            run, signs32 = with_relu_signs(reference, lambda: outputs_and_gradients(reference, batch, seed))
        if same_signs(signs32):
            largest = [max(e) for e in zip(largest, differences(run, want))]
    agree(runs32[1][0], want, tolerances(largest),
          f"in float32 against --fwp-backend reference in float64 ({TIMES_THE_REFERENCES} times the reference's own "
          f"float32 differences {references_own[0]:.2g}, {references_own[-1]:.2g}, or those of its ops rounded "
          f"once more, up to {largest[0]:.2g}, {largest[-1]:.2g})")


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


MODEL_INVARIANTS = (refused_naming_a_flag_or_built, training_gives_finite_gradients_to_every_parameter,
                    the_fused_glue_computes_its_composition, attention_weights_reproduce_the_output,
                    decoding_equals_the_full_forward,
                    the_fused_step_decodes_as_the_rules_own,
                    a_prompt_in_one_call_then_single_tokens_equals_the_full_forward,
                    a_prompt_read_in_one_call_generates_what_forcing_does,
                    a_session_generates_what_the_whole_history_does,
                    two_carried_segments_equal_one_long_one, a_left_padded_source_computes_what_it_computes_alone,
                    the_backend_gives_the_references_outputs_and_gradients, a_checkpoint_reloads_and_decodes_the_same)
