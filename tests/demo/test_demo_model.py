"""The bundled demo checkpoint (halserve.demo): loads offline with transformers, is small,
tokenizes and templates prompts in the training format, and adds correctly on held-out
problems (greedy, batched)."""
import json
import os
import random

import pytest

from halserve.demo import (
    DEMO_MODEL_NAME,
    DEMO_MODEL_PATH,
    HELD_OUT_PERCENT,
    is_correct,
    is_held_out,
    make_problem,
    parse_prompt,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_PATH, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    m = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_PATH, local_files_only=True, dtype=torch.float32)
    m.eval()
    return m


# -- the helpers -------------------------------------------------------------------------


def test_module_constants():
    assert os.path.isabs(DEMO_MODEL_PATH)
    assert os.path.isdir(DEMO_MODEL_PATH)
    assert DEMO_MODEL_NAME == "halserve-demo-adder"


def test_make_problem_is_held_out_and_in_range():
    rng = random.Random(0)
    for _ in range(300):
        prompt, answer = make_problem(rng)
        a, b = parse_prompt(prompt)
        assert prompt == f"{a}+{b}="
        assert 0 <= a <= 999 and 0 <= b <= 999
        assert answer == str(a + b)
        assert is_held_out(a, b)
    # deterministic for a given seed
    assert [make_problem(random.Random(5)) for _ in range(3)] == [make_problem(random.Random(5)) for _ in range(3)]


def test_held_out_share():
    pairs = [(a, b) for a in range(0, 1000, 7) for b in range(0, 1000, 3)]
    share = sum(is_held_out(a, b) for a, b in pairs) / len(pairs)
    assert abs(share - HELD_OUT_PERCENT / 100) < 0.01


def test_is_correct():
    assert is_correct("123+456=", "579")
    assert is_correct("<s>123+456=", " 579</s>")
    assert not is_correct("123+456=", "5790")
    assert not is_correct("123+456=", "0579")
    assert not is_correct("123+456=", "")
    with pytest.raises(ValueError):
        is_correct("hello", "1")


# -- the checkpoint ----------------------------------------------------------------------


def test_files_and_size():
    names = set(os.listdir(DEMO_MODEL_PATH))
    assert EXPECTED_FILES <= names
    total = sum(os.path.getsize(os.path.join(DEMO_MODEL_PATH, n)) for n in names)
    assert total < 10 * 1024 * 1024


def test_config(model):
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # exercises GQA
    assert cfg.tie_word_embeddings is False
    assert cfg.bos_token_id == 1 and cfg.eos_token_id == 2 and cfg.pad_token_id == 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    with open(os.path.join(DEMO_MODEL_PATH, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"


def test_generation_config_is_greedy_friendly():
    with open(os.path.join(DEMO_MODEL_PATH, "generation_config.json")) as f:
        gen = json.load(f)
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2
    for key in ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty"):
        assert key not in gen or key == "do_sample" and gen[key] is False


def test_tokenizer_round_trip(tokenizer):
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>" and tokenizer.pad_token == "<pad>"
    assert len(tokenizer) == 16
    ids = tokenizer("123+456=")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == 1 + len("123+456=")  # one token per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == "123+456="
    assert tokenizer.decode(ids) == "<s>123+456="
    digits = tokenizer("579", add_special_tokens=False)["input_ids"]
    assert len(digits) == 3
    assert tokenizer.decode(digits) == "579"
    assert tokenizer.decode(digits + [tokenizer.eos_token_id], skip_special_tokens=True) == "579"
    for text in ("0", "9+9=18", "999+999=1998"):
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    # whitespace is dropped, so "12 + 3 =" is the trained prompt too
    assert tokenizer(" 12 + 3 = ")["input_ids"] == tokenizer("12+3=")["input_ids"]


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "123+456"}],
        [{"role": "user", "content": "123+456="}],
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "123+456"}],
        [{"role": "user", "content": [{"type": "text", "text": "123 + 456 = ?"}]}],
        [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "123+456="}],
    ],
)
def test_chat_template_gives_training_prompt(tokenizer, messages):
    for add_generation_prompt in (True, False):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert text == "<s>123+456="
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == tokenizer("123+456=")["input_ids"]  # exactly one <s>


def test_chat_template_renders_a_training_example(tokenizer):
    messages = [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False) == "<s>1+2=3</s>"


def test_chat_template_is_the_bundled_jinja(tokenizer):
    from halserve.demo import CHAT_TEMPLATE_PATH

    with open(CHAT_TEMPLATE_PATH, encoding="utf-8") as f:
        assert tokenizer.chat_template == f.read()


def test_greedy_accuracy_on_held_out_problems(model, tokenizer):
    """200 held-out problems in one left-padded batch, greedy; >= 95% exactly right."""
    rng = random.Random(20240611)
    problems = [make_problem(rng) for _ in range(200)]
    prompts = [p for p, _ in problems]
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    ended = [tokenizer.eos_token_id in row for row in out[:, enc["input_ids"].shape[1] :].tolist()]
    correct = [ok and is_correct(p, c) for p, c, ok in zip(prompts, completions, ended)]
    accuracy = sum(correct) / len(correct)
    wrong = [(p, c) for p, c, ok in zip(prompts, completions, correct) if not ok]
    assert accuracy >= 0.95, f"accuracy {accuracy:.3f}; wrong: {wrong[:10]}"


def test_single_prompt_stops_at_eos(model, tokenizer):
    enc = tokenizer("123+456=", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    assert new[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(new, skip_special_tokens=True) == "579"
