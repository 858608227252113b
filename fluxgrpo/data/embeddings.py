"""Precomputed prompt embeddings in DanceGRPO's layout, so its data and ours are interchangeable.

Layout under ``<out>`` (one prompt = index ``i``, file name ``<i>.pt``)::

    prompt_embed/<i>.pt           T5 last_hidden_state [S, D] (S = max_sequence_length, padded, unmasked)
    pooled_prompt_embeds/<i>.pt   CLIP pooled output [P]
    text_ids/<i>.pt               zeros (3,): one row of FLUX's text position ids; readers repeat it to [S, 3]
    videos2caption.json           list (indent=4) of {"prompt_embed_path": "<i>.pt", "text_ids": "<i>.pt",
                                  "pooled_prompt_embeds_path": "<i>.pt", "caption": "<prompt>"}

Tensors are stored in the dtype the encoders computed in (bf16 on accelerators, as DanceGRPO; float32 on cpu).
The index is written last, so an embeddings folder with ``videos2caption.json`` is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.models.flux import read_transformer_config
from fluxgrpo.paths import EMBEDDINGS_INDEX, write_atomic
from fluxgrpo.safe_load import load_plain

PROMPT_EMBED_DIR = "prompt_embed"
POOLED_DIR = "pooled_prompt_embeds"
TEXT_IDS_DIR = "text_ids"
EMBEDDING_DIRS = (PROMPT_EMBED_DIR, POOLED_DIR, TEXT_IDS_DIR)
# JSON key naming each folder's file, in DanceGRPO's spelling.
_ENTRY_KEYS = {PROMPT_EMBED_DIR: "prompt_embed_path", POOLED_DIR: "pooled_prompt_embeds_path", TEXT_IDS_DIR: "text_ids"}


@dataclass
class PromptEmbedding:
    """One prompt's conditioning, as the FLUX transformer takes it (batch dimension added by the caller)."""

    prompt_embeds: torch.Tensor  # [S, D] T5 hidden states
    pooled: torch.Tensor  # [P] CLIP pooled
    text_ids: torch.Tensor  # [S, 3] text position ids (all zero for FLUX)
    caption: str


@dataclass(frozen=True)
class EmbeddingsInfo:
    """What ``EmbeddingDataset.validate`` found: every item agrees on these."""

    count: int
    seq_len: int  # S
    embed_dim: int  # D
    pooled_dim: int  # P
    dtype: str  # e.g. "bfloat16"


def index_entry(index: int, caption: str) -> dict[str, str]:
    """The videos2caption.json element for prompt ``index``."""
    name = f"{index}.pt"
    return {"prompt_embed_path": name, "text_ids": name, "pooled_prompt_embeds_path": name, "caption": caption}


def embedding_files(out_dir: str | Path, index: int) -> dict[str, Path]:
    """{folder name: path} of prompt ``index``'s three files."""
    return {folder: Path(out_dir) / folder / f"{index}.pt" for folder in EMBEDDING_DIRS}


def save_tensor_atomic(tensor: torch.Tensor, path: Path) -> None:
    """torch.save to a hidden temp name beside ``path``, then rename: a crash never leaves a half-written file.

    The tensor is cloned so only its own elements are stored (a view would drag its whole storage along).
    """

    own = tensor.detach().to("cpu").clone().contiguous()
    write_atomic(path, lambda f: torch.save(own, f))


def write_embedding(
    out_dir: str | Path,
    index: int,
    prompt_embeds: torch.Tensor,
    pooled: torch.Tensor,
    text_ids_row: torch.Tensor,
) -> None:
    """Write prompt ``index``'s files: prompt_embeds [S, D], pooled [P], text_ids_row [3]."""
    files = embedding_files(out_dir, index)
    save_tensor_atomic(prompt_embeds, files[PROMPT_EMBED_DIR])
    save_tensor_atomic(pooled, files[POOLED_DIR])
    save_tensor_atomic(text_ids_row, files[TEXT_IDS_DIR])


def write_index(out_dir: str | Path, captions: list[str], draws: list[int] | None = None) -> Path:
    """Write videos2caption.json for prompts 0..N-1 atomically; call it only once every file is in place.

    ``draws`` lists the prompt index of each entry, in order (a prompt listed twice is drawn twice as often by the
    training sampler, from one set of files); None: each prompt once."""
    order = range(len(captions)) if draws is None else draws
    entries = [index_entry(i, captions[i]) for i in order]
    return write_atomic(Path(out_dir) / EMBEDDINGS_INDEX, json.dumps(entries, indent=4))


def _load(path: Path, mmap: bool = False, fix: str = "delete it and run `fluxgrpo preprocess`") -> Any:
    """Tensors only: a file that asks to run code is refused before any of it runs (``safe_load``)."""

    return load_plain(path, fix, mmap=mmap)


def stored_embedding_ok(out_dir: str | Path, index: int, seq_len: int, embed_dim: int, pooled_dim: int) -> bool:
    """True when prompt ``index``'s three files exist, load, and have the expected shapes (memory-mapped, cheap)."""
    files = embedding_files(out_dir, index)
    try:
        embeds = _load(files[PROMPT_EMBED_DIR], mmap=True)
        pooled = _load(files[POOLED_DIR], mmap=True)
        text_ids = _load(files[TEXT_IDS_DIR], mmap=True)
    except Exception:
        return False
    return (
        tuple(embeds.shape) == (seq_len, embed_dim)
        and tuple(pooled.shape) == (pooled_dim,)
        and tuple(text_ids.shape) in ((3,), (seq_len, 3))
    )


