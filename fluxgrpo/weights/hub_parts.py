"""What ``fetch-weights`` takes from which repository: each part's repos on both hubs, its allow-list, and where its
files go in the standard layout (``layout.py``). Every part is here: FLUX's, the rewards' (each reward's record in
``rewards/registry.py`` names its own from ``REWARD_HUB_PARTS``) and the benchmark prompt sets. ``hub.py`` plans,
downloads and verifies them.
"""

from __future__ import annotations

from collections.abc import Sequence

from fluxgrpo.errors import UsageError
from fluxgrpo.weights.hub_part import CLIP_MIRROR_REPO, CLIP_REPO, HubPart
from fluxgrpo.weights.layout import (
    CLIP_MANIFEST,
    FLUX_COMPONENTS,
    HPS_CHECKPOINT,
    HPS_MANIFEST,
    HPSV3_BASE_DIR,
    HPSV3_BASE_FILES,
    HPSV3_CHECKPOINT,
    HPSV3_DIR,
    HPSV3_MODEL_DIR,
    IMAGEREWARD_CHECKPOINT,
    IMAGEREWARD_DIR,
    IMAGEREWARD_MED_CONFIG,
    IMAGEREWARD_MODEL_DIR,
    IMAGEREWARD_TOKENIZER_DIR,
    IMAGEREWARD_TOKENIZER_FILES,
    IMAGEREWARD_VISION_ARCH_FILE,
    OPEN_CLIP_WEIGHTS,
    PICKSCORE_BPE_FILES,
    PICKSCORE_DIR,
    PICKSCORE_MODEL_DIR,
    PICKSCORE_PROCESSOR_DIR,
    PICKSCORE_TOKENIZER_JSON,
    PICKSCORE_WEIGHTS,
    REWARD_ARCH_FILE,
)
from fluxgrpo.weights.manifest import MANIFEST_NAME

