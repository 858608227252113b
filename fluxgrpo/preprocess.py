"""``fluxgrpo preprocess``: encode a prompt file once with FLUX's text encoders into DanceGRPO's embedding layout.

Runs in one process, or on every rank under torchrun (``worker_entry`` is what the CLI runs on every worker for
``--dies N``). Prompt ``i`` belongs to rank ``i % world``: every prompt is encoded exactly
once, with no sampler padding (DanceGRPO's sampler encoded up to W-1 prompts twice and listed them twice).

Restartable: each file is written under a temp name and renamed, a re-run skips prompts whose three files exist
with the right shapes, and ``videos2caption.json`` is written by rank 0 last, after every rank has finished, so a
partial run never looks complete. ``.fluxgrpo-preprocess.json`` records what the folder's files were made from
(prompt list, sequence length, text encoders); a re-run with different inputs is refused instead of mixing them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import T5Tokenizer

import fluxgrpo.models.flux
import fluxgrpo.runtime.device
from fluxgrpo.data.embeddings import (
    EMBEDDING_DIRS,
    PROMPT_EMBED_DIR,
    EmbeddingDataset,
    embedding_files,
    stored_embedding_ok,
    write_embedding,
    write_index,
)
from fluxgrpo.data.prompts import read_prompts
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.models.flux import encode_prompts, require_flux_dir
from fluxgrpo.paths import EMBEDDINGS_INDEX, ensure_writable_dir, write_atomic
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.device import autocast
from fluxgrpo.runtime.worker import worker_session
from fluxgrpo.weights.manifest import read_manifest

if TYPE_CHECKING:
    from fluxgrpo.runtime.dist import DistContext

STATE_FILE = ".fluxgrpo-preprocess.json"
ENCODE_BATCH = 8  # prompts per encoder call; every T5 input is padded to the same length, so batching is exact
_ENCODER_PARTS = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")


@dataclass(frozen=True)
class PreprocessSummary:
    """What a preprocess run produced (the same on every rank)."""

    out_dir: str
    index_path: str
    prompts: int  # distinct prompts in the file (blank lines dropped), each encoded once
    draws: int  # entries of the index: ``prompts``, or with keep_repeats every line (repeats are sampling weights)
    encoded: int  # encoded by this run, all ranks together
    skipped: int  # already present and valid from an earlier run
    truncated: int  # prompts longer than seq_len T5 tokens, cut to seq_len
    world_size: int
    seq_len: int  # S
    embed_dim: int  # D
    pooled_dim: int  # P
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_inputs(
    prompts_path: str | Path,
    flux_dir: str | Path,
    out_dir: str | Path,
    max_sequence_length: int,
    keep_repeats: bool = False,
) -> list[str]:
    """Everything that can be checked before a model loads: the prompts, the weights, a writable ``out_dir``.

    Returns the prompt lines (with ``keep_repeats`` a repeated line stays, else only its first occurrence). Creates
    ``out_dir`` and its three sub-folders.
    """
    if max_sequence_length < 1:
        raise UsageError(f"--max-sequence-length must be at least 1 (got {max_sequence_length}); FLUX uses 512")
    prompts = read_prompts(prompts_path, keep_repeats=keep_repeats)
    require_flux_dir(flux_dir)
    out = Path(out_dir)
    for folder in EMBEDDING_DIRS:
        ensure_writable_dir(out / folder, "embeddings", "--out")
    return prompts


def rank_indices(count: int, rank: int, world_size: int) -> list[int]:
    """The prompt indices rank ``rank`` encodes: i with i % world_size == rank (disjoint, covering, no padding)."""
    return list(range(rank, count, world_size))


def _encoder_dims(flux_dir: Path) -> tuple[int, int]:
    """(D, P) from the encoders' config files, so valid stored files can be recognised without loading a model."""
    try:
        t5 = json.loads((flux_dir / "text_encoder_2" / "config.json").read_text())
        clip = json.loads((flux_dir / "text_encoder" / "config.json").read_text())
        return int(t5["d_model"]), int(clip["hidden_size"])
    except (OSError, ValueError, KeyError) as exc:
        raise FluxgrpoError(
            f"cannot read the text encoder configs in {flux_dir} ({exc}): run `fluxgrpo fetch-weights`"
        ) from None


