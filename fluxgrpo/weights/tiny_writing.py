"""Writing tiny random weights safely, shared by every part's tiny writer (``rewards/tiny_weights.py`` for FLUX, each
reward's record for its own): never over real weights, an earlier tiny folder replaced whole, manifests last.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.weights.manifest import MANIFEST_NAME, Manifest, describe_files, read_manifest, write_manifest

TINY_SOURCE = "tiny"
SHAPES_SOURCE = "shapes"  # the shapes world's pretrained weights, shipped in the package (``shapes/shipped.py``)
# Sources written offline by fluxgrpo itself: each may replace the other's folder (never a hub's).
OFFLINE_SOURCES = (TINY_SOURCE, SHAPES_SOURCE)


def refuse_unless_tiny_or_empty(
    folder: Path, manifest_names: tuple[str, ...], own_files: tuple[str, ...] | None, flag: str, making: str = "tiny"
) -> None:
    """Never overwrite real weights with tiny (or shapes, ``making``) ones: only an empty folder or an earlier
    offline-written one (tiny or shapes) is replaced."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise FluxgrpoError(f"{folder} exists and is not a folder: choose another {flag}")
    for name in manifest_names:
        manifest = read_manifest(folder, name)
        if manifest is not None and manifest.source not in OFFLINE_SOURCES:
            raise FluxgrpoError(
                f"{folder} holds {manifest.source} weights ({name}); refusing to overwrite them with {making} ones: "
                f"choose another {flag}"
            )
    present = [p.name for p in folder.iterdir()]
    if own_files is not None:
        present = [name for name in present if name in own_files]
    has_offline_manifest = any(
        (m := read_manifest(folder, name)) is not None and m.source in OFFLINE_SOURCES for name in manifest_names
    )
    if present and not has_offline_manifest:
        raise FluxgrpoError(
            f"{folder} already holds weights placed without a manifest; refusing to overwrite them with {making} "
            f"ones: choose another {flag} (or delete the folder)"
        )


def relative_files(root: Path, exclude: set[str]) -> list[str]:
    return [p.relative_to(root).as_posix() for p in sorted(root.rglob("*")) if p.is_file() and p.name not in exclude]


def fresh_subfolders(*subs: Path) -> None:
    """Empty subfolders of a reward part to write into, refusing any that holds non-tiny weights."""
    for sub in subs:
        refuse_unless_tiny_or_empty(sub, (MANIFEST_NAME,), None, "--hps-dir")
    for sub in subs:
        if sub.exists():
            shutil.rmtree(sub)  # an earlier tiny folder: start clean so no stale file survives
        sub.mkdir(parents=True)


def write_subfolder_manifests(part: str, *subs: Path) -> int:
    """A tiny manifest in each subfolder, written last; the bytes they list."""
    total = 0
    for sub in subs:
        files = describe_files(sub, relative_files(sub, {MANIFEST_NAME}))
        write_manifest(sub, Manifest(part=part, source=TINY_SOURCE, files=files), MANIFEST_NAME)
        total += sum(f.size for f in files)
    return total
