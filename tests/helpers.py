"""Helpers of the test suite, in one place: random op inputs and the comparisons on them, and tiny fairseq
models built in-process through fairseq's own argument parsing, and a web server for the downloads."""
import contextlib
import functools
import http.server
import os
import threading
import types

import torch
import torch.nn.functional as F

from examples.recipes.commands import PLUGIN_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: examples run from here

# -- the ops: random inputs, outputs and fresh gradients, comparisons ---------------------

def make_inputs(B, H, T, D, Dv, dtype=torch.float64, with_state=True, seed=0):
    """q, k, v, beta, W0 with requires_grad; keys are unit-norm so the delta rule is stable."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, H, T, D, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
    beta = torch.rand(B, H, T, generator=g, dtype=dtype)
    W0 = torch.randn(B, H, Dv, D, generator=g, dtype=dtype) if with_state else None
    return [x.requires_grad_() if x is not None else None for x in (q, k, v, beta, W0)]


def make_decay(B, H, T, dtype=torch.float64, low=0.5, seed=3):
    """Decays a_t in (low, 1), with requires_grad."""
    g = torch.Generator().manual_seed(seed)
    return (low + (1 - low) * torch.rand(B, H, T, generator=g, dtype=dtype)).requires_grad_()


def run_op(rule, inputs, backend, **gate):
    """backend: a backend name, or a callable (q, k, v, beta, W0, **gate) -> (out, W); gate: decay= or
    log_decay=."""
    from fairseq_fwp.ops import fast_weight_delta, fast_weight_sum

    q, k, v, beta, W0 = inputs
    if callable(backend):
        return backend(q, k, v, beta, W0, **gate)
    if rule == "sum":
        return fast_weight_sum(q, k, v, W0, backend=backend, **gate)
    return fast_weight_delta(q, k, v, beta, W0, backend=backend, **gate)


def loss_weights(tensors, generator):
    """Random weights for a loss on each tensor, drawn in float32 and then cast: torch's CPU generator
    draws other sequences for half types, which would give half and float32 runs different losses."""
    return [torch.randn(x.shape, generator=generator).to(x.device, x.dtype) for x in tensors]


def outputs_and_grads(rule, inputs, backend, seed=1, rounded_as=None, **gate):
    """{"out", "state", and "d<name>" for every input that needs a gradient}: fresh gradients of a random
    loss on the output and the final state. gate: decay= or log_decay= (its gradient is "ddecay");
    rounded_as: the dtypes (of out, of the state) to round the loss weights to first, as another run sees them."""
    out, W = run_op(rule, inputs, backend, **gate)
    weights = loss_weights((out, W), torch.Generator().manual_seed(seed))
    if rounded_as is not None:
        weights = [w.to(dtype).to(w.dtype) for w, dtype in zip(weights, rounded_as)]
    loss = sum((x * w).sum() for x, w in zip((out, W), weights))
    names = ["dq", "dk", "dv", "dbeta", "dstate"]
    wrt = {name: x for name, x in zip(names, inputs)
           if x is not None and x.requires_grad and (rule == "delta" or name != "dbeta")}
    wrt.update({"ddecay": x for x in gate.values() if x is not None and x.requires_grad})
    grads = torch.autograd.grad(loss, list(wrt.values())) if wrt else []
    return {"out": out.detach(), "state": W.detach(), **dict(zip(wrt, grads))}


def assert_all_close(got, want, rtol, atol):
    """got and want from outputs_and_grads: the same names, every tensor finite and close."""
    assert got.keys() == want.keys()
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        torch.testing.assert_close(got[name].to(want[name].dtype), want[name], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


def relative_errors(got, want):
    """{name: max |got - want| / max |want|} over outputs_and_grads' tensors."""
    return {name: ((got[name].double() - want[name].double()).abs().max()
                   / want[name].double().abs().max().clamp_min(1e-12)).item() for name in want}


def recurrence(rule):
    """The paper's recurrences written out here, token by token, with the decay as a plain multiplier a_t
    (no log anywhere): the ground truth the reference backend is held to, and for decays of exactly zero.
    A callable for run_op. Sum rule (Eq. 17, Eq. 11): W_t = a_t W_{t-1} + v_t k_t^T; delta rule (Eqs. 20, 24,
    25): vbar_t = a_t W_{t-1} k_t, W_t = a_t W_{t-1} + beta_t (v_t - vbar_t) k_t^T; out_t = W_t q_t."""
    def run(q, k, v, beta, W0, decay=None):
        B, H, T, D = q.shape
        W = q.new_zeros(B, H, v.shape[-1], D) if W0 is None else W0
        outs = []
        for t in range(T):
            if decay is not None:
                W = W * decay[:, :, t, None, None]
            write = v[:, :, t]
            if rule == "delta":
                write = beta[:, :, t, None] * (write - (W @ k[:, :, t, :, None])[..., 0])
            W = W + write[..., None] * k[:, :, t, None, :]
            outs.append((W @ q[:, :, t, :, None])[..., 0])
        return torch.stack(outs, 2), W

    return run