FLUX_PART = HubPart(
    "flux",
    {"hf": ("black-forest-labs/FLUX.1-dev",), "modelscope": ("black-forest-labs/FLUX.1-dev",)},
    allow=("model_index.json", *(f"{component}/*" for component in FLUX_COMPONENTS)),
    root="flux",
    manifest_name=MANIFEST_NAME,
)
# The rewards' parts, by the name of the weights part that owns them (``rewards/registry.py``: its ``WeightsPart``),
# in registry order; a part kept in several repositories is fetched under that name as a group. Kept here, below
# the rewards, so this layer needs nothing from ``rewards/``.
REWARD_HUB_PARTS: dict[str, tuple[HubPart, ...]] = {
    "hps": (  # hpsv2
        HubPart(
            "hps",
            {"hf": ("xswu/HPSv2",), "modelscope": ("AI-ModelScope/HPSv2",)},
            allow=(HPS_CHECKPOINT,),
            root="hps",
            manifest_name=HPS_MANIFEST,
            # The tiny reward's architecture file would make the loader build the tiny model around real
            # weights.
            replaces=(REWARD_ARCH_FILE,),
        ),
    ),
    "clip": (  # hpsv2
        HubPart(
            "clip",
            # ModelScope's copy under the laion id has only one source; AI-ModelScope's is the known fallback.
            {"hf": (CLIP_REPO,), "modelscope": (CLIP_REPO, CLIP_MIRROR_REPO)},
            allow=(OPEN_CLIP_WEIGHTS,),
            root="hps",
            manifest_name=CLIP_MANIFEST,
        ),
    ),
    "pickscore": (  # pickscore
        HubPart(
            "pickscore-model",
            # AI-ModelScope/PickScore_v1 is the copy DiffSynth-Studio's PickScore metric downloads.
            {"hf": ("yuvalkirstain/PickScore_v1",), "modelscope": ("AI-ModelScope/PickScore_v1",)},
            allow=("config.json", PICKSCORE_WEIGHTS),
            root="hps",
            manifest_name=MANIFEST_NAME,
            subdir=f"{PICKSCORE_DIR}/{PICKSCORE_MODEL_DIR}",
        ),
        HubPart(
            "pickscore-processor",
            # PickScore was trained with laion's CLIP-H processor; the AI-ModelScope copy is the one
            # DiffSynth-Studio loads it from, the laion id on ModelScope is the fallback.
            {"hf": (CLIP_REPO,), "modelscope": (CLIP_MIRROR_REPO, CLIP_REPO)},
            # The tokenizer in either form is required; whichever other files of it the repo has come along.
            allow=(
                "preprocessor_config.json",
                "tokenizer_config.json",
                (PICKSCORE_TOKENIZER_JSON, PICKSCORE_BPE_FILES[0]),
            ),
            optional=(PICKSCORE_TOKENIZER_JSON, *PICKSCORE_BPE_FILES, "special_tokens_map.json"),
            root="hps",
            manifest_name=MANIFEST_NAME,
            subdir=f"{PICKSCORE_DIR}/{PICKSCORE_PROCESSOR_DIR}",
        ),
    ),
    "imagereward": (  # imagereward
        HubPart(
            "imagereward-model",
            # No ModelScope copy of THUDM/ImageReward was found (DiffSynth-Studio's QualityMetric repo holds
            # a safetensors conversion in another layout), so this part is Hugging Face only.
            {"hf": ("THUDM/ImageReward",), "modelscope": ()},
            allow=(IMAGEREWARD_CHECKPOINT, IMAGEREWARD_MED_CONFIG),
            root="hps",
            manifest_name=MANIFEST_NAME,
            subdir=f"{IMAGEREWARD_DIR}/{IMAGEREWARD_MODEL_DIR}",
            replaces=(IMAGEREWARD_VISION_ARCH_FILE,),  # the tiny vision shape would misbuild the real ViT-L
        ),
        HubPart(
            "imagereward-tokenizer",
            # What BLIP's init_tokenizer loads ('bert-base-uncased'); a ModelScope copy was not verified.
            {"hf": ("google-bert/bert-base-uncased",), "modelscope": ()},
            allow=IMAGEREWARD_TOKENIZER_FILES,
            root="hps",
            manifest_name=MANIFEST_NAME,
            subdir=f"{IMAGEREWARD_DIR}/{IMAGEREWARD_TOKENIZER_DIR}",
        ),
    ),
    "hpsv3": (  # hpsv3
        HubPart(
            "hpsv3-model",
            # The authors' inference code downloads HPSv3.safetensors from MizzenAI/HPSv3 on Hugging Face;
            # DiffSynth-Studio and VideoX-Fun point at the same id on ModelScope.
            {"hf": ("MizzenAI/HPSv3",), "modelscope": ("MizzenAI/HPSv3",)},
            allow=(HPSV3_CHECKPOINT,),
            root="hps",
            manifest_name=MANIFEST_NAME,
            subdir=f"{HPSV3_DIR}/{HPSV3_MODEL_DIR}",
        ),
        HubPart(
            "hpsv3-base",
            # Only the config and tokenizer of the base model: HPSv3.safetensors holds every weight (16 GB
            # saved).
            {"hf": ("Qwen/Qwen2-VL-7B-Instruct",), "modelscope": ("Qwen/Qwen2-VL-7B-Instruct",)},
            allow=HPSV3_BASE_FILES,
            root="hps",
            manifest_name=MANIFEST_NAME,
            subdir=f"{HPSV3_DIR}/{HPSV3_BASE_DIR}",
        ),
    ),
}
# Benchmark prompt sets (``data/benchmarks.py``, `train --eval-prompts NAME`), fetched into --prompts-dir.
PROMPT_PARTS = (
    HubPart(
        "hpdv2-prompts",
        # HPSv2's authors' dataset repo (Apache-2.0): test.json, the 400 test prompts of HPDv2 with their images'
        # paths and human rankings. No ModelScope copy was verified, so this part is Hugging Face only.
        {"hf": ("zhwang/HPDv2",), "modelscope": ()},
        allow=("test.json",),
        root="prompts",
        manifest_name=MANIFEST_NAME,
        subdir="hpdv2",
        repo_type="dataset",
    ),
)
# What a plain `fetch-weights` fetches: everything training with the default reward (HPSv2.1) needs.
DEFAULT_PARTS: tuple[str, ...] = ("flux", "hps", "clip")


def hub_parts() -> dict[str, HubPart]:
    """Every downloadable part by name: FLUX, then each reward's (``REWARD_HUB_PARTS``), in registry order."""
    rewards = {hub.name: hub for group in REWARD_HUB_PARTS.values() for hub in group}
    return {FLUX_PART.name: FLUX_PART, **rewards, **{part.name: part for part in PROMPT_PARTS}}


def part_groups() -> dict[str, tuple[str, ...]]:
    """Names --only accepts besides the parts themselves: a reward part kept in several repos names them all."""
    groups = {name: tuple(hub.name for hub in group) for name, group in REWARD_HUB_PARTS.items()}
    return {name: members for name, members in groups.items() if members != (name,)}


def part_choices() -> tuple[str, ...]:
    """What --only accepts, in the order its errors list them."""
    groups = part_groups()
    return (*DEFAULT_PARTS, *groups, *(p for p in hub_parts() if p not in DEFAULT_PARTS))


def expand_parts(names: Sequence[str]) -> list[str]:
    """Part names with each group (``pickscore``) replaced by its parts, in ``hub_parts()`` order, without repeats.

    Raises UsageError naming --only for an unknown name or an empty selection.
    """
    parts, groups = hub_parts(), part_groups()
    unknown = [name for name in names if name not in parts and name not in groups]
    if unknown:
        raise UsageError(f"unknown part {unknown[0]!r}: choose from {', '.join(part_choices())} (--only)")
    wanted = {part for name in names for part in groups.get(name, (name,))}
    if not wanted:
        raise UsageError(f"no part selected: choose from {', '.join(part_choices())} (--only)")
    return [name for name in parts if name in wanted]
