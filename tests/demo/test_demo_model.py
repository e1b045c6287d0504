"""The demo's corpora: the easy source of a mixture is the same on every call and made of its phrases."""

from __future__ import annotations

from trainguard.demo.model import phrase_bytes


def test_phrase_bytes_is_the_same_on_every_call_and_made_of_its_phrases() -> None:
    text = phrase_bytes(4096)
    assert len(text) == 4096 and text == phrase_bytes(4096) and phrase_bytes(100) == text[:100]
    words = {"the", "cat", "a", "dog", "sat", "on", "mat", "ran", "to", "park", "and", "then", "slept"}
    sentences = text.decode().split(".\n")[:-1]  # the last one is cut at the limit
    assert sentences and all(len(s.split(" ")) >= 8 and set(s.split(" ")) <= words for s in sentences)
