"""``fetch-weights --source tiny``: write tiny random, seeded FLUX and HPS weights in exactly the real layout.

The FLUX part is a ``FluxPipeline.save_pretrained`` folder (what FLUX.1-dev's diffusers repo holds); the reward
part is saved the way the real files are: ``HPS_v2.1_compressed.pt`` is ``{"state_dict": ...}`` of a full open_clip
CLIP and ``open_clip_pytorch_model.bin`` is a plain open_clip state dict (LAION's initial weights, which HPS was
fine-tuned from, so here it is a different random draw). Only the tiny part also gets ``open_clip_config.json``,
the architecture (the real one is ViT-H-14). Manifests are written last, so a part with a manifest is complete.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.weights.layout import (
    CLIP_MANIFEST,
    HPS_CHECKPOINT,
    HPS_MANIFEST,
    OPEN_CLIP_WEIGHTS,
    REWARD_ARCH_FILE,
)
from fluxgrpo.weights.manifest import MANIFEST_NAME, Manifest, describe_files, read_manifest, write_manifest

TINY_SOURCE = "tiny"
_REWARD_FILES = (HPS_CHECKPOINT, OPEN_CLIP_WEIGHTS, REWARD_ARCH_FILE, HPS_MANIFEST, CLIP_MANIFEST)


@dataclass(frozen=True)
class TinyWeightsSummary:
    """What ``write_tiny_weights`` wrote."""

    flux_dir: Path
    hps_dir: Path
    seed: int
    flux_bytes: int
    hps_bytes: int
    clip_bytes: int


def _refuse_unless_tiny_or_empty(folder: Path, manifest_names: tuple[str, ...], own_files: tuple[str, ...] | None,
                                 flag: str) -> None:
    """Never overwrite real weights with tiny ones: only an empty folder or an earlier tiny one is replaced."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise FluxgrpoError(f"{folder} exists and is not a folder: choose another {flag}")
    for name in manifest_names:
        manifest = read_manifest(folder, name)
        if manifest is not None and manifest.source != TINY_SOURCE:
            raise FluxgrpoError(
                f"{folder} holds {manifest.source} weights ({name}); refusing to overwrite them with tiny ones: "
                f"choose another {flag}"
            )
    present = [p.name for p in folder.iterdir()]
    if own_files is not None:
        present = [name for name in present if name in own_files]
    has_tiny_manifest = any(
        (m := read_manifest(folder, name)) is not None and m.source == TINY_SOURCE for name in manifest_names
    )
    if present and not has_tiny_manifest:
        raise FluxgrpoError(
            f"{folder} already holds weights placed without a manifest; refusing to overwrite them with tiny "
            f"ones: choose another {flag} (or delete the folder)"
        )


def _relative_files(root: Path, exclude: set[str]) -> list[str]:
    return [p.relative_to(root).as_posix() for p in sorted(root.rglob("*")) if p.is_file() and p.name not in exclude]


def write_tiny_flux(flux_dir: Path, seed: int = 0) -> int:
    """Write the tiny FLUX pipeline and its manifest; returns the bytes written (manifest excluded)."""
    from fluxgrpo.models.tiny import build_tiny_flux_pipeline

    flux_dir = Path(flux_dir)
    _refuse_unless_tiny_or_empty(flux_dir, (MANIFEST_NAME,), None, "--flux-dir")
    if flux_dir.exists():
        shutil.rmtree(flux_dir)  # an earlier tiny folder: start clean so no stale file survives
    pipeline = build_tiny_flux_pipeline(seed)
    pipeline.save_pretrained(flux_dir)
    files = describe_files(flux_dir, _relative_files(flux_dir, {MANIFEST_NAME}))
    write_manifest(flux_dir, Manifest(part="flux", source=TINY_SOURCE, files=files), MANIFEST_NAME)
    return sum(f.size for f in files)


def write_tiny_reward(hps_dir: Path, seed: int = 0) -> tuple[int, int]:
    """Write the tiny HPS checkpoint, the open_clip initial weights, the architecture file and both manifests.

    Returns (hps bytes incl. the architecture file, clip bytes).
    """
    import torch

    from fluxgrpo.models.tiny import TINY_REWARD_CONFIG, build_tiny_reward_model

    hps_dir = Path(hps_dir)
    _refuse_unless_tiny_or_empty(hps_dir, (HPS_MANIFEST, CLIP_MANIFEST), _REWARD_FILES, "--hps-dir")
    hps_dir.mkdir(parents=True, exist_ok=True)
    for name in (HPS_MANIFEST, CLIP_MANIFEST):  # manifests go first so a crash below leaves an unfinished part
        (hps_dir / name).unlink(missing_ok=True)

    hps_model = build_tiny_reward_model(seed)
    initial_model = build_tiny_reward_model(seed + 1)
    torch.save({"state_dict": hps_model.state_dict()}, hps_dir / HPS_CHECKPOINT)
    torch.save(initial_model.state_dict(), hps_dir / OPEN_CLIP_WEIGHTS)
    (hps_dir / REWARD_ARCH_FILE).write_text(json.dumps(TINY_REWARD_CONFIG, indent=2) + "\n")

    hps_files = describe_files(hps_dir, [HPS_CHECKPOINT, REWARD_ARCH_FILE])
    clip_files = describe_files(hps_dir, [OPEN_CLIP_WEIGHTS])
    write_manifest(hps_dir, Manifest(part="hps", source=TINY_SOURCE, files=hps_files), HPS_MANIFEST)
    write_manifest(hps_dir, Manifest(part="clip", source=TINY_SOURCE, files=clip_files), CLIP_MANIFEST)
    return sum(f.size for f in hps_files), sum(f.size for f in clip_files)


def write_tiny_weights(flux_dir: Path, hps_dir: Path, seed: int = 0) -> TinyWeightsSummary:
    """Write tiny random FLUX (``flux_dir``) and HPS (``hps_dir``) weights, offline, in the real layout.

    Afterwards ``check_flux_dir(flux_dir)`` and ``check_hps_dir(hps_dir)`` report complete. The same seed gives
    the same weights. A folder holding non-tiny weights (another source's manifest, or files without one) is
    never overwritten: FluxgrpoError names the flag to change.
    """
    flux_bytes = write_tiny_flux(Path(flux_dir), seed)
    hps_bytes, clip_bytes = write_tiny_reward(Path(hps_dir), seed)
    return TinyWeightsSummary(Path(flux_dir), Path(hps_dir), seed, flux_bytes, hps_bytes, clip_bytes)
