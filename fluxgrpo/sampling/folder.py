"""A sample folder: the files it may hold, the contact sheet, and ``index.json`` (written last, atomically,
and read back with every entry checked)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from fluxgrpo import __version__
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.paths import ensure_writable_dir, write_atomic
from fluxgrpo.run_folder import (
    INDEX_FILE,  # a sample folder's index, and each evaluation's in a run folder
    enclosing_run,
)
from fluxgrpo.sampling.request import SampledImage, SampleRequest, SampleSettings

GRID_FILE = "grid.png"
INDEX_FORMAT = "fluxgrpo-sample-index"
INDEX_FORMAT_VERSION = 1
SEED_FORMULA = (
    'int.from_bytes(hashlib.sha256(f"fluxgrpo-sample:{seed}:{prompt_index}:{image_index}".encode()).digest()[:8], '
    '"big") & (2**63 - 1)'
)

# Contact sheet: tiles at most 256 px on their long side, shrunk so the sheet stays near 4096 px, never under 16 px.
GRID_TILE_MAX = 256
GRID_TILE_MIN = 16
GRID_TARGET_SIDE = 4096
GRID_GAP = 2
GRID_CAPTION = 14  # px above each row: its prompt, in PIL's default font (cut with "…" to the sheet's width)
GRID_MIN_WIDTH = 320  # a sheet of a few small tiles still has room for its captions

_OWN_FILE = re.compile(r"^(\d+_\d+\.png|index\.json|grid\.png|\..+\.tmp)$")


def check_output_dir(out_dir: str | Path) -> Path:
    """``out_dir`` exists (created), is writable, and holds nothing but an earlier sample run's files."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FluxgrpoError(f"--out {out} is a file: pass a folder")
    ensure_writable_dir(out, "images", "--out")
    foreign = sorted(p.name for p in out.iterdir() if not _OWN_FILE.match(p.name))
    if foreign:
        raise FluxgrpoError(
            f"--out {out} holds files `fluxgrpo sample` did not write (e.g. {foreign[0]}): pass an empty or new "
            "folder with --out"
        )
    return out


def check_not_inside_a_run(out: Path, overwrite: bool) -> None:
    """A training run's folders (its eval/iteration-<k>/ above all) are its record: ``--out`` there only with
    ``--overwrite``, which moves what is there aside (``run_folder.move_aside``) instead of replacing it."""

    run = enclosing_run(out)
    if run is not None and not overwrite:
        raise UsageError(
            f"--out {out} is inside the training run {run}, whose evaluations and checkpoints `sample` must not "
            f"replace: pass another --out, or add --overwrite to move what is there to {out.name}.replaced-<UTC "
            "time> first"
        )


def clear_previous_run(out: Path) -> int:
    """Delete an earlier run's index (first, so the folder stops looking complete), images, grid and temp files."""
    index = out / INDEX_FILE
    removed = int(index.is_file())
    index.unlink(missing_ok=True)
    for path in out.iterdir():
        if _OWN_FILE.match(path.name) and path.is_file():
            path.unlink()
            removed += 1
    return removed


