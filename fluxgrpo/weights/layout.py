"""Where each weights part lives and what makes it complete.

The layout is the real one (FLUX.1-dev's diffusers folders, the HPSv2 and open_clip files), so tiny and
real weights load through the same code. A part is *complete* when its manifest (written last by
``fetch-weights``) lists files that are all present with the right sizes; a folder placed by hand with no
manifest is checked for the required files only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.weights.config_guard import (
    flux_pipeline_problems,
    folder_config_problems,
    open_clip_architecture,
    read_config_document,
)
from fluxgrpo.weights.integrity import folder_safetensors_problems
from fluxgrpo.weights.manifest import read_manifest, verify_manifest

FLUX_COMPONENTS = ("scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "transformer", "vae")
HPS_CHECKPOINT = "HPS_v2.1_compressed.pt"
OPEN_CLIP_WEIGHTS = "open_clip_pytorch_model.bin"
# Written beside the tiny reward checkpoints only: the architecture of a non-ViT-H-14 open_clip model.
# Its absence means the real ViT-H-14.
REWARD_ARCH_FILE = "open_clip_config.json"
HPS_MANIFEST = "manifest.hps.json"
CLIP_MANIFEST = "manifest.clip.json"
# PickScore lives in its own folder inside the HPS folder, so `train --hps-dir` finds every reward in one place:
# <hps_dir>/pickscore/model     CLIPModel (config.json + weights) from yuvalkirstain/PickScore_v1
# <hps_dir>/pickscore/processor CLIP processor (preprocessor_config.json + tokenizer) from laion's CLIP-ViT-H-14
# Each subfolder is a plain Hugging Face folder (from_pretrained loads it) with its own manifest.json.
PICKSCORE_DIR = "pickscore"
PICKSCORE_MODEL_DIR = "model"
PICKSCORE_PROCESSOR_DIR = "processor"
PICKSCORE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # either one; the hub repo has both
# The CLIP tokenizer as tokenizers' single file, or as the BPE pair; the hub repo has both.
PICKSCORE_TOKENIZER_JSON = "tokenizer.json"
PICKSCORE_BPE_FILES = ("vocab.json", "merges.txt")

# ImageReward lives beside PickScore, in the same two-folder shape:
# <hps_dir>/imagereward/model      ImageReward.pt + med_config.json from THUDM/ImageReward
# <hps_dir>/imagereward/tokenizer  bert-base-uncased's tokenizer (what BLIP's init_tokenizer loads)
IMAGEREWARD_DIR = "imagereward"
IMAGEREWARD_MODEL_DIR = "model"
IMAGEREWARD_TOKENIZER_DIR = "tokenizer"
IMAGEREWARD_CHECKPOINT = "ImageReward.pt"
IMAGEREWARD_MED_CONFIG = "med_config.json"
IMAGEREWARD_TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json")
# Written beside the tiny ImageReward only: its vision tower's shape. Its absence means BLIP's ViT-L/16 at 224.
IMAGEREWARD_VISION_ARCH_FILE = "vision_config.json"

# HPSv3 lives beside them, in the same two-folder shape:
# <hps_dir>/hpsv3/model  HPSv3.safetensors from MizzenAI/HPSv3: the whole reward model (Qwen2-VL-7B fine-tuned, with
#                        the <|Reward|> token's embedding row and the rm_head), so the base model's weights are not needed
# <hps_dir>/hpsv3/base   Qwen2-VL-7B-Instruct's config.json and tokenizer: what the authors' code reads from the base
#                        repo besides its weights
HPSV3_DIR = "hpsv3"
HPSV3_MODEL_DIR = "model"
HPSV3_BASE_DIR = "base"
HPSV3_CHECKPOINT = "HPSv3.safetensors"
HPSV3_BASE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
_MODEL_COMPONENTS = ("text_encoder", "text_encoder_2", "transformer", "vae")


@dataclass
class PartStatus:
    """Whether one weights part is usable, and what to do if not."""

    name: str  # flux | hps | clip | pickscore
    path: str
    complete: bool
    source: str | None = None  # from the manifest: tiny | hf | modelscope; None when placed by hand
    problems: list[str] = field(default_factory=list)
    fix: str | None = None


def _has_weights(folder: Path) -> bool:
    return folder.is_dir() and any(p.name.endswith(_WEIGHT_SUFFIXES) for p in folder.iterdir())


def check_flux_dir(flux_dir: str | Path) -> PartStatus:
    """Check the FLUX diffusers folder: model_index.json, every component, and the manifest if present."""
    root = Path(flux_dir)
    fix = f"run `fluxgrpo fetch-weights --flux-dir {root}` (or --source tiny for a CPU trial)"
    status = PartStatus("flux", str(root), complete=False, fix=fix)
    if not root.is_dir():
        status.problems.append(f"weights not found in {root}")
        return status
    if not (root / "model_index.json").is_file():
        status.problems.append(f"{root}/model_index.json is missing (not a diffusers FLUX folder)")
    for comp in FLUX_COMPONENTS:
        sub = root / comp
        if not sub.is_dir():
            status.problems.append(f"component {comp}/ is missing")
        elif comp in _MODEL_COMPONENTS and not ((sub / "config.json").is_file() and _has_weights(sub)):
            status.problems.append(f"{comp}/ has no config.json or no weights file")
    status.problems.extend(flux_pipeline_problems(root, FLUX_COMPONENTS))
    manifest = read_manifest(root)
    if manifest is not None:
        status.source = manifest.source
        status.problems.extend(verify_manifest(root, manifest))
    else:  # placed by hand: no sizes to compare against, so read each shard's header instead
        for comp in _MODEL_COMPONENTS:
            status.problems.extend(folder_safetensors_problems(root / comp))
    status.complete = not status.problems
    if status.complete:
        status.fix = None
    return status


def check_reward_file(hps_dir: str | Path, filename: str, part: str, manifest_name: str) -> PartStatus:
    root = Path(hps_dir)
    only = {"hps": "hps", "clip": "clip"}[part]
    status = PartStatus(
        part,
        str(root / filename),
        complete=False,
        fix=f"run `fluxgrpo fetch-weights --only {only} --hps-dir {root}`",
    )
    path = root / filename
    if not path.is_file():
        status.problems.append(f"{path} not found")
        return status
    manifest = read_manifest(root, manifest_name)
    if manifest is not None:
        status.source = manifest.source
        status.problems.extend(verify_manifest(root, manifest))
    elif path.stat().st_size == 0:
        status.problems.append(f"{path} is empty")
    status.complete = not status.problems
    if status.complete:
        status.fix = None
    return status


def check_hps_dir(hps_dir: str | Path) -> list[PartStatus]:
    """Check the HPSv2 checkpoint and the open_clip ViT-H-14 weights in ``hps_dir``."""
    return [check_reward_file(hps_dir, HPS_CHECKPOINT, "hps", HPS_MANIFEST), check_clip_part(hps_dir)]


def check_clip_part(hps_dir: str | Path) -> PartStatus:
    """Check LAION's open_clip ViT-H-14 weights alone (what clipscore needs; HPSv2 needs the HPS file as well), and
    the architecture file beside tiny weights, which both read."""
    status = check_reward_file(hps_dir, OPEN_CLIP_WEIGHTS, "clip", CLIP_MANIFEST)
    problems = reward_architecture_problems(hps_dir)
    if problems:
        status.problems.extend(problems)
        status.complete = False
        status.fix = f"run `fluxgrpo fetch-weights --hps-dir {hps_dir}`"
    return status


def reward_architecture(hps_dir: str | Path) -> dict | None:
    """The open_clip architecture stored beside tiny reward weights (its numeric keys only: see
    ``config_guard.open_clip_architecture``), or None for the real ViT-H-14.

    Raises:
        FluxgrpoError: the file is unreadable, or holds anything but a plain ViT CLIP's numeric keys.
    """
    path = Path(hps_dir) / REWARD_ARCH_FILE
    if not path.is_file():
        return None
    document, problem = read_config_document(path)
    if problem is not None:
        raise FluxgrpoError(f"{problem}: re-run `fluxgrpo fetch-weights --hps-dir {hps_dir}`")
    return open_clip_architecture(path, document)


def reward_architecture_problems(hps_dir: str | Path) -> list[str]:
    """``reward_architecture``'s refusal as a problem line (none when the file is absent or fine)."""
    try:
        reward_architecture(hps_dir)
    except FluxgrpoError as exc:
        return [str(exc)]
    return []


