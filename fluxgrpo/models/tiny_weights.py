"""``fetch-weights --source tiny``: tiny random, seeded FLUX and reward weights in exactly the real layout.

The FLUX part is a ``FluxPipeline.save_pretrained`` folder (what FLUX.1-dev's diffusers repo holds); the reward
part is saved the way the real files are: ``HPS_v2.1_compressed.pt`` is ``{"state_dict": ...}`` of a full open_clip
CLIP and ``open_clip_pytorch_model.bin`` is a plain open_clip state dict (LAION's initial weights, which HPS was
fine-tuned from, so here it is a different random draw). Only the tiny part also gets ``open_clip_config.json``,
the architecture (the real one is ViT-H-14). PickScore goes to ``<hps_dir>/pickscore``: ``model/`` is a
``CLIPModel.save_pretrained`` folder, ``processor/`` the CLIP tokenizer and image processor config, as the two hub
repos hold them. ImageReward (``<hps_dir>/imagereward``) and HPSv3 (``<hps_dir>/hpsv3``) are written in their
checkpoints' own key names beside the config and tokenizer files their hub repos hold. Manifests are written last,
so a part with a manifest is complete.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.weights.layout import (
    CLIP_MANIFEST,
    HPS_CHECKPOINT,
    HPS_MANIFEST,
    HPSV3_BASE_DIR,
    HPSV3_CHECKPOINT,
    HPSV3_MODEL_DIR,
    IMAGEREWARD_CHECKPOINT,
    IMAGEREWARD_MED_CONFIG,
    IMAGEREWARD_MODEL_DIR,
    IMAGEREWARD_TOKENIZER_DIR,
    IMAGEREWARD_VISION_ARCH_FILE,
    OPEN_CLIP_WEIGHTS,
    PICKSCORE_BPE_FILES,
    PICKSCORE_MODEL_DIR,
    PICKSCORE_PROCESSOR_DIR,
    REWARD_ARCH_FILE,
)
from fluxgrpo.weights.manifest import MANIFEST_NAME, Manifest, describe_files, read_manifest, write_manifest

TINY_SOURCE = "tiny"
_REWARD_FILES = (HPS_CHECKPOINT, OPEN_CLIP_WEIGHTS, REWARD_ARCH_FILE, HPS_MANIFEST, CLIP_MANIFEST)


def tiny_parts() -> tuple[str, ...]:
    """What --only can name for --source tiny: flux, then every reward weights part with a tiny writer (its record's
    ``write_tiny``), in registry order. A reward's parts are written together (hps and clip: the HPS checkpoint
    and the initial weights it was fine-tuned from)."""
    from fluxgrpo.rewards.registry import reward_records

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


def _refuse_unless_tiny_or_empty(
    folder: Path, manifest_names: tuple[str, ...], own_files: tuple[str, ...] | None, flag: str
) -> None:
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

    from fluxgrpo.rewards.tiny import TINY_REWARD_CONFIG, build_tiny_reward_model

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


def fresh_subfolders(*subs: Path) -> None:
    """Empty subfolders of a reward part to write into, refusing any that holds non-tiny weights."""
    for sub in subs:
        _refuse_unless_tiny_or_empty(sub, (MANIFEST_NAME,), None, "--hps-dir")
    for sub in subs:
        if sub.exists():
            shutil.rmtree(sub)  # an earlier tiny folder: start clean so no stale file survives
        sub.mkdir(parents=True)


def write_subfolder_manifests(part: str, *subs: Path) -> int:
    """A tiny manifest in each subfolder, written last; the bytes they list."""
    total = 0
    for sub in subs:
        files = describe_files(sub, _relative_files(sub, {MANIFEST_NAME}))
        write_manifest(sub, Manifest(part=part, source=TINY_SOURCE, files=files), MANIFEST_NAME)
        total += sum(f.size for f in files)
    return total


def write_tiny_pickscore(folder: Path, seed: int = 0) -> int:
    """Write a tiny PickScore (``model/`` + ``processor/``) into ``folder`` with a manifest in each; returns bytes.

    ``folder`` is normally ``pickscore_dir(hps_dir)``; afterwards ``check_pickscore_dir(folder)`` reports complete.
    """
    from transformers import CLIPImageProcessor

    from fluxgrpo.models.tiny import build_tiny_clip_tokenizer
    from fluxgrpo.rewards.tiny import PICKSCORE_PROCESSOR_CONFIG, build_tiny_pickscore_model

    folder = Path(folder)
    model_dir, processor_dir = folder / PICKSCORE_MODEL_DIR, folder / PICKSCORE_PROCESSOR_DIR
    fresh_subfolders(model_dir, processor_dir)
    build_tiny_pickscore_model(seed).save_pretrained(model_dir)
    tokenizer = build_tiny_clip_tokenizer()
    tokenizer.save_pretrained(processor_dir)
    # The hub repo also has the BPE pair (vocab.json + merges.txt), which transformers 5 no longer writes; the
    # tiny vocabulary has no merges, so the pair is the vocabulary and merges.txt's version line.
    (processor_dir / PICKSCORE_BPE_FILES[0]).write_text(json.dumps(tokenizer.get_vocab(), ensure_ascii=False) + "\n")
    (processor_dir / PICKSCORE_BPE_FILES[1]).write_text("#version: 0.2\n")
    CLIPImageProcessor(**PICKSCORE_PROCESSOR_CONFIG).save_pretrained(processor_dir)
    return write_subfolder_manifests("pickscore", model_dir, processor_dir)


def write_tiny_imagereward(folder: Path, seed: int = 0) -> int:
    """Write a tiny ImageReward (``model/``: ImageReward.pt in the authors' keys + med_config.json + the tiny vision
    shape; ``tokenizer/``: a WordPiece vocab.txt + tokenizer_config.json) with a manifest in each; returns bytes."""
    import torch

    from fluxgrpo.rewards.tiny import (
        TINY_IMAGEREWARD_VISION,
        build_tiny_imagereward_state,
        tiny_bert_vocab,
        tiny_imagereward_med_config,
    )

    folder = Path(folder)
    model_dir, tokenizer_dir = folder / IMAGEREWARD_MODEL_DIR, folder / IMAGEREWARD_TOKENIZER_DIR
    fresh_subfolders(model_dir, tokenizer_dir)
    torch.save(build_tiny_imagereward_state(seed), model_dir / IMAGEREWARD_CHECKPOINT)
    (model_dir / IMAGEREWARD_MED_CONFIG).write_text(json.dumps(tiny_imagereward_med_config(), indent=2) + "\n")
    (model_dir / IMAGEREWARD_VISION_ARCH_FILE).write_text(json.dumps(TINY_IMAGEREWARD_VISION, indent=2) + "\n")
    (tokenizer_dir / "vocab.txt").write_text("\n".join(tiny_bert_vocab()) + "\n")
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "model_max_length": 512}))
    return write_subfolder_manifests("imagereward", model_dir, tokenizer_dir)


def write_tiny_hpsv3(folder: Path, seed: int = 0) -> int:
    """Write a tiny HPSv3 (``model/``: HPSv3.safetensors in the authors' keys; ``base/``: a Qwen2-VL config.json in
    the real file's format and a Qwen2 tokenizer) with a manifest in each; returns bytes."""
    from safetensors.torch import save_file

    from fluxgrpo.rewards.tiny import build_tiny_hpsv3_state, build_tiny_qwen2_tokenizer, tiny_hpsv3_base_config

    folder = Path(folder)
    model_dir, base_dir = folder / HPSV3_MODEL_DIR, folder / HPSV3_BASE_DIR
    fresh_subfolders(model_dir, base_dir)
    tokenizer = build_tiny_qwen2_tokenizer()
    save_file(build_tiny_hpsv3_state(tokenizer, seed), model_dir / HPSV3_CHECKPOINT, metadata={"format": "pt"})
    tokenizer.save_pretrained(base_dir)
    (base_dir / "config.json").write_text(json.dumps(tiny_hpsv3_base_config(tokenizer), indent=2) + "\n")
    return write_subfolder_manifests("hpsv3", model_dir, base_dir)


def write_tiny_weights(
    flux_dir: Path, hps_dir: Path, seed: int = 0, parts: Sequence[str] | None = None
) -> TinyWeightsSummary:
    """Write tiny random FLUX (``flux_dir``) and reward (``hps_dir``) weights, offline, in the real layout.

    ``parts`` selects from ``tiny_parts()`` (default all; a reward's parts are written together). Afterwards the
    layout checks (``check_flux_dir``, each part's record check) report complete for what was written. The same seed
    gives the same weights. A folder holding non-tiny weights (another source's manifest, or files without one) is
    never overwritten: FluxgrpoError names the flag to change.
    """
    from fluxgrpo.rewards.registry import reward_records

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
