"""FastWeightSequenceGenerator: fairseq's SequenceGenerator that reads a prompt in one decoder call.

fairseq's generator forces a prompt (prefix_tokens) one token per step: every layer's whole step, and the
generator's own work, for every prompt token before the first new one. A fast-weight decoder
(FastWeightTransformerDecoder) reads any number of tokens in one incremental call, each layer's chunked form
over them, and leaves its state as the steps would. This generator reads every row's prompt in one call,
the rows left-padded to the longest (padding writes nothing), and keeps what the steps would have computed
from it: each prompt token's log-probability and each row's distribution after its prompt.

- The prompt positions that every row forces (the shortest prompt's) are not stepped through: fairseq's loop
  starts after them, its lengths shifted by as many tokens, and each finished hypothesis gets them back
  (its tokens, positional scores, and its score normalised by its whole length). Beam search (greedy
  included) starts there as it does at its first step, from one hypothesis per sentence (the others
  score -inf while the prompt is forced); sampling draws the random numbers of the skipped steps first,
  so that a seeded run samples what forcing samples. Other searches (and an LM fused in, n-gram blocking,
  outputs as long as the sources, a beam of about half the vocabulary or more) step through every position.
- A position where some rows still force their prompt is served without a decoder call; a row whose prompt
  has ended reads its new tokens one per step (the others read padding: nothing).

The tokens and scores are forcing's (its log-probabilities computed in another order: equal to rounding), but
where a prompt holds </s> (fairseq-generate --prefix-size takes its prompts from language_modeling's blocks, which
keep each line's </s>): it is read as context, as the rest of the prompt, where fairseq's forcing ends the
hypothesis there (and, in a beam, may stop on an assertion). Each sentence's result is the same whatever the batch.
The length limit is fairseq's (--max-len-a, --max-len-b; the prompt counts): a model without positions, or
with positions that restart (--fwp-position-period), has none of its own; a model with positions that do not
restart is refused a length past them before any work, where fairseq would cut it silently.
"""
import contextlib
import math

import torch
import torch.nn.functional as F
from fairseq import search
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator

from .modules.transformer_layers import FastWeightTransformerDecoder
from .ops.memory import is_identity
from .session import SessionRefusal

LOG_PROB_CHUNK = 256  # positions whose whole-vocabulary log-probabilities are held at once (an adaptive softmax's
# 267K words: 270 MB in float32)


