"""The bundled demo model: ``halserve-demo-adder``.

A tiny Llama-architecture checkpoint (``transformers.LlamaForCausalLM``, about 0.8M
parameters, float32, a few MB) shipped inside the wheel (``demo/model/``, the package's
``model`` folder) so that ``halserve serve`` with no MODEL works offline and its answers can be checked.

It does multi-digit addition: the prompt ``"123+456="`` (the tokenizer prepends ``<s>``)
is completed with ``"579"`` followed by ``</s>``. Operands have 1 to 3 digits
(0..999). The chat template turns a user message ``"123+456"`` or ``"123+456="`` into the
same prompt, ``"<s>123+456="``.

This module stays import-cheap (standard library only). ``halserve.demo.train`` rebuilds
the tokenizer and the checkpoint from scratch; its docstring documents the data and the
held-out split, which :func:`is_held_out`, :func:`make_problem` and :func:`is_correct`
implement for evaluation.
"""
from __future__ import annotations

import hashlib
import os
import random

__all__ = [
    "DEMO_MODEL_PATH",
    "DEMO_MODEL_NAME",
    "CHAT_TEMPLATE_PATH",
    "MAX_OPERAND_DIGITS",
    "HELD_OUT_PERCENT",
    "is_held_out",
    "sample_operands",
    "make_problem",
    "parse_prompt",
    "is_correct",
]

_HERE = os.path.dirname(os.path.abspath(__file__))

#: Absolute path of the bundled Hugging Face-format checkpoint (config, weights, tokenizer).
DEMO_MODEL_PATH = os.path.join(_HERE, "model")
#: The name the server reports for the demo model (``/v1/models``).
DEMO_MODEL_NAME = "halserve-demo-adder"
#: Jinja source of the chat template (also embedded in ``model/tokenizer_config.json``).
CHAT_TEMPLATE_PATH = os.path.join(_HERE, "chat_template.jinja")

#: Operands have 1..MAX_OPERAND_DIGITS digits.
MAX_OPERAND_DIGITS = 3
#: About this share (in percent) of all (a, b) pairs is never seen in training.
HELD_OUT_PERCENT = 10


def is_held_out(a: int, b: int) -> bool:
    """True when the problem ``a+b`` belongs to the held-out split (never trained on).

    The split is a hash of the prompt text: the first 4 bytes of
    ``sha256(f"{a}+{b}")`` read as a big-endian integer, modulo 100, below
    :data:`HELD_OUT_PERCENT`. It depends on the ordered pair, so ``a+b`` and ``b+a`` fall
    independently.
    """
    digest = hashlib.sha256(f"{a}+{b}".encode("ascii")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def sample_operands(rng: random.Random) -> tuple[int, int]:
    """One (a, b) pair from the task distribution (training and held-out alike).

    Each operand independently: a digit count uniform in 1..MAX_OPERAND_DIGITS, then a
    number uniform among those with exactly that many digits (0..9 for one digit, so
    ``0`` is included; no leading zeros otherwise).
    """
    out = []
    for _ in range(2):
        n = rng.randint(1, MAX_OPERAND_DIGITS)
        lo = 0 if n == 1 else 10 ** (n - 1)
        out.append(rng.randrange(lo, 10**n))
    return out[0], out[1]


def make_problem(rng: random.Random) -> tuple[str, str]:
    """A held-out problem: ``(prompt, answer)``, e.g. ``("123+456=", "579")``.

    ``rng`` is a :class:`random.Random`; pairs are drawn from the task distribution and
    rejected until one in the held-out split comes up. The prompt carries no ``<s>``; the
    tokenizer adds it (``add_special_tokens=True``, the default).
    """
    while True:
        a, b = sample_operands(rng)
        if is_held_out(a, b):
            return f"{a}+{b}=", str(a + b)


def parse_prompt(prompt: str) -> tuple[int, int]:
    """``"123+456="`` (optionally with a leading ``<s>`` or spaces) -> ``(123, 456)``."""
    text = prompt.replace("<s>", "").replace(" ", "").strip()
    if text.endswith("="):
        text = text[:-1]
    left, sep, right = text.partition("+")
    if not sep or not left.isdigit() or not right.isdigit():
        raise ValueError(f"not an addition prompt: {prompt!r}")
    return int(left), int(right)


def is_correct(prompt: str, completion: str) -> bool:
    """Whether ``completion`` is exactly the sum asked for by ``prompt``.

    Surrounding whitespace and a trailing ``</s>`` (when a caller keeps special tokens) are
    ignored; anything else (extra digits, leading zeros, other text) counts as wrong.
    """
    a, b = parse_prompt(prompt)
    text = completion.strip()
    if text.endswith("</s>"):
        text = text[: -len("</s>")].strip()
    return text == str(a + b)
