"""``manifest.json`` beside each weights part: where it came from and exactly which files make it complete.

Written last, after every file is in place, so a folder with a manifest is a folder that was finished;
``env-check``, ``train`` and ``sample`` read it to say "complete" or what is missing.

Format (stable keys)::

    {"format": 1, "part": "flux", "source": "tiny|hf|modelscope", "repo": "org/name" | null,
     "revision": "<commit or tag>" | null, "created": "<ISO time>",
     "files": [{"path": "transformer/config.json", "size": 123, "sha256": "<hex>" | null}, ...]}
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fluxgrpo.paths import write_atomic

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1


@dataclass(frozen=True)
class ManifestFile:
    path: str  # relative to the part's folder, forward slashes
    size: int
    sha256: str | None = None


@dataclass(frozen=True)
class Manifest:
    part: str
    source: str
    files: list[ManifestFile]
    repo: str | None = None
    revision: str | None = None
    created: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat())
    format: int = MANIFEST_FORMAT

    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def sha256_file(path: Path, chunk_bytes: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(root: Path, relpaths: Iterable[str], with_hash: bool = True) -> list[ManifestFile]:
    """ManifestFile entries for files already on disk under ``root``."""
    out = []
    for rel in sorted(relpaths):
        p = root / rel
        out.append(ManifestFile(rel, p.stat().st_size, sha256_file(p) if with_hash else None))
    return out


def write_manifest(root: Path, manifest: Manifest, name: str = MANIFEST_NAME) -> Path:
    """Write atomically (temp file + rename) so a crash never leaves a half-written manifest."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return write_atomic(root / name, json.dumps(asdict(manifest), indent=2) + "\n")


def read_manifest(root: Path, name: str = MANIFEST_NAME) -> Manifest | None:
    """The manifest in ``root``, or None when there is none or it cannot be parsed."""
    path = Path(root) / name
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        files = [ManifestFile(**f) for f in data.pop("files")]
        return Manifest(files=files, **data)
    except (ValueError, TypeError, KeyError):
        return None


def verify_manifest(root: Path, manifest: Manifest, check_hashes: bool = False) -> list[str]:
    """Problems with the files a manifest lists: missing, wrong size, or (optionally) wrong sha256."""
    problems = []
    root = Path(root)
    for entry in manifest.files:
        p = root / entry.path
        if not p.is_file():
            problems.append(f"missing {entry.path}")
            continue
        size = p.stat().st_size
        if size != entry.size:
            problems.append(f"{entry.path} is {size} bytes, expected {entry.size}")
            continue
        if check_hashes and entry.sha256 and sha256_file(p) != entry.sha256:
            problems.append(f"{entry.path} sha256 differs from the manifest")
    return problems
