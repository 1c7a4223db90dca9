"""Generation that remembers: a session carries a fast-weight LM's state from one input to the next.

A fast-weight decoder holds everything it has read in a state of fixed size (W, z, the short convolutions'
caches; a hybrid's softmax layers keep their key/value caches, which grow). A session keeps that state, after
the best hypothesis of each turn, and reads only the next input from it, in one call, before generating
(FastWeightSequenceGenerator.generate(..., history=...)). A turn generates what generating with the whole
history as one prompt generates: every earlier input and kept reply in order, each reply followed by the </s>
that ended it, then the new input (tests/test_session.py holds the tokens, positional scores and scores equal,
in float64). A turn reads its whole input, always; --max-len-a/b bound its reply (at most a n + b tokens after an
input of n) and --min-len is the reply's own minimum. Options that would see only the turn where the whole
history as one prompt sees it all (an LM fused in, n-gram blocking, diverse and constrained searches) are refused,
as is <pad> in an input: SessionRefusal, before any work, the session as it was.

- ``History``: what the decoders have read, for one conversation: each model's incremental state (batch 1; the
  decoders count the columns read, and a turn's columns start after them), and the history's summed positional
  scores and length (a turn's hypothesis is scored as the whole history's); saved to a file and loaded again by
  the same model only (session_file.py checks the file).
- ``Session``: the hub's way, ``Session(TransformerLanguageModel.from_pretrained(...), beam=4)`` then
  ``reply(text)``: generation options held for every turn, the hub's by default, overridable per turn.
- The plugin's LM tasks take ``--fwp-session``: fairseq-interactive continues the session with every input line,
  an empty line starts a new one, and ``--fwp-session-file`` resumes and saves it (tasks/prompt_reading.py).
"""
import copy
import difflib

import torch
from omegaconf import open_dict

from . import session_file
from .modules.feature_maps import FeatureMap
from .modules.state import FastWeightState, buffer_tensors


class SessionRefusal(ValueError):
    """A turn refused before any work: the session is as it was (fairseq-interactive reads the next line)."""


def feature_draws(models):
    """Each random feature map's draw (FAVOR+), in module order: a state is only meaningful in the features it was
    written with."""
    return [[m.draw for m in model.modules() if isinstance(m, FeatureMap) and m.draw is not None] for model in models]


def _copied(incremental_state):
    """A copy of fairseq's incremental state that shares no storage with it."""
    return {key: value.copied() if isinstance(value, FastWeightState)
            else {name: None if x is None else x.clone() for name, x in value.items()}
            for key, value in incremental_state.items()}


