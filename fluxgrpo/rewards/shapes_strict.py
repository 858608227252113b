"""The ``shapes-strict`` reward (no weights): 1 when every one of ``shapes-scene``'s claims holds, else 0.

GenEval's accuracy as a reward, with the scene claim (nothing else in the image) so that it cannot be earned by
scattering extra objects. A training reward to weigh beside ``shapes-scene``: the fraction of claims rewards each
claim on its own, and a caption with three or four claims (colour attribution, position) then improves claim by claim
while images where *all* of them hold stay rare (docs/results/shapes-world.md, "The overfit check"); the
all-or-nothing part pays for the conjunction. ``--reward shapes-scene:1,shapes-strict:1`` is their mean.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fluxgrpo.rewards import shapes

if TYPE_CHECKING:
    import torch

NAME = "shapes-strict"


def _load(hps_dir: Path, device: torch.device | str, dtype: torch.dtype) -> shapes.ShapesReward:
    return shapes.ShapesReward(scene=True, all_or_nothing=True, name=NAME)


RECORD = shapes.scene_record(NAME, _load)
