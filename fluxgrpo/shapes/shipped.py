"""``fetch-weights --source shapes``: the shapes world's pretrained weights, shipped in the package, put in place.

The package holds what ``python -m fluxgrpo.lab.build --out fluxgrpo/shapes/weights`` wrote: ``flux/`` (a
diffusers FLUX folder) and ``hps/`` (the tiny HPS in HPSv2's layout). Writing them is a copy plus a manifest per
part (source ``shapes``), offline, in seconds. The ``clip`` part (``open_clip_pytorch_model.bin``, what HPSv2 was
fine-tuned from) holds the same contrastively trained CLIP: the world's HPS is that CLIP, with no preference
fine-tuning on top, so ``clipscore`` reads it too.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.weights.layout import CLIP_MANIFEST, HPS_CHECKPOINT, HPS_MANIFEST, OPEN_CLIP_WEIGHTS, REWARD_ARCH_FILE
from fluxgrpo.weights.manifest import MANIFEST_NAME, Manifest, describe_files, write_manifest
from fluxgrpo.weights.tiny_writing import SHAPES_SOURCE, refuse_unless_tiny_or_empty, relative_files

SHAPES_PARTS = ("flux", "hps", "clip")
_HPS_FILES = (HPS_CHECKPOINT, OPEN_CLIP_WEIGHTS, REWARD_ARCH_FILE, HPS_MANIFEST, CLIP_MANIFEST)


def shipped_weights_dir() -> Path:
    """Where the package keeps the built files (``build.FLUX_SUBDIR`` and ``build.HPS_SUBDIR`` inside)."""
    return Path(__file__).parent / "weights"


def _shipped(source: Path, relative: str) -> Path:
    path = source / relative
    if not path.exists():
        raise FluxgrpoError(
            f"the shapes weights are missing from the package ({path}): reinstall fluxgrpo, or rebuild them with "
            f"`python -m fluxgrpo.lab.build --out {source}`"
        )
    return path


def write_shapes_flux(flux_dir: Path, source: Path | None = None) -> int:
    """Copy the shipped FLUX folder to ``flux_dir`` and write its manifest; the bytes written (manifest excluded)."""
    from fluxgrpo.shapes.sizes import FLUX_SUBDIR

    shipped = _shipped(source or shipped_weights_dir(), FLUX_SUBDIR)
    flux_dir = Path(flux_dir)
    refuse_unless_tiny_or_empty(flux_dir, (MANIFEST_NAME,), None, "--flux-dir", making="shapes")
    if flux_dir.exists():
        shutil.rmtree(flux_dir)  # an earlier offline folder: start clean so no stale file survives
    shutil.copytree(shipped, flux_dir, ignore=shutil.ignore_patterns(MANIFEST_NAME))
    files = describe_files(flux_dir, relative_files(flux_dir, {MANIFEST_NAME}))
    write_manifest(flux_dir, Manifest(part="flux", source=SHAPES_SOURCE, files=files), MANIFEST_NAME)
    return sum(f.size for f in files)


def write_shapes_reward(hps_dir: Path, source: Path | None = None) -> tuple[int, int]:
    """The tiny HPS checkpoint, its architecture file, the CLIP it is (as the initial weights) and both manifests.

    Returns (hps bytes incl. the architecture file, clip bytes). Other rewards' subfolders are left alone.
    """
    import torch

    from fluxgrpo.shapes.sizes import HPS_SUBDIR

    shipped = _shipped(source or shipped_weights_dir(), HPS_SUBDIR)
    hps_dir = Path(hps_dir)
    refuse_unless_tiny_or_empty(hps_dir, (HPS_MANIFEST, CLIP_MANIFEST), _HPS_FILES, "--hps-dir", making="shapes")
    hps_dir.mkdir(parents=True, exist_ok=True)
    for name in (HPS_MANIFEST, CLIP_MANIFEST):  # manifests go first so a crash below leaves an unfinished part
        (hps_dir / name).unlink(missing_ok=True)
    for name in (HPS_CHECKPOINT, REWARD_ARCH_FILE):
        shutil.copyfile(_shipped(shipped, name), hps_dir / name)
    checkpoint = torch.load(hps_dir / HPS_CHECKPOINT, map_location="cpu", weights_only=True)
    torch.save(checkpoint["state_dict"], hps_dir / OPEN_CLIP_WEIGHTS)
    hps_files = describe_files(hps_dir, [HPS_CHECKPOINT, REWARD_ARCH_FILE])
    clip_files = describe_files(hps_dir, [OPEN_CLIP_WEIGHTS])
    write_manifest(hps_dir, Manifest(part="hps", source=SHAPES_SOURCE, files=hps_files), HPS_MANIFEST)
    write_manifest(hps_dir, Manifest(part="clip", source=SHAPES_SOURCE, files=clip_files), CLIP_MANIFEST)
    return sum(f.size for f in hps_files), sum(f.size for f in clip_files)


def write_shapes_weights(
    flux_dir: Path, hps_dir: Path, parts: Sequence[str] | None = None, source: Path | None = None
) -> dict[str, int]:
    """Write the shapes world's FLUX (``flux_dir``) and HPS + CLIP (``hps_dir``) in the real layout; the bytes
    written per part. ``parts`` selects from :data:`SHAPES_PARTS` (hps and clip are written together);
    ``source`` is a build folder to take them from instead of the package's."""
    parts = SHAPES_PARTS if parts is None else parts
    unknown = [part for part in parts if part not in SHAPES_PARTS]
    if unknown or not parts:
        raise UsageError(
            f"{'unknown part ' + repr(unknown[0]) if unknown else 'no part selected'} for --source shapes: choose "
            f"from {', '.join(SHAPES_PARTS)} (--only)"
        )
    written: dict[str, int] = {}
    if "flux" in parts:
        written["flux"] = write_shapes_flux(Path(flux_dir), source)
    if {"hps", "clip"} & set(parts):
        written["hps"], written["clip"] = write_shapes_reward(Path(hps_dir), source)
    return written