class PromptReadingEnsemble(EnsembleModel):
    """fairseq's EnsembleModel whose forward_decoder reads the prompts at the first step and then serves the
    steps that force them (read_prompts)."""

    def __init__(self, models):
        super().__init__(models)
        self.prompts = self.served = self.skipped_scores = self.history = self.after_prompt = self.read = None
        self.skipped = 0
        self.rows = None  # the loop's rows at its last step: a reorder that keeps each in place is skipped

    def reads_prompts(self):
        return not self.has_encoder() and all(
            isinstance(getattr(m, "decoder", None), FastWeightTransformerDecoder) for m in self.models)

    def read_prompts(self, prompts, lengths, steps, skipped=0, history=None):
        """At the next first step: every row reads its prompt, prompts ``[sentences, P]`` (left-aligned,
        padding after), of `lengths` ``[sentences]`` tokens, before at most `steps` more steps; the loop's
        steps start `skipped` positions into them; from a session's `history` (session.History) where given,
        which then gets the state after the prompt (after_prompt) and the columns read (read). None: fairseq's
        own steps."""
        self.prompts = None if prompts is None else (prompts, lengths, steps)
        self.served, self.skipped, self.history = None, skipped, history
        self.after_prompt = self.read = None

    def forward_decoder(self, tokens, encoder_outs, incremental_states, temperature: float = 1.0):
        step = tokens.size(1) - 1 + self.skipped  # the position in the whole sequence
        self.rows = tokens.size(0)
        if self.prompts is not None:
            self._read(tokens, incremental_states, temperature)
        if self.served is None:
            return super().forward_decoder(tokens, encoder_outs, incremental_states, temperature)
        served, lprobs = self.served, None
        if step > self.skipped:
            self._restore_forced(tokens, step - 1)
        reading = served["lengths"] < step  # rows past their prompt read this step's token, the others padding
        if bool(reading.any()):
            served["fed"][:, served["width"]] = torch.where(reading, tokens[:, -1], self._pad)
            served["width"] += 1
            lprobs = self._log_probs(served["fed"][:, :served["width"]], incremental_states, temperature)[1]
        return self._served(step, lprobs), None

    def _restore_forced(self, tokens, position):
        """The prompt's tokens at `position` in the loop's last column, where the loop forced a stand-in for a
        prompt's </s> (FastWeightSequenceGenerator._prefix_tokens); `tokens` is a view of the loop's buffer, which
        an LM fused in, n-gram blocking and the finished hypotheses read."""
        forced = self.served["lengths"] > position
        if bool(forced.any()):
            tokens[forced, -1] = self.served["prompts"][forced, position]

    @property
    def _pad(self):
        return self.single_model.decoder.padding_idx

    def _read(self, tokens, incremental_states, temperature):
        """Each row reads its bos and its prompt, left-padded to the longest, in one call per model."""
        prompts, lengths, steps = self.prompts
        self.prompts = None
        beam = tokens.size(0) // prompts.size(0)
        prompts, lengths = prompts.repeat_interleave(beam, 0), lengths.repeat_interleave(beam, 0)
        rows, longest = prompts.shape
        column = torch.arange(longest + 1, device=tokens.device)
        first = tokens[:, :1] if self.history is None else self.history.first(tokens[:, :1])
        bos_and_prompt = torch.cat([first, prompts], 1).masked_fill(column > lengths.unsqueeze(1), self._pad)
        shift = longest - lengths  # padding before each row's bos
        fed = bos_and_prompt.gather(1, (column - shift.unsqueeze(1)) % (longest + 1))  # each row moved right
        after_each = torch.cat([fed[:, 1:], fed[:, :1]], 1)  # the token after each column (the last: unused)
        if self.history is not None:  # the session's state (its columns read count as read before these)
            for index, state in enumerate(incremental_states):
                state.update(self.history.replicated(index, rows))
        chosen, after = self._log_probs(fed, incremental_states, temperature, targets=after_each)
        if self.history is not None:
            self.after_prompt = [self.history.row_copy(index, state) for index, state in enumerate(incremental_states)]
            self.read = fed[:1].clone()
        # position i of row r forces its prompt's token i, read after column shift_r + i
        forced = chosen.gather(1, (shift.unsqueeze(1) + column[:longest]).clamp(max=longest))
        room = fed.new_full((rows, fed.size(1) + steps), self._pad)  # and the columns the steps will read
        room[:, :fed.size(1)] = fed
        self.served = {"lengths": lengths, "forced": forced, "after": after, "prompts": prompts, "fed": room,
                       "width": fed.size(1)}
        self.skipped_scores = forced[::beam, :self.skipped]  # per sentence, in the batch's order

    def _served(self, step, lprobs):
        """The log-probabilities at position `step`: a row still forcing its prompt gets its token's (the
        others -inf, as forcing leaves them), a row at its prompt's end the distribution after it, the others
        `lprobs` (the decoder's)."""
        served = self.served
        lengths, after = served["lengths"], served["after"]
        out = after.new_full(after.shape, -math.inf) if lprobs is None else lprobs
        forcing = lengths > step
        if bool(forcing.any()):
            rows = forcing.nonzero().squeeze(1)
            out[rows] = -math.inf
            out[rows, served["prompts"][rows, step]] = served["forced"][rows, step]
        ending = lengths == step
        if bool(ending.any()):
            out[ending] = after[ending]
        return out

    def _log_probs(self, fed, incremental_states, temperature, targets=None):
        """Every model's log-probabilities after reading `fed`'s unread tokens, combined as fairseq's ensemble
        combines them: (those of `targets` ``[rows, columns]`` after each column, or None; the whole
        distribution ``[rows, vocabulary]`` after the last)."""
        chosen, after = [], []
        for model, state in zip(self.models, incremental_states):
            features, extra = model.decoder(fed, incremental_state=state, features_only=True)
            if targets is not None:
                # contiguous: an adaptive softmax views its targets as one row
                chunks = [(start, targets[:, start:start + LOG_PROB_CHUNK].contiguous())
                          for start in range(0, features.size(1), LOG_PROB_CHUNK)]
                chosen.append(torch.cat([
                    self._normalized(model, features[:, start:start + LOG_PROB_CHUNK], extra, temperature, chunk)
                    .gather(2, chunk.unsqueeze(2)).squeeze(2) for start, chunk in chunks], 1))
            after.append(self._normalized(model, features[:, -1:], extra, temperature)[:, -1])
        return (_combined(chosen) if targets is not None else None), _combined(after)

    @staticmethod
    def _normalized(model, features, extra, temperature, targets=None):
        """fairseq's ensemble step on a decoder's features: the output layer, the temperature, the log-softmax;
        with `targets`, correct at them only (an adaptive softmax computes a tail cluster only where a target
        falls in it)."""
        output = model.decoder.output_layer(features)
        if temperature != 1:  # not in place: an adaptive softmax's output layer returns the features themselves
            output = output / temperature
        return model.get_normalized_probs((output, extra), log_probs=True,
                                          sample=None if targets is None else {"target": targets})

    def reorder_incremental_state(self, incremental_states, new_order):
        if self.rows is not None and is_identity(new_order, self.rows):
            return  # greedy search, or a beam that kept every hypothesis in place: fairseq's walk of every
            # module of every model would move nothing (the turn's whole cost, at batch 1, in a session)
        super().reorder_incremental_state(incremental_states, new_order)
        if self.served is not None:
            for key in ("lengths", "forced", "after", "prompts", "fed"):
                self.served[key] = self.served[key].index_select(0, new_order)


