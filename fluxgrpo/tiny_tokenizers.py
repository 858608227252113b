"""The tiny byte-level CLIP tokenizer that the tiny FLUX (its CLIP-L text encoder) and the tiny CLIP rewards share.

A leaf module (transformers is imported inside), so ``models/tiny.py`` and ``rewards/`` both read it without either
importing the other.
"""

from __future__ import annotations

from typing import Any

CLIP_MAX_LENGTH = 77


def byte_level_symbols() -> list[str]:
    """The 256 printable stand-ins for bytes used by byte-level BPE, in CLIP's vocabulary order.

    Bytes that are already visible characters map to themselves; the rest (controls, space, a few Latin-1
    gaps) map to code points from 256 upward, in byte order.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    remapped = [b for b in range(256) if b not in set(visible)]
    return [chr(b) for b in visible] + [chr(256 + n) for n in range(len(remapped))]


def build_tiny_clip_tokenizer() -> Any:
    """A CLIP BPE tokenizer with no merges: 256 byte symbols, 256 end-of-word variants, start and end tokens.

    Token ids 0..511 coincide with the full CLIP vocabulary's; only the merges (and so the length) differ.
    """
    from transformers import CLIPTokenizer

    symbols = byte_level_symbols()
    tokens = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={tok: i for i, tok in enumerate(tokens)}, merges=[], model_max_length=CLIP_MAX_LENGTH)
