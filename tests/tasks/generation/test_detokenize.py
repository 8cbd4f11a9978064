"""Incremental detokenization never prints half a character (byte-fallback pieces, multi-byte UTF-8 split across
byte-level tokens) and adds up to ``decode``; stop strings are held back until they cannot start, and cut."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from luminal_recipes.tasks.generation.detokenize import IncrementalDetokenizer, StopStrings

TEXTS = ["héllo wörld", "emoji 🦊🌍 and 日本語", "a\tb\nc\r\\d", "Ça marche très bien! ✨"]


def byte_fallback_tokenizer() -> tokenizers.Tokenizer:
    """A SentencePiece-style BPE (Llama 2 / Mistral v0.1 layout): ASCII letters and '▁' as pieces, every other
    character as <0xNN> byte tokens, decoded by Replace + ByteFallback + Fuse + Strip."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!":
        vocab.setdefault(ch, len(vocab))
    vocab["▁h"] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "h")], byte_fallback=True, unk_token="<unk>",
                                          fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def byte_level_tokenizer(tmp_path) -> tokenizers.Tokenizer:
    from generation_checkpoints import llama_tokenizer

    return llama_tokenizer(tmp_path).backend_tokenizer


@pytest.mark.parametrize("kind", ["byte_fallback", "byte_level"])
def test_pieces_are_whole_characters_and_add_up_to_decode(kind, tmp_path):
    tok = byte_fallback_tokenizer() if kind == "byte_fallback" else byte_level_tokenizer(tmp_path)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) > len(text.split())  # characters really are split over several tokens
        detok = IncrementalDetokenizer(lambda ids: tok.decode(list(ids), skip_special_tokens=True))
        pieces = [detok.push(i) for i in ids] + [detok.flush()]
        assert not any("\ufffd" in p for p in pieces), pieces
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
        assert "".join(pieces).replace(" ", "") == text.replace(" ", "")


def test_an_incomplete_character_at_the_end_is_flushed_as_decode_prints_it():
    tok = byte_fallback_tokenizer()
    ids = tok.encode("a🦊", add_special_tokens=False).ids[:-1]  # the fox's last byte never comes
    detok = IncrementalDetokenizer(lambda ids: tok.decode(list(ids)))
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == "a"
    assert "".join(pieces) + detok.flush() == tok.decode(ids)


def test_stop_strings_are_held_back_and_cut():
    stops = StopStrings(["</answer>", "STOP"])
    out = [stops.feed(p) for p in ["The answer", " is 4</", "ans", "wer> and more"]]
    assert out == [("The answer", False), (" is 4", False), ("", False), ("", True)]
    assert stops.flush() == ""
    s = StopStrings(["STOP"])
    assert s.feed("no ST") == ("no ", False) and s.feed("AY") == ("STAY", False) and s.flush() == ""
    s = StopStrings(["STOP"])
    assert s.feed("ends with ST") == ("ends with ", False) and s.flush() == "ST"
    assert StopStrings([]).feed("x") == ("x", False)