def pickscore_dir(hps_dir: str | Path) -> Path:
    """Where the PickScore model and processor live for a given HPS folder: ``<hps_dir>/pickscore``."""
    return Path(hps_dir) / PICKSCORE_DIR


def check_pickscore_dir(folder: str | Path) -> PartStatus:
    """Check a PickScore folder (``pickscore_dir(hps_dir)``): the model and processor subfolders and their manifests.

    Complete when ``model/`` has config.json and a weights file and ``processor/`` has preprocessor_config.json,
    tokenizer_config.json and the tokenizer (tokenizer.json, or vocab.json + merges.txt), and each manifest present
    lists files that are all in place.
    """
    root = Path(folder)
    model, processor = root / PICKSCORE_MODEL_DIR, root / PICKSCORE_PROCESSOR_DIR
    status = PartStatus(
        "pickscore",
        str(root),
        complete=False,
        fix=f"run `fluxgrpo fetch-weights --only pickscore --hps-dir {root.parent}` (or --source tiny for a CPU trial)",
    )
    if not root.is_dir():
        status.problems.append(f"PickScore weights not found in {root}")
        return status
    if not (model / "config.json").is_file():
        status.problems.append(f"{model}/config.json is missing")
    if not any((model / name).is_file() for name in PICKSCORE_WEIGHTS):
        status.problems.append(f"{model} has no {' or '.join(PICKSCORE_WEIGHTS)}")
    for name in ("preprocessor_config.json", "tokenizer_config.json"):
        if not (processor / name).is_file():
            status.problems.append(f"{processor}/{name} is missing")
    has_bpe = all((processor / name).is_file() for name in PICKSCORE_BPE_FILES)
    if not (processor / PICKSCORE_TOKENIZER_JSON).is_file() and not has_bpe:
        status.problems.append(f"{processor} has no {PICKSCORE_TOKENIZER_JSON} (nor {' + '.join(PICKSCORE_BPE_FILES)})")
    sources = []
    for sub in (model, processor):
        status.problems.extend(folder_config_problems(sub))
        manifest = read_manifest(sub)
        if manifest is not None:
            sources.append(manifest.source)
            status.problems.extend(f"{sub.name}/: {problem}" for problem in verify_manifest(sub, manifest))
    if sources:
        status.source = "+".join(dict.fromkeys(sources))  # "hf", or e.g. "modelscope+hf" when mixed
    status.complete = not status.problems
    if status.complete:
        status.fix = None
    return status