def grid_tile_size(rows: int, cols: int, height: int, width: int) -> tuple[int, int]:
    """(width, height) of one contact-sheet tile: the image, scaled down (never up, aspect kept) so its long side
    is at most 256 px and the sheet's long side stays near 4096 px, but not under 16 px."""
    longest = max(GRID_TILE_MIN, min(GRID_TILE_MAX, GRID_TARGET_SIDE // max(rows, cols, 1)))
    scale = min(1.0, longest / max(height, width))
    return max(1, round(width * scale)), max(1, round(height * scale))


def grid_tile_origin(prompt_index: int, image_index: int, tile: tuple[int, int]) -> tuple[int, int]:
    """(left, top) of image ``image_index`` of prompt ``prompt_index`` on the sheet: rows of a caption band (the
    prompt) over the tiles, with ``GRID_GAP`` between them."""
    tile_w, tile_h = tile
    row = GRID_CAPTION + tile_h + GRID_GAP
    return GRID_GAP + image_index * (tile_w + GRID_GAP), GRID_GAP + prompt_index * row + GRID_CAPTION


def _caption(text: str, width: int, measure: Any) -> str:
    """``text`` cut (with "…") to ``width`` pixels as ``measure`` sizes it."""
    if measure(text) <= width:
        return text
    while text and measure(text + "…") > width:
        text = text[:-1]
    return text.rstrip() + "…"


def write_grid(out: Path, images: list[SampledImage], num_prompts: int, settings: SampleSettings) -> Path:
    """``grid.png``: row i, under its prompt as caption ("i: prompt"), column j holds image j of prompt i,
    downscaled to the tile size."""

    cols = settings.images_per_prompt
    tile_w, tile_h = grid_tile_size(num_prompts, cols, settings.height, settings.width)
    width = max(cols * (tile_w + GRID_GAP) + GRID_GAP, GRID_MIN_WIDTH)
    sheet = Image.new("RGB", (width, num_prompts * (GRID_CAPTION + tile_h + GRID_GAP) + GRID_GAP), (255, 255, 255))
    draw, font = ImageDraw.Draw(sheet), ImageFont.load_default()
    captions: dict[int, str] = {}
    for record in images:
        captions.setdefault(record.prompt_index, record.prompt)
        with Image.open(out / record.file) as source:
            tile = source.convert("RGB")
        if tile.size != (tile_w, tile_h):
            tile = tile.resize((tile_w, tile_h), Image.Resampling.LANCZOS)
        sheet.paste(tile, grid_tile_origin(record.prompt_index, record.image_index, (tile_w, tile_h)))
    for index, prompt in captions.items():
        if index < num_prompts:
            top = grid_tile_origin(index, 0, (tile_w, tile_h))[1] - GRID_CAPTION
            line = _caption(f"{index}: {prompt}", width - 2 * GRID_GAP, lambda t: draw.textlength(t, font=font))
            draw.text((GRID_GAP, top + 1), line, fill=(40, 40, 40), font=font)
    return write_atomic(out / GRID_FILE, lambda f: sheet.save(f, format="PNG"))


def write_index(
    out: Path,
    request: SampleRequest,
    images: list[SampledImage],
    run: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``index.json`` atomically (temp file, fsync, rename): the marker of a complete run.

    Keys: format, format_version, fluxgrpo_version, model, checkpoint, ema, settings (the SampleSettings plus
    ``run``: world_size, device_type, dtype), seed_formula, prompts, grid, images (file, prompt, prompt_index,
    image_index, seed; ordered by prompt_index then image_index), then any ``extra`` keys (the in-training
    evaluation adds its iteration and scores).
    """
    document = {
        "format": INDEX_FORMAT,
        "format_version": INDEX_FORMAT_VERSION,
        "fluxgrpo_version": __version__,
        "model": request.model,
        "checkpoint": request.checkpoint,
        "ema": request.ema,
        "settings": {**asdict(request.settings), **run},
        "seed_formula": SEED_FORMULA,
        "prompts": request.prompts,
        "grid": GRID_FILE,
        "images": [asdict(record) for record in images],
        **(extra or {}),
    }
    return write_atomic(out / INDEX_FILE, json.dumps(document, indent=2, ensure_ascii=False) + "\n", durable=True)


@dataclass(frozen=True)
class SampleIndex:
    """A complete sample run read back from its ``index.json``, every listed file checked to exist."""

    path: Path  # the index.json
    root: Path  # its folder; image files are relative to it
    model: str
    checkpoint: str | None
    ema: bool
    settings: dict[str, Any]
    prompts: list[str]
    images: list[SampledImage] = field(default_factory=list)

    def image_path(self, image: SampledImage) -> Path:
        return self.root / image.file


def _inside(root: Path, name: str) -> bool:
    """``name`` is a relative path that stays inside ``root`` (no ``..``, not absolute, no link out of it)."""
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or not name:
        return False
    return (root / relative).resolve().is_relative_to(root.resolve())


def read_index(path: str | Path) -> SampleIndex:
    """Read and check a ``fluxgrpo sample`` index (``index.json``, or the folder holding it).

    Raises:
        FluxgrpoError: the file is missing or unreadable, is not a fluxgrpo sample index, an entry lacks its
            prompt or other fields, or a listed image is no longer beside it (the folder was moved in parts).
    """
    path = Path(path)
    if path.is_dir():
        path = path / INDEX_FILE
    fix = "pass the index.json that `fluxgrpo sample` wrote (or its --out folder)"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FluxgrpoError(f"{path} not found (an unfinished `fluxgrpo sample` run has none): {fix}") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FluxgrpoError(f"cannot read {path} ({exc}): {fix}") from None
    if not isinstance(document, dict) or document.get("format") != INDEX_FORMAT:
        raise FluxgrpoError(f'{path} is not a fluxgrpo sample index (no "format": "{INDEX_FORMAT}"): {fix}')
    version = document.get("format_version")
    if version != INDEX_FORMAT_VERSION:
        raise FluxgrpoError(
            f"{path} has index format version {version}; this fluxgrpo reads version {INDEX_FORMAT_VERSION}: "
            "re-run `fluxgrpo sample` with this version"
        )
    prompts = document.get("prompts")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise FluxgrpoError(f"{path} has no prompt list: {fix}")
    root = path.parent
    images = []
    listed: dict[str, int] = {}
    positions: dict[tuple[int, int], int] = {}
    for position, entry in enumerate(document.get("images") or []):
        try:
            record = SampledImage(
                file=str(entry["file"]),
                prompt=entry["prompt"],
                prompt_index=int(entry["prompt_index"]),
                image_index=int(entry["image_index"]),
                seed=int(entry["seed"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
            raise FluxgrpoError(f"{path}: image entry {position} is malformed ({what}): {fix}") from None
        if not 0 <= record.prompt_index < len(prompts) or record.prompt != prompts[record.prompt_index]:
            raise FluxgrpoError(
                f"{path}: image {record.file} has no prompt (prompt_index {record.prompt_index} does not name its "
                f"prompt in the prompt list): {fix}"
            )
        if not _inside(root, record.file):
            raise FluxgrpoError(
                f"{path}: image entry {position} names {record.file}, outside the index's folder {root} (an index "
                f"lists only the images beside it): {fix}"
            )
        earlier = listed.get(record.file, positions.get((record.prompt_index, record.image_index)))
        if earlier is not None:
            raise FluxgrpoError(
                f"{path}: image entry {position} ({record.file}, prompt {record.prompt_index} image "
                f"{record.image_index}) repeats entry {earlier}; every image is listed once: {fix}"
            )
        listed[record.file] = position
        positions[(record.prompt_index, record.image_index)] = position
        if not (root / record.file).is_file():
            raise FluxgrpoError(
                f"{path} lists {record.file}, which is not in {root} (were the images moved without their "
                "index?): keep index.json in the folder with its images"
            )
        images.append(record)
    if not images:
        raise FluxgrpoError(f"{path} lists no images: {fix}")
    return SampleIndex(
        path=path,
        root=root,
        model=str(document.get("model")),
        checkpoint=document.get("checkpoint"),
        ema=bool(document.get("ema")),
        settings=dict(document.get("settings") or {}),
        prompts=list(prompts),
        images=images,
    )
