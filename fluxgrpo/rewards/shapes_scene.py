"""The ``shapes-scene`` reward (no weights): the ``shapes`` checker's claims and one more, that the image holds
nothing but what the caption asks for (``shapes.checker.scene_claim``).

A training reward. GenEval's rules, which ``shapes`` follows, penalize extra objects only when a caption counts, so
a policy trained on ``shapes`` learns to scatter fragments of every colour: each one earns a present and a colour
claim in the other captions (docs/results/shapes-world.md, "AWM hacks the checker"). Here an extra object costs a
claim, as it would in the eyes of anyone reading the image. Evaluate on the faithful checker (``--eval-rewards shapes``),
which the shapes configs do.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fluxgrpo.rewards import shapes

if TYPE_CHECKING:
    import torch

NAME = "shapes-scene"


def _load(hps_dir: Path, device: torch.device | str, dtype: torch.dtype) -> shapes.ShapesReward:
    return shapes.ShapesReward(scene=True)


RECORD = shapes.scene_record(NAME, _load)