def _combined(log_probs):
    """fairseq's ensemble: the mean of the models' probabilities, as a log."""
    if len(log_probs) == 1:
        return log_probs[0]
    return torch.logsumexp(torch.stack(log_probs), 0) - math.log(len(log_probs))


class FastWeightSequenceGenerator(SequenceGenerator):
    """fairseq's SequenceGenerator (same arguments, same results) that reads prompts in one decoder call where
    every model is a fast-weight decoder-only model; for other models it is fairseq's."""

    def __init__(self, models, tgt_dict, **kwargs):
        super().__init__(PromptReadingEnsemble(models), tgt_dict, **kwargs)
        self._skipped_prompts = self._history = self.reply_limit = None

    def _generate(self, sample, prefix_tokens=None, constraints=None, bos_token=None, history=None):
        """fairseq's, and with `history` (a session's session.History) a turn of that session: its prompt read
        from the history's state, its hypotheses scored as the whole history's, and the best one kept."""
        src_tokens = sample["net_input"]["src_tokens"]
        with self._turn(history, src_tokens, prefix_tokens, constraints):
            requested = (int(sample["net_input"]["src_lengths"].max()) if self.match_source_len
                         else int(self.max_len_a * src_tokens.size(1) + self.max_len_b))
            self._check_length(requested, history)
            max_len = min(requested, self.max_len - 1)
            prompts, lengths = self._prompts(prefix_tokens, max_len)
            skipped = int(lengths.min()) if prompts is not None and self._can_skip(constraints) else 0
            self.model.read_prompts(prompts, lengths, max_len + 2, skipped, history)
            self._skipped_prompts = prompts[:, :skipped] if skipped else None
            self._history = history
            try:
                with self._starting_after(skipped):
                    finalized = super()._generate(sample, None if prefix_tokens is None or prefix_tokens.size(1) <=
                                                  skipped else prefix_tokens[:, skipped:], constraints, bos_token)
                if history is not None:
                    history.keep(self.model.read, self.model.after_prompt, prompts[0, :int(lengths[0])],
                                 finalized[0][0])
                return finalized
            finally:
                self.model.read_prompts(None, None, 0)
                self._skipped_prompts = self._history = None

    @contextlib.contextmanager
    def _turn(self, history, src_tokens, prefix_tokens, constraints):
        """A session's turn (`history` given): refused before any work where the session cannot continue with it
        (session.SessionRefusal), and generated with the reply's own limits: the input read whole, at most
        --max-len-a n + --max-len-b tokens after an input of n, and at least --min-len where that limit leaves
        room (fairseq's limits, which count from the sequence's start, set so for the turn)."""
        if history is None:
            yield
            return
        history.check(self.model.models, src_tokens.size(0))
        self.check_session_options(constraints)
        if prefix_tokens is None or not self.model.reads_prompts():
            raise SessionRefusal("a session's turn needs its input as prefix_tokens, and fast-weight decoders")
        padding = prefix_tokens.eq(self.pad).nonzero()
        if len(padding):
            raise SessionRefusal(f"the input holds <pad> (index {self.pad}) at token {int(padding[0, 1]) + 1}: a "
                                 "session reads every token of its input, and <pad> is padding, not text")
        n = prefix_tokens.size(1)
        kept = self.max_len_a, self.max_len_b, self.min_len
        self.reply_limit = max(int(self.max_len_a * n + self.max_len_b), 0)
        self.max_len_a, self.max_len_b = 0, n + self.reply_limit
        self.min_len = n + min(self.min_len, self.reply_limit)
        try:
            yield
        finally:
            self.max_len_a, self.max_len_b, self.min_len = kept

    def check_session_options(self, constraints=None):
        """Refuses (session.SessionRefusal) the options that would see only a session's turn, where the whole
        history as one prompt sees all of it: an LM fused in, n-gram blocking, searches other than beam search and
        sampling, outputs as long as the sources."""
        seen = [(self.lm_model is not None, "--lm-path (an LM fused in)", "reads only the turn's tokens"),
                (self.repeat_ngram_blocker is not None, "--no-repeat-ngram-size", "blocks the turn's n-grams only"),
                (isinstance(self.search, search.DiverseBeamSearch), "--diverse-beam-groups",
                 "penalises the turn's steps only"),
                (isinstance(self.search, search.DiverseSiblingsSearch), "--diversity-rate",
                 "penalises the turn's steps only"),
                (constraints is not None or isinstance(self.search, search.LexicallyConstrainedBeamSearch),
                 "--constraints", "constrains the turn only"),
                (isinstance(self.search, search.PrefixConstrainedBeamSearch), "prefix_allowed_tokens_fn",
                 "sees the turn's tokens only"),
                (self.match_source_len, "--match-source-len", "has no source in a session")]
        for refused, option, why in seen:
            if refused:
                raise SessionRefusal(f"{option} in a session: it {why}, where the whole history as one prompt gives "
                                     "it every token before; leave it out of a session")
        if type(self.search) not in (search.BeamSearch, search.Sampling):
            raise SessionRefusal(f"a session generates with beam search or sampling, not {type(self.search).__name__}")

    def _prompts(self, prefix_tokens, max_len):
        """(prompts, their lengths) where every model reads prompts and every row's prompt is a prefix of its
        prefix_tokens (fairseq's right padding), cut where forcing stops (the length limit); else (None, None)."""
        if prefix_tokens is None or not self.model.reads_prompts():
            return None, None
        given = prefix_tokens.ne(self.pad)
        lengths = given.long().cumprod(1).sum(1)
        if not bool((given.sum(1) == lengths).all()):
            return None, None
        lengths = lengths.clamp(max=max_len)
        return prefix_tokens[:, :int(lengths.max())], lengths

    def _can_skip(self, constraints):
        """Whether fairseq's loop may start after the prompt positions every row forces: a search that treats
        them alike (beam search, sampling) and nothing else that reads the steps before (an LM fused in, n-gram
        blocking, outputs as long as the sources, constraints)."""
        return (type(self.search) in (search.BeamSearch, search.Sampling) and self.lm_model is None
                and self.repeat_ngram_blocker is None and not self.match_source_len and constraints is None
                and not self._first_step_takes_fewer())

    def _first_step_takes_fewer(self):
        """Whether beam search's first step, which takes its candidates from one hypothesis per sentence, takes
        fewer than a later step (min(2 beam, V - 1) against 2 beam): with a beam of about half the vocabulary
        or more, starting the loop after the prompt would give other hypotheses than forcing."""
        return isinstance(self.search, search.BeamSearch) and 2 * self.beam_size > self.vocab_size - 1

    def _prefix_tokens(self, step, lprobs, scores, tokens, prefix_tokens, beam_size):
        """fairseq's forcing of the prompt positions the loop steps through, but a prompt's </s> is read as
        context, as in the positions it skips: forced in a stand-in's column (padding's), so that the loop does
        not end the hypothesis there (PromptReadingEnsemble puts the </s> back before anything reads it).
        Where the prompts are not read in one call, fairseq's own: a forced </s> ends the hypothesis."""
        if self.model.served is None:
            return super()._prefix_tokens(step, lprobs, scores, tokens, prefix_tokens, beam_size)
        forced = prefix_tokens[:, step].repeat_interleave(beam_size)
        rows = forced.ne(self.pad).nonzero().squeeze(1)
        forced = forced[rows].unsqueeze(1)
        score = lprobs[rows].gather(1, forced)
        lprobs[rows] = lprobs.new_full((len(rows), lprobs.size(1)), -math.inf).scatter(
            1, forced.masked_fill(forced.eq(self.eos), self.pad), score)
        return lprobs, tokens, scores

    @contextlib.contextmanager
    def _starting_after(self, skipped):
        """fairseq's loop from position `skipped` on: its lengths shorter by as many tokens, and sampling's
        steps numbered from there (its scores of the steps before: zero, whose values it only adds)."""
        if not skipped:
            yield
            return
        kept = self.max_len_b, self.max_len, self.min_len
        self.max_len_b, self.max_len, self.min_len = self.max_len_b - skipped, self.max_len - skipped, \
            max(self.min_len - skipped, 0)
        if isinstance(self.search, search.Sampling):
            self.search.step = _SamplingAfter(self.search, skipped, self)
        try:
            yield
        finally:
            self.max_len_b, self.max_len, self.min_len = kept
            self.search.__dict__.pop("step", None)

    def finalize_hypos(self, step, bbsz_idx, eos_scores, tokens, scores, finalized, finished, beam_size, attn,
                       src_lengths, max_len):
        before = [len(hypotheses) for hypotheses in finalized]
        done = super().finalize_hypos(step, bbsz_idx, eos_scores, tokens, scores, finalized, finished, beam_size,
                                      attn, src_lengths, max_len)
        if self._skipped_prompts is not None or self._history is not None:
            for sentence, hypotheses in enumerate(finalized):
                for hypothesis in hypotheses[before[sentence]:]:
                    self._made_whole(hypothesis, sentence)
        return done

    def _made_whole(self, hypothesis, sentence):
        """A hypothesis finished by the loop that started after the skipped prompt positions, or in a session's
        turn, made whole: the skipped positions' tokens and scores before its own, and its score the whole
        sequence's (the session's history included), normalised by its whole length, as forcing's."""
        positional = hypothesis["positional_scores"]
        if self._skipped_prompts is not None:
            prompt = self._skipped_prompts[sentence]
            skipped = self.as_forced(self.model.skipped_scores[sentence], prompt).to(positional)
            positional = torch.cat([skipped, positional])
            hypothesis["tokens"] = torch.cat([prompt, hypothesis["tokens"]])
            hypothesis["positional_scores"] = positional
        total, length = positional.sum(), len(positional)
        if self._history is not None:
            total, length = total + self._history.score, length + self._history.length
        hypothesis["score"] = total / length ** self.len_penalty if self.normalize_scores else total

    def as_forced(self, log_probs, tokens):
        """What forcing scores the tokens with log-probabilities `log_probs`: less the unknown word's penalty."""
        return log_probs - self.unk_penalty * tokens.eq(self.unk).to(log_probs)

    def _check_length(self, requested, history=None):
        """fairseq cuts a generation silently at the models' positions: a fast-weight model with positions that
        do not restart is refused a longer one, naming its limit (a session's history counts)."""
        limit = self.model.max_decoder_positions()
        read = 0 if history is None else history.tokens_read
        if requested + read <= limit - 1 or not self.model.reads_prompts():
            return
        period = ("give its positions a period (--fwp-position-period, which fwp_stream_lm sets to its segments' "
                  "length: finetune it there) so that it reads and generates past them with its fast weights carried")
        if history is None:
            raise ValueError(
                f"--max-len-a {self.max_len_a} --max-len-b {self.max_len_b} ask for up to {requested} tokens, the "
                f"prompt's included, and the model has {limit} positions: ask for at most {limit - 1}, or {period}")
        raise SessionRefusal(
            f"the session has read {read} tokens, and this input's {requested - self.reply_limit} and a reply of up "
            f"to {self.reply_limit} (--max-len-a, --max-len-b) would reach past the model's {limit} positions: "
            f"{max(limit - 1 - read, 0)} are left; give a shorter input or a lower limit, reset the session, or "
            f"{period}")