def imagereward_dir(hps_dir: str | Path) -> Path:
    """Where ImageReward's model and tokenizer live for a given HPS folder: ``<hps_dir>/imagereward``."""
    return Path(hps_dir) / IMAGEREWARD_DIR


def check_imagereward_dir(folder: str | Path) -> PartStatus:
    """Check an ImageReward folder (``imagereward_dir(hps_dir)``): ``model/`` has ImageReward.pt and med_config.json,
    ``tokenizer/`` has vocab.txt and tokenizer_config.json, and each manifest present lists files all in place."""
    return check_subfolders_part(
        "imagereward",
        "ImageReward",
        Path(folder),
        {
            IMAGEREWARD_MODEL_DIR: (IMAGEREWARD_CHECKPOINT, IMAGEREWARD_MED_CONFIG),
            IMAGEREWARD_TOKENIZER_DIR: IMAGEREWARD_TOKENIZER_FILES,
        },
    )


def hpsv3_dir(hps_dir: str | Path) -> Path:
    """Where HPSv3's model and its base model's config and tokenizer live for a given HPS folder: ``<hps_dir>/hpsv3``."""
    return Path(hps_dir) / HPSV3_DIR


def check_hpsv3_dir(folder: str | Path) -> PartStatus:
    """Check an HPSv3 folder (``hpsv3_dir(hps_dir)``): ``model/`` has HPSv3.safetensors, ``base/`` has Qwen2-VL's
    config.json, tokenizer.json and tokenizer_config.json, and each manifest present lists files all in place
    (without a manifest, the checkpoint's safetensors header is read instead)."""
    root = Path(folder)
    status = check_subfolders_part(
        "hpsv3", "HPSv3", root, {HPSV3_MODEL_DIR: (HPSV3_CHECKPOINT,), HPSV3_BASE_DIR: HPSV3_BASE_FILES}
    )
    model = root / HPSV3_MODEL_DIR
    if (model / HPSV3_CHECKPOINT).is_file() and read_manifest(model) is None:
        status.problems.extend(folder_safetensors_problems(model))
        status.complete = not status.problems
        status.fix = None if status.complete else _fetch_fix("hpsv3", root)
    return status


def _fetch_fix(part: str, folder: Path) -> str:
    return f"run `fluxgrpo fetch-weights --only {part} --hps-dir {folder.parent}` (or --source tiny for a CPU trial)"


def check_subfolders_part(part: str, title: str, root: Path, required: dict[str, tuple[str, ...]]) -> PartStatus:
    """A reward kept as subfolders of ``root``, each with its required files and (when fetched) its own manifest."""
    status = PartStatus(part, str(root), complete=False, fix=_fetch_fix(part, root))
    if not root.is_dir():
        status.problems.append(f"{title} weights not found in {root}")
        return status
    for sub_name, names in required.items():
        sub = root / sub_name
        status.problems.extend(f"{sub}/{name} is missing" for name in names if not (sub / name).is_file())
    sources = []
    for sub_name in required:
        sub = root / sub_name
        status.problems.extend(folder_config_problems(sub))
        manifest = read_manifest(sub)
        if manifest is not None:
            sources.append(manifest.source)
            status.problems.extend(f"{sub.name}/: {problem}" for problem in verify_manifest(sub, manifest))
    if sources:
        status.source = "+".join(dict.fromkeys(sources))
    status.complete = not status.problems
    if status.complete:
        status.fix = None
    return status
