"""Structured outputs: generation constrained to a JSON schema, any JSON object, a regex, one of
a list of strings, or an EBNF grammar (vLLM's ``StructuredOutputsParams``), through xgrammar.

The request carries a ``StructuredOutputsParams``; the frontend parses its grammar when the
request is added (a bad schema or regex is a ``ValueError`` there, never in the step loop).
The engine core compiles it against the tokenizer in a background thread
(``StructuredOutputManager``, cached per grammar) while the scheduler runs the other
requests: the request is admitted once its grammar is ready. The core keeps one matcher per
request; each step it sends the workers the allowed-token bitmask of every request that
samples under a grammar (``SchedulerOutput.grammar_bitmask``), the workers mask those logits
before sampling (``apply_grammar_bitmask``), and the core advances the matcher with each
sampled token. Once the grammar is complete only EOS is allowed, so the request ends as a
normal stop (min_tokens gives way). A step where the grammar and the request's other
constraints (allowed_token_ids) leave no token ends the request there without one:
finish_reason "stop", the stop_reason says why (``no_token_stop_reason``).

xgrammar is an optional dependency (``pip install "halserve[structured-outputs]"``).
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from halserve.request import Request

logger = logging.getLogger(__name__)

_INSTALL_HINT = "structured outputs need xgrammar: pip install 'halserve[structured-outputs]'"


CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")  # StructuredOutputsParams takes one


@dataclass(slots=True, kw_only=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names)."""

    json: str | dict | None = None
    """A JSON schema (dict or JSON text): the output is one JSON value that satisfies it."""
    json_object: bool | None = None
    """The output is a JSON object (any keys and values)."""
    regex: str | None = None
    """The output matches this regular expression."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """The output derives from this EBNF (GBNF) grammar's ``root`` rule."""
    start_after: list[int] | None = None
    """Not a constraint: the constraint applies only once the output holds these token ids in a
    row, free generation before (a reasoning model's end-of-thinking marker, e.g. ``</think>``:
    the server sets it when its reasoning parser expects the model to think first)."""
    opened_by: int | None = None
    """With ``start_after``: the wait holds only for an output that opens with this token (a
    thinking model's ``<think>``, which it may leave out); the first token is either this one
    or one the constraint allows, and any other opening puts the whole output under it."""

    def __post_init__(self) -> None:
        # (json_object=False is "not given"; json=False is the schema that matches nothing)
        given = [name for name in CONSTRAINTS
                 if getattr(self, name) is not None and not (name == "json_object" and self.json_object is False)]
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(given) if given else 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(
                f"structured outputs: json must be a JSON schema (an object or its text), got {self.json!r}"
            )
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured outputs: json_object must be true or false, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs: {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured outputs: choice must be a non-empty list of strings, got {self.choice!r}")
            for option in self.choice:
                if not isinstance(option, str) or not option:
                    raise ValueError(f"structured outputs: each choice must be a non-empty string, got {option!r}")
            self.choice = list(self.choice)
        if self.start_after is not None:
            if (isinstance(self.start_after, (str, bytes)) or not self.start_after
                    or not all(isinstance(t, int) and t >= 0 for t in self.start_after)):
                raise ValueError(
                    f"structured outputs: start_after must be a non-empty list of token ids, got {self.start_after!r}"
                )
            self.start_after = list(self.start_after)
        if self.opened_by is not None and (self.start_after is None or not isinstance(self.opened_by, int)
                                           or isinstance(self.opened_by, bool) or self.opened_by < 0):
            raise ValueError(f"structured outputs: opened_by must be a token id and needs start_after, "
                             f"got {self.opened_by!r}")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec): what identifies the compiled grammar (the cache key)."""
        if self.json is not None:
            # (keys keep their order: xgrammar emits an object's properties in the schema's order)
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.json_object:
            return "json", '{"type": "object"}'  # an object, not any JSON value
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            # one alternative per choice, each a JSON-escaped string literal (GBNF's escapes)
            # (ensure_ascii=False: xgrammar reads a \ud83e\udd8a escape as two lone surrogates, not one emoji)
            return "grammar", "root ::= " + " | ".join(json.dumps(option, ensure_ascii=False) for option in self.choice)
        return "grammar", self.grammar  # type: ignore[return-value]


@dataclass(slots=True)
class RequestGrammar:
    """One request's matcher and whether its constraint has started."""

    params: StructuredOutputsParams
    matcher: Any
    waits: bool  # not started: its start_after marker is not generated yet
    gated: bool  # before the first token with opened_by: that token, or one the grammar allows

    @property
    def masks(self) -> bool:
        """The grammar filters the next token."""
        return not self.waits or self.gated

    @property
    def active(self) -> bool:
        return not self.waits

    def follow(self, token_id: int, previous: list[int]) -> bool:
        """After ``token_id`` was sampled (``previous``: the output before it): advance the
        matcher if the constraint applies. False, the matcher unchanged, if the token does not fit it."""
        if self.gated:
            self.gated = False
            if token_id == self.params.opened_by:
                return True  # thinking: the constraint waits for the end marker
            self.waits = False
        elif self.waits:
            marker = self.params.start_after
            self.waits = [*previous[max(0, len(previous) - len(marker) + 1) :], token_id] != marker
            return True
        return self.matcher.is_terminated() or self.matcher.accept_token(token_id)

    def valid_prefix(self, draft_token_ids: list[int]) -> list[int]:
        """The leading drafts the grammar accepts, up to and including one that ends it (the
        matcher is left as it was). Only for an active, ungated grammar."""
        matcher = self.matcher
        num_valid = 0
        for token_id in draft_token_ids:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            num_valid += 1
        if num_valid:
            matcher.rollback(num_valid)
        return draft_token_ids[:num_valid]

    def is_complete(self) -> bool:
        """The tokens under the constraint form a whole string of the grammar (EOS may end it)."""
        return self.active and (self.matcher.is_terminated() or self.matcher.is_completed())