class _SamplingAfter:
    """Sampling.step for a loop that starts `skipped` positions into the prompts: at its first step it first
    draws what forcing's skipped steps drew (their forced distributions, from the prompts read), then every step
    is numbered as in the whole sequence."""

    def __init__(self, sampling, skipped, generator):
        self.step, self.skipped, self.generator = type(sampling).step.__get__(sampling), skipped, generator
        self.drawn = False

    def __call__(self, step, lprobs, scores, prev_output_tokens=None, original_batch_idxs=None):
        bsz, beam, _ = lprobs.shape
        if not self.drawn:  # the random numbers of the skipped steps, as forcing drew them
            self.drawn = True
            served = self.generator.model.served
            for skipped_step in range(self.skipped):
                tokens = served["prompts"][:, skipped_step:skipped_step + 1]
                forced = lprobs.new_full((bsz * beam, lprobs.size(2)), -math.inf)
                forced.scatter_(1, tokens, self.generator.as_forced(served["forced"][:, skipped_step:skipped_step + 1],
                                                                    tokens).to(lprobs))
                self.step(skipped_step, forced.view(bsz, beam, -1), scores.new_zeros(bsz, beam, skipped_step),
                          prev_output_tokens, original_batch_idxs)
        return self.step(step + self.skipped, lprobs, F.pad(scores, (self.skipped, 0)), prev_output_tokens,
                         original_batch_idxs)
