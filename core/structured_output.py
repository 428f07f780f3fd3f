"""Structured outputs: generation constrained to a JSON schema, any JSON object, a regex, one of
a list of strings, or an EBNF grammar (vLLM's ``StructuredOutputsParams``), through xgrammar.

The request carries a ``StructuredOutputsParams``; the frontend parses its grammar when the
request is added (a bad schema or regex is a ``ValueError`` there, never in the step loop).
The model runner compiles it against the tokenizer (``StructuredOutputs``, cached per
grammar), keeps one matcher per request, masks the logits of every token the grammar does
not allow before sampling, and advances the matcher with each sampled token. Once the grammar
is complete only EOS is allowed, so the request ends as a normal stop (min_tokens gives way).
A step where the grammar and the request's other constraints (allowed_token_ids) leave no
token ends the request there without one: finish_reason "stop", the stop_reason says why.

xgrammar is an optional dependency (``pip install "halserve[structured-outputs]"``).
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

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
            return "grammar", "root ::= " + " | ".join(json.dumps(option) for option in self.choice)
        return "grammar", self.grammar  # type: ignore[return-value]


def constrained_tail(params: StructuredOutputsParams, generated: list[int]) -> list[int] | None:
    """The generated tokens under the constraint (from where it started), or None while it has
    not started (``start_after``'s marker not generated yet; with ``opened_by``, no token yet)."""
    if params.start_after is None or (params.opened_by is not None and generated[:1] not in ([], [params.opened_by])):
        return generated
    end = marker_end(generated, params.start_after)
    return None if end is None else generated[end:]


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

    def follow(self, token_id: int, output: list[int]) -> bool:
        """After ``token_id`` was sampled (``output`` ends with it): advance the matcher if the
        constraint applies. False, the matcher unchanged, if the token does not fit it."""
        if self.gated:
            self.gated = False
            if token_id == self.params.opened_by:
                return True  # thinking: the constraint waits for the end marker
            self.waits = False
        elif self.waits:
            marker = self.params.start_after
            self.waits = output[-len(marker) :] != marker
            return True
        return self.matcher.is_terminated() or self.matcher.accept_token(token_id)

    def is_complete(self) -> bool:
        """The tokens under the constraint form a whole string of the grammar (EOS may end it)."""
        return self.active and (self.matcher.is_terminated() or self.matcher.is_completed())


def marker_end(token_ids: list[int], marker: list[int]) -> int | None:
    """The index just past the first occurrence of ``marker`` in ``token_ids`` (None: absent)."""
    n = len(marker)
    for i in range(len(token_ids) - n + 1):
        if token_ids[i : i + n] == marker:
            return i + n
    return None


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
        raise ValueError(f"structured outputs: invalid {kind}: {message}") from None


class StructuredOutputs:
    """The model runner's side: compiled grammars (cached) and the logits mask of a step."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info)
        self._compiled: dict[tuple[str, str], Any] = {}

    def start(self, req_id: str, params: StructuredOutputsParams, generated: list[int]) -> RequestGrammar | None:
        """A request's matcher (its grammar compiled once per distinct constraint), advanced
        past the tokens it already generated (a request resumed after preemption). None, with
        an error logged, if the grammar does not compile (``validate`` parsed it when the
        request was added, so this is not expected): a step never fails for one request."""
        key = params.key
        try:
            compiled = self._compiled.get(key)
            if compiled is None:
                kind, spec = key
                if kind == "json":
                    compiled = self._compiler.compile_json_schema(spec, any_whitespace=False)
                elif kind == "regex":
                    compiled = self._compiler.compile_regex(spec)
                else:
                    compiled = self._compiler.compile_grammar(spec)
                self._compiled[key] = compiled
        except Exception:  # noqa: BLE001 - keep the engine serving
            logger.exception("request %s: its %s constraint did not compile; it runs unconstrained", req_id, key[0])
            return None
        matcher = self._xgr.GrammarMatcher(compiled)
        tail = constrained_tail(params, generated)
        for token_id in tail or ():  # (the matcher follows the tokens under the constraint only)
            if not self.accept(req_id, matcher, token_id):
                return None
        gated = params.opened_by is not None and not generated
        return RequestGrammar(params, matcher, waits=tail is None, gated=gated)

    def mask_logits(self, logits: "torch.Tensor", grammars: list[tuple[int, RequestGrammar]]) -> "torch.Tensor":
        """-inf in ``logits`` rows (one per (row, grammar)) for every token the grammar does not
        allow next (a gated one's opened_by token stays allowed); returns the masked logits (a
        copy: the caller's stay as they were)."""
        import torch

        bitmask = self._xgr.allocate_token_bitmask(len(grammars), self.vocab_size)
        for i, (_, grammar) in enumerate(grammars):
            grammar.matcher.fill_next_token_bitmask(bitmask, i)
            if grammar.gated:
                word, bit = divmod(grammar.params.opened_by, 32)
                bitmask[i, word] |= (1 << bit) if bit < 31 else -(1 << 31)  # (int32 words)
        rows = torch.tensor([row for row, _ in grammars], dtype=torch.long, device=logits.device)
        masked = logits.index_select(0, rows).float()
        self._xgr.apply_token_bitmask_inplace(masked, bitmask.to(masked.device))
        return logits.index_copy(0, rows, masked.to(logits.dtype))

    @staticmethod
    def accept(req_id: str, matcher: Any, token_id: int) -> bool:
        """Advance a matcher by one sampled token; False if the token does not fit (the caller
        drops the matcher). After the grammar completed, EOS is all it allows: ignored."""
        if matcher.is_terminated() or matcher.accept_token(token_id):
            return True
        logger.warning("request %s: token %d does not fit its grammar; it runs unconstrained from here",
                       req_id, token_id)
        return False