class History:
    """What a session's decoders have read (one conversation: batch 1)."""

    def __init__(self, models, dictionary):
        self.models, self.dictionary = list(models), dictionary
        self.draws = feature_draws(self.models)
        self.reset()

    def reset(self):
        self.device = next(self.models[0].parameters()).device
        self.states = [{} for _ in self.models]
        self.tokens_read = 0
        self.score, self.length = 0.0, 0  # the kept hypotheses' summed positional scores, and their tokens
        self.last = None  # the token that ended the last kept hypothesis (</s>), read at the next turn's start

    def state_bytes(self):
        """Bytes of the decoders' state: W, z and the short convolutions' caches, of fixed size; a softmax layer's
        keys and values, which grow with the history."""
        held = [x for state in self.states for buffer in state.values() for x in buffer_tensors(buffer)]
        return sum(x.numel() * x.element_size() for x in held)

    # -- a turn (FastWeightSequenceGenerator) ---------------------------------------------------

    def check(self, models, sentences):
        """Refuses, before any work, a turn this history cannot continue."""
        if [id(m) for m in models] != [id(m) for m in self.models]:
            raise SessionRefusal("this session was started with other models: start a new one for these")
        if sentences != 1:
            raise SessionRefusal(f"a session continues one conversation: give one input at a time, not {sentences}")
        draws = feature_draws(self.models)
        if draws != self.draws:
            raise SessionRefusal(f"the models' random features were redrawn (FAVOR+ draws {self.draws} -> {draws}) "
                             "since the session read its history: its state cannot be read with them; reset it")

    def first(self, bos):
        """The column a turn reads first: the loop's bos at the start, else the </s> that ended the last reply."""
        return bos if self.last is None else bos.new_full(bos.shape, self.last)

    def replicated(self, index, rows):
        """Model `index`'s state, a copy for each of `rows` rows."""
        state = _copied(self.states[index])
        if state:
            self.models[index].decoder.reorder_incremental_state_scripting(
                state, torch.zeros(rows, dtype=torch.long, device=self.device))
        return state

    def row_copy(self, index, state):
        """A batch-1 copy of row 0 of model `index`'s incremental state (every row of a turn's prompt is alike)."""
        state = _copied(state)
        self.models[index].decoder.reorder_incremental_state_scripting(
            state, torch.zeros(1, dtype=torch.long, device=self.device))
        return state

    def keep(self, read, after_prompt, prompt, hypothesis):
        """The history after a turn: `read` (the columns the turn read before its first new token) and the kept
        `hypothesis`'s reply, read from `after_prompt` (each model's state there) in one call; the next turn's
        columns start after them (the decoders' count of columns read: FastWeightTransformerDecoder)."""
        reply = hypothesis["tokens"][prompt.numel():-1]
        columns = torch.cat([read[:1], reply.unsqueeze(0)], 1)
        with torch.no_grad():
            for model, state in zip(self.models, after_prompt):
                if reply.numel():
                    model.decoder(columns, incremental_state=state, features_only=True)
                model.decoder.start_after_read(state)
        self.states, self.last = after_prompt, int(hypothesis["tokens"][-1])
        self.tokens_read += columns.size(1)
        self.score += float(hypothesis["positional_scores"].double().sum())
        self.length += hypothesis["tokens"].numel()

    # -- a file ------------------------------------------------------------------------------------

    def save(self, path):
        """Writes the history to `path` (session_file.write: whole or not at all), with the models' fingerprints."""
        exact, architecture, dtypes = session_file.fingerprints(self.models)
        session_file.write(path, {
            "fingerprint": exact, "architecture": architecture, "dtypes": dtypes, "draws": self.draws,
            "tokens_read": self.tokens_read, "score": self.score, "length": self.length, "last": self.last,
            "states": [self._saved(model, state) for model, state in zip(self.models, self.states)]})

    def load(self, path):
        """Reads a history that `save` wrote for these models; refuses, naming what is wrong, a file that is not one,
        a damaged or incomplete one, and one written by another model (session_file.SessionFileError)."""
        saved = session_file.read(path, self.device, self.models)
        states = saved["states"]
        for index, (model, state) in enumerate(zip(self.models, states)):
            kept = self._kept_keys(index) if saved["tokens_read"] else set()
            if set(state) != kept:
                missing, foreign = kept - set(state), set(state) - kept
                raise session_file.SessionFileError(
                    f"{path} is incomplete: " + (f"it holds no state for {_described(model, missing)}" if missing else
                                                 f"it holds states that the model keeps none of: "
                                                 f"{_described(model, foreign)}"))
        self.draws = saved["draws"]
        self.tokens_read, self.score, self.length, self.last = saved["tokens_read"], saved["score"], \
            saved["length"], saved["last"]
        self.states = [self._loaded(model, state) for model, state in zip(self.models, states)]

    def _kept_keys(self, index):
        """The entries of model `index`'s incremental state after it reads a token (module positions and names, as
        saved): every layer that keeps a state, and the decoder's count of columns read."""
        model, state = self.models[index], {}
        bos = torch.full((1, 1), self.dictionary.eos(), dtype=torch.long, device=self.device)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model.decoder(bos, incremental_state=state, features_only=True)
        return set(self._saved(model, state))

    @staticmethod
    def _ids(model):
        """fairseq's incremental-state id of each module that has one, in module order."""
        return [m._incremental_state_id for m in model.modules() if hasattr(m, "_incremental_state_id")]

    def _saved(self, model, state):
        """The state with its keys by module order (fairseq keys them by a random id per module object)."""
        index = {module_id: i for i, module_id in enumerate(self._ids(model))}
        saved = {}
        for key, value in state.items():
            module_id, name = key.split(".", 1)
            value = {"fwp_state": value.as_dict()} if isinstance(value, FastWeightState) else dict(value)
            saved[f"{index[module_id]}.{name}"] = value
        return saved

    def _loaded(self, model, saved):
        ids = self._ids(model)
        state = {}
        for key, value in saved.items():
            position, name = key.split(".", 1)
            state[f"{ids[int(position)]}.{name}"] = (FastWeightState.from_dict(value["fwp_state"])
                                                      if "fwp_state" in value else value)
        return state


