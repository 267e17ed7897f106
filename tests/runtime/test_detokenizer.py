"""runtime.request.detokenizer: streamed deltas vs one-shot decode, split UTF-8 chars, spaces, stop strings."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runtime.request.detokenizer import IncrementalDetokenizer, StopChecker, TextStream

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Streaming text, token by token!",
    "Café crème, naïve façade, Ångström, über, señor, déjà vu, Œuvre, Ærø, Łódź, Straße.",
    "日本語のテキストを少しだけ書きます。東京と京都。中文字符也在这里，你好世界。",
    "한국어 문장도 조금. Emoji: 😀 🎉 👍🏽 🚀 ❤️ 🇫🇷 and more 🙂🙃.",
    "Numbers 12345 67890, symbols #$%&*()[]{}<>, and a tab\tand newline\nhere.",
]
ALPHABET = sorted(set("".join(CORPUS)))


def _train(tok: Tokenizer, vocab_size: int, **kw) -> Tokenizer:
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, **kw)
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    """Byte-level BPE with ~300 tokens: most multi-byte chars are split over several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return _train(tok, 300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"])


@pytest.fixture(scope="module")
def meta_tok() -> Tokenizer:
    """SentencePiece-style BPE: '▁' marks spaces, the decoder strips the leading one."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return _train(tok, 400, special_tokens=["<unk>", "</s>"], initial_alphabet=ALPHABET)


def stream(tok: Tokenizer, ids: list[int], skip: bool = True, **kw) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, **kw)
    return [detok.add(i) for i in ids] + [detok.flush()]


def random_text(rng: random.Random) -> str:
    words = [w for line in CORPUS for w in line.split()]
    parts = [rng.choice(words) if rng.random() < 0.6 else "".join(rng.choices(ALPHABET, k=rng.randint(1, 6)))
             for _ in range(rng.randint(1, 10))]
    return "".join(p + rng.choice([" ", "", "  ", "\n"]) for p in parts)


def test_tokenizer_really_splits_multibyte_chars(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("😀 日本語 café").ids
    assert any("\ufffd" in byte_tok.decode([i]) for i in ids)


def test_valid_texts_stream_exactly_without_replacement_chars(byte_tok: Tokenizer) -> None:
    rng = random.Random(0)
    held_back = 0
    for text in CORPUS + [random_text(rng) for _ in range(150)]:
        ids = byte_tok.encode(text).ids
        deltas = stream(byte_tok, ids)
        assert "".join(deltas) == byte_tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)
        held_back += sum(d == "" for d in deltas[:-1])
    assert held_back > 0  # some tokens ended mid-character and were held back


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences_match_full_decode(byte_tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(1)
    vocab = byte_tok.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        assert "".join(stream(byte_tok, ids, skip)) == byte_tok.decode(ids, skip_special_tokens=skip)


def test_special_tokens_skipped(byte_tok: Tokenizer) -> None:
    eos = byte_tok.token_to_id("<eos>")
    ids = byte_tok.encode("Hi 😀").ids + [eos]
    assert "".join(stream(byte_tok, ids, skip=True)) == "Hi 😀"
    assert "".join(stream(byte_tok, ids, skip=False)) == "Hi 😀<eos>"


def test_prompt_context_continues_prompt_text(byte_tok: Tokenizer, meta_tok: Tokenizer) -> None:
    for tok in (byte_tok, meta_tok):
        prompt = tok.encode("Café crème and").ids
        gen = tok.encode("Café crème and the lazy dog 😀 世界").ids[len(prompt):]
        deltas = stream(tok, gen, prompt_ids=prompt, prompt_context=True)
        full, head = tok.decode(prompt + gen), tok.decode(prompt)
        assert "".join(deltas) == full[len(head):]
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt)  # default: prompt ignored
        assert "".join([detok.add(i) for i in gen] + [detok.flush()]) == tok.decode(gen)
        assert detok.generated_ids == gen


def test_metaspace_spaces(meta_tok: Tokenizer) -> None:
    rng = random.Random(2)
    for text in ["Hello world, streaming text token by token", "the  lazy   dog"] + CORPUS[:2]:
        ids = meta_tok.encode(text).ids
        deltas = stream(meta_tok, ids)
        assert "".join(deltas) == meta_tok.decode(ids)
        assert " " in "".join(deltas)
    ids = meta_tok.encode("over the lazy dog").ids
    assert "".join(meta_tok.decode([i]) for i in ids) != meta_tok.decode(ids)  # naive per-token decode is wrong
    for _ in range(100):
        ids = meta_tok.encode(random_text(rng)).ids
        assert "".join(stream(meta_tok, ids)) == meta_tok.decode(ids)
    vocab = meta_tok.get_vocab_size()
    for _ in range(100):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        assert "".join(stream(meta_tok, ids)) == meta_tok.decode(ids)


def run_stream(tok: Tokenizer, text: str, stop: tuple[str, ...]) -> tuple[list[str], bool, TextStream]:
    ts = TextStream(tok, stop)
    deltas: list[str] = []
    for i in tok.encode(text).ids:
        d, stopped = ts.push(i)
        deltas.append(d)
        if stopped:
            return deltas, True, ts
    deltas.append(ts.finish())
    return deltas, False, ts


def test_stop_string_split_across_tokens(byte_tok: Tokenizer) -> None:
    text = "The quick brown fox 日本語 jumps ###END### over the lazy dog"
    stop = "###END###"
    ids = byte_tok.encode(text).ids
    assert not any(stop in byte_tok.decode([i]) for i in ids)  # no single token holds it
    deltas, stopped, ts = run_stream(byte_tok, text, (stop, "never"))
    assert stopped and ts.stop_string == stop
    assert "".join(deltas) == text[:text.index(stop)] == ts.text
    assert not any("#" in d for d in deltas)  # the partial match was never streamed
    assert ts.push(ids[-1]) == ("", True) and ts.finish() == ""


def test_multibyte_stop_and_earliest_match(byte_tok: Tokenizer) -> None:
    text = "Hello 你好世界 and 😀🎉 done"
    deltas, stopped, ts = run_stream(byte_tok, text, ("🎉", "世界"))
    assert stopped and "".join(deltas) == "Hello 你好" and ts.stop_string == "世界"


def test_held_back_text_released_at_finish(byte_tok: Tokenizer) -> None:
    text = "streaming ends with ###EN"
    ts = TextStream(byte_tok, ("###END###",))
    pushed = "".join(ts.push(i)[0] for i in byte_tok.encode(text).ids)
    assert pushed == "streaming ends with " and not ts.stopped
    assert ts.finish() == "###EN" and ts.text == text and not ts.stopped


def test_random_stop_strings(byte_tok: Tokenizer) -> None:
    rng = random.Random(3)
    for _ in range(100):
        text = random_text(rng)
        a = rng.randrange(len(text))
        stop = text[a:a + rng.randint(1, 4)]
        deltas, stopped, _ = run_stream(byte_tok, text, (stop,))
        assert stopped and "".join(deltas) == text[:text.index(stop)]
        deltas, stopped, _ = run_stream(byte_tok, text, ("\x00never",))
        assert not stopped and "".join(deltas) == text


def test_stop_checker() -> None:
    sc = StopChecker(("</s>", "STOP"))
    assert sc.check("abc</s>def STOP") == (True, "abc")
    assert sc.check("no stop here") == (False, "no stop here")
    assert sc.safe_length("text </") == 5 and sc.safe_length("text ST") == 5
    assert sc.safe_length("text") == 4 and StopChecker(()).safe_length("x<") == 2
    with pytest.raises(ValueError):
        StopChecker(("",))