class EmbeddingDataset:
    """Read a DanceGRPO-layout embeddings folder through its ``videos2caption.json``.

    Files are located from the JSON entries, in the folders beside the JSON. Any missing or unreadable file is a
    FluxgrpoError naming the file and ``fluxgrpo preprocess``.
    """

    def __init__(self, json_path: str | Path):
        self.json_path = Path(json_path)
        self.root = self.json_path.parent
        self._fix = f"run `fluxgrpo preprocess --out {self.root}`"
        try:
            entries = json.loads(self.json_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FluxgrpoError(f"no embeddings index at {self.json_path}: {self._fix}") from None
        except (OSError, ValueError) as exc:
            raise FluxgrpoError(f"cannot read embeddings index {self.json_path} ({exc}): {self._fix}") from None
        needed = (*_ENTRY_KEYS.values(), "caption")
        well_formed = isinstance(entries, list) and all(
            isinstance(entry, dict) and all(key in entry for key in needed) for entry in entries
        )
        if not well_formed:
            raise FluxgrpoError(
                f"{self.json_path} is not a videos2caption.json (a list of entries with {', '.join(needed)}): "
                f"{self._fix}"
            )
        if not entries:
            raise FluxgrpoError(f"{self.json_path} lists no prompts: {self._fix} with a non-empty --prompts file")
        self.entries: list[dict[str, str]] = entries
        self._check_entries_stay_inside()

    def _check_entries_stay_inside(self) -> None:
        """Every entry names a file in its folder beside the index: no path, no ``..``, no link out of the folder
        (an index pointing elsewhere would be followed, and its errors would advise deleting that file)."""
        root = self.root.resolve()
        for position, entry in enumerate(self.entries):
            for folder, key in _ENTRY_KEYS.items():
                name = entry[key]
                inside = isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name
                if inside and "\\" not in name:
                    inside = (self.root / folder / name).resolve().is_relative_to(root)
                if not inside:
                    raise FluxgrpoError(
                        f"{self.json_path} entry {position} names {name!r} for {key}, which is not a file in "
                        f"{self.root / folder}: an index lists only the files beside it; {self._fix}"
                    )

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def captions(self) -> list[str]:
        return [entry["caption"] for entry in self.entries]

    def _path(self, index: int, folder: str) -> Path:
        return self.root / folder / self.entries[index][_ENTRY_KEYS[folder]]

    def _load_file(self, path: Path, mmap: bool = False) -> torch.Tensor:
        missing = f"embedding file {path} is missing: {self._fix} (it re-encodes only what is missing)"
        if not path.is_file():
            raise FluxgrpoError(missing)
        try:
            tensor = _load(path, mmap=mmap, fix=f"delete it and {self._fix}")
        except FileNotFoundError:
            raise FluxgrpoError(missing) from None
        if not isinstance(tensor, torch.Tensor):
            raise FluxgrpoError(f"embedding file {path} does not hold a tensor: delete it and {self._fix}")
        return tensor

    def _load_item(self, index: int, mmap: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            self._load_file(self._path(index, PROMPT_EMBED_DIR), mmap),
            self._load_file(self._path(index, POOLED_DIR), mmap),
            self._load_file(self._path(index, TEXT_IDS_DIR), mmap),
        )

    def __getitem__(self, index: int) -> PromptEmbedding:
        embeds, pooled, text_ids = self._load_item(index, mmap=False)
        if text_ids.ndim == 1:  # DanceGRPO stores one row; FLUX wants one (all-zero) row per text token
            text_ids = text_ids.reshape(1, -1).repeat(embeds.shape[0], 1)
        return PromptEmbedding(embeds, pooled, text_ids, self.entries[index]["caption"])

    def validate(self, flux_dir: str | Path | None = None) -> EmbeddingsInfo:
        """Check every file exists and every item has the same shapes and dtype; with ``flux_dir``, also that
        D equals the transformer's joint_attention_dim and P its pooled_projection_dim.

        Files are memory-mapped, not read, so this is cheap even for tens of thousands of prompts.
        """
        want = None
        if flux_dir is not None:
            config = read_transformer_config(flux_dir)
            want = (config.get("joint_attention_dim"), config.get("pooled_projection_dim"))
        reference: tuple[Any, ...] | None = None
        for index in range(len(self)):
            embeds, pooled, text_ids = self._load_item(index, mmap=True)
            if embeds.ndim != 2 or pooled.ndim != 1 or tuple(text_ids.shape) not in ((3,), (embeds.shape[0], 3)):
                raise FluxgrpoError(
                    f"prompt {index} in {self.root} has shapes {tuple(embeds.shape)}, {tuple(pooled.shape)}, "
                    f"{tuple(text_ids.shape)} (want [S, D], [P], [3]): delete the folder and {self._fix}"
                )
            if want is not None and (embeds.shape[1], pooled.shape[0]) != want:
                raise FluxgrpoError(
                    f"embeddings in {self.root} were made for another model (prompt {index} has T5 width "
                    f"{embeds.shape[1]}, CLIP width {pooled.shape[0]}; the transformer in {flux_dir} expects {want[0]} "
                    f"and {want[1]}): run `fluxgrpo preprocess --model {flux_dir} --out <new folder>`"
                )
            found = (tuple(embeds.shape), tuple(pooled.shape), embeds.dtype, pooled.dtype)
            if reference is None:
                reference = found
            elif found != reference:
                raise FluxgrpoError(
                    f"prompt {index} in {self.root} has shapes/dtypes {found} but prompt 0 has {reference}; the "
                    f"folder mixes two preprocess runs: delete it and {self._fix}"
                )
        assert reference is not None  # __init__ rejects an empty index
        (seq_len, embed_dim), (pooled_dim,), dtype = reference[0], reference[1], reference[2]
        return EmbeddingsInfo(len(self), seq_len, embed_dim, pooled_dim, str(dtype).removeprefix("torch."))