def _encoder_identity(flux_dir: Path) -> list[Any]:
    """The text encoder and tokenizer files, by manifest hash where there is one, else by size."""
    manifest = read_manifest(flux_dir)
    if manifest is not None:
        return sorted([f.path, f.size, f.sha256] for f in manifest.files if f.path.split("/")[0] in _ENCODER_PARTS)
    return sorted(
        [p.relative_to(flux_dir).as_posix(), p.stat().st_size, None]
        for part in _ENCODER_PARTS
        for p in (flux_dir / part).rglob("*")
        if p.is_file()
    )


def _fingerprint(prompts: list[str], max_sequence_length: int, flux_dir: Path) -> dict[str, Any]:
    digest = hashlib.sha256("\n".join(prompts).encode()).hexdigest()
    encoders = hashlib.sha256(json.dumps(_encoder_identity(flux_dir)).encode()).hexdigest()
    return {
        "prompts": len(prompts),
        "prompts_sha256": digest,
        "max_sequence_length": max_sequence_length,
        "text_encoders_sha256": encoders,
    }


def _check_folder_matches(out: Path, lines: list[str], fingerprint: dict[str, Any]) -> None:
    """Refuse a folder whose files were made from other inputs; every rank runs it and reaches the same verdict."""
    state_path = out / STATE_FILE
    fix = f"pass a new --out, or delete {out} to start over"
    if state_path.is_file():
        try:
            recorded = json.loads(state_path.read_text())
        except ValueError:
            recorded = None
        if recorded != fingerprint:
            raise FluxgrpoError(
                f"{out} holds embeddings made from another prompt list, --max-sequence-length or text encoders: {fix}"
            )
        return
    has_files = any(any((out / folder).glob("*.pt")) for folder in EMBEDDING_DIRS)
    if not has_files:
        return
    index = out / EMBEDDINGS_INDEX
    if index.is_file():  # a folder from DanceGRPO or an older run: adopt it if it lists exactly these prompts
        try:
            if EmbeddingDataset(index).captions == lines:
                return
        except FluxgrpoError:
            pass
    raise FluxgrpoError(f"{out} already holds embedding files that were not made from these prompts: {fix}")


def preprocess(
    prompts_path: str | Path,
    flux_dir: str | Path,
    out_dir: str | Path,
    max_sequence_length: int = 512,
    device: str | None = None,
    keep_repeats: bool = False,
) -> PreprocessSummary:
    """Encode every prompt in ``prompts_path`` with the text encoders in ``flux_dir`` into ``out_dir``.

    ``keep_repeats``: a prompt listed k times is encoded once and listed k times in the index, so training draws it k
    times as often (the lines' repeats are sampling weights, as in ``shapes-train-balanced``); else once.

    Call it from every rank under torchrun, or once in a plain process (a world of one). ``device`` is a device
    type or None/"auto" for the best one found. Only the text encoders are loaded, and only on ranks that have
    prompts left to encode. Returns the same summary on every rank.

    Raises:
        FluxgrpoError: bad prompt file, incomplete weights, unwritable or mismatched ``out_dir`` (all before any
            model loads).
    """

    with worker_session(device) as ctx:
        return _preprocess_on_rank(
            ctx, Path(prompts_path), Path(flux_dir), Path(out_dir), max_sequence_length, keep_repeats
        )


