"""``fetch-weights --source tiny``: tiny random, seeded FLUX and reward weights in exactly the real layout.

The FLUX part is written here, a ``FluxPipeline.save_pretrained`` folder (what FLUX.1-dev's diffusers repo holds).
Each reward part is written by its reward's record (``write_tiny`` in ``rewards/<name>.py``), the way its real files
are, with the helpers of ``weights/tiny_writing.py``. Manifests are written last, so a part with a manifest is
complete.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fluxgrpo.errors import UsageError
from fluxgrpo.models.tiny import build_tiny_flux_pipeline
from fluxgrpo.rewards.registry import reward_records
from fluxgrpo.weights.manifest import MANIFEST_NAME, Manifest, describe_files, write_manifest
from fluxgrpo.weights.tiny_writing import TINY_SOURCE, refuse_unless_tiny_or_empty, relative_files


def tiny_parts() -> tuple[str, ...]:
    """What --only can name for --source tiny: flux, then every reward weights part with a tiny writer (its record's
    ``write_tiny``), in registry order. A reward's parts are written together (hps and clip: the HPS checkpoint
    and the initial weights it was fine-tuned from)."""

    return ("flux", *(part.name for record in reward_records() if record.write_tiny for part in record.parts))


@dataclass(frozen=True)
class TinyWeightsSummary:
    """What ``write_tiny_weights`` wrote: the bytes of each part (manifests excluded), in ``tiny_parts()`` order."""

    flux_dir: Path
    hps_dir: Path
    seed: int
    part_bytes: dict[str, int]

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.part_bytes)


def write_tiny_flux(flux_dir: Path, seed: int = 0) -> int:
    """Write the tiny FLUX pipeline and its manifest; returns the bytes written (manifest excluded)."""

    flux_dir = Path(flux_dir)
    refuse_unless_tiny_or_empty(flux_dir, (MANIFEST_NAME,), None, "--flux-dir")
    if flux_dir.exists():
        shutil.rmtree(flux_dir)  # an earlier tiny folder: start clean so no stale file survives
    pipeline = build_tiny_flux_pipeline(seed)
    pipeline.save_pretrained(flux_dir)
    files = describe_files(flux_dir, relative_files(flux_dir, {MANIFEST_NAME}))
    write_manifest(flux_dir, Manifest(part="flux", source=TINY_SOURCE, files=files), MANIFEST_NAME)
    return sum(f.size for f in files)


def write_tiny_weights(
    flux_dir: Path, hps_dir: Path, seed: int = 0, parts: Sequence[str] | None = None
) -> TinyWeightsSummary:
    """Write tiny random FLUX (``flux_dir``) and reward (``hps_dir``) weights, offline, in the real layout.

    ``parts`` selects from ``tiny_parts()`` (default all; a reward's parts are written together). Afterwards the
    layout checks (``check_flux_dir``, each part's record check) report complete for what was written. The same seed
    gives the same weights. A folder holding non-tiny weights (another source's manifest, or files without one) is
    never overwritten: FluxgrpoError names the flag to change.
    """

    choices = tiny_parts()
    parts = choices if parts is None else parts
    unknown = [part for part in parts if part not in choices]
    if unknown or not parts:
        raise UsageError(
            f"{'unknown part ' + repr(unknown[0]) if unknown else 'no part selected'} for --source tiny: choose from "
            f"{', '.join(choices)} (--only)"
        )
    written: dict[str, int] = {}
    if "flux" in parts:
        written["flux"] = write_tiny_flux(Path(flux_dir), seed)
    for record in reward_records():
        owned = [part.name for part in record.parts]
        if record.write_tiny is not None and set(owned) & set(parts):
            written.update(record.write_tiny(Path(hps_dir), seed))
    return TinyWeightsSummary(
        Path(flux_dir), Path(hps_dir), seed, {part: written[part] for part in choices if part in written}
    )