def with_full_forgets(decay, pattern):
    """decay (a leaf) with some values replaced: "one zero", "zeros in a row" (across a chunk border of 64
    and 32), or "subnormal" (below float32's smallest normal). Returns a new leaf with requires_grad."""
    a = decay.detach().clone()
    if pattern == "one zero":
        a[..., 5] = 0
    elif pattern == "zeros in a row":
        a[..., 30:34] = 0
        a[..., 62:66] = 0
    elif pattern == "subnormal":
        a[..., 5] = 1e-40
        a[..., 40] = 3e-39
        a[..., 41] = 0
    else:
        raise ValueError(pattern)
    return a.requires_grad_()


# -- tiny fairseq models -------------------------------------------------------------------


def parse_args(task, arch, *flags):
    """fairseq-train's arguments for a model of `arch` (data not read)."""
    from fairseq import options

    parser = options.get_training_parser()
    argv = ["/nonexistent-data", "--task", task, "--arch", arch, "--user-dir", PLUGIN_DIR, *flags]
    return options.parse_args_and_arch(parser, argv)


def toy_dictionary(n_words=30):
    from fairseq.data import Dictionary

    d = Dictionary()
    for i in range(n_words):
        d.add_symbol(f"w{i}")
    return d


def build_translation_model(*flags, seed=0):
    from fairseq_fwp.models.fwp_transformer import FastWeightTransformerModel

    args = parse_args("translation", "fwp_transformer_tiny", "--dropout", "0", *flags)
    d = toy_dictionary()
    torch.manual_seed(seed)
    model = FastWeightTransformerModel.build_model(args, types.SimpleNamespace(source_dictionary=d, target_dictionary=d))
    return model.eval(), d


def build_lm_model(*flags, seed=0):
    from fairseq_fwp.models.fwp_transformer_lm import FastWeightTransformerLanguageModel

    args = parse_args("language_modeling", "fwp_lm_tiny", "--dropout", "0", *flags)
    d = toy_dictionary()
    torch.manual_seed(seed)
    model = FastWeightTransformerLanguageModel.build_model(
        args, types.SimpleNamespace(source_dictionary=d, target_dictionary=d))
    return model.eval(), d


def log_probabilities(model, *inputs):
    """What `model` (in eval mode) predicts at every position of `inputs`: the log-probability of every word of
    its vocabulary (model.get_normalized_probs; through an adaptive softmax, its head and every tail cluster)."""
    with torch.no_grad():
        return model.get_normalized_probs(model(*inputs), log_probs=True)


def random_tokens(d, lengths, seed=0, left_pad=True):
    """[B, max_len] tokens of the given lengths, padded left (sources) or right."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    tokens = torch.full((len(lengths), T), d.pad(), dtype=torch.long)
    for i, n in enumerate(lengths):
        row = torch.randint(d.nspecial, len(d), (n,), generator=g)
        row[-1] = d.eos()
        if left_pad:
            tokens[i, T - n:] = row
        else:
            tokens[i, :n] = row
    return tokens


# -- language-model generation: a prompt read in one call against forcing ---------------------


def prompts(d, lengths, seed=0):
    """fairseq's LM generation input for prompts of `lengths` tokens: (the sample, whose src_tokens are each
    prompt after </s>, and prefix_tokens, the prompts), both right-padded as fairseq pads them."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.full((len(lengths), max(lengths)), d.pad())
    for row, length in enumerate(lengths):
        prefix[row, :length] = torch.randint(d.nspecial, len(d), (length,), generator=g)
    src = torch.cat([torch.full((len(lengths), 1), d.eos()), prefix], 1)
    return {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([n + 1 for n in lengths])}}, prefix


