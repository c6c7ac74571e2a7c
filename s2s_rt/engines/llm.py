"""The chat LLM engine: a CTranslate2 decoder that streams its answer.

One :class:`CT2ChatLLM` is loaded per process and shared by every slot (calls
take their lane, :mod:`~s2s_rt.engines.llm_lanes`; the tokenizer is read-only).
A model directory holds the CTranslate2 model, a tokenizer (``tokenizer.json``
or SentencePiece's), and, laid out as Hugging Face does, the chat template
(``tokenizer_config.json``) and end-of-turn ids (``generation_config.json``):
``s2s-rt models prepare`` writes them, as does CTranslate2's ``--copy_files``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from s2s_rt.engines.base import ChatMessage, FirstWordsPause, LLMRequest, LLMUsage, StopCheck
from s2s_rt.engines.chat_formats import ChatFormat
from s2s_rt.engines.function_choice import call_opening, choose
from s2s_rt.engines.kept_state import MIN_KEPT_TOKENS, PROBE, KeptStateCheck, check_kept_state
from s2s_rt.engines.llm_lanes import LONG_READING_TOKENS, Lanes, never
from s2s_rt.engines.llm_turns import SENTENCE_END, AnswerTurn, Turns
from s2s_rt.engines.prompt_cache import ConversationPrefixes, StaticPrefixes
from s2s_rt.engines.tokenizing import TextStream, begin_ids, load_tokenizer, read_json, read_vocabulary
from s2s_rt.memory import release_freed_memory
from s2s_rt.models.errors import PREPARE_COMMAND, ModelError
from s2s_rt.toolcalls import CallFraming

#: At or below this temperature, decoding is greedy (deterministic).
GREEDY_TEMPERATURE = 0.01
#: Sampling keeps the most likely 40 tokens, then the top 95 % of probability.
SAMPLING_TOP_K = 40
SAMPLING_TOP_P = 0.95
#: Context budget when the model directory does not state one.
DEFAULT_CONTEXT_TOKENS = 4096

#: A user turn after a system prompt, to find where the system prompt's tokens end.
_ANY_USER = ChatMessage("user", "Hello")

log = logging.getLogger(__name__)


class CT2ChatLLM:
    """A chat LLM in CTranslate2, streaming its answers (implements ``base.LLM``).

    Args:
        model_dir: a CTranslate2 decoder directory with a tokenizer (see the
            module docstring); :func:`s2s_rt.models.resolve_llm_dir` turns a
            preset name into one.
        device: ``"cpu"`` or ``"cuda"``.
        device_index: which GPU, for ``"cuda"``.
        compute_type: CTranslate2 compute type; None picks ``int8`` on CPU
            and ``int8_float16`` on CUDA.
        inter_threads: generations that run at once (each on its own
            workers); more requests wait their turn. The model gets one
            replica more (sharing the weights), for long readings
            (:mod:`s2s_rt.engines.llm_lanes`).
        intra_threads: threads per generation. On small CPUs one thread
            decodes a model of 0.5B parameters or less fastest.
        max_context_tokens: prompt plus answer budget; None takes the
            model's ``model_max_length``, at most 4096.
        repetition_penalty: > 1 discourages repeating tokens.
        temperature_scale: multiplies the temperature each answer asks for.
            Small models answer worse the more they sample: Qwen2.5-Coder-0.5B
            got 32 of the evaluation's 52 questions right at the Realtime
            API's default 0.8 and 34 greedily (BENCHMARKS.md, "How good are the answers");
            0.25 turns 0.8 into 0.2, where it answers as well as greedily
            and still varies.
        cached_system_prompts: system prompts whose model state is kept after
            their first answer, so later answers skip reading them again (see
            :mod:`s2s_rt.engines.prompt_cache`); the server's default
            instructions, never a client's.
        prefix_cache_tokens: tokens of conversation-prefix state kept between
            answers (:meth:`prime`; 0: none); past it the model is reloaded,
            which forgets them all.
        prefix_session_tokens: the longest prefix kept for one conversation.
        long_reading_tokens: a call that reads at least this many prompt
            tokens (past a kept state) reads them in the long lane, beside
            other sessions' answers (:class:`~s2s_rt.engines.llm_lanes.Lanes`).

    Both kinds of kept state are checked once after loading
    (:func:`check_kept_state`) and turned off, with a warning, where a
    prompt read after a kept state would not be read as the whole prompt.

    Raises:
        ModelError: if a model file is missing, corrupt, or of an
            unsupported chat format.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        device: str = "cpu",
        device_index: int = 0,
        compute_type: str | None = None,
        inter_threads: int = 1,
        intra_threads: int = 1,
        max_context_tokens: int | None = None,
        repetition_penalty: float = 1.0,
        temperature_scale: float = 1.0,
        cached_system_prompts: Sequence[str] = (),
        prefix_cache_tokens: int = 0,
        prefix_session_tokens: int = 2048,
        long_reading_tokens: int = LONG_READING_TOKENS,
        choose_functions: bool = True,
    ) -> None:
        import ctranslate2

        self.model_dir = model_dir = Path(model_dir)
        for name in ("model.bin", "config.json"):
            if not (model_dir / name).is_file():
                raise ModelError(f"{model_dir / name} is missing; for the presets, fix: {PREPARE_COMMAND}")
        self.compute_type = compute_type or _default_compute_type(ctranslate2, device)
        self.device = device
        self._tokenizer = load_tokenizer(model_dir)
        tokenizer_config = read_json(model_dir / "tokenizer_config.json")
        self._chat = ChatFormat.from_template(
            tokenizer_config.get("chat_template"),
            self._tokenizer,
            model_dir,
            begin_ids(tokenizer_config, self._tokenizer),
        )
        self._vocabulary = read_vocabulary(model_dir)
        self._end_ids = self._stop_ids(tokenizer_config)
        model_max = int(tokenizer_config.get("model_max_length") or DEFAULT_CONTEXT_TOKENS)
        self.context_tokens = max_context_tokens or min(model_max, DEFAULT_CONTEXT_TOKENS)
        self.message_tokens = self._chat.message_tokens  # base.CountsTokens
        self._repetition_penalty = repetition_penalty
        self.temperature_scale = temperature_scale
        self._static = StaticPrefixes(
            lambda text: [
                i for turn in self._chat.encode([ChatMessage("system", text), _ANY_USER]).turns for i in turn
            ],
            cached_system_prompts,
        )
        self._load = functools.partial(
            ctranslate2.Generator,
            str(model_dir),
            device=device,
            device_index=device_index,
            compute_type=self.compute_type,
            # One replica more, for long readings; replicas share the weights and the kept states.
            inter_threads=inter_threads + 1,
            intra_threads=intra_threads,
        )
        #: The conversation prefixes CTranslate2 holds (guarded by ``_lock``).
        self.prefixes = ConversationPrefixes(prefix_cache_tokens, prefix_session_tokens)
        self._lock = threading.Lock()
        #: Times the model was reloaded to forget held prefixes.
        self.reloads = 0
        #: Answers waiting for their first words go first (long readings' answers take turns apart, beside them).
        self.turns, self.long_turns, self.lanes = Turns(), Turns(), Lanes(inter_threads)
        self.long_reading_tokens = long_reading_tokens
        #: A request with functions offered goes to the one chosen by likelihood (:mod:`.function_choice`).
        self.choose_functions = choose_functions
        #: Token ids that end a sentence (``turn_end_probability``).
        self._sentence_ends = [i for i, token in enumerate(self._vocabulary) if SENTENCE_END.fullmatch(token)]
        try:
            self._generator: ctranslate2.Generator | None = self._load()
        except (RuntimeError, ValueError) as exc:
            raise ModelError(
                f"cannot load the LLM in {model_dir} ({exc}); check it with `s2s-rt models verify`, "
                f"fix: {PREPARE_COMMAND} --force"
            ) from exc
        self.threads = (inter_threads, intra_threads)
        #: The start-up check of the kept state; None when none is kept.
        self.kept_state: KeptStateCheck | None = None
        #: The fewest tokens a kept state, and what is read after it, may have (the check's verdict).
        self.min_kept_tokens = MIN_KEPT_TOKENS
        if self._static.prefixes or self.prefixes.budget_tokens:
            probe = [i for turn in self._chat.encode(PROBE).turns for i in turn]
            self.kept_state = check_kept_state(self._next_logits, probe)
            if not self.kept_state.trusted:
                log.warning("LLM %s: %s", model_dir, self.kept_state.describe())
                self._static.prefixes = []
                self.prefixes = ConversationPrefixes(0, prefix_session_tokens)
            else:
                self.min_kept_tokens = self.kept_state.min_tokens
        # A state is kept this many tokens short of what it was read for, so that the shortest next turn (a
        # one-word user turn and the answer's opening) still makes a piece of min_kept_tokens after it.
        shortest_turn = sum(map(len, self._chat.encode([_ANY_USER]).turns[-2:]))
        self._held_short_by = max(0, self.min_kept_tokens - shortest_turn)
        # Loading read each weight through temporary buffers that glibc keeps mapped: ~340 MB for the 0.5B model.
        release_freed_memory(min_interval_s=0.0)
        _LOADED.add(self)

    def close(self) -> None:
        """Release the model (streams already running finish first); called for every one loaded at exit."""
        self._generator = None

    def describe(self) -> str:
        """One line for the start-up log."""
        inter, intra = self.threads
        kept = f"; {self.kept_state.describe()}" if self.kept_state is not None else ""
        return (
            f"LLM {self.model_dir} (CTranslate2 {self.compute_type} on {self.device}, "
            f"{inter} concurrent + 1 for long readings x {intra} threads, context {self.context_tokens}){kept}"
        )

    def _next_logits(self, kept: Sequence[int], rest: Sequence[int]) -> np.ndarray:
        """The logits of the token after ``kept + rest``, read as :meth:`stream` reads a prompt after a kept state."""
        assert self._generator is not None
        result = self._generator.generate_batch(
            [[self._vocabulary[i] for i in rest]],
            static_prompt=[self._vocabulary[i] for i in kept] or None,
            # CTranslate2 never forgets a cached state: the probe's must not stay.
            cache_static_prompt=False,
            max_length=1,
            sampling_topk=1,
            return_logits_vocab=True,
            include_prompt_in_result=False,
        )[0]
        return np.asarray(result.logits[0][0], dtype=np.float64)

    def stream(
        self,
        request: LLMRequest,
        *,
        should_stop: StopCheck,
        usage: LLMUsage,
        urgent: Callable[[], bool] | None = None,
        pause: FirstWordsPause | None = None,
    ) -> Generator[str, None, None]:
        """Yield the assistant's answer to ``request`` as pieces of text.

        Args:
            request: its ``messages`` are the conversation, oldest first (the
                oldest non-system turns are left out when it does not fit the
                context); ``max_tokens`` the most tokens to generate; its
                ``temperature`` is scaled by ``temperature_scale``, then <=
                0.01 decodes greedily, above it samples; ``tools`` are offered
                to the model, which calls one by writing
                ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``; with
                ``require_tool`` the answer must be a call (it starts with
                ``<tool_call>`` already written).
            should_stop: checked between tokens; True ends the answer within
                one token (generation stops in CTranslate2 too).
            usage: receives input tokens before the first piece, and output
                tokens as they come.
            urgent: True while the answer has not been heard yet (its first
                clause not spoken). CTranslate2 decodes one answer at a time;
                answers that are not urgent stop between tokens while another
                is, and resume (reading what they said so far again) once
                none is (:class:`Turns`); a long prompt's answer goes beside
                them (:class:`~s2s_rt.engines.llm_lanes.Lanes`).
            pause: decoding pauses after the token that ends the first
                clause until its speech is made, for at most
                :data:`~s2s_rt.engines.llm_turns.HOLD_S`, and not while
                another answer waits for its first words (:meth:`Turns.hold`).
        """
        generator = self._generator
        if generator is None:
            raise RuntimeError(f"the LLM engine for {self.model_dir} is closed")
        tools, require_tool = request.tools, request.require_tool
        call = None
        if self.choose_functions and tools and not require_tool:
            call = self._choose_function(request, should_stop)
            yield ""  # nothing said, the engine alive: a per-piece deadline gives the prompt's reading its own
        chat = self._chat.encode(request.messages, tools, require_tool, call)
        prompt, max_tokens = chat.fit(self.context_tokens, request.max_tokens)
        usage.input_tokens = len(prompt)
        usage.output_tokens = 0
        if max_tokens <= 0 or should_stop():
            return
        temperature = request.temperature * self.temperature_scale
        greedy = temperature <= GREEDY_TEMPERATURE
        static, prompt, usage.cached_tokens = self._split(prompt)
        static_tokens = [self._vocabulary[i] for i in static] or None
        # A long reading goes beside other answers, in a lane of its own, where it takes turns with other long ones.
        long = len(static) - usage.cached_tokens + len(prompt) >= self.long_reading_tokens
        said: list[int] = []  # the answer's tokens so far, read again when it resumes after giving way
        text = TextStream(self._tokenizer)
        framing = CallFraming(required=require_tool or call is not None) if tools else None
        if framing is not None and call is not None:
            framing.feed(call_opening(call))  # held with the rest of the call, and framed at its end
        turns = self.long_turns if long else self.turns
        # The pause sees the text as decoded in CTranslate2's worker, before the next token is computed.
        place = AnswerTurn(
            turns,
            TextStream(self._tokenizer).push,
            self._end_ids,
            urgent=urgent,
            pause=pause,
            should_stop=should_stop,
        )

        try:
            while True:
                ended = False
                steps = self.lanes.steps(
                    generator,
                    long,
                    [self._vocabulary[i] for i in prompt + said],
                    should_stop=should_stop,
                    urgent=lambda: place.waiting,
                    callback=place.after_token,
                    max_length=max_tokens - len(said),
                    static_prompt=static_tokens,
                    usage=usage,
                    sampling_topk=1 if greedy else SAMPLING_TOP_K,
                    sampling_topp=1.0 if greedy else SAMPLING_TOP_P,
                    sampling_temperature=1.0 if greedy else temperature,
                    repetition_penalty=self._repetition_penalty,
                    end_token=self._end_ids,
                )
                try:
                    for step in steps:
                        if should_stop():
                            return
                        if step.token_id in self._end_ids:
                            ended = True
                            break
                        said.append(step.token_id)
                        usage.output_tokens += 1
                        piece = text.push(step.token_id)
                        if framing is not None:
                            piece = framing.feed(piece)
                        if piece:
                            yield piece
                        place.took(len(said))
                finally:
                    # Closing tells CTranslate2 to stop this answer at its next token and waits for it.
                    steps.close()
                    gave_way_to = turns.entered
                if ended or len(said) >= max_tokens or should_stop():
                    break
                # Stopped short of its end: it gave way to answers that have not spoken yet. Resume once those
                # have (not those asked for since), for a share of its own.
                turns.wait_clear(should_stop, entered_by=gave_way_to)
                if should_stop():
                    return
                place.resumed()
        finally:
            place.close()
        rest = framing.finish() if framing is not None else ""
        if rest and not should_stop():
            yield rest

    def _split(self, prompt: list[int]) -> tuple[list[int], list[int], int]:
        """The prompt's longest prefix whose state is held (or will be: a known system prompt), the rest,
        and how many of its tokens need no reading."""
        least = self.min_kept_tokens
        with self._lock:
            # Shorter pieces are read differently from the whole prompt (KEPT_PIECE_SIZES).
            held = self.prefixes.find(prompt[: len(prompt) - least + 1])
            if len(held) < least:
                held = []
            known, rest = self._static.split(prompt)
            if known and self._held_short_by:
                # Held short, as a read-ahead state is: the shortest next turn still makes a piece of ``least``.
                cut = len(known) - self._held_short_by
                known, rest = prompt[:cut], prompt[cut:]
            if len(known) < least or len(rest) < least:
                known, rest = [], prompt
            if len(held) > len(known):
                return held, prompt[len(held) :], len(held)
            cached = len(known) if self.prefixes.holds(known) else 0
            if known:
                # CTranslate2 keeps it from this answer on.
                self.prefixes.add(known)
            return known, rest, cached

    def prime(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] = ()) -> bool:
        """Read ``messages`` now, so that the next answer after them reads only what follows.

        ``messages`` is a conversation as the next answer's prompt will
        begin (ending with the last answer); CTranslate2 keeps the model
        state after it. The next :meth:`stream` whose prompt starts with it
        reads only the new turn; one that does not (the conversation was
        changed, or cut to fit the context) reads the whole prompt, as
        without it. Past ``prefix_cache_tokens`` of held state the model is
        reloaded first, forgetting every held prefix. Costs what reading
        the conversation costs; run it when the model is otherwise idle (a
        long one is read beside other sessions' answers, in the long lane).

        Returns:
            whether the state after ``messages`` is held now.
        """
        generator = self._generator
        if generator is None or not self.prefixes.budget_tokens:
            return False
        chat = self._chat.encode(messages, tools)
        read = [token for turn in chat.turns[:-1] for token in turn]
        prefix = read[: len(read) - self._held_short_by]
        if len(prefix) < self.min_kept_tokens:
            return False  # too short to be used (KEPT_PIECE_SIZES)
        if len(read) + 64 > self.context_tokens:
            return False  # the next answer will be cut to fit, and start differently
        with self._lock:
            if self.prefixes.holds(prefix):
                return True
            if not self.prefixes.worth_keeping(prefix):
                return False
            reload = not self.prefixes.fits(prefix)
            if reload:
                self.prefixes.clear()
            self.prefixes.add(prefix)
        if reload:
            # Streams running on the old model finish on it; it is freed after them.
            self._generator = generator = self._load()
            self.reloads += 1
        after = read[len(prefix)] if len(prefix) < len(read) else chat.turns[-1][0]
        with self.lanes.take(len(prefix) >= self.long_reading_tokens, never):
            steps = generator.generate_tokens(
                [self._vocabulary[after]],
                static_prompt=[self._vocabulary[i] for i in prefix],
                max_length=1,
                sampling_topk=1,
            )
            for _step in steps:
                break
            steps.close()
        return True

    def turn_end_probability(self, messages: Sequence[ChatMessage]) -> float:
        """The probability that the user's words (the last message) are all they meant to say.

        It is the model's probability that the user's sentence ends right
        after the words: that its next token is a full stop, question mark
        or exclamation mark. The recogniser's own punctuation is taken off
        first: Whisper closes a fragment cut at a pause with one ("I would
        like to book a table for."), and the model, reading that, found the
        turn finished (0.41 for it, against 0.97 for a question). Read
        without it, fragments that stop mid-phrase get 0.0001 or less,
        questions, greetings and commands 0.02-0.95. One pass over a short
        prompt and one step, no sampling (:class:`~s2s_rt.turn.SemanticTurnEnd`).
        """
        generator = self._generator
        if generator is None:
            raise RuntimeError(f"the LLM engine for {self.model_dir} is closed")
        *context, last = messages
        words = last.content.strip().rstrip(" .?!,;:…")
        if not words or not self._sentence_ends:
            return 1.0
        tokens = [t for turn in self._chat.encode([*context, ChatMessage("user", words)]).turns[:-1] for t in turn]
        end = max(i for i, token in enumerate(tokens) if token == self._chat.end_id)
        tokens = tokens[:end][-self.context_tokens :]  # up to the words, without the turn's end
        with self.lanes.take(len(tokens) >= self.long_reading_tokens, never):
            prompt = [[self._vocabulary[i] for i in tokens]]
            result = generator.generate_batch(
                prompt, max_length=1, return_logits_vocab=True, include_prompt_in_result=False
            )[0]
        logits = np.asarray(result.logits[0][0], dtype=np.float64)
        chance = np.exp(logits - logits.max())
        return float(chance[self._sentence_ends].sum() / chance.sum())

    def _choose_function(self, request: LLMRequest, should_stop: StopCheck) -> str | None:
        """The function the user's last words need, chosen by likelihood (:mod:`.function_choice`); None: none."""

        def score(batch: list[list[int]]) -> list[list[float]] | None:
            with self.lanes.take(False, should_stop) as got:
                scored = got and generator.score_batch([[self._vocabulary[i] for i in ids] for ids in batch])
            return [list(one.log_probs) for one in scored] if scored else None

        generator: Any = self._generator  # None once closed
        return choose(request.tools, request.messages, self._tokenizer.encode_text, score) if generator else None

    def count_tokens(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] = ()) -> int:
        """Return the prompt length of ``messages`` in tokens (with the chat markup)."""
        return sum(len(turn) for turn in self._chat.encode(messages, tools).turns)

    def _stop_ids(self, tokenizer_config: dict[str, Any]) -> list[int]:
        ids = [self._chat.end_id]
        eos = read_json(self.model_dir / "generation_config.json").get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        for config in (tokenizer_config, read_json(self.model_dir / "config.json")):
            token = config.get("eos_token")
            if isinstance(token, dict):  # tokenizer_config's AddedToken form
                token = token.get("content")
            if isinstance(token, str) and (token_id := self._tokenizer.control_id(token)) is not None:
                ids.append(token_id)
        return list(dict.fromkeys(ids))


#: Engines still loaded, released before the interpreter shuts down.
_LOADED: weakref.WeakSet[CT2ChatLLM] = weakref.WeakSet()


@atexit.register
def _close_engines_at_exit() -> None:
    # CTranslate2 streams tokens through Python callbacks held by its worker threads; a Generator still alive
    # when the interpreter finalises aborts the process now and then ("terminate called without an active
    # exception", exit status 134: 3 to 10 exits in 30 on a busy 2-core machine). Destroyed here, it never did.
    for engine in list(_LOADED):
        engine.close()


def _default_compute_type(ctranslate2: Any, device: str) -> str:
    supported = ctranslate2.get_supported_compute_types(device)
    preferred = ("int8", "int8_float32") if device == "cpu" else ("int8_float16", "float16")
    return next((c for c in preferred if c in supported), "default")
