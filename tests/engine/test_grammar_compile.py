"""Grammars compile in the engine core's background thread: a request waits for its own
grammar while the others keep stepping, and the workers apply the scheduler's bitmask."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from halserve import LLM, SamplingParams
from halserve.structured_output import StructuredOutputManager, apply_grammar_bitmask

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')

xgr = pytest.importorskip("xgrammar", reason="structured outputs need the structured-outputs extra (xgrammar)")


@pytest.fixture(scope="module")
def llm(checkpoint_factory):
    return LLM(checkpoint_factory("llama"), platform="cpu", dtype="float32", block_size=16, max_model_len=128)


@pytest.fixture
def gated_compiles(monkeypatch):
    """Compiles block until the test opens the gate; yields the gate and the compile count."""
    gate = threading.Event()
    started: list[tuple[str, str]] = []
    original = StructuredOutputManager._compile

    def compile_after_gate(self, key):
        started.append(key)
        assert gate.wait(timeout=60), "the test never opened the gate"
        return original(self, key)

    monkeypatch.setattr(StructuredOutputManager, "_compile", compile_after_gate)
    yield gate, started
    gate.set()


def _drain(engine, outputs: dict, timeout: float = 60.0, until=None) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests() and not (until and until()):
        assert time.monotonic() < deadline, "the engine made no progress"
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out


def test_a_compiling_grammar_holds_up_only_its_own_request(llm, gated_compiles):
    gate, started = gated_compiles
    engine = llm.llm_engine
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate("the quick brown fox", plain, use_tqdm=False)[0].outputs[0].token_ids

    engine.add_request("constrained", "give me json", SamplingParams(temperature=0.0, max_tokens=30,
                                                                     structured_outputs={"json": schema}))
    engine.add_request("plain", "the quick brown fox", plain)
    outputs: dict = {}
    _drain(engine, outputs, until=lambda: "plain" in outputs)
    # the unconstrained request ran to its end while the grammar was still compiling
    assert outputs["plain"].outputs[0].token_ids == alone
    assert "constrained" not in outputs and engine.has_unfinished_requests() and len(started) == 1
    # nothing else to run: a step waits for the grammar (briefly) and returns nothing
    t0 = time.monotonic()
    assert engine.step() == [] and time.monotonic() - t0 >= 0.02
    gate.set()
    _drain(engine, outputs)
    text = outputs["constrained"].outputs[0].text
    assert isinstance(json.loads(text)["n"], int), text


def test_abort_while_the_grammar_compiles(llm, gated_compiles):
    gate, _ = gated_compiles
    engine = llm.llm_engine
    engine.add_request("doomed", "hi", SamplingParams(max_tokens=5, structured_outputs={"regex": "[0-9]{3}"}))
    assert engine.step() == []
    engine.abort_request("doomed")
    assert not engine.has_unfinished_requests()
    gate.set()
    out = llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=5, structured_outputs={"regex": "[0-9]{3}"}),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.text) == 3 and out.text.isdigit(), out.text


@pytest.mark.parametrize("vocab,width", [(100, 100), (100, 128), (70, 96), (64, 64)])
def test_apply_grammar_bitmask_matches_xgrammar(vocab, width):
    torch.manual_seed(vocab + width)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32)
    bitmask[1, -1] |= -(2**31)  # bit 31 set: the sign bit
    if vocab % 32:  # (a matcher's row has no bit set past the vocabulary)
        bitmask[:, -1] &= (1 << (vocab % 32)) - 1
    logits = torch.randn(5, width)
    rows = torch.tensor([4, 0, 2])
    ours = apply_grammar_bitmask(logits, rows, bitmask)

    expected = logits.clone()
    masked = expected[rows][:, :vocab].contiguous()
    xgr.apply_token_bitmask_inplace(masked, bitmask)
    expected[rows, :vocab] = masked
    expected[rows, vocab:] = float("-inf")  # tokens past the tokenizer's vocabulary are never allowed
    assert torch.equal(ours, expected)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])  # other rows untouched, input not modified


def test_choices_outside_the_basic_plane(llm):
    # (a choice's JSON-escaped surrogate pair used to reach xgrammar as two lone surrogates)
    choices = ["🦊 fox", "🐶 dog", "é🦊"]
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=20, structured_outputs={"choice": choices})
        out = llm.generate("pick one", params, use_tqdm=False)[0].outputs[0]
        assert out.text in choices, out.text


def test_a_compile_queued_for_an_aborted_request_is_dropped(llm, gated_compiles):
    gate, started = gated_compiles
    engine = llm.llm_engine
    # two compile threads: both block at the gate; the third compile waits in the queue
    for i in range(3):
        engine.add_request(f"q{i}", "hi", SamplingParams(max_tokens=3, structured_outputs={"regex": f"[0-9]{{{i + 1}}}"}))
    engine.step()
    deadline = time.monotonic() + 10
    while len(started) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(started) == 2
    engine.abort_request(["q0", "q1", "q2"])
    gate.set()
    out = llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=5, structured_outputs={"regex": "[a-c]{2}"}),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.text) == 2 and set(out.text) <= set("abc"), out.text
    assert ("regex", "[0-9]{3}") not in started  # the aborted request's queued compile never ran


def test_a_compile_in_progress_does_not_hold_up_the_process_exit(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "import threading, time\n"
        "from types import SimpleNamespace\n"
        "from halserve.structured_output import StructuredOutputManager, StructuredOutputsParams\n"
        "started = threading.Event()\n"
        "def forever(self, key):\n"
        "    started.set()\n"
        "    threading.Event().wait()\n"
        "StructuredOutputManager._compile = forever\n"
        "manager = StructuredOutputManager(lambda: None, 16)\n"
        "params = SimpleNamespace(structured_outputs=StructuredOutputsParams(regex='a'))\n"
        "manager.submit(SimpleNamespace(sampling_params=params, grammar_future=None))\n"
        "assert started.wait(30)\n"
        "print('exiting', flush=True)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr
