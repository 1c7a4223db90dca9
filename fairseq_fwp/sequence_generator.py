"""FastWeightSequenceGenerator: fairseq's SequenceGenerator that reads a prompt in one decoder call.

fairseq's generator forces a prompt (prefix_tokens) one token per step: every layer's whole step for every
prompt token before the first new one. A fast-weight decoder (FastWeightTransformerDecoder) reads any number
of tokens in one incremental call, each layer's chunked form over them, and leaves its state as the steps
would. This generator reads every row's prompt at step 0 in one call, the rows left-padded to the longest
(padding writes nothing), and keeps what the steps would have computed from it: each prompt token's
log-probability and each row's distribution after its prompt. The steps that force a prompt token then
serve those, without a decoder call; a row whose prompt has ended reads its new tokens one per step, a
shorter row's while the longer ones are still served (those read padding: nothing). Everything else is
fairseq's own loop, so the tokens and scores are forcing's (the log-probabilities computed in another order:
equal to rounding).

The length limit is fairseq's (--max-len-a, --max-len-b; the prompt counts): a model without positions, or
with positions that restart (--fwp-position-period), has none of its own; a model with positions that do not
restart is refused a length past them before any work, where fairseq would cut it silently.
"""
import math

import torch
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator

from .modules.transformer_layers import FastWeightTransformerDecoder

LOG_PROB_CHUNK = 256  # positions whose whole-vocabulary log-probabilities are held at once (an adaptive softmax's
# 267K words: 270 MB in float32)


class PromptReadingEnsemble(EnsembleModel):
    """fairseq's EnsembleModel whose forward_decoder serves a prompt read at step 0 (read_prompts)."""

    def __init__(self, models):
        super().__init__(models)
        self.prompts = None

    def reads_prompts(self):
        return all(isinstance(getattr(m, "decoder", None), FastWeightTransformerDecoder) for m in self.models) \
            and not self.has_encoder()

    def read_prompts(self, prompts, lengths, steps):
        """At the next step 0: every row reads its prompt, prompts ``[sentences, P]`` (left-aligned, padding
        after), of `lengths` ``[sentences]`` tokens, before at most `steps` steps; None: fairseq's own steps."""
        self.prompts = None if prompts is None else (prompts, lengths, steps)
        self.served = None

    def forward_decoder(self, tokens, encoder_outs, incremental_states, temperature: float = 1.0):
        step = tokens.size(1) - 1
        if step == 0 and self.prompts is not None:
            return self._read(tokens, incremental_states, temperature), None
        if self.served is None:
            return super().forward_decoder(tokens, encoder_outs, incremental_states, temperature)
        served, lprobs = self.served, None
        reading = served["lengths"] < step  # rows past their prompt read this step's token, the others padding
        if bool(reading.any()):
            served["fed"][:, served["width"]] = torch.where(reading, tokens[:, -1], self._pad)
            served["width"] += 1
            lprobs = self._log_probs(served["fed"][:, :served["width"]], incremental_states, temperature)[1]
        return self._served(step, lprobs), None

    @property
    def _pad(self):
        return self.single_model.decoder.padding_idx

    def _read(self, tokens, incremental_states, temperature):
        """Step 0: each row reads its bos and its prompt, left-padded to the longest, in one call per model."""
        prompts, lengths, steps = self.prompts
        self.prompts = None
        beam = tokens.size(0) // prompts.size(0)
        prompts, lengths = prompts.repeat_interleave(beam, 0), lengths.repeat_interleave(beam, 0)
        rows, longest = prompts.shape
        column = torch.arange(longest + 1, device=tokens.device)
        bos_and_prompt = torch.cat([tokens[:, :1], prompts], 1).masked_fill(column > lengths.unsqueeze(1), self._pad)
        shift = longest - lengths  # padding before each row's bos
        fed = bos_and_prompt.gather(1, (column - shift.unsqueeze(1)) % (longest + 1))  # each row moved right
        after_each = torch.cat([fed[:, 1:], fed[:, :1]], 1)  # the token after each column (the last: unused)
        chosen, after = self._log_probs(fed, incremental_states, temperature, targets=after_each)
        # step i of row r forces its prompt's token i, read after column shift_r + i
        forced = chosen.gather(1, (shift.unsqueeze(1) + column[:longest]).clamp(max=longest))
        room = fed.new_full((rows, longest + 1 + steps), self._pad)  # and the columns the steps will read
        room[:, :longest + 1] = fed
        self.served = {"lengths": lengths, "forced": forced, "after": after, "prompts": prompts, "fed": room,
                       "width": longest + 1}
        return self._served(0, None)

    def _served(self, step, lprobs):
        """Step `step`'s log-probabilities: a row still forcing its prompt gets its token's served, a row at its
        prompt's end the distribution after it, the others `lprobs` (the decoder's)."""
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
            starts = range(0, features.size(1), LOG_PROB_CHUNK) if targets is not None else [features.size(1) - 1]
            pieces = []
            for start in starts:
                lprobs = self._normalized(model, features[:, start:start + LOG_PROB_CHUNK], extra, temperature)
                if targets is not None:
                    pieces.append(lprobs.gather(2, targets[:, start:start + LOG_PROB_CHUNK].unsqueeze(2)).squeeze(2))
            chosen.append(torch.cat(pieces, 1) if pieces else None)
            after.append(lprobs[:, -1])
        return (_combined(chosen) if targets is not None else None), _combined(after)

    @staticmethod
    def _normalized(model, features, extra, temperature):
        """fairseq's ensemble step on a decoder's features: the output layer, the temperature, the log-softmax."""
        output = model.decoder.output_layer(features).div_(temperature)
        return model.get_normalized_probs((output, extra), log_probs=True, sample=None)

    def reorder_incremental_state(self, incremental_states, new_order):
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

    def _generate(self, sample, prefix_tokens=None, constraints=None, bos_token=None):
        src_tokens = sample["net_input"]["src_tokens"]
        requested = (int(sample["net_input"]["src_lengths"].max()) if self.match_source_len
                     else int(self.max_len_a * src_tokens.size(1) + self.max_len_b))
        self._check_length(requested)
        prompts = lengths = None
        if prefix_tokens is not None and self.model.reads_prompts():
            given = prefix_tokens.ne(self.pad)
            lengths = given.long().cumprod(1).sum(1)
            if bool((given.sum(1) == lengths).all()):  # every row's prompt is a prefix: fairseq's right padding
                lengths = lengths.clamp(max=min(requested, self.max_len - 1))  # forcing stops at the length limit
                prompts = prefix_tokens[:, :int(lengths.max())]
        self.model.read_prompts(prompts, lengths, steps=min(requested, self.max_len - 1) + 2)
        try:
            return super()._generate(sample, prefix_tokens, constraints, bos_token)
        finally:
            self.model.read_prompts(None, None, 0)

    def _check_length(self, requested):
        """fairseq cuts a generation silently at the models' positions: a fast-weight model with positions that
        do not restart is refused a longer one, naming its limit."""
        limit = self.model.max_decoder_positions()
        if requested > limit - 1 and self.model.reads_prompts():
            raise ValueError(
                f"--max-len-a {self.max_len_a} --max-len-b {self.max_len_b} ask for up to {requested} tokens, the "
                f"prompt's included, and the model has {limit} positions: ask for at most {limit - 1}, or give its "
                "positions a period (--fwp-position-period, which fwp_stream_lm sets to its segments' length: "
                "finetune it there) so that it reads and generates past them with its fast weights carried")
