import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from halserve.detokenizer import IncrementalDetokenizer
from halserve.sampling_params import SamplingParams

# The emoji and the CJK characters appear once, so the small vocabulary never merges their
# bytes: each character spans several byte-level tokens.
CORPUS = ["héllo 世界 🙂 hello world"] + [
    "the quick brown fox jumps over the lazy dog",
    "hello world héllo café",
    "stop here STOP now the end",
] * 4


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290,
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """SentencePiece-style: words carry a leading '▁' that decode() strips at the start."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["</s>"], show_progress=False)
    tok.train_from_iterator(["hello world the quick brown fox"] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", clean_up_tokenization_spaces=False)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stream(tok, prompt_ids, output_ids, params, step=1):
    """Feed output ids `step` at a time; returns (detokenizer, streamed deltas, stop string)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas, stop = [], None
    for i in range(0, len(output_ids), step):
        stop = detok.update(output_ids[i : i + step])
        deltas.append(detok.get_delta(finished=stop is not None))
        if stop is not None:
            break
    deltas.append(detok.get_delta(finished=True))
    return detok, deltas, stop


@pytest.mark.parametrize("text", ["héllo 世界 🙂 hello world", "the lazy dog 🙂🙂 café", "plain ascii words"])
@pytest.mark.parametrize("step", [1, 3])
def test_streaming_concatenation_equals_final_decode(tokenizer, text, step):
    out = encode(tokenizer, text)
    detok, deltas, stop = stream(tokenizer, encode(tokenizer, "hello "), out, SamplingParams(), step)
    assert stop is None
    assert "".join(deltas) == detok.output_text == tokenizer.decode(out, skip_special_tokens=True) == text
    assert detok.output_token_ids == out


def test_split_emoji_is_held_back_never_replacement_char(tokenizer):
    out = encode(tokenizer, "héllo 🙂")
    emoji_ids = encode(tokenizer, "🙂")
    assert len(emoji_ids) >= 2, "precondition: the emoji spans several tokens"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    texts = []
    for tid in out:
        detok.update([tid])
        assert "\ufffd" not in detok.output_text
        texts.append(detok.get_delta())
    assert all("\ufffd" not in t for t in texts)
    # the emoji's first byte tokens give nothing; its last token completes the character
    assert texts[-len(emoji_ids):] == [""] * (len(emoji_ids) - 1) + ["🙂"]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tokenizer, include):
    out = encode(tokenizer, "say STOP now the end")
    stop_str = "P no"  # spans the tokens "OP", " ", "now"
    params = SamplingParams(stop=["zzz", stop_str], include_stop_str_in_output=include)
    detok, deltas, stop = stream(tokenizer, [], out, params)
    assert stop == stop_str and detok.stop_string == stop_str
    want = "say STOP no" if include else "say STO"
    assert detok.output_text == want
    assert "".join(deltas) == want


def test_stop_string_prefix_never_streamed(tokenizer):
    out = encode(tokenizer, "the end of the quick fox")
    params = SamplingParams(stop=["the quick"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    sent = ""
    for tid in out:
        stop = detok.update([tid])
        sent += detok.get_delta(finished=stop is not None)
        assert detok.output_text.startswith(sent)
        assert "the q" not in sent or stop is not None  # a prefix of the stop string is held back
        if stop:
            break
    assert stop == "the quick" and sent == detok.output_text == "the end of "


def test_first_completed_stop_string_wins_when_several_tokens_arrive(tokenizer):
    out = encode(tokenizer, "hello world the end")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["end", "world"]))
    assert detok.update(out) == "world"
    assert detok.output_text == "hello "
    assert detok.update(encode(tokenizer, " more")) is None  # stopped: nothing changes
    assert detok.output_text == "hello "


def test_no_stop_string_before_min_tokens(tokenizer):
    out = encode(tokenizer, "the end the end")
    n_first = len(encode(tokenizer, "the end"))  # the first "end" completes at this token
    detok, _, stop = stream(tokenizer, [], out, SamplingParams(stop=["end"], min_tokens=n_first, max_tokens=16))
    assert stop == "end"
    assert detok.output_text == "the end the "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    out = encode(tokenizer, "hello") + [tokenizer.convert_tokens_to_ids("<|im_start|>")] + encode(tokenizer, " world")
    detok, deltas, _ = stream(tokenizer, [], out, SamplingParams(skip_special_tokens=skip))
    want = "hello world" if skip else "hello<|im_start|> world"
    assert detok.output_text == "".join(deltas) == want == tokenizer.decode(out, skip_special_tokens=skip)


def test_stop_terminated_token_text_is_left_out(tokenizer):
    out = encode(tokenizer, "hello world")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    detok.update(out[:-1])
    detok.update([tokenizer.eos_token_id], stop_terminated=True)
    assert detok.output_text == tokenizer.decode(out[:-1])
    assert detok.output_token_ids[-1] == tokenizer.eos_token_id


def test_sentencepiece_spaces_use_prompt_context(metaspace_tokenizer):
    tok = metaspace_tokenizer
    prompt, out = encode(tok, "hello"), encode(tok, "world the fox")
    assert tok.convert_ids_to_tokens(out[0]).startswith("▁")
    detok, deltas, _ = stream(tok, prompt, out, SamplingParams())
    full = tok.decode(prompt + out)
    # the completion continues the prompt: " world the fox", with its word-boundary space
    assert detok.output_text == "".join(deltas) == full[len(tok.decode(prompt)):] == " world the fox"


def test_decode_window_stays_small(tokenizer):
    """O(new tokens) per update: the decoded windows do not grow with the output."""
    sizes = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def decode(self, ids, skip_special_tokens=False):
            sizes.append(len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    class Wrapped:
        backend_tokenizer = Spy(tokenizer.backend_tokenizer)

    out = encode(tokenizer, "the quick brown fox jumps over the lazy dog héllo 世界 🙂 " * 8)
    detok = IncrementalDetokenizer(Wrapped(), encode(tokenizer, "hello world the end"), SamplingParams())
    for tid in out:
        detok.update([tid])
    assert detok.output_text == tokenizer.decode(out)
    assert max(sizes) <= 12, max(sizes)


def test_detokenize_false_keeps_ids_only(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(detokenize=False))
    assert detok.update(encode(tokenizer, "hello")) is None
    assert detok.output_text == "" and detok.output_token_ids == encode(tokenizer, "hello")
