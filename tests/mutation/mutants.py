"""Plausible bugs, most of them one line, in the code that holds the math and the state: each is a mistake someone could
make while changing that code, written as the one line (or fragment) it would change. `bash scripts/mutants.sh`
(run.py) applies each to a copy of the repository (copies.py) and runs the property harness against it, and the
fast lane where the harness misses it: the score is in docs/DEVELOPERS.md ("Test strength").

`harness`: the property tests that must catch it, by an assertion (pytest's -k over tests/properties; run.py
counts a crash apart, not as caught), where it breaks one of their invariants; None where only other tests can
(a formula that every path of the layer computes alike, a guard the harness's draws never cross). `equivalent`:
why no test can tell it from the original, where none can (the same function, or a difference below every
dtype's rounding, or one that only a GPU could show).

Each edit's original text must occur exactly once in its file (copies.apply checks): a change to that code
that moves the text makes run.py report the mutant as stale, to be rewritten against the new code.
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


CHUNKED, GATED = "fairseq_fwp/ops/chunked.py", "fairseq_fwp/ops/chunked_gated.py"
CHANNELS = "fairseq_fwp/ops/chunked_channels.py"
DECAY, COLUMNS, MEMORY = "fairseq_fwp/ops/decay.py", "fairseq_fwp/ops/decay_columns.py", "fairseq_fwp/ops/memory.py"
STATE, STREAMS = "fairseq_fwp/modules/state.py", "fairseq_fwp/modules/carried_streams.py"
FUSED, GATES = "fairseq_fwp/modules/fused_step.py", "fairseq_fwp/modules/gates.py"
MAPS = "fairseq_fwp/modules/feature_maps.py"
LAYER = "fairseq_fwp/modules/fast_weight_attention.py"
GENERATOR, SESSION = "fairseq_fwp/sequence_generator.py", "fairseq_fwp/session.py"
RULES = "fairseq_fwp/ops/rules/"

# -k selections of tests/properties (test ids: test_every_call_of_the_ops[<invariant>-<rule>],
# test_every_combination_of_flags[<invariant>-<family>(-<map>)])
OPS = "test_every_call_of_the_ops"
MODELS = "test_every_combination_of_flags"
PER_CHANNEL = "(gla or kda or gdn2 or per-channel)"
# the model invariants that a wrong forward of a kernel breaks: decoding (the rules' own steps, or the fused step)
# and a prompt's steps against the kernel's full forward, carried segments (a start state), the reference backend
FORWARD = "decoding_equals or a_prompt or two_carried or the_backend_gives"
DECODING = "decoding_equals or a_prompt or two_carried or fused_step"


def ops(invariants, rules):
    return f"{OPS} and ({invariants}) and ({rules})"


def models(invariants, families):
    return f"{MODELS} and ({invariants}) and ({families})"


GENERATION = f"{MODELS} and a_prompt_read_in_one_call"  # the LM generation invariant, every family


MUTANTS = (
    one_line("chunked-delta-beta-gradient-through-chunk-starts", "fairseq_fwp/ops/chunked.py",
           "            db -= (neg_dR_k * K).sum(-1)\n", "",
           "the delta rule's chunked backward drops beta's gradient through the chunk-start states",
           harness="test_every_call_of_the_ops and named_backend and delta"
                   " or test_every_combination_of_flags and the_backend_gives and (delta or product)"),
    one_line("reorder-skips-short-convolution-caches", "fairseq_fwp/modules/state.py",
           "        if self.convolutions:\n            self.convolutions = tuple(cache.index_select(0, new_order)",
           "        if False:\n            self.convolutions = tuple(cache.index_select(0, new_order)",
           "beam search's reorder moves the memory but not the short convolutions' caches",
           harness="test_every_combination_of_flags and decoding_equals"),
    Mutant("disjoint-supports-under-attention-normalisation", (
        ("fairseq_fwp/modules/normaliser.py",
         "    return torch.where(normalizer > 0, out / (normalizer + eps), 0.0)",
         "    return out / (normalizer + eps)"),
        ("fairseq_fwp/ops/chunked.py", "            later = qdo[:, :, 1:].flip(2).cumsum(2).flip(2)\n"
         "            dS_end = torch.cat([later, torch.zeros_like(qdo[:, :, :1])], 2)\n",
         "            dS_end = qdo.flip(2).cumsum(2).flip(2) - qdo\n")),
        "Eqs. 19, 28 divide by z . phi(q) + eps where z . phi(q) is 0 (disjoint DPFP supports), and the sum rule's "
        "chunked backward takes each chunk's own term from a reverse cumulative sum that holds it: the 1 / eps "
        "gradients' rounding reaches the other chunks",
        harness="test_every_combination_of_flags and the_backend_gives and dpfp"),

    # -- ops/chunked.py: the sum and delta rules' chunked forms, DeltaProduct's interleaving --
    one_line("chunked-sum-exclusive-mask", CHUNKED,
             "        A = (Q @ _t(K)).tril()  # inclusive", "        A = (Q @ _t(K)).tril(-1)  # inclusive",
             "the sum rule's intra-chunk mask without its diagonal: out_t reads W_{t-1}, not W_t",
             harness=ops("named_backend", "sum") + " or " + models(FORWARD, "sum")),
    one_line("chunked-sum-later-chunks-off-by-one", CHUNKED,
             "later = qdo[:, :, 1:].flip(2)", "later = qdo[:, :, :-1].flip(2)",
             "the sum rule's backward: the state gradient at chunk n's end sums the queries of chunks m >= n - 1 "
             "(an off-by-one at the chunk border), not m > n",
             harness=ops("named_backend", "sum") + " or " + models("the_backend_gives", "sum")),
    one_line("chunked-delta-key-gradient-drops-the-transposed-term", CHUNKED,
             "_add_matmul_(dK, P + _t(P), K)", "_add_matmul_(dK, P, K)",
             "the delta rule's backward through K K^T keeps dM's lower triangle only (d(K K^T) is P + P^T)",
             harness=ops("named_backend", "delta") + " or " + models("the_backend_gives", "delta or product")),
    one_line("chunked-delta-state-alone-adds-the-retrieval", CHUNKED,
             "Uv[:, :, n] - Wk[:, :, n] @ S\n", "Uv[:, :, n] + Wk[:, :, n] @ S\n",
             "the delta rule's final-state-only form adds the start state's retrieval to the pseudo-values (a sign)",
             harness=ops("state_alone", "delta or product")),
    one_line("chunked-product-decays-at-the-last-write", CHUNKED,
             "torch.cat([log_decay.unsqueeze(3), log_decay.new_zeros(B, H, T, N - 1, *log_decay.shape[3:])],",
             "torch.cat([log_decay.new_zeros(B, H, T, N - 1, *log_decay.shape[3:]), log_decay.unsqueeze(3)],",
             "DeltaProduct's interleaved sequence decays the memory before the token's last write, not its first",
             harness=ops("named_backend or state_alone", "product") + " or " + models(FORWARD, "product")),
    one_line("chunked-delta-system-keeps-its-diagonal", CHUNKED,
             "M = (KKt * beta.unsqueeze(-1)).tril_(-1)", "M = (KKt * beta.unsqueeze(-1)).tril_()",
             "the delta rule's triangular system takes tril_() for its strictly lower part",
             equivalent="the next line overwrites the diagonal with ones, and the solve is unitriangular (it never "
                        "reads the diagonal): the same M^-1, bit for bit"),

    # -- ops/chunked_gated.py: a decay per head --
    one_line("gated-decay-factors-read-the-future", GATED,
             "n.unsqueeze(-1), n.unsqueeze(-2), lower)", "n.unsqueeze(-1), n.unsqueeze(-2))",
             "the chunk's decay factors G without the causal mask: queries read the chunk's later keys",
             harness=ops("named_backend", "gated") + " or " + models(FORWARD, "gated or product")),
    one_line("gated-backward-drops-the-end-decays-pull", GATED,
             "(d_rho * rho).sum(-1) + d_gamma_end * gamma_end", "(d_rho * rho).sum(-1)",
             "the gated backward drops the decays' gradient through gamma_C (the state carried to the next chunk)",
             harness=ops("named_backend", "gated") + " or " + models("the_backend_gives", "gated or product")),
    one_line("gated-backward-cumsum-forwards", GATED,
             "d_log = dc.flip(-1).cumsum(-1).flip(-1)", "d_log = dc.cumsum(-1)",
             "c = cumsum(log a), so d log a is the reverse cumulative sum of dc: a forward one instead",
             harness=ops("named_backend", "gated") + " or " + models("the_backend_gives", "gated or product")),
    one_line("gated-delta-beta-gradient-drops-the-start-decay", GATED,
             "(dR_v * V).sum(-1) + (dR_k * K).sum(-1) * gamma\n", "(dR_v * V).sum(-1) + (dR_k * K).sum(-1)\n",
             "the gated delta rule's beta gradient through the start state's retrieval without its decay gamma",
             harness=ops("named_backend", "gated-delta") + " or " + models("the_backend_gives", "gated or product")),
    one_line("gated-delta-start-state-retrieval-undecayed", GATED,
             "Wk, U = Tinv @ (K * (b * gamma.unsqueeze(-1))), Tinv @ (V * b)", "Wk, U = Tinv @ (K * b), Tinv @ (V * b)",
             "the gated delta rule retrieves the chunk's start state without the decay since the chunk's start",
             harness=ops("named_backend or state_alone", "gated-delta") + " or " + models(FORWARD, "gated or product")),
    one_line("gated-full-forgets-below-eps", GATED,
             "return 2.0 * math.log(torch.finfo(dtype).eps)", "return math.log(torch.finfo(dtype).eps)",
             "decays below eps of the dtype (not eps^2) counted as full forgets",
             equivalent="a decay between eps^2 and eps that is cut to 0 removes less than eps of the dtype, relative "
                        "to the state it scales, from every output and gradient (log a's own gradient there is a "
                        "times a finite number; decay='s small decays take exact passes that set them to 1): below "
                        "the rounding of the dtype, under every tolerance"),

    # -- ops/chunked_channels.py: a decay per key channel --
    one_line("channels-state-decay-misses-the-first-step", CHANNELS,
             "gamma_end = gamma[..., -1, :]", "gamma_end = rho[..., 0, :]",
             "the state's decay across a chunk taken as rho_0 = exp(c_C - c_1), which misses the first step's decay",
             harness=ops("named_backend or state_alone", PER_CHANNEL) + " or " + models(FORWARD, "per-channel")),
    one_line("channels-start-state-retrieval-undecayed", CHANNELS,
             "M_inv @ (R * gamma)", "M_inv @ R",
             "KDA's and GDN-2's retrieval of the chunk's start state without the decay since the chunk's start",
             harness=ops("named_backend or state_alone", "kda or gdn2") + " or " + models(FORWARD, "per-channel")),
    one_line("channels-cumsum-over-channels", CHANNELS,
             "c = g.masked_fill(forgets, 0.0).double().cumsum(-2)",
             "c = g.masked_fill(forgets, 0.0).double().cumsum(-1)",
             "the cumulative log-decays summed over the key channels instead of over time",
             harness=ops("named_backend or state_alone", PER_CHANNEL) + " or " + models(FORWARD, "per-channel")),
    one_line("channels-writes-decayed-from-the-chunk-start", CHANNELS,
             "Kr = (K * rho).transpose(-1, -2)", "Kr = (K * gamma).transpose(-1, -2)",
             "each write decayed by the steps before it (gamma) instead of after it (rho) on its way to the chunk's "
             "end",
             harness=ops("named_backend or state_alone", PER_CHANNEL) + " or " + models(FORWARD, "per-channel")),

    # -- ops/decay.py, ops/decay_columns.py: exact gradients of small decays given as decay= --
    one_line("decay-exact-below-eps-not-sqrt-eps", DECAY,
             "return torch.finfo(dtype).eps ** 0.5", "return torch.finfo(dtype).eps",
             "decays between eps and sqrt(eps) get d log a / a, which loses most of its digits there",
             harness=ops("named_backend or reference_agrees", "gated or gla or kda or gdn2")),
    one_line("decay-passes-counted-across-heads", DECAY,
             "rank = full.cumsum(2)  # each row's steps", "rank = full.cumsum(1)  # each row's steps",
             "the small steps split into two passes by a count over the heads, not over time: adjacent small steps "
             "of one row share a pass",
             harness=ops("named_backend or reference_agrees", "gated or gla or kda or gdn2")),
    one_line("decay-exact-only-when-every-decay-is-small", DECAY,
             "and bool((decay.detach() < small(decay.dtype)).any()))",
             "and bool((decay.detach() < small(decay.dtype)).all()))",
             "the exact gradients only where every decay is small (all, not any): 0 / 0 at a full forget otherwise",
             harness=ops("named_backend or reference_agrees", "gated or gla or kda or gdn2")),
    one_line("columns-backward-sum-unshifted", COLUMNS,
             "shifted = torch.cat([log_decay[:, :, 1:], torch.zeros_like(log_decay[:, :, :1])], 2)",
             "shifted = log_decay",
             "the columns' adjoint decayed by a_t instead of a_{t+1} (an off-by-one in time)",
             harness=ops("named_backend or reference_agrees", "gla or kda")),
    one_line("columns-delta-retrieval-pull-sign", COLUMNS,
             "pulls -= (k_d.unsqueeze(-1)", "pulls += (k_d.unsqueeze(-1)",
             "the delta write's retrieval term added to the columns' adjoint instead of subtracted",
             harness=ops("named_backend or reference_agrees", "kda")),
    one_line("columns-read-after-the-write", COLUMNS,
             "before = torch.cat([start.unsqueeze(3), read[:, :, :, :-1]], 3)", "before = read",
             "dL/da_t takes the column as step t's query reads it, after the write (W_t), not the column the decay "
             "scales (W_{t-1}): an off-by-one in time",
             harness=ops("named_backend or reference_agrees", "gla or kda")),
    one_line("columns-history-ignores-the-start-state", COLUMNS,
             "start = torch.zeros_like(read[:, :, :, 0]) if state is None else _channel_of(copies, state)",
             "start = torch.zeros_like(read[:, :, :, 0])",
             "the column before the first step taken as 0 where the op starts from a state",
             harness=ops("named_backend or reference_agrees", "gla or kda")),
    one_line("columns-adjoint-starts-from-zero", COLUMNS,
             "flip(shifted), final.unsqueeze(-1))", "flip(shifted), None)",
             "the columns' adjoint run back from 0, not from the final state's gradient dL/dW_T",
             harness=ops("named_backend or reference_agrees", "gla or kda")),

    # -- ops/memory.py: the decoder's memory --
    one_line("memory-reorder-leaves-the-free-slot-unzeroed", MEMORY,
             "            new[:, :, n:].zero_()\n", "",
             "a reorder of W's factors leaves the slot for the next token as the storage held it (read before the "
             "write fills it)",
             harness=f"{MODELS} and (decoding_equals or fused_step)"),
    one_line("memory-copy-not-detached", MEMORY,
             "return self._copy(lambda x: x.detach())", "return self._copy(lambda x: x)",
             "the memory a next segment starts from keeps the previous segment's autograd history"),
    one_line("memory-holds-factors-a-token-too-long", MEMORY,
             "        if self.tokens >= limit:\n", "        if self.tokens > limit:\n",
             "W's factors kept one token past the length where W is smaller (the same reads, more numbers to copy)"),

    # -- modules/state.py, modules/carried_streams.py: what a layer carries --
    one_line("state-source-rows-grouped-without-transpose", STATE,
             "grouped = q.view(n, g, H, T, D).transpose(1, 2).reshape(n, H, g * T, D)",
             "grouped = q.view(n, g, H, T, D).reshape(n, H, g * T, D)",
             "the beams that share a source memory grouped by a reshape without the transpose: heads and beams mixed",
             harness=f"{MODELS} and (decoding_equals or fused_step)"),
    one_line("state-arbitrary-reorder-kept-as-groups", STATE,
             "kept = new_order.numel() % g == 0 and bool((source.view(-1, g) == source.view(-1, g)[:, :1]).all())",
             "kept = new_order.numel() % g == 0",
             "a reorder whose rows stop coming in groups of one source still read one memory per group"),
    one_line("streams-any-other-position-continues", STREAMS,
             "elif stream is not None and position == stream.position + 1 and position > 0:",
             "elif stream is not None and position != stream.position:",
             "a carried stream's reset skipped: a segment at any new position continues the last one, not only the "
             "next"),
    one_line("streams-start-not-copied", STREAMS,
             "state = stream.start.to(device)", "state = stream.start",
             "the state a segment starts from handed out itself, not a copy: the layer's forward moves it on"),
    one_line("streams-end-not-detached", STREAMS,
             "stream.end = state.detached()", "stream.end = state",
             "the state a segment ends with kept with its autograd history (no truncated backpropagation)"),

    # -- modules/fused_step.py: the fused decoding step's Python glue --
    one_line("fused-normalised-retrieval-for-every-rule", FUSED,
             "o.attention_normalization and attention.rule.normalised_retrieval,", "o.attention_normalization,",
             "the fused step told to normalise the retrieval (Eqs. 26-28) for every rule under attention "
             "normalisation, DeltaProduct's too",
             harness=f"{MODELS} and (decoding_equals or fused_step)"),
    one_line("fused-qk-norm-codes-swapped", FUSED,
             'QK_NORMS = {"none": 0, "sum": 1, "l2": 2}', 'QK_NORMS = {"none": 0, "sum": 2, "l2": 1}',
             "the q/k normalisation passed to the fused step as the other one's code",
             harness=f"{MODELS} and (decoding_equals or fused_step)"),
    one_line("fused-drops-favors-input-scale", FUSED,
             'float(getattr(attention.feature_map, "input_scale", 1.0))', "1.0",
             "FAVOR+'s input scale head_dim^-1/4 not passed to the fused step",
             harness=f"{MODELS} and (decoding_equals or fused_step)"),
    one_line("fused-on-a-gpu-without-its-kernels", FUSED,
             'if built is None or (device == "cuda" and not built.has_cuda_kernels()):', "if built is None:",
             "the fused step runs CUDA tensors with an extension built without its CUDA kernels"),

    # -- modules/gates.py, modules/feature_maps.py: gates and feature maps --
    one_line("output-gate-rms-over-time", GATES,
             "vector_norm(out, dim=-1, keepdim=True, dtype=wide)", "vector_norm(out, dim=-2, keepdim=True, dtype=wide)",
             "the output gate's RMS norm over the time axis instead of the head's channels",
             harness=f"{MODELS} and ({DECODING})"),
    one_line("output-gate-eps-outside-the-root", GATES,
             "torch.rsqrt(mean_square + self.eps)", "(torch.rsqrt(mean_square) + self.eps)",
             "the RMS norm's eps added after the reciprocal square root, not under it: 1 / 0 where a head's output "
             "is 0 (DPFP's disjoint supports under attention normalisation)",
             harness=f"{MODELS} and (training_gives or the_backend_gives or {DECODING})"),
    one_line("decay-gate-normaliser-inside", GATES,
             "return F.logsigmoid(z) / 16", "return F.logsigmoid(z / 16)",
             "GLA's normaliser 16 divides the logit, not the log-sigmoid"),
    one_line("dpfp-rolls-from-zero", MAPS,
             "for i in range(1, self.nu + 1)]", "for i in range(self.nu)]",
             "DPFP's rolls start at 0 (r * r) instead of 1",
             harness=f"{MODELS} and (decoding_equals or fused_step)"),
    # the layers' fused normalisations (normalized_features; their references, normalize_features, are tests')
    one_line("l2-normalise-over-time", MAPS,
             "vector_norm(phi, dim=-1, keepdim=True", "vector_norm(phi, dim=-2, keepdim=True",
             "the L2 normalisation of phi(q), phi(k) over the time axis instead of the features",
             harness=f"{MODELS} and ({DECODING})"),
    one_line("sum-normalise-eps-added", MAPS,
             "inverse = total.clamp_min_(eps).reciprocal_()", "inverse = total.add_(eps).reciprocal_()",
             "Eq. 29's eps added to the sum instead of bounding it below (the fused step's own normalisation, in "
             "C++, still bounds it)",
             harness=f"{MODELS} and ({DECODING})"),
    one_line("sum-normalise-backward-drops-the-sums-term", MAPS,
             "along = _along(g, out, unclamped, inverse.dtype, through_inverse)",
             "along = _along(g, out, unclamped, inverse.dtype, through_inverse).mul_(0)",
             "Eq. 29's backward without the gradient through the sum it divides by",
             harness=f"{MODELS} and the_fused_glue"),
    one_line("second-derivative-without-the-normalisers-own-term", MAPS,
             "through_inverse = None if g_inverse is None else g_inverse.to(inverse.dtype) * inverse",
             "through_inverse = None",
             "the fused sum normalisation's backward drops the gradient reaching 1 / S itself, which only a second "
             "derivative (a gradient penalty) sends", harness=f"{MODELS} and the_fused_glue"),
    one_line("linear-map-fused-for-a-subclass", MAPS,
             'if how == "sum" and type(self) is LinearFeatureMap and fused():', 'if how == "sum" and fused():',
             "a user's subclass of the linear map (its own forward) runs the built-in map's fused elu + 1",
             harness=f"{MODELS} and the_fused_glue"),
    one_line("linear-features-through-elu-plus-one", MAPS,
             "            phi = elu_plus_one(x) if through_elu else x",
             "            phi = (F.elu(x) + 1) if through_elu else x",
             "the fused linear map computes elu(x) + 1 as elu plus 1, which cancels where x is negative",
             harness="test_a_normalisation_errs_as_the_composition_it_fuses and linear"),
    one_line("projections-hide-their-calls-from-hooks", "fairseq_fwp/modules/layouts.py",
             "if not torch.is_grad_enabled() or not fused() or any(type(linear) is not torch.nn.Linear or observed(linear)",
             "if not torch.is_grad_enabled() or not fused() or any(type(linear) is not torch.nn.Linear",
             "the shared-input projections run under a user's hooks, which then never see the projections' calls",
             harness=f"{MODELS} and the_fused_glue"),

    # -- modules/fast_weight_attention.py: attention normalisation --
    one_line("attention-normaliser-over-time", LAYER,
             "divided_by_normalizer(out, (q * z).sum(-1, keepdim=True), self.options.eps)",
             "divided_by_normalizer(out, (q * z).sum(-2, keepdim=True), self.options.eps)",
             "z_t . phi(q_t) summed over the time axis instead of the features",
             harness=f"{MODELS} and ({DECODING})"),
    one_line("normaliser-without-eps", "fairseq_fwp/modules/normaliser.py",
             "torch.where(normalizer > 0, out / (normalizer + eps), 0.0)",
             "torch.where(normalizer > 0, out / normalizer, 0.0)",
             "Eqs. 19, 28's eps dropped as redundant beside the guard against a normaliser of 0 (the fused step, in "
             "C++, still adds it)",
             harness=f"{MODELS} and ({DECODING})"),
    one_line("normaliser-guard-branches-swapped", "fairseq_fwp/modules/normaliser.py",
             "torch.where(normalizer > 0, out / (normalizer + eps), 0.0)",
             "torch.where(normalizer > 0, 0.0, out / (normalizer + eps))",
             "the guard's branches swapped: 0 wherever z . phi(q) is positive, the quotient where it is 0",
             harness=f"{MODELS} and ({DECODING})"),
    one_line("delta-retrieval-normalised-by-the-current-sum", LAYER,
             "    return torch.cat([first, z[:, :, :-1]], 2)", "    return z",
             "the delta rules' retrieval normalised by z_t (this token's key included), not z_{t-1} (Eqs. 26-28)",
             harness=models(DECODING, "delta or product")),

    # -- attention weights: the dual form of the causal rules, and the sources' (source_attention.py) --
    one_line("source-weights-not-normalised", "fairseq_fwp/modules/source_attention.py",
             "weights = None if weights is None else divided_by_normalizer(weights, normalizer, layer.options.eps)",
             "weights = weights",
             "the sources' attention weights left undivided by the normaliser the output is divided by (Eq. 19)",
             harness=f"{MODELS} and attention_weights"),
    one_line("dual-form-weights-not-normalised", LAYER,
             "return weights if z is None else self._normalize_output(weights, q, z.to(weights.dtype))",
             "return weights", "a causal layer's dual-form weights left undivided by z . phi(q) (Eqs. 19, 28)",
             harness=f"{MODELS} and attention_weights"),

    # -- sequence_generator.py: a prompt read in one call --
    one_line("log-probability-chunk-targets-a-column-slice", GENERATOR,
             "targets[:, start:start + LOG_PROB_CHUNK].contiguous())", "targets[:, start:start + LOG_PROB_CHUNK])",
             "a chunk of the prompt's targets handed on as a column slice: an adaptive softmax views it as one row, "
             "which fails for several rows", harness=GENERATION),
    one_line("temperature-divides-in-place", GENERATOR,
             "output = output / temperature", "output = output.div_(temperature)",
             "--temperature divides the output layer's output in place: an adaptive softmax's is the features "
             "themselves, and the distribution after the prompt is divided twice (T squared)", harness=GENERATION),
    one_line("prompts-eos-ends-the-hypothesis-in-the-forced-positions", GENERATOR,
             "if self.model.served is None:\n            return super()._prefix_tokens",
             "if True:\n            return super()._prefix_tokens",
             "fairseq's forcing where the loop steps through a prompt: its </s> ends the hypothesis there, but is "
             "read as context in the positions the loop skips (the result depends on the batch)", harness=GENERATION),
    one_line("a-beam-of-the-vocabulary-starts-after-the-prompt", GENERATOR,
             "\n                and not self._first_step_takes_fewer())", ")",
             "beam search starts after the prompt at its first step even where that step takes fewer candidates "
             "than a later one (a beam of half the vocabulary or more)", harness=GENERATION),
    one_line("prompt-rows-not-right-aligned", GENERATOR,
             "shift = longest - lengths  # padding before each row's bos", "shift = lengths * 0",
             "the prompts read in one call left-aligned: a shorter prompt's padding falls after it, between the prompt "
             "and its first new token", harness=GENERATION),
    one_line("shifted-start-keeps-the-length-limit", GENERATOR,
             "self.max_len_b, self.max_len, self.min_len = self.max_len_b - skipped,",
             "self.max_len_b, self.max_len, self.min_len = self.max_len_b,",
             "the loop that starts after the skipped prompt positions keeps --max-len-b as given: hypotheses as many "
             "tokens longer", harness=GENERATION),
    one_line("skipped-prompt-scores-without-unknown-penalty", GENERATOR,
             "skipped = self.as_forced(self.model.skipped_scores[sentence], prompt).to(positional)",
             "skipped = self.model.skipped_scores[sentence].to(positional)",
             "the skipped prompt positions' scores given back without --unkpen on their <unk>", harness=GENERATION),
    one_line("sampling-draws-one-skipped-step-too-few", GENERATOR,
             "for skipped_step in range(self.skipped):", "for skipped_step in range(self.skipped - 1):",
             "seeded sampling draws the random numbers of one skipped prompt position too few: other samples than "
             "forcing's", harness=GENERATION),
    one_line("forced-eos-stand-in-left-in-the-tokens", GENERATOR,
             "        if step > self.skipped:\n            self._restore_forced(tokens, step - 1)\n", "",
             "the stand-in the loop forces for a prompt's </s> is left in its tokens: hypotheses with padding in their "
             "prompts, and n-gram blocking or an LM fused in reading it", harness=GENERATION),

    # -- session.py: a session's history --
    one_line("session-leaves-a-one-token-reply-unread", SESSION,
             "                if reply.numel():\n", "                if reply.numel() > 1:\n",
             "a reply of one token is not read into the state before the next turn (a test's replies were longer)",
             harness=f"{MODELS} and a_session"),
    one_line("session-length-without-the-replys-eos", SESSION,
             'self.length += hypothesis["tokens"].numel()', 'self.length += hypothesis["tokens"].numel() - 1',
             "the history's length leaves out each reply's </s>: scores normalised by another length than the whole "
             "history's", harness=f"{MODELS} and a_session"),
    one_line("session-score-without-the-replys-eos", SESSION,
             'self.score += float(hypothesis["positional_scores"].double().sum())',
             'self.score += float(hypothesis["positional_scores"][:-1].double().sum())',
             "the history's score leaves out the </s> that ended each reply", harness=f"{MODELS} and a_session"),
    one_line("session-turn-starts-from-bos", SESSION,
             "return bos if self.last is None else bos.new_full(bos.shape, self.last)", "return bos",
             "a later turn starts from the loop's bos, not from the </s> that ended the reply before: the same "
             "token but with --add-bos-token, which the harness does not draw (test_session.py's bos test)"),

    one_line("session-limit-counts-the-input", GENERATOR,
             "self.max_len_a, self.max_len_b = 0, n + self.reply_limit",
             "self.max_len_a, self.max_len_b = 0, self.reply_limit",
             "a turn's length limit counts its input, as fairseq's counts the prompt: an input past it is cut, and "
             "the cut input becomes the history", harness=f"{MODELS} and a_session"),
    one_line("session-min-len-from-the-turns-start", GENERATOR,
             "self.min_len = n + min(self.min_len, self.reply_limit)", "self.min_len = min(self.min_len, self.reply_limit)",
             "--min-len counts from the turn's input, not the reply's start", harness=f"{MODELS} and a_session"),
    one_line("session-takes-options-that-see-only-the-turn", GENERATOR,
             "        self.check_session_options(constraints)\n", "",
             "a turn takes an LM fused in, n-gram blocking, diverse and constrained searches, which see only its "
             "tokens", harness=f"{MODELS} and a_session"),

    # -- ops/rules/: the rules' own steps and kernels --
    one_line("sum-rule-reads-before-its-write", RULES + "sum.py",
             "        return read + v * (k * q).sum(-1, keepdim=True)  # W_t q",
             "        return read  # W_t q",
             "the sum rule's step returns W_{t-1} q, not W_t q (Eq. 11 after Eq. 17)",
             harness=ops("named_backend", "sum or gla")
             + " or " + models(f"{FORWARD} or fused_step", "sum or gated or per-channel")),
    one_line("delta-substeps-retrieve-by-the-query", RULES + "delta.py",
             "vbar = vbar + u * (k[..., j, :] * k[..., i, :]).sum(-1, keepdim=True)",
             "vbar = vbar + u * (k[..., j, :] * q).sum(-1, keepdim=True)",
             "DeltaProduct's sub-step i retrieves the earlier sub-steps' writes with the query, not its key",
             harness=ops("named_backend", "product") + " or " + models(f"{FORWARD} or fused_step", "product or delta")),
    one_line("gdn2-writes-kdas-value", RULES + "channels.py",
             "u = write * v - vbar", "u = write * (v - vbar)",
             "GDN-2's step gates the retrieval with the write gate too (KDA's form), not the value alone",
             harness=ops("named_backend", "gdn2") + " or " + models(f"{FORWARD} or fused_step", "per-channel")),
    one_line("kda-chunked-retrieval-without-beta", RULES + "channels.py",
             "(beta.unsqueeze(-1) * k, beta.unsqueeze(-1) * v)", "(k, beta.unsqueeze(-1) * v)",
             "KDA's chunked kernel retrieves with k_t instead of beta_t k_t",
             harness=ops("named_backend or state_alone", "kda") + " or " + models(FORWARD, "per-channel")),
)
