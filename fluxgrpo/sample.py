"""``fluxgrpo sample``: images from the base FLUX model or a trained checkpoint, reproducible image by image.

Generation is diffusers' ``FluxPipeline`` (loaded from ``--model``) with, for a checkpoint, the trained
transformer (``checkpoint-{k}/transformer`` or ``transformer_ema``) swapped in, or for a LoRA run's checkpoint its
adapter (``lora/`` or ``lora_ema/``) loaded with ``load_lora_weights``. Weights and compute use the
runtime's compute dtype (bfloat16 on accelerators, float32 on cpu) under its autocast, and the transformer gets
the runtime's device adaptations (``adapt_transformer``).

Determinism: image j of prompt i starts from its own noise, drawn in float32 on the cpu from a generator seeded
with ``image_seed(S, i, j)``:

    image_seed(S, i, j) = int.from_bytes(sha256(f"fluxgrpo-sample:{S}:{i}:{j}".encode()).digest()[:8], "big")
                          & (2**63 - 1)

so every image depends only on (weights, settings, S, i, j): not on ``--batch-size`` or ``--dies``, and a
base-vs-trained comparison with the same ``--seed`` starts every image from the same noise. Each prompt is encoded
on its own (a batch of one), so its text embedding does not depend on its batch either. (Batched kernels may still
round differently from unbatched ones on some devices; on cpu the pixels are identical.)

Output folder (``--out``):

    <i:04d>_<j:02d>.png   image j of prompt i (the prompt and seed are also in the PNG's text chunks)
    grid.png              contact sheet: one row per prompt, one column per image, tiles downscaled
    index.json            written LAST, atomically: run facts and one entry per image (see ``write_index``)

A folder without ``index.json`` is an incomplete run. Re-running into the same folder first deletes the earlier
run's index, images and grid; a folder holding anything else is refused. With ``--dies N`` prompt ``i`` belongs
to rank ``i % N``; every rank writes its own images (the folder must be on a filesystem every rank sees), and
rank 0 gathers the records and writes the grid and the index once every image is on disk.

``worker_entry`` is what ``fluxgrpo sample --dies N`` runs on every worker (``runtime.launch.run_workers``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fluxgrpo import __version__
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.paths import DEFAULT_SAMPLES_DIR, ensure_writable_dir, write_atomic
from fluxgrpo.run_folder import INDEX_FILE  # a sample folder's index, and each evaluation's in a run folder

GRID_FILE = "grid.png"
INDEX_FORMAT = "fluxgrpo-sample-index"
INDEX_FORMAT_VERSION = 1
SEED_FORMULA = (
    'int.from_bytes(hashlib.sha256(f"fluxgrpo-sample:{seed}:{prompt_index}:{image_index}".encode()).digest()[:8], '
    '"big") & (2**63 - 1)'
)

# Contact sheet: tiles at most 256 px on their long side, shrunk so the sheet stays near 4096 px, never under 16 px.
GRID_TILE_MAX = 256
GRID_TILE_MIN = 16
GRID_TARGET_SIDE = 4096
GRID_GAP = 2

_OWN_FILE = re.compile(r"^(\d+_\d+\.png|index\.json|grid\.png|\..+\.tmp)$")


# --------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class SampleSettings:
    """How images are generated; everything except ``batch_size`` changes the pixels."""

    height: int = 720  # pixels, a multiple of 16 (the training recipe's 720)
    width: int = 720
    steps: int = 28  # denoising steps of the pipeline's Euler flow-matching sampler
    guidance: float = 3.5  # FLUX-dev's distilled guidance value
    seed: int = 0  # S in image_seed(S, i, j)
    images_per_prompt: int = 1  # K
    batch_size: int = 1  # images per transformer forward (the noise and prompts do not depend on it)
    max_sequence_length: int = 512  # T5 tokens per prompt
    attention: str = "sdpa"
    compile: bool = False  # FLUX's repeated blocks compiled regionally (models/compile.py); pixels equal to rounding

    def validate(self) -> SampleSettings:
        """Raise UsageError naming the flag for the first bad value."""
        from fluxgrpo.grpo.latents import image_size_problem
        from fluxgrpo.runtime.adapt import ATTENTION_BACKENDS

        size_problem = image_size_problem(self.height, self.width)
        if size_problem is not None:
            raise UsageError(f"{size_problem}: set --height and --width to multiples of 16, e.g. 720 or 1024")
        for flag, value in (
            ("--steps", self.steps),
            ("--images-per-prompt", self.images_per_prompt),
            ("--batch-size", self.batch_size),
            ("--max-sequence-length", self.max_sequence_length),
        ):
            if value < 1:
                raise UsageError(f"{flag} must be at least 1 (got {value})")
        if self.seed < 0:
            raise UsageError(f"--seed must be >= 0 (got {self.seed})")
        if self.attention not in ATTENTION_BACKENDS:
            raise UsageError(f"--attention {self.attention!r}: use one of {', '.join(ATTENTION_BACKENDS)}")
        return self


@dataclass(frozen=True)
class SampleRequest:
    """A validated sampling job: what ``sample`` runs on every rank (JSON-serialisable for the workers)."""

    model: str  # FLUX diffusers folder
    prompts: list[str]  # prompt i is row i of the grid
    out_dir: str
    checkpoint: str | None  # a complete checkpoint-{k} folder, or None for the base model
    ema: bool  # load checkpoint/transformer_ema instead of checkpoint/transformer
    settings: SampleSettings
    device: str = "auto"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SampleRequest:
        return cls(**{**data, "settings": SampleSettings(**data["settings"])})

    @property
    def transformer_dir(self) -> Path | None:
        """The diffusers folder of the transformer to sample with; None means the base model's own (also for a
        LoRA checkpoint, whose adapter ``lora_file`` is loaded into it)."""
        from fluxgrpo.checkpoint import EMA_TRANSFORMER_DIR, TRANSFORMER_DIR

        if self.checkpoint is None or self.lora_file is not None:
            return None
        return Path(self.checkpoint) / (EMA_TRANSFORMER_DIR if self.ema else TRANSFORMER_DIR)

    @property
    def lora_file(self) -> Path | None:
        """The checkpoint's adapter (``pytorch_lora_weights.safetensors``) for a LoRA run's checkpoint, else None."""
        from fluxgrpo.checkpoint import EMA_LORA_DIR, LORA_DIR
        from fluxgrpo.lora import LORA_WEIGHTS_NAME

        if self.checkpoint is None:
            return None
        path = Path(self.checkpoint) / (EMA_LORA_DIR if self.ema else LORA_DIR) / LORA_WEIGHTS_NAME
        return path if path.is_file() else None


@dataclass(frozen=True)
class SampledImage:
    """One image of a run, as ``index.json`` lists it."""

    file: str  # name inside the output folder, <i:04d>_<j:02d>.png
    prompt: str
    prompt_index: int  # i
    image_index: int  # j
    seed: int  # image_seed(S, i, j)


@dataclass(frozen=True)
class SampleSummary:
    """What a sampling run produced (returned on every rank; rank 0's is the one printed)."""

    out_dir: str
    index_path: str
    grid_path: str
    model: str
    checkpoint: str | None
    ema: bool
    prompts: int
    images: int
    images_per_prompt: int
    world_size: int
    device_type: str
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def image_seed(seed: int, prompt_index: int, image_index: int) -> int:
    """The 63-bit generator seed of image ``image_index`` of prompt ``prompt_index`` in a run seeded ``seed``."""
    digest = hashlib.sha256(f"fluxgrpo-sample:{seed}:{prompt_index}:{image_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def image_filename(prompt_index: int, image_index: int) -> str:
    return f"{prompt_index:04d}_{image_index:02d}.png"


def default_out_dir(checkpoint: str | Path | None, ema: bool) -> Path:
    """``data/outputs/samples/base``, or ``.../<run folder>-checkpoint-<k>[-ema]``, so runs never collide."""
    if checkpoint is None:
        return Path(DEFAULT_SAMPLES_DIR) / "base"
    checkpoint = Path(checkpoint).resolve()
    return Path(DEFAULT_SAMPLES_DIR) / f"{checkpoint.parent.name}-{checkpoint.name}{'-ema' if ema else ''}"


# --------------------------------------------------------------------------------------------- checks


def resolve_checkpoint(path: str | Path, ema: bool) -> Path:
    """The complete checkpoint ``--checkpoint`` names: the folder itself, or a training output folder's latest.

    Raises:
        FluxgrpoError: no complete checkpoint there, or ``ema`` but the checkpoint holds no EMA weights.
    """
    from fluxgrpo.checkpoint import (
        CHECKPOINT_PREFIX,
        EMA_LORA_DIR,
        EMA_TRANSFORMER_DIR,
        LORA_DIR,
        TRANSFORMER_DIR,
        is_usable_checkpoint,
        latest_checkpoint,
        read_checkpoint_info,
    )
    from fluxgrpo.lora import LORA_WEIGHTS_NAME

    given = Path(path).expanduser()
    if is_usable_checkpoint(given):
        found = given
    elif given.is_dir() and (latest := latest_checkpoint(given)) is not None:
        found = latest
    else:
        if not given.exists():
            why = "it does not exist"
        elif given.name.startswith(CHECKPOINT_PREFIX):
            why = "it is not a complete checkpoint (an interrupted save has no COMPLETE marker)"
        else:
            why = f"it holds no complete {CHECKPOINT_PREFIX}<k> folder"
        raise FluxgrpoError(
            f"--checkpoint {given}: {why}; pass a checkpoint-<k> folder, a run's best/ (--keep-best) or the training "
            "--output-dir (its latest complete checkpoint is used), or drop --checkpoint to sample the base model"
        )
    info = read_checkpoint_info(found)
    lora = bool(info.get("lora"))
    ema_dir = EMA_LORA_DIR if lora else EMA_TRANSFORMER_DIR
    if ema and (not info.get("has_ema", False) or not (found / ema_dir).is_dir()):
        raise FluxgrpoError(
            f"--ema: {found} has no EMA weights ({ema_dir}/; the run was trained without --use-ema): "
            "drop --ema to sample its trained weights"
        )
    if lora:
        weights = found / (EMA_LORA_DIR if ema else LORA_DIR) / LORA_WEIGHTS_NAME
        if not weights.is_file():
            raise FluxgrpoError(f"{weights} is missing: the checkpoint is damaged; pass another --checkpoint")
        from fluxgrpo.lora import check_adapter_file

        check_adapter_file(weights, "the checkpoint is damaged; pass another --checkpoint")
        return found
    weights = found / (EMA_TRANSFORMER_DIR if ema else TRANSFORMER_DIR)
    if not (weights / "config.json").is_file():
        raise FluxgrpoError(f"{weights}/config.json is missing: the checkpoint is damaged; pass another --checkpoint")
    from fluxgrpo.weights.config_guard import folder_config_problems
    from fluxgrpo.weights.integrity import folder_safetensors_problems

    damaged = folder_config_problems(weights) + folder_safetensors_problems(weights)
    if damaged:
        raise FluxgrpoError(f"the checkpoint is damaged: {damaged[0]}; pass another --checkpoint")
    return found


# Transformer sizes that must agree for a checkpoint to run in the base model's pipeline.
_SHAPE_KEYS = (
    "in_channels",
    "joint_attention_dim",
    "pooled_projection_dim",
    "num_layers",
    "num_single_layers",
    "num_attention_heads",
    "attention_head_dim",
)


def check_checkpoint_fits_model(transformer_dir: Path, model: str | Path) -> None:
    """Raise FluxgrpoError when the checkpoint's transformer was not trained from a model shaped like ``model``."""
    from fluxgrpo.models.flux import read_transformer_config

    base = read_transformer_config(model)
    try:
        trained = json.loads((transformer_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise FluxgrpoError(f"cannot read {transformer_dir}/config.json ({exc}): pass another --checkpoint") from None
    differ = [key for key in _SHAPE_KEYS if base.get(key) != trained.get(key)]
    if differ:
        key = differ[0]
        raise FluxgrpoError(
            f"{transformer_dir} was trained from another model than {model} ({key} {trained.get(key)} vs "
            f"{base.get(key)}): pass the --model the checkpoint was trained from"
        )


def check_output_dir(out_dir: str | Path) -> Path:
    """``out_dir`` exists (created), is writable, and holds nothing but an earlier sample run's files."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FluxgrpoError(f"--out {out} is a file: pass a folder")
    ensure_writable_dir(out, "images", "--out")
    foreign = sorted(p.name for p in out.iterdir() if not _OWN_FILE.match(p.name))
    if foreign:
        raise FluxgrpoError(
            f"--out {out} holds files `fluxgrpo sample` did not write (e.g. {foreign[0]}): pass an empty or new "
            "folder with --out"
        )
    return out


def build_request(
    *,
    model: str,
    prompts: list[str],
    out_dir: str | Path | None,
    checkpoint: str | None,
    ema: bool,
    settings: SampleSettings,
    device: str = "auto",
    overwrite: bool = False,
) -> SampleRequest:
    """Check everything that can be checked before a model loads and return the job (``overwrite``: ``--out`` may
    lie inside a training run; the caller moves what is there aside).

    Raises:
        UsageError: bad settings, no prompts, ``--ema`` without ``--checkpoint``.
        FluxgrpoError: incomplete weights, a missing/incomplete checkpoint or EMA weights, a checkpoint of
            another model, an unusable output folder.
    """
    from fluxgrpo.models.flux import require_flux_dir
    from fluxgrpo.runtime.device import resolve_device_type

    settings.validate()
    device_type = resolve_device_type(device)
    if settings.compile:
        from fluxgrpo.runtime.adapt import compile_backend

        compile_backend(device_type)  # refuses --compile where it is not supported, before any worker starts
    if not prompts:
        raise UsageError("no prompts: pass --prompts FILE or --prompt TEXT (repeatable)")
    if ema and checkpoint is None:
        raise UsageError("--ema needs --checkpoint (the base model has no EMA weights)")
    require_flux_dir(model)
    resolved = None
    if checkpoint is not None:
        resolved = resolve_checkpoint(checkpoint, ema)
    out = Path(out_dir) if out_dir is not None else default_out_dir(resolved, ema)
    request = SampleRequest(
        model=str(model),
        prompts=list(prompts),
        out_dir=str(out),
        checkpoint=None if resolved is None else str(resolved),
        ema=ema,
        settings=settings,
        device=device,
    )
    if request.transformer_dir is not None:
        check_checkpoint_fits_model(request.transformer_dir, model)
    check_not_inside_a_run(out, overwrite)
    check_output_dir(out)
    return request


def check_not_inside_a_run(out: Path, overwrite: bool) -> None:
    """A training run's folders (its eval/iteration-<k>/ above all) are its record: ``--out`` there only with
    ``--overwrite``, which moves what is there aside (``run_folder.move_aside``) instead of replacing it."""
    from fluxgrpo.run_folder import enclosing_run

    run = enclosing_run(out)
    if run is not None and not overwrite:
        raise UsageError(
            f"--out {out} is inside the training run {run}, whose evaluations and checkpoints `sample` must not "
            f"replace: pass another --out, or add --overwrite to move what is there to {out.name}.replaced-<UTC "
            "time> first"
        )


def clear_previous_run(out: Path) -> int:
    """Delete an earlier run's index (first, so the folder stops looking complete), images, grid and temp files."""
    index = out / INDEX_FILE
    removed = int(index.is_file())
    index.unlink(missing_ok=True)
    for path in out.iterdir():
        if _OWN_FILE.match(path.name) and path.is_file():
            path.unlink()
            removed += 1
    return removed


# --------------------------------------------------------------------------------------------- generation


def load_pipeline(request: SampleRequest, ctx: Any) -> Any:
    """FluxPipeline from ``request.model`` in the compute dtype on ``ctx.device``, with the trained transformer
    swapped in when there is a checkpoint, adapted to the device by the runtime."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from fluxgrpo.runtime.adapt import adapt_transformer
    from fluxgrpo.runtime.device import compute_dtype
    from fluxgrpo.safe_load import load_pretrained

    dtype = compute_dtype(ctx.device_type)
    components: dict[str, Any] = {}
    other = "pass another --checkpoint"
    if request.transformer_dir is not None:
        transformer_dir = request.transformer_dir
        components["transformer"] = load_pretrained(
            lambda: FluxTransformer2DModel.from_pretrained(transformer_dir, dtype=dtype),
            "the trained transformer",
            transformer_dir,
            other,
        )
    # model_index.json and every config in the folder were checked to name FLUX's own classes and no code
    # (check_flux_dir); no remote code either way. Its bars: worker_session.
    pipe = load_pretrained(
        lambda: FluxPipeline.from_pretrained(request.model, dtype=dtype, trust_remote_code=False, **components),
        "the FLUX pipeline",
        request.model,
        f"re-run `fluxgrpo fetch-weights --flux-dir {request.model}`",
    )
    lora_file = request.lora_file
    if lora_file is not None:  # checked before launch (resolve_checkpoint)
        load_pretrained(
            lambda: pipe.load_lora_weights(lora_file.parent, weight_name=lora_file.name),
            "the LoRA adapter",
            lora_file,
            other,
        )
    pipe = pipe.to(ctx.device)
    pipe.set_progress_bar_config(disable=True)
    adapt_transformer(pipe.transformer, ctx.device_type, attention=request.settings.attention, compute_dtype=dtype)
    if request.settings.compile:
        from fluxgrpo.models.compile import compile_repeated_blocks
        from fluxgrpo.runtime.adapt import compile_backend

        compile_repeated_blocks(pipe.transformer, compile_backend(ctx.device_type))
    return pipe


def denoise(pipe: Any, settings: SampleSettings, embeds: Any, pooled: Any, seeds: list[int], output_type: str) -> Any:
    """One FluxPipeline call with ``settings`` from each seed's initial noise: the forward `sample` makes per batch
    (and the evaluation's padding forwards repeat, so every rank runs the same sharded steps)."""
    return pipe(
        prompt_embeds=embeds,
        pooled_prompt_embeds=pooled,
        latents=initial_latents(seeds, settings.height, settings.width),
        height=settings.height,
        width=settings.width,
        num_inference_steps=settings.steps,
        guidance_scale=settings.guidance,
        max_sequence_length=settings.max_sequence_length,
        output_type=output_type,
    )


def initial_latents(seeds: list[int], height: int, width: int) -> Any:
    """[B, L, 64] packed float32 cpu noise, row b drawn from a generator seeded ``seeds[b]``."""
    import torch

    from fluxgrpo.grpo.latents import latent_shape, pack_latents

    shape = latent_shape(height, width)
    rows = [
        torch.randn((1, *shape.unpacked), generator=torch.Generator().manual_seed(s), dtype=torch.float32)
        for s in seeds
    ]
    return pack_latents(torch.cat(rows))


def _save_png(image: Any, path: Path, prompt: str, seed: int) -> None:
    """Write a PNG under a temp name and rename it, so a killed run never leaves a truncated image."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_itxt("prompt", prompt)
    info.add_text("seed", str(seed))
    write_atomic(path, lambda f: image.save(f, format="PNG", pnginfo=info))


class _Progress:
    """A rich progress bar on stderr (rank 0 only); a no-op elsewhere."""

    def __init__(self, enabled: bool, total: int, description: str):
        self._bar = None
        if enabled and total:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}", markup=False),  # the description names the output folder
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._task = self._bar.add_task(description, total=total)
            self._bar.start()

    def advance(self, count: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, count)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def encode_prompt(pipe: Any, prompt: str, ctx: Any, max_sequence_length: int) -> tuple[Any, Any]:
    """(T5 embeddings, pooled CLIP embedding) of one prompt, encoded on its own (a batch of one)."""
    import torch

    from fluxgrpo.runtime.device import autocast

    with torch.no_grad(), autocast(ctx.device_type):
        embeds, pooled, _ = pipe.encode_prompt(
            prompt=[prompt], prompt_2=None, device=ctx.device, max_sequence_length=max_sequence_length
        )
    return embeds, pooled


def generate_images(
    pipe: Any,
    request: SampleRequest,
    prompt_indices: list[int],
    ctx: Any,
    show_progress: bool = False,
    encoded: dict[int, tuple[Any, Any]] | None = None,
) -> list[SampledImage]:
    """Generate and write every image of ``prompt_indices``, ``batch_size`` images per pipeline call.

    ``encoded`` (prompt index → ``encode_prompt``'s output) supplies the prompts' embeddings, for a pipeline
    without text encoders (the in-training evaluation); without it each prompt is encoded when first needed."""
    import torch

    from fluxgrpo.runtime.device import autocast

    settings = request.settings
    out = Path(request.out_dir)
    work = [(i, j) for i in prompt_indices for j in range(settings.images_per_prompt)]
    precomputed = encoded is not None
    encoded = encoded if encoded is not None else {}
    records: list[SampledImage] = []
    progress = _Progress(
        show_progress,
        len(work),
        f"sampling on {ctx.world_size} rank(s), rank 0's share" if ctx.distributed else "sampling",
    )
    try:
        for start in range(0, len(work), settings.batch_size):
            batch = work[start : start + settings.batch_size]
            if not precomputed:
                for stale in [i for i in encoded if i < batch[0][0]]:
                    del encoded[stale]
                for i in dict.fromkeys(i for i, _ in batch):
                    if i not in encoded:
                        encoded[i] = encode_prompt(pipe, request.prompts[i], ctx, settings.max_sequence_length)
            with torch.no_grad(), autocast(ctx.device_type):
                seeds = [image_seed(settings.seed, i, j) for i, j in batch]
                embeds = torch.cat([encoded[i][0] for i, _ in batch])
                pooled = torch.cat([encoded[i][1] for i, _ in batch])
                images = denoise(pipe, settings, embeds, pooled, seeds, output_type="pil").images
            for (i, j), seed, image in zip(batch, seeds, images, strict=True):
                name = image_filename(i, j)
                _save_png(image, out / name, request.prompts[i], seed)
                records.append(
                    SampledImage(file=name, prompt=request.prompts[i], prompt_index=i, image_index=j, seed=seed)
                )
            progress.advance(len(batch))
    finally:
        progress.close()
    return records


# --------------------------------------------------------------------------------------------- grid and index


def grid_tile_size(rows: int, cols: int, height: int, width: int) -> tuple[int, int]:
    """(width, height) of one contact-sheet tile: the image, scaled down (never up, aspect kept) so its long side
    is at most 256 px and the sheet's long side stays near 4096 px, but not under 16 px."""
    longest = max(GRID_TILE_MIN, min(GRID_TILE_MAX, GRID_TARGET_SIDE // max(rows, cols, 1)))
    scale = min(1.0, longest / max(height, width))
    return max(1, round(width * scale)), max(1, round(height * scale))


def write_grid(out: Path, images: list[SampledImage], num_prompts: int, settings: SampleSettings) -> Path:
    """``grid.png``: row i, column j holds image j of prompt i, downscaled to the tile size."""
    from PIL import Image

    cols = settings.images_per_prompt
    tile_w, tile_h = grid_tile_size(num_prompts, cols, settings.height, settings.width)
    size = (cols * (tile_w + GRID_GAP) + GRID_GAP, num_prompts * (tile_h + GRID_GAP) + GRID_GAP)
    sheet = Image.new("RGB", size, (255, 255, 255))
    for record in images:
        with Image.open(out / record.file) as source:
            tile = source.convert("RGB")
        if tile.size != (tile_w, tile_h):
            tile = tile.resize((tile_w, tile_h), Image.Resampling.LANCZOS)
        sheet.paste(
            tile,
            (GRID_GAP + record.image_index * (tile_w + GRID_GAP), GRID_GAP + record.prompt_index * (tile_h + GRID_GAP)),
        )
    return write_atomic(out / GRID_FILE, lambda f: sheet.save(f, format="PNG"))


def write_index(
    out: Path,
    request: SampleRequest,
    images: list[SampledImage],
    run: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``index.json`` atomically (temp file, fsync, rename): the marker of a complete run.

    Keys: format, format_version, fluxgrpo_version, model, checkpoint, ema, settings (the SampleSettings plus
    ``run``: world_size, device_type, dtype), seed_formula, prompts, grid, images (file, prompt, prompt_index,
    image_index, seed; ordered by prompt_index then image_index), then any ``extra`` keys (the in-training
    evaluation adds its iteration and scores).
    """
    document = {
        "format": INDEX_FORMAT,
        "format_version": INDEX_FORMAT_VERSION,
        "fluxgrpo_version": __version__,
        "model": request.model,
        "checkpoint": request.checkpoint,
        "ema": request.ema,
        "settings": {**asdict(request.settings), **run},
        "seed_formula": SEED_FORMULA,
        "prompts": request.prompts,
        "grid": GRID_FILE,
        "images": [asdict(record) for record in images],
        **(extra or {}),
    }
    return write_atomic(out / INDEX_FILE, json.dumps(document, indent=2, ensure_ascii=False) + "\n", durable=True)


# --------------------------------------------------------------------------------------------- the run


def sample(request: SampleRequest, show_progress: bool = True) -> SampleSummary:
    """Generate every image of ``request``; call it on every rank under torchrun, or once in a plain process.

    Ranks with no prompts load no model. Rank 0 clears an earlier run in the output folder before any rank
    writes, and writes the grid and then ``index.json`` after every rank's images are on disk.

    Raises:
        FluxgrpoError: an image that was not written (the index is then not written either).
    """
    from fluxgrpo.runtime.worker import worker_session

    with worker_session(request.device) as ctx:
        return _sample_on_rank(request, ctx, show_progress)


def _sample_on_rank(request: SampleRequest, ctx: Any, show_progress: bool) -> SampleSummary:
    from fluxgrpo.preprocess import rank_indices
    from fluxgrpo.runtime import dist as rt_dist
    from fluxgrpo.runtime.device import compute_dtype

    out = Path(request.out_dir)
    if ctx.is_main:
        check_output_dir(out)
        if clear_previous_run(out):
            rt_dist.rank0_print(ctx, f"replacing the earlier sample run in {out}")
    rt_dist.barrier(ctx)

    mine = rank_indices(len(request.prompts), ctx.rank, ctx.world_size)  # prompt i on rank i % world
    records: list[SampledImage] = []
    if mine:
        pipe = load_pipeline(request, ctx)
        records = generate_images(pipe, request, mine, ctx, show_progress=show_progress and ctx.is_main)
        del pipe

    gathered = rt_dist.all_gather_object(ctx, [asdict(r) for r in records])
    images = sorted(
        (SampledImage(**r) for part in gathered for r in part), key=lambda r: (r.prompt_index, r.image_index)
    )
    dtype = str(compute_dtype(ctx.device_type)).removeprefix("torch.")
    run = {"world_size": ctx.world_size, "device_type": ctx.device_type, "dtype": dtype}
    if ctx.is_main:
        expected = len(request.prompts) * request.settings.images_per_prompt
        missing = [r.file for r in images if not (out / r.file).is_file()]
        if len(images) != expected or missing:
            raise FluxgrpoError(
                f"{expected - len(images) + len(missing)} of {expected} images were not written to {out}"
                + (f" (e.g. {missing[0]})" if missing else "")
                + ": run `fluxgrpo sample` again"
            )
        write_grid(out, images, len(request.prompts), request.settings)
        write_index(out, request, images, run)
    rt_dist.barrier(ctx)  # no rank returns before the index exists
    return SampleSummary(
        out_dir=str(out),
        index_path=str(out / INDEX_FILE),
        grid_path=str(out / GRID_FILE),
        model=request.model,
        checkpoint=request.checkpoint,
        ema=request.ema,
        prompts=len(request.prompts),
        images=len(images),
        images_per_prompt=request.settings.images_per_prompt,
        world_size=ctx.world_size,
        device_type=ctx.device_type,
        dtype=dtype,
    )


# --------------------------------------------------------------------------------------------- reading an index


@dataclass(frozen=True)
class SampleIndex:
    """A complete sample run read back from its ``index.json``, every listed file checked to exist."""

    path: Path  # the index.json
    root: Path  # its folder; image files are relative to it
    model: str
    checkpoint: str | None
    ema: bool
    settings: dict[str, Any]
    prompts: list[str]
    images: list[SampledImage] = field(default_factory=list)

    def image_path(self, image: SampledImage) -> Path:
        return self.root / image.file


def _inside(root: Path, name: str) -> bool:
    """``name`` is a relative path that stays inside ``root`` (no ``..``, not absolute, no link out of it)."""
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or not name:
        return False
    return (root / relative).resolve().is_relative_to(root.resolve())


def read_index(path: str | Path) -> SampleIndex:
    """Read and check a ``fluxgrpo sample`` index (``index.json``, or the folder holding it).

    Raises:
        FluxgrpoError: the file is missing or unreadable, is not a fluxgrpo sample index, an entry lacks its
            prompt or other fields, or a listed image is no longer beside it (the folder was moved in parts).
    """
    path = Path(path)
    if path.is_dir():
        path = path / INDEX_FILE
    fix = "pass the index.json that `fluxgrpo sample` wrote (or its --out folder)"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FluxgrpoError(f"{path} not found (an unfinished `fluxgrpo sample` run has none): {fix}") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FluxgrpoError(f"cannot read {path} ({exc}): {fix}") from None
    if not isinstance(document, dict) or document.get("format") != INDEX_FORMAT:
        raise FluxgrpoError(f'{path} is not a fluxgrpo sample index (no "format": "{INDEX_FORMAT}"): {fix}')
    version = document.get("format_version")
    if version != INDEX_FORMAT_VERSION:
        raise FluxgrpoError(
            f"{path} has index format version {version}; this fluxgrpo reads version {INDEX_FORMAT_VERSION}: "
            "re-run `fluxgrpo sample` with this version"
        )
    prompts = document.get("prompts")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise FluxgrpoError(f"{path} has no prompt list: {fix}")
    root = path.parent
    images = []
    listed: dict[str, int] = {}
    positions: dict[tuple[int, int], int] = {}
    for position, entry in enumerate(document.get("images") or []):
        try:
            record = SampledImage(
                file=str(entry["file"]),
                prompt=entry["prompt"],
                prompt_index=int(entry["prompt_index"]),
                image_index=int(entry["image_index"]),
                seed=int(entry["seed"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
            raise FluxgrpoError(f"{path}: image entry {position} is malformed ({what}): {fix}") from None
        if not 0 <= record.prompt_index < len(prompts) or record.prompt != prompts[record.prompt_index]:
            raise FluxgrpoError(
                f"{path}: image {record.file} has no prompt (prompt_index {record.prompt_index} does not name its "
                f"prompt in the prompt list): {fix}"
            )
        if not _inside(root, record.file):
            raise FluxgrpoError(
                f"{path}: image entry {position} names {record.file}, outside the index's folder {root} (an index "
                f"lists only the images beside it): {fix}"
            )
        earlier = listed.get(record.file, positions.get((record.prompt_index, record.image_index)))
        if earlier is not None:
            raise FluxgrpoError(
                f"{path}: image entry {position} ({record.file}, prompt {record.prompt_index} image "
                f"{record.image_index}) repeats entry {earlier}; every image is listed once: {fix}"
            )
        listed[record.file] = position
        positions[(record.prompt_index, record.image_index)] = position
        if not (root / record.file).is_file():
            raise FluxgrpoError(
                f"{path} lists {record.file}, which is not in {root} (were the images moved without their "
                "index?): keep index.json in the folder with its images"
            )
        images.append(record)
    if not images:
        raise FluxgrpoError(f"{path} lists no images: {fix}")
    return SampleIndex(
        path=path,
        root=root,
        model=str(document.get("model")),
        checkpoint=document.get("checkpoint"),
        ema=bool(document.get("ema")),
        settings=dict(document.get("settings") or {}),
        prompts=list(prompts),
        images=images,
    )


# --------------------------------------------------------------------------------------------- worker entry


def worker_entry(payload: dict[str, Any]) -> SampleSummary:
    """Every rank's part of ``fluxgrpo sample --dies N`` (``runtime.launch.run_workers``): a SampleRequest."""
    return sample(SampleRequest.from_dict(payload))
