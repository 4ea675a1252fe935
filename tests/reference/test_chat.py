"""Chat rendering, incremental decoding and request validation, without a server."""

from __future__ import annotations

import random

import pytest

from reference.manager.chat import (
    ChatRenderer,
    IncrementalDecoder,
    RequestError,
    find_stop,
    parse_chat,
    parse_completion,
)


def test_render_is_chatml_token_for_token(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    ids = ChatRenderer(tok).render(messages)
    assert tok.decode(ids) == tok.render_chat(messages)
    assert ids[0] == tok.im_start_id and ids.count(tok.im_end_id) == 2


def test_render_splices_generated_ids(tok):
    renderer = ChatRenderer(tok)
    first = renderer.render([{"role": "user", "content": "hi"}])
    sampled = [tok.encode("h")[0], tok.encode("ello")[0], tok.im_end_id]  # not how "hello" tokenises
    text = tok.decode(sampled[:-1])
    renderer.remember(text, sampled)
    second = renderer.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": text},
                              {"role": "user", "content": "bye"}])  # fmt: skip
    assert second[: len(first) + len(sampled)] == [*first, *sampled]
    # Text that was never generated in this session is tokenised as usual.
    other = renderer.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": text + "!"}])
    plain = tok.encode(text + "!")
    assert other[len(first) : len(first) + len(plain) + 1] == [*plain, tok.im_end_id]


def test_length_stopped_completion_gets_its_end_marker(tok):
    renderer = ChatRenderer(tok)
    first = renderer.render([{"role": "user", "content": "hi"}])
    sampled = tok.encode("cut sho")
    renderer.remember("cut sho", sampled)
    second = renderer.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "cut sho"}])
    assert second[len(first) : len(first) + len(sampled) + 1] == [*sampled, tok.im_end_id]


@pytest.mark.parametrize("seed", range(5))
def test_incremental_decoder_equals_whole_decode(tok, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(["héllo ", "世界", "🙂", "\n", "x = 1;", "ü", " "]) for _ in range(60))
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(t) for t in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == text == dec.text
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_decoder_skips_stop_tokens(tok):
    dec = IncrementalDecoder(tok, skip_ids=(tok.im_end_id,))
    for t in [*tok.encode("done"), tok.im_end_id]:
        dec.push(t)
    dec.flush()
    assert dec.text == "done"


def test_find_stop():
    assert find_stop("abc STOP def", ["STOP", "def"]) == 4
    assert find_stop("abc", ["x"]) == -1
    assert find_stop("STOP STOP", ["STOP"], start=1) == 5


def test_parse_chat_errors_name_the_field():
    with pytest.raises(RequestError, match="'stop' takes at most 4"):
        parse_chat({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]})
    with pytest.raises(RequestError, match=r"messages\[1\].role"):
        parse_chat({"messages": [{"role": "user", "content": "x"}, {"content": "y"}]})
    with pytest.raises(RequestError, match="only text parts"):
        parse_chat({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    ok = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "stop": "x"})
    assert ok.sampling.stop == ("x",) and ok.sampling.temperature == 1.0


def test_ignore_eos_is_a_boolean_off_by_default():
    assert parse_completion({"prompt": "x", "ignore_eos": True}).sampling.ignore_eos
    assert not parse_completion({"prompt": "x"}).sampling.ignore_eos
    with pytest.raises(RequestError, match="'ignore_eos' must be a boolean, got 1") as e:
        parse_completion({"prompt": "x", "ignore_eos": 1})
    assert e.value.param == "ignore_eos"
