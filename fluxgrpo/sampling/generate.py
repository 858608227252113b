"""The FLUX pipeline (with a checkpoint's transformer or LoRA adapter) and the images it generates, each
from its own seeded noise."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from PIL.PngImagePlugin import PngInfo
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from fluxgrpo.grpo.latents import latent_shape, pack_latents
from fluxgrpo.models.compile import compile_repeated_blocks
from fluxgrpo.paths import write_atomic
from fluxgrpo.runtime.adapt import adapt_transformer, compile_backend
from fluxgrpo.runtime.device import autocast, compute_dtype
from fluxgrpo.safe_load import load_pretrained
from fluxgrpo.sampling.request import SampledImage, SampleRequest, SampleSettings, image_filename, image_seed

if TYPE_CHECKING:
    from PIL import Image

    from fluxgrpo.runtime.dist import DistContext


def load_pipeline(request: SampleRequest, ctx: DistContext) -> FluxPipeline:
    """FluxPipeline from ``request.model`` in the compute dtype on ``ctx.device``, with the trained transformer
    swapped in when there is a checkpoint, adapted to the device by the runtime."""

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
        compile_repeated_blocks(pipe.transformer, compile_backend(ctx.device_type))
    return pipe


def denoise(
    pipe: FluxPipeline,
    settings: SampleSettings,
    embeds: torch.Tensor,
    pooled: torch.Tensor,
    seeds: list[int],
    output_type: str,
) -> Any:
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


def initial_latents(seeds: list[int], height: int, width: int) -> torch.Tensor:
    """[B, L, 64] packed float32 cpu noise, row b drawn from a generator seeded ``seeds[b]``."""

    shape = latent_shape(height, width)
    rows = [
        torch.randn((1, *shape.unpacked), generator=torch.Generator().manual_seed(s), dtype=torch.float32)
        for s in seeds
    ]
    return pack_latents(torch.cat(rows))


def _save_png(image: Image.Image, path: Path, prompt: str, seed: int) -> None:
    """Write a PNG under a temp name and rename it, so a killed run never leaves a truncated image."""

    info = PngInfo()
    info.add_itxt("prompt", prompt)
    info.add_text("seed", str(seed))
    write_atomic(path, lambda f: image.save(f, format="PNG", pnginfo=info))


class _Progress:
    """A rich progress bar on stderr (rank 0 only); a no-op elsewhere."""

    def __init__(self, enabled: bool, total: int, description: str):
        self._bar = None
        if enabled and total:
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


def encode_prompt(
    pipe: FluxPipeline, prompt: str, ctx: DistContext, max_sequence_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T5 embeddings, pooled CLIP embedding) of one prompt, encoded on its own (a batch of one)."""

    with torch.no_grad(), autocast(ctx.device_type):
        embeds, pooled, _ = pipe.encode_prompt(
            prompt=[prompt], prompt_2=None, device=ctx.device, max_sequence_length=max_sequence_length
        )
    return embeds, pooled


def generate_images(
    pipe: FluxPipeline,
    request: SampleRequest,
    prompt_indices: list[int],
    ctx: DistContext,
    show_progress: bool = False,
    encoded: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[SampledImage]:
    """Generate and write every image of ``prompt_indices``, ``batch_size`` images per pipeline call.

    ``encoded`` (prompt index → ``encode_prompt``'s output) supplies the prompts' embeddings, for a pipeline
    without text encoders (the in-training evaluation); without it each prompt is encoded when first needed."""

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