@contextlib.contextmanager
def softmax_in_the_models_dtype():
    """fairseq's softmax and log_softmax compute in float32 whatever the model's dtype (the output's, and a
    softmax layer's attention): in the model's here, so that a float64 model's generated scores are float64
    too (SequenceGenerator keeps them in the log-probabilities' dtype)."""
    from unittest import mock

    from fairseq import utils

    with mock.patch.object(utils, "log_softmax", lambda x, dim, onnx_trace=False: torch.log_softmax(x, dim=dim)), \
            mock.patch.object(utils, "softmax", lambda x, dim, onnx_trace=False: torch.softmax(x, dim=dim)):
        yield


def generated(generator_class, model, d, sample, prefix, seed=0, search_options=(), history=None, bos_token=None,
              **options):
    """generator_class([model], d, ...).generate with prefix_tokens, torch's generator seeded first (sampling);
    search_options: beam_size, or sampling=True with sampling_topk, or diverse=(groups, strength) (diverse beam
    search); history: a session's turn (session.History); bos_token: what the generation starts from (</s>)."""
    from fairseq import search

    options = {**dict(search_options), **options}
    if options.pop("sampling", False):
        options["search_strategy"] = search.Sampling(d, sampling_topk=options.pop("sampling_topk"))
    if "diverse" in options:
        options["search_strategy"] = search.DiverseBeamSearch(d, *options.pop("diverse"))
    generator = generator_class([model], d, **options)
    torch.manual_seed(seed)
    with torch.no_grad():
        return generator.generate([model], sample, prefix_tokens=prefix, bos_token=bos_token,
                                  **({} if history is None else {"history": history}))


def read_in_one_call(model, d, sample, prefix, **options):
    """FastWeightSequenceGenerator's generations; where it raises, an AssertionError that says so (forcing, the
    generator it must equal, generates on the same input)."""
    from fairseq_fwp.sequence_generator import FastWeightSequenceGenerator

    try:
        return generated(FastWeightSequenceGenerator, model, d, sample, prefix, **options)
    except Exception as error:
        raise AssertionError(f"FastWeightSequenceGenerator raised {error!r}") from error


def teacher_forced(model, d, tokens):
    """The model's log-probability of each of `tokens` after </s> and the ones before it (a full forward)."""
    inputs = torch.cat([tokens.new_tensor([d.eos()]), tokens[:-1]]).unsqueeze(0)
    with torch.no_grad():
        lprobs = model.get_normalized_probs(model(inputs), log_probs=True)[0]
    return lprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def assert_same_hypotheses(got, want, tolerance=1e-9, what="forcing"):
    """Every sentence's hypotheses: the same tokens, positional scores and score (within `tolerance`)."""
    for sentence_got, sentence_want in zip(got, want, strict=True):
        assert len(sentence_got) == len(sentence_want), f"not as many hypotheses as {what}"
        for hypothesis, hypothesis_want in zip(sentence_got, sentence_want):
            assert torch.equal(hypothesis["tokens"], hypothesis_want["tokens"]), f"not the tokens of {what}"
            for key in ("positional_scores", "score"):
                difference = (hypothesis[key] - hypothesis_want[key]).abs().max().item()
                assert difference <= tolerance, f"{key} {difference:.3g} off {what}'s"


def assert_scores_are_teacher_forced(model, d, generations, tolerance=1e-9):
    """Each hypothesis's positional scores are the model's log-probabilities of its tokens (a full forward)."""
    for hypotheses in generations:
        for hypothesis in hypotheses:
            want = teacher_forced(model, d, hypothesis["tokens"])
            difference = (hypothesis["positional_scores"] - want).abs().max().item()
            assert difference <= tolerance, f"positional scores {difference:.3g} off the teacher-forced ones"


def assert_generates_what_forcing_does(model, d, sample, prefix, tolerance=1e-9, scores_are_the_models=True,
                                       **options):
    """FastWeightSequenceGenerator gives the hypotheses of fairseq's SequenceGenerator (which forces the prompt
    one token per step): tokens, positional scores and scores; the positional scores the model's teacher-forced
    log-probabilities (unless options change them: a temperature, an LM fused in). In float64, under
    softmax_in_the_models_dtype. Returns its generations."""
    from fairseq.sequence_generator import SequenceGenerator

    forced = generated(SequenceGenerator, model, d, sample, prefix, **options)
    read = read_in_one_call(model, d, sample, prefix, **options)
    assert_same_hypotheses(read, forced, tolerance)
    if scores_are_the_models:
        assert_scores_are_teacher_forced(model, d, read, tolerance)
    return read