def _described(model, keys):
    """Saved state keys ("3.fwp_state": module position and name) by module name."""
    names = [name for name, module in model.named_modules() if hasattr(module, "_incremental_state_id")]
    return ", ".join(f"{names[int(key.split('.', 1)[0])] or 'the model'} ({key.split('.', 1)[1]})"
                     for key in sorted(keys))


class Session:
    """A conversation with a fast-weight LM loaded through fairseq's hub (``from_pretrained``): each ``reply``
    reads only the new input, from the state the earlier inputs and replies left, and keeps the best hypothesis
    (the first, as fairseq prints it).

    Generation options are fairseq's, as the hub's sample() takes them (beam, max_len_b, min_len, sampling, ...):
    those given when the session starts hold for every turn (``options``, a dict, changes them later), and those
    given to one ``reply`` hold for that turn only. Unset, they are the hub's: its generation config, and beam 1
    as in sample()."""

    def __init__(self, hub, **options):
        from .sequence_generator import PromptReadingEnsemble

        if not PromptReadingEnsemble(hub.models).reads_prompts():
            raise ValueError("a session needs fast-weight language models (fwp_transformer_lm): these keep no "
                             "state of fixed size to continue from")
        self.hub = hub
        self.history = History(hub.models, hub.task.source_dictionary)
        self.options = {"beam": 1, **self._checked(options)}

    def reply(self, text, **options):
        """The reply to `text`, with this turn's `options` over the session's."""
        tokens = self.hub.encode(text)[:-1]  # without its </s>: the prompt goes on
        hypothesis = self.generate(tokens, **options)[0]
        return self.hub.decode(hypothesis["tokens"][tokens.numel():-1])

    def generate(self, tokens, **options):
        """This turn's hypotheses for the input `tokens` (1-D), each its tokens (the input, the reply, </s>),
        positional scores and score (the whole history's, as when it is given as one prompt); `options` for this
        turn only."""
        from .sequence_generator import FastWeightSequenceGenerator

        generation = copy.deepcopy(self.hub.cfg.generation)
        with open_dict(generation):
            for name, value in self._checked({**self.options, **options}).items():
                setattr(generation, name, value)
        task, dictionary = self.hub.task, self.hub.task.source_dictionary
        generator = task.build_generator(self.hub.models, generation, seq_gen_cls=FastWeightSequenceGenerator)
        tokens = tokens.to(self.history.device)
        # language_modeling's bos: <s> where the model was trained with it, else </s>
        bos = dictionary.bos() if getattr(getattr(task, "args", None), "add_bos_token", False) else dictionary.eos()
        sample = {"net_input": {"src_tokens": torch.cat([tokens.new_tensor([bos]), tokens]).unsqueeze(0),
                                "src_lengths": tokens.new_tensor([tokens.numel() + 1])}}
        with torch.no_grad():
            return generator.generate(self.hub.models, sample, prefix_tokens=tokens.unsqueeze(0), bos_token=bos,
                                      history=self.history)[0]

    def _checked(self, options):
        """`options`, each a field of the hub's generation config (a misspelt one would be set and never read)."""
        known = set(self.hub.cfg.generation)
        for name in options:
            if name not in known:
                near = difflib.get_close_matches(name, known, n=3)
                raise ValueError(f"{name!r} is not a generation option (fairseq's GenerationConfig"
                                 + (f"; did you mean {', '.join(near)}?)" if near else ")"))
        return dict(options)

    def reset(self):
        self.history.reset()

    def save(self, path):
        self.history.save(path)

    def load(self, path):
        self.history.load(path)