def _preprocess_on_rank(
    ctx: DistContext, prompts_path: Path, flux_dir: Path, out: Path, max_sequence_length: int, keep_repeats: bool
) -> PreprocessSummary:
    lines = check_inputs(prompts_path, flux_dir, out, max_sequence_length, keep_repeats)
    prompts = list(dict.fromkeys(lines))  # each encoded once, whatever its repeats
    position = {prompt: i for i, prompt in enumerate(prompts)}
    draws = [position[line] for line in lines]
    embed_dim, pooled_dim = _encoder_dims(flux_dir)
    fingerprint = _fingerprint(lines, max_sequence_length, flux_dir)
    _check_folder_matches(out, lines, fingerprint)
    rt_dist.barrier(ctx)  # every rank has passed the check before rank 0 records it
    if ctx.is_main:
        write_atomic(out / STATE_FILE, json.dumps(fingerprint, indent=2) + "\n")

    mine = rank_indices(len(prompts), ctx.rank, ctx.world_size)
    todo = [i for i in mine if not stored_embedding_ok(out, i, max_sequence_length, embed_dim, pooled_dim)]
    if sum(rt_dist.all_gather_object(ctx, len(todo))) and ctx.is_main:
        (out / EMBEDDINGS_INDEX).unlink(missing_ok=True)  # the folder is about to be incomplete until the end
        rt_dist.rank0_print(ctx, f"encoding prompts into {out} on {ctx.world_size} rank(s) ({ctx.device_type})")

    truncated, dtype = _encode_and_write(ctx, flux_dir, out, prompts, mine, todo, max_sequence_length)

    stats = rt_dist.all_gather_object(ctx, {"encoded": len(todo), "truncated": truncated, "dtype": dtype})
    rt_dist.barrier(ctx)
    encoded = sum(s["encoded"] for s in stats)
    truncated_total = sum(s["truncated"] for s in stats)
    dtype = next((s["dtype"] for s in stats if s["dtype"]), None) or _stored_dtype(out)
    if ctx.is_main:
        if truncated_total:
            rt_dist.rank0_print(
                ctx,
                f"warning: {truncated_total} of {len(prompts)} prompts are longer than {max_sequence_length} T5 "
                "tokens and were truncated to it",
            )
        missing = [str(p) for i in range(len(prompts)) for p in embedding_files(out, i).values() if not p.is_file()]
        if missing:
            raise FluxgrpoError(f"{len(missing)} embedding file(s) were not written, e.g. {missing[0]}: run again")
        write_index(out, prompts, draws)
    rt_dist.barrier(ctx)  # no rank returns before the index exists
    return PreprocessSummary(
        out_dir=str(out),
        index_path=str(out / EMBEDDINGS_INDEX),
        prompts=len(prompts),
        draws=len(draws),
        encoded=encoded,
        skipped=len(prompts) - encoded,
        truncated=truncated_total,
        world_size=ctx.world_size,
        seq_len=max_sequence_length,
        embed_dim=embed_dim,
        pooled_dim=pooled_dim,
        dtype=dtype,
    )


def _encode_and_write(
    ctx: DistContext,
    flux_dir: Path,
    out: Path,
    prompts: list[str],
    mine: list[int],
    todo: list[int],
    max_sequence_length: int,
) -> tuple[int, str | None]:
    """Encode this rank's ``todo`` prompts and write them; returns (this rank's truncated count, stored dtype).

    Truncation is counted over all of this rank's prompts, encoded now or earlier, so the count does not depend
    on how often the run was restarted.
    """

    if not todo:
        tokenizer = T5Tokenizer.from_pretrained(flux_dir / "tokenizer_2")
        return _count_truncated(tokenizer, [prompts[i] for i in mine], max_sequence_length), None

    dtype = fluxgrpo.runtime.device.compute_dtype(ctx.device_type)
    # Weights in the compute dtype (DanceGRPO loads the encoders in bf16 too): T5-XXL is 19 GB in float32.
    encoders = fluxgrpo.models.flux.load_text_encoders(flux_dir, dtype=dtype, device=ctx.device)
    truncated = _count_truncated(encoders.t5_tokenizer, [prompts[i] for i in mine], max_sequence_length)
    text_ids_row = torch.zeros(3, dtype=dtype)
    for start in range(0, len(todo), ENCODE_BATCH):
        batch = todo[start : start + ENCODE_BATCH]
        with autocast(ctx.device_type):
            encoded = encode_prompts(encoders, [prompts[i] for i in batch], max_sequence_length)
        for row, index in enumerate(batch):
            embeds, pooled = encoded.prompt_embeds[row].to(dtype), encoded.pooled[row].to(dtype)
            write_embedding(out, index, embeds, pooled, text_ids_row)
    return truncated, str(dtype).removeprefix("torch.")


def _count_truncated(tokenizer: T5Tokenizer, prompts: list[str], max_sequence_length: int) -> int:
    if not prompts:
        return 0
    ids = tokenizer(prompts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    return sum(len(row) > max_sequence_length for row in ids)


def _stored_dtype(out: Path) -> str:
    """The dtype of prompt 0's stored embedding (a run that only skipped never saw the encoders)."""

    path = embedding_files(out, 0)[PROMPT_EMBED_DIR]
    tensor = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return str(tensor.dtype).removeprefix("torch.")


def worker_entry(payload: dict[str, Any]) -> PreprocessSummary:
    """Every rank's part of ``fluxgrpo preprocess --dies N`` (``runtime.launch.run_workers``): ``preprocess``'s
    arguments by name."""
    return preprocess(**payload)
