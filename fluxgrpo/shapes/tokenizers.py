"""The shapes world's own tokenizers: FLUX's two tokenizer classes with every world word one whole token.

``fetch-weights --source tiny`` keeps its byte-level tokenizers (``tiny_tokenizers.py``, ``models/tiny.py``); the
world's FLUX gets these instead, saved in its ``tokenizer/`` and ``tokenizer_2/`` folders, so a caption's words reach
the text encoders as words. Characters stay in both vocabularies, so any other text still tokenizes (spelled out).
"""

from __future__ import annotations

from typing import Any

from fluxgrpo.shapes.sizes import WORLD_TEXT_LENGTH
from fluxgrpo.shapes.world import VOCABULARY
from fluxgrpo.tiny_tokenizers import CLIP_MAX_LENGTH, byte_level_symbols

_T5_CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()&/%$#@*+=_"


def _word_merges(word: str) -> list[tuple[str, str]]:
    """The BPE merges that join ``word`` left to right into one end-of-word token (CLIP marks the last symbol)."""
    symbols = [*word[:-1], word[-1] + "</w>"]
    merges = []
    joined = symbols[0]
    for symbol in symbols[1:]:
        merges.append((joined, symbol))
        joined += symbol
    return merges


def build_world_clip_tokenizer() -> Any:
    """A CLIP BPE tokenizer: the tiny one's 256 byte symbols and end-of-word variants, the start and end tokens,
    then one merge chain per world word (longest words first, so a shorter word's merge never splits a longer one).

    Raises:
        RuntimeError: a world word does not come out as one token (a merge order conflict).
    """
    from transformers import CLIPTokenizer

    symbols = byte_level_symbols()
    tokens = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    merges: list[tuple[str, str]] = []
    for word in sorted(set(VOCABULARY), key=lambda w: (-len(w), w)):
        for pair in _word_merges(word):
            if pair not in merges:
                merges.append(pair)
    for left, right in merges:
        merged = left + right
        if merged not in tokens:
            tokens.append(merged)
    tokenizer = CLIPTokenizer(
        vocab={tok: i for i, tok in enumerate(tokens)},
        merges=merges,
        model_max_length=CLIP_MAX_LENGTH,
    )
    _require_whole_words(tokenizer, "CLIP")
    return tokenizer


def build_world_t5_tokenizer() -> Any:
    """A T5 unigram tokenizer: every world word a whole piece, scored far above the single characters."""
    from transformers import T5Tokenizer

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -4.0)]
    seen = {p for p, _ in pieces}
    for word in VOCABULARY:
        if "▁" + word not in seen:
            pieces.append(("▁" + word, -6.0))
            seen.add("▁" + word)
    for char in _T5_CHARACTERS:
        for piece in (char, "▁" + char):
            if piece not in seen:
                pieces.append((piece, -12.0))
                seen.add(piece)
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=WORLD_TEXT_LENGTH)
    _require_whole_words(tokenizer, "T5")
    return tokenizer


def _require_whole_words(tokenizer: Any, name: str) -> None:
    split = [w for w in VOCABULARY if len(tokenizer.tokenize(w)) != 1]
    if split:
        raise RuntimeError(f"the world's {name} tokenizer splits {', '.join(split)}: fix the merge order")
