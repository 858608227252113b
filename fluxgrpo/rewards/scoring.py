"""Scoring saved images with a reward, as ``fluxgrpo score`` and the in-training evaluation both do: each image
read back from disk and decoded as RGB, scored in batches through the reward's PIL path when it has one (its
encoders in float32), the statistics as population mean and std."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from PIL import Image, UnidentifiedImageError

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.rewards import load_reward, reward_record
from fluxgrpo.rewards.base import pil_to_tensor

if TYPE_CHECKING:
    from fluxgrpo.rewards.base import RewardFn

DEFAULT_SCORE_BATCH = 16


@dataclass(frozen=True)
class ImageToScore:
    """One image and what it is scored against."""

    path: Path  # where it is read from
    file: str  # how it is reported: its name inside the index's or the images' folder
    prompt: str
    prompt_index: int  # the run's prompt index (index mode) or the prompt group's (folder mode)
    image_index: int  # j within its prompt
    seed: int | None  # from the index; None in folder mode


@dataclass(frozen=True)
class ScoredImage:
    file: str
    prompt: str
    prompt_index: int
    image_index: int
    seed: int | None
    score: float


# The largest image fluxgrpo reads: its own largest sample (8192² pixels, --height/--width's limit). Every reward
# resizes to a few hundred pixels, so a larger file is refused before it is decoded (a 12000² PNG decodes to 430 MB,
# a "decompression bomb" header of 40000² to gigabytes).
MAX_SCORE_PIXELS = 8192 * 8192


def _refusal(path: Path, why: str) -> FluxgrpoError:
    return FluxgrpoError(f"cannot read image {path} ({why}): replace or remove it")


def _checked_size(path: Path, image: Image.Image) -> None:
    width, height = image.size
    if width * height > MAX_SCORE_PIXELS:
        raise _refusal(
            path,
            f"{width}×{height} is {width * height / 1e6:.0f} Mpixel, above the {MAX_SCORE_PIXELS / 1e6:.0f} Mpixel "
            "(8192×8192) fluxgrpo reads",
        )


def check_images_readable(items: Iterable[ImageToScore]) -> None:
    """Open every image's header, so a file that is no image, or one too large to decode, fails before any model
    loads."""

    for item in items:
        try:
            with warnings.catch_warnings():  # the size is judged here, in one line, not in PIL's warning
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(item.path) as image:
                    _checked_size(item.path, image)
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as exc:
            raise _refusal(item.path, str(exc)) from None


def load_image(path: Path) -> Image.Image:
    """The image at ``path``, fully decoded, as RGB."""

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                _checked_size(path, image)
                image.load()
                return image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as exc:
        raise _refusal(path, str(exc)) from None


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """(mean, population standard deviation) of a non-empty sequence."""
    mean = math.fsum(values) / len(values)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def load_scorer(name: str, hps_dir: str | Path, device: torch.device | str) -> RewardFn:
    """The reward ``name`` on ``device``, its encoders in float32: scores compared across runs should not carry
    bf16 rounding (8 significant bits)."""

    return load_reward(name, hps_dir, device, reward_dtype="fp32")


def score_items(
    items: Sequence[ImageToScore],
    scorer: RewardFn,
    batch_size: int,
    device: torch.device | str = "cpu",
    progress: Callable[[int], None] | None = None,
) -> list[ScoredImage]:
    """Score ``items`` in batches of ``batch_size`` images (decoded per batch, so memory stays bounded)."""

    scored: list[ScoredImage] = []
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        images = [load_image(item.path) for item in batch]
        prompts = [item.prompt for item in batch]
        with torch.no_grad():
            if hasattr(scorer, "score_pil"):
                values = scorer.score_pil(images, prompts)
            elif len({image.size for image in images}) == 1:
                values = scorer(torch.stack([pil_to_tensor(image) for image in images]).to(device), prompts)
            else:  # tensor rewards take [B, 3, H, W]: images of different sizes go one at a time
                values = torch.cat(
                    [
                        scorer(pil_to_tensor(image).unsqueeze(0).to(device), [prompt])
                        for image, prompt in zip(images, prompts, strict=True)
                    ]
                )
        for item, value in zip(batch, values.float().cpu().tolist(), strict=True):
            scored.append(
                ScoredImage(
                    file=item.file,
                    prompt=item.prompt,
                    prompt_index=item.prompt_index,
                    image_index=item.image_index,
                    seed=item.seed,
                    score=float(value),
                )
            )
        if progress is not None:
            progress(len(batch))
    return scored


def reward_details(name: str, prompts: Sequence[str], scores: Sequence[float]) -> dict[str, float]:
    """Reward ``name``'s own numbers beside the mean (``RewardRecord.summarize``; shapes: the strict rate, seen and
    novel combinations apart), {} for a reward without any."""

    summarize = reward_record(name).summarize
    return summarize(prompts, scores) if summarize is not None else {}