def assert_reads_eos_as_context(model, d, sample, prefix, tolerance=1e-9, scores_are_the_models=True, **options):
    """A prompt holding </s>, which FastWeightSequenceGenerator reads as context (fairseq's forcing ends there):
    every hypothesis holds its whole prompt and goes on after it, with the model's teacher-forced log-probabilities
    through it as positional scores (unless options change them); and, but in sampling, each sentence generates
    what it generates alone (with beam search: its prompt read before the loop starts, whatever the batch's other
    prompts), but a prompt shorter than --min-len, which fairseq does not apply while another row forces its
    prompt (forcing's own dependence on the batch)."""
    read = read_in_one_call(model, d, sample, prefix, **options)
    for hypotheses, prompt in zip(read, prefix, strict=True):
        prompt = prompt[prompt.ne(d.pad())]
        for hypothesis in hypotheses:
            assert torch.equal(hypothesis["tokens"][:len(prompt)], prompt), "the prompt is not whole"
            assert len(hypothesis["tokens"]) > len(prompt), "the hypothesis ended in its prompt"
    if scores_are_the_models:
        assert_scores_are_teacher_forced(model, d, read, tolerance)
    if not dict(options.get("search_options", ())).get("sampling"):  # sampling draws for the whole batch at once
        for row, hypotheses in enumerate(read):
            length = int(prefix[row].ne(d.pad()).sum())
            if length < options.get("min_len", 1):  # fairseq lifts --min-len while any row forces its prompt
                continue
            by_itself = {"net_input": {"src_tokens": sample["net_input"]["src_tokens"][row:row + 1, :length + 1],
                                       "src_lengths": torch.tensor([length + 1])}}
            assert_same_hypotheses([hypotheses], read_in_one_call(model, d, by_itself, prefix[row:row + 1, :length],
                                                                  **options), tolerance, "the sentence alone")
    return read


def one_prompt(d, tokens):
    """fairseq's LM generation input for one prompt `tokens` (1-D): (the sample, prefix_tokens)."""
    src = torch.cat([tokens.new_tensor([d.eos()]), tokens]).unsqueeze(0)
    return {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([src.size(1)])}}, tokens.unsqueeze(0)


def session_turn(model, d, history, tokens, **options):
    """A turn of the session `history` (session.History) with the input `tokens` (1-D): its generations."""
    from fairseq_fwp.sequence_generator import FastWeightSequenceGenerator

    return generated(FastWeightSequenceGenerator, model, d, *one_prompt(d, tokens), history=history, **options)


def assert_turns_equal_the_whole_history(model, d, history, turns, kept=None, **options):
    """Each turn against generating with the whole history (the kept hypotheses, then the input) as one prompt,
    with the turn's limits counted from there (as_whole_history): the turn's hypotheses are the whole history's,
    less the history's tokens and positional scores. In float64, under softmax_in_the_models_dtype. `kept`: the
    tokens the history holds already (none). Returns the tokens kept (every input and kept reply, each with its
    </s>)."""
    from fairseq_fwp.sequence_generator import FastWeightSequenceGenerator

    kept = torch.zeros(0, dtype=torch.long) if kept is None else kept
    for tokens in turns:
        got = session_turn(model, d, history, tokens, **options)
        want = generated(FastWeightSequenceGenerator, model, d, *one_prompt(d, torch.cat([kept, tokens])),
                         **as_whole_history(options, len(kept), len(tokens)))
        for hypothesis in want[0]:
            hypothesis["tokens"] = hypothesis["tokens"][len(kept):]
            hypothesis["positional_scores"] = hypothesis["positional_scores"][len(kept):]
        assert_same_hypotheses(got, want, what="the whole history as one prompt")
        kept = torch.cat([kept, got[0][0]["tokens"]])
        assert history.tokens_read == len(kept), "the session has not read every input and kept reply"
    return kept


def as_whole_history(options, kept, n):
    """A turn's generation `options` for the whole history as one prompt (`kept` tokens before an input of n): a
    turn's limits are its reply's (at most max_len_a n + max_len_b tokens, at least min_len where that leaves room),
    fairseq's count from the sequence's start."""
    reply = max(int(options.get("max_len_a", 0) * n + options.get("max_len_b", 200)), 0)
    return {**options, "max_len_a": 0, "max_len_b": kept + n + reply,
            "min_len": kept + n + min(options.get("min_len", 1), reply)}


# -- a web server for the downloads ----------------------------------------------------------


@contextlib.contextmanager
def serving(root):
    """The folder `root` served over HTTP on 127.0.0.1, from a thread of this process; yields its URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