_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise ValueError(_INSTALL_HINT) from exc
    return xgrammar


def validate(params: StructuredOutputsParams) -> None:
    """Parse the constraint (no tokenizer needed): ``ValueError`` naming what is wrong."""
    xgr = _xgrammar()
    kind, spec = params.key
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the parser's message
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        message = _XGRAMMAR_PREFIX.sub("", message)  # (its log prefix: "[06:24:02] /project/cpp/x.cc:83: ")
        what = "JSON schema" if kind == "json" else kind  # (the schema is what fails, not the JSON text)
        raise ValueError(f"structured outputs: invalid {what}: {message}") from None




class StructuredOutputManager:
    """The engine core's side: grammars compiled in a background thread, each request's matcher,
    and the token bitmask of the requests that sample in a step.

    A request enters the scheduler with its compile submitted (``submit``); the scheduler
    admits it once ``is_ready`` (a slow compile never holds up the other requests' steps),
    builds each step's bitmask here (``grammar_bitmask``) for the workers to apply to the
    logits, and advances the matcher with every sampled token (``RequestGrammar.follow``).
    Compiled grammars are cached by constraint (xgrammar's cache, bounded)."""

    CACHE_LIMIT_BYTES = 1 << 30
    NUM_COMPILE_THREADS = 2  # (a slow compile leaves the other thread to the small ones)

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None  # built by the first compile, in a compile thread
        self._compiler_lock = threading.Lock()
        self._queue: queue.SimpleQueue | None = None  # (future, key) to compile; None stops a thread

    def submit(self, request: Request) -> None:
        """Queue the compile of ``request``'s grammar (``grammar_future``). The result is the
        compiled grammar, or None (an error logged) if it does not compile (``validate``
        parsed it when the request was added, so this is not expected: it runs unconstrained).
        The compile threads are daemons: a compile in progress never holds up the process's exit."""
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            for i in range(self.NUM_COMPILE_THREADS):
                threading.Thread(target=self._compile_loop, name=f"halserve-grammar-{i}", daemon=True).start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, request.sampling_params.structured_outputs.key))
        request.grammar_future = future

    def cancel(self, request: Request) -> None:
        """``request`` ended (aborted, perhaps while waiting): its compile is dropped if it has not
        started (one that has runs to its end; xgrammar cannot stop it)."""
        if request.grammar_future is not None:
            request.grammar_future.cancel()
            request.grammar_future = None

    def _compile_loop(self) -> None:
        _lower_thread_priority()
        assert self._queue is not None
        while (item := self._queue.get()) is not None:
            future, key = item
            if future.set_running_or_notify_cancel():  # (False: cancelled while queued)
                future.set_result(self._compile(key))

    def is_ready(self, request: Request) -> bool:
        """Whether ``request`` may run: it has no grammar to wait for. The first call after its
        compile finished gives it its matcher (``request.grammar``)."""
        future = request.grammar_future
        if future is None:
            return True
        if not future.done():
            return False
        request.grammar = self.start(request.sampling_params.structured_outputs, future.result())
        request.grammar_future = None
        return True

    @staticmethod
    def wait(requests: Iterable[Request], timeout: float) -> None:
        """Block until one of ``requests``' grammars compiles, at most ``timeout`` seconds."""
        pending = [r.grammar_future for r in requests if r.grammar_future is not None]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def _compile(self, key: tuple[str, str]) -> Any:
        try:
            with self._compiler_lock:
                if self._compiler is None:
                    xgr = _xgrammar()
                    info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size)
                    threads = max(1, (os.cpu_count() or 2) // 4)  # (the model's step runs beside them)
                    self._compiler = xgr.GrammarCompiler(info, max_threads=threads,
                                                         cache_limit_bytes=self.CACHE_LIMIT_BYTES)
            kind, spec = key
            if kind == "json":
                return self._compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            return self._compiler.compile_grammar(spec)
        except Exception:  # noqa: BLE001 - keep the engine serving
            logger.exception("a %s constraint did not compile; its requests run unconstrained", key[0])
            return None

    @staticmethod
    def start(params: StructuredOutputsParams, compiled: Any) -> RequestGrammar | None:
        """A new request's matcher over its compiled grammar; None if it did not compile."""
        if compiled is None:
            return None
        matcher = _xgrammar().GrammarMatcher(compiled)
        return RequestGrammar(params, matcher, waits=params.start_after is not None, gated=params.opened_by is not None)

    def grammar_bitmask(self, grammars: list[RequestGrammar],
                        drafts: list[list[int]] | None = None) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32: bit t of a row says token t may come next (a gated
        grammar's ``opened_by`` token stays allowed). One row per grammar, or with ``drafts``
        (speculative decoding: drafts its grammar accepts, ``RequestGrammar.valid_prefix``)
        k + 1 rows for a grammar with k drafts: next after its output, then after each draft."""
        xgr = _xgrammar()
        drafts = drafts or [[] for _ in grammars]
        bitmask = xgr.allocate_token_bitmask(sum(len(d) + 1 for d in drafts), self.vocab_size)
        row = 0
        for grammar, draft in zip(grammars, drafts):
            matcher = grammar.matcher
            for j in range(len(draft) + 1):
                if j:
                    accepted = matcher.accept_token(draft[j - 1])
                    assert accepted, "a draft its grammar refuses (valid_prefix cuts them)"
                matcher.fill_next_token_bitmask(bitmask, row)
                row += 1
            if draft:
                matcher.rollback(len(draft))
            if grammar.gated:  # (never with drafts)
                word, bit = divmod(grammar.params.opened_by, 32)
                bitmask[row - 1, word] |= (1 << bit) if bit < 31 else -(1 << 31)  # (int32 words)
        return bitmask

    def shutdown(self) -> None:
        if self._queue is not None:
            for _ in range(self.NUM_COMPILE_THREADS):
                self._queue.put(None)


def _lower_thread_priority() -> None:
    """A compile thread yields the CPU to the model's step threads (Linux: a thread has its
    own nice value); where that is not possible it runs at normal priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def apply_grammar_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf in ``logits`` [R, V] rows ``rows`` [k] for every token the matching ``bitmask`` row
    [k, ceil(V' / 32)] int32 does not allow (tokens past its V' are not allowed); returns the
    masked logits (a copy: the caller's stay as they were). Plain torch: any device."""
    import torch

    bitmask = bitmask.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [k, words * 32]
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    masked = logits.index_select(0, rows).masked_fill(~allowed[:, :vocab], float("-inf"))
    return logits.index_copy(0, rows, masked)


def no_token_stop_reason(req_id: str, params: Any, grammar: RequestGrammar | None, rejected: int | None) -> str | None:
    """The stop_reason of a request that ends without a token this step (``rejected``: the
    sampled token its grammar refused; None: its constraints left no token). None when
    its structured output is complete, so ending is what EOS would have done; otherwise
    why, logged as a warning: its constraints contradict each other."""
    grammar = grammar if grammar is not None and grammar.active else None
    if rejected is not None:
        reason = f"the sampled token {rejected} does not fit the request's structured outputs grammar"
    elif grammar is not None and grammar.is_complete():
        logger.info("request %s: its structured output is complete but its other constraints forbid EOS; "
                    "it ends here", req_id)
        return None
    else:
        # (min_tokens is never the cause: it gives way to stop tokens, see Sampler)
        constraints = [name for name, active in (("structured outputs", grammar is not None),
                                                 ("allowed_token_ids", getattr(params, "allowed_token_ids", None)),
                                                 ("bad_words", getattr(params, "bad_words", None))) if active]
        reason = (f"the request's constraints leave no token to generate ({' with '.join(constraints)})"
                  if constraints else "no token can be sampled: its logits are -inf or NaN")
    logger.warning("request %s: %s; it ends here", req_id, reason)
    return reason
