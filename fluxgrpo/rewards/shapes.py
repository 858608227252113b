"""The ``shapes`` reward (no weights): the shapes world's rule-based checker, GenEval-style (``shapes/checker.py``).

Each image is checked against its caption's claims (objects present, count, colour, relative position); its score
is the fraction of claims that hold, in [0, 1]. An image scores exactly 1 when every claim holds, so the strict
all-claims rate (GenEval's accuracy) is the fraction of scores equal to 1: :func:`summarize` reports it, and on the
world's held-out prompts the seen-combination and novel-combination scores apart (``eval_shapes_*`` metrics,
``fluxgrpo score``'s summary line).

Prompts must be captions of the world (``fluxgrpo preprocess --prompts shapes-train``; ``--eval-prompts
shapes-heldout``) and images 64² or 128²; anything else is one line naming the words or the size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.rewards.base import check_batch
from fluxgrpo.rewards.registry import RewardLoader, RewardRecord

if TYPE_CHECKING:
    import torch

    from fluxgrpo.shapes.world import Caption

_FIX = (
    "the shapes reward scores captions of the shapes world (train on `fluxgrpo preprocess --prompts shapes-train`, "
    "evaluate on --eval-prompts shapes-heldout)"
)


@lru_cache(maxsize=4096)
def _caption(prompt: str, reward: str = "shapes") -> Caption:
    from fluxgrpo.shapes.world import CaptionError, parse_caption

    try:
        return parse_caption(prompt)
    except CaptionError as exc:
        raise FluxgrpoError(f"--reward {reward} cannot read the prompt {exc}: {_FIX}") from None


class ShapesReward:
    """The fraction of the caption's claims each image satisfies, in [0, 1] (deterministic, on the CPU); with
    ``scene``, the claim that nothing else is in the image counts too (``shapes-scene``); with ``all_or_nothing``,
    1 when every claim holds and 0 otherwise (``shapes-strict``)."""

    def __init__(self, scene: bool = False, all_or_nothing: bool = False, name: str | None = None) -> None:
        self.scene = scene
        self.all_or_nothing = all_or_nothing
        self.name = name or ("shapes-scene" if scene else "shapes")

    def check(self, images: torch.Tensor, prompts: list[str]) -> list[Any]:
        """One ``shapes.checker.CheckResult`` per image: each claim, whether it holds and what was found."""
        from fluxgrpo.shapes.checker import ImageSizeError, check

        check_batch(images, prompts)
        captions = [_caption(prompt, self.name) for prompt in prompts]  # every prompt read before the first image
        # Back to the bytes the image was made of: [0, 1] floats from a PNG (x/255) round-trip exactly.
        pixels = (images.detach().float().clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
        try:
            return [check(image, caption, scene=self.scene) for image, caption in zip(pixels, captions, strict=True)]
        except ImageSizeError as exc:
            raise FluxgrpoError(f"--reward {self.name}: {exc}") from None

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        import torch

        results = self.check(images, prompts)
        scores = [float(result.strict) if self.all_or_nothing else result.score for result in results]
        return torch.tensor(scores, dtype=torch.float32, device=images.device)


def summarize(prompts: Sequence[str], scores: Sequence[float]) -> dict[str, float]:
    """The strict all-claims rate (``strict``), and for each kind of caption the prompts hold, the mean and strict
    rate of the seen-combination and novel-combination captions apart (``seen``, ``seen_strict``, ``novel``,
    ``novel_strict``; ``shapes.world.combination_kind``). Non-finite scores are left out. (No key ends in ``_mean``:
    ``eval_<name>_mean`` is a reward's own mean in metrics.jsonl.)"""

    from fluxgrpo.shapes.world import is_novel

    pairs = [(prompt, score) for prompt, score in zip(prompts, scores, strict=True) if math.isfinite(score)]
    if not pairs:
        return {}
    out = {"strict": sum(score == 1.0 for _, score in pairs) / len(pairs)}
    for kind in ("seen", "novel"):
        mine = [score for prompt, score in pairs if is_novel(_caption(prompt)) == (kind == "novel")]
        if mine:
            out[kind] = sum(mine) / len(mine)
            out[f"{kind}_strict"] = sum(score == 1.0 for score in mine) / len(mine)
    return out


def explain(path: Path, prompt: str, *, scene: bool = False) -> list[str]:
    """Each claim of ``prompt`` on the image file, ``✓ claim`` or ``✗ claim (what was found)``; [] for an image or
    prompt the checker cannot read (the report still renders). ``scene``: with the nothing-else claim."""
    import numpy as np
    from PIL import Image

    from fluxgrpo.shapes.checker import ImageSizeError, check
    from fluxgrpo.shapes.world import CaptionError

    try:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
        return [claim.label() for claim in check(pixels, prompt, scene=scene).claims]
    except (OSError, ValueError, SyntaxError, CaptionError, ImageSizeError):
        return []


def prompt_problems(prompts: Sequence[str], *, reward: str = "shapes") -> list[str]:
    """The first prompt the checker cannot read, in one line naming its words (one is enough to say what to fix)."""
    for prompt in dict.fromkeys(prompts):
        try:
            _caption(prompt, reward)
        except FluxgrpoError as exc:
            return [str(exc)]
    return []


def image_size_problems(height: int, width: int, *, reward: str = "shapes") -> list[str]:
    """A run's image size the checker cannot read, said before any worker starts."""
    from fluxgrpo.shapes.checker import WORLD_SIZES

    if height == width and height in WORLD_SIZES:
        return []
    sizes = " or ".join(str(size) for size in WORLD_SIZES)
    return [
        f"--reward {reward} checks {sizes}-pixel square images: use --height and --width {sizes} (got {height}x{width})"
    ]


def _load(hps_dir: Path, device: torch.device | str, dtype: torch.dtype) -> ShapesReward:
    return ShapesReward()


RECORD = RewardRecord(  # no weights
    "shapes",
    _load,
    summarize=summarize,
    explain=explain,
    prompt_problems=prompt_problems,
    image_size_problems=image_size_problems,
)


def scene_record(name: str, load: RewardLoader) -> RewardRecord:
    """The registry record of a training reward that reads the scene claim too (``shapes-scene``, ``shapes-strict``):
    the checker's summary, its claims with the scene claim, its one-line errors under ``name``."""
    return RewardRecord(  # no weights
        name,
        load,
        summarize=summarize,
        explain=partial(explain, scene=True),
        prompt_problems=partial(prompt_problems, reward=name),
        image_size_problems=partial(image_size_problems, reward=name),
    )
