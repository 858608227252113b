"""``fluxgrpo sample``: the run on every rank (``worker_entry`` is what ``--dies N`` starts through
``runtime.launch.run_workers``) on top of ``fluxgrpo.sampling``, which documents the seeds and the output folder."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.models.flux import read_transformer_config, require_flux_dir
from fluxgrpo.models.known import KNOWN_MODELS, KnownModel, known_model
from fluxgrpo.paths import DEFAULT_SAMPLES_DIR
from fluxgrpo.preprocess import rank_indices
from fluxgrpo.run_folder import INDEX_FILE  # a sample folder's index, and each evaluation's in a run folder
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.adapt import compile_backend
from fluxgrpo.runtime.device import compute_dtype, resolve_device_type
from fluxgrpo.runtime.worker import worker_session
from fluxgrpo.sampling.checkpoints import check_checkpoint_fits_model, resolve_checkpoint
from fluxgrpo.sampling.folder import (
    GRID_FILE,
    check_not_inside_a_run,
    check_output_dir,
    clear_previous_run,
    write_grid,
    write_index,
)
from fluxgrpo.sampling.generate import generate_images, load_pipeline
from fluxgrpo.sampling.request import SampledImage, SampleRequest, SampleSettings

if TYPE_CHECKING:
    from fluxgrpo.runtime.dist import DistContext


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


def default_out_dir(checkpoint: str | Path | None, ema: bool) -> Path:
    """``data/outputs/samples/base``, or ``.../<run folder>-checkpoint-<k>[-ema]``, so runs never collide."""
    if checkpoint is None:
        return Path(DEFAULT_SAMPLES_DIR) / "base"
    checkpoint = Path(checkpoint).resolve()
    return Path(DEFAULT_SAMPLES_DIR) / f"{checkpoint.parent.name}-{checkpoint.name}{'-ema' if ema else ''}"


def own_model(model: str | Path) -> KnownModel:
    """The known model ``--model`` holds, whose own settings `sample` defaults to; FLUX.1-dev's where the folder holds
    none or has no readable config (the request's checks then say what is wrong with it)."""

    try:
        known = known_model(read_transformer_config(model))
    except FluxgrpoError:
        known = None
    return known or KNOWN_MODELS["flux-dev"]


def model_sample_steps(model: str | Path) -> int:
    """The denoising steps `sample` uses when --steps is not given: the model's own (the shapes world: 12, as its
    evaluation), else FLUX.1-dev's 28."""
    return own_model(model).sample_steps


def model_sample_guidance(model: str | Path) -> float:
    """The distilled guidance `sample` uses when --guidance is not given: the model's own (the shapes world: 1.75, as
    its configs roll out and evaluate at), else FLUX.1-dev's 3.5."""
    return own_model(model).sample_guidance


def model_sample_defaults(model: str | Path) -> tuple[int, int]:
    """(image side, T5 tokens) `sample` uses when --height/--width/--max-sequence-length are not given: the model's
    own where ``--model`` holds a known model trained at other ones (the shapes world: 64 and 12, where FLUX.1-dev's
    720 and 512 give noise), else FLUX.1-dev's."""
    return own_model(model).sample_defaults


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

    settings.validate()
    device_type = resolve_device_type(device)
    if settings.compile:
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


# --------------------------------------------------------------------------------------------- the run


def sample(request: SampleRequest, show_progress: bool = True) -> SampleSummary:
    """Generate every image of ``request``; call it on every rank under torchrun, or once in a plain process.

    Ranks with no prompts load no model. Rank 0 clears an earlier run in the output folder before any rank
    writes, and writes the grid and then ``index.json`` after every rank's images are on disk.

    Raises:
        FluxgrpoError: an image that was not written (the index is then not written either).
    """

    with worker_session(request.device) as ctx:
        return _sample_on_rank(request, ctx, show_progress)


def _sample_on_rank(request: SampleRequest, ctx: DistContext, show_progress: bool) -> SampleSummary:
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


# --------------------------------------------------------------------------------------------- worker entry


def worker_entry(payload: dict[str, Any]) -> SampleSummary:
    """Every rank's part of ``fluxgrpo sample --dies N`` (``runtime.launch.run_workers``): a SampleRequest."""
    return sample(SampleRequest.from_dict(payload))
