"""One downloadable part of the weights (``HubPart``), and the repos several parts share. Every part is declared
where it belongs (FLUX's in ``hub_parts.py``, each reward's in its record); ``hub_parts.py`` lists them all."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class HubPart:
    """One downloadable part: its repo on each hub, which files, and where they go."""

    name: str
    repos: Mapping[str, tuple[str, ...]]  # source → candidate repo ids, tried in order
    # Each entry must match at least one file: an fnmatch pattern over repo paths, or a tuple of alternative
    # patterns of which the first that matches anything is taken (e.g. safetensors, else the .bin).
    allow: tuple[str | tuple[str, ...], ...]
    root: str  # "flux" → flux_dir, "hps" → hps_dir, "prompts" → prompts_dir
    manifest_name: str
    subdir: str = ""  # below the root, for a part that must not mix with the others there
    optional: tuple[str, ...] = ()  # patterns fetched when the repo has them, not required
    # Files of another variant of this part that must go when it is fetched (they would change how it loads).
    replaces: tuple[str, ...] = ()
    repo_type: str = "model"  # or "dataset" (the benchmark prompt sets)


# LAION's CLIP-H: open_clip weights for HPSv2 and CLIPScore, the processor for PickScore.
CLIP_REPO = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
CLIP_MIRROR_REPO = "AI-ModelScope/CLIP-ViT-H-14-laion2B-s32B-b79K"
