"""What ``fetch-weights`` takes from which repository: each part's repos on both hubs, its allow-list, and where its
files go in the standard layout (``layout.py``). ``hub.py`` plans, downloads and verifies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fluxgrpo.errors import UsageError
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


_CLIP_REPO = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
_CLIP_MIRROR_REPO = "AI-ModelScope/CLIP-ViT-H-14-laion2B-s32B-b79K"

HUB_PARTS: dict[str, HubPart] = {
    part.name: part
    for part in (
        HubPart(
            "flux",
            {"hf": ("black-forest-labs/FLUX.1-dev",), "modelscope": ("black-forest-labs/FLUX.1-dev",)},
            allow=("model_index.json", *(f"{component}/*" for component in FLUX_COMPONENTS)),
            root="flux",
            manifest_name=MANIFEST_NAME,
        ),
        HubPart(
            "hps",
            {"hf": ("xswu/HPSv2",), "modelscope": ("AI-ModelScope/HPSv2",)},
            allow=(HPS_CHECKPOINT,),
            root="hps",
            manifest_name=HPS_MANIFEST,
            # The tiny reward's architecture file would make the loader build the tiny model around real weights.
            replaces=(REWARD_ARCH_FILE,),
        ),
        HubPart(
            "clip",
            # ModelScope's copy under the laion id has only one source; AI-ModelScope's is the known fallback.
            {"hf": (_CLIP_REPO,), "modelscope": (_CLIP_REPO, _CLIP_MIRROR_REPO)},
            allow=(OPEN_CLIP_WEIGHTS,),
            root="hps",
            manifest_name=CLIP_MANIFEST,
        ),
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
            # PickScore was trained with laion's CLIP-H processor; the AI-ModelScope copy is the one DiffSynth-Studio
            # loads it from, the laion id on ModelScope is the fallback.
            {"hf": (_CLIP_REPO,), "modelscope": (_CLIP_MIRROR_REPO, _CLIP_REPO)},
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
        HubPart(
            "imagereward-model",
            # No ModelScope copy of THUDM/ImageReward was found (DiffSynth-Studio's QualityMetric repo holds a
            # safetensors conversion in another layout), so this part is Hugging Face only.
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
        HubPart(
            "hpsv3-model",
            # The authors' inference code downloads HPSv3.safetensors from MizzenAI/HPSv3 on Hugging Face; DiffSynth-Studio
            # and VideoX-Fun point at the same id on ModelScope.
            {"hf": ("MizzenAI/HPSv3",), "modelscope": ("MizzenAI/HPSv3",)},
            allow=(HPSV3_CHECKPOINT,),
            root="hps",
            manifest_name=MANIFEST_NAME,
            subdir=f"{HPSV3_DIR}/{HPSV3_MODEL_DIR}",
        ),
        HubPart(
            "hpsv3-base",
            # Only the config and tokenizer of the base model: HPSv3.safetensors holds every weight (16 GB saved).
            {"hf": ("Qwen/Qwen2-VL-7B-Instruct",), "modelscope": ("Qwen/Qwen2-VL-7B-Instruct",)},
            allow=HPSV3_BASE_FILES,
            root="hps",
            manifest_name=MANIFEST_NAME,
            subdir=f"{HPSV3_DIR}/{HPSV3_BASE_DIR}",
        ),
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
}

# Names --only accepts besides the parts themselves: one name for parts that are only useful together.
PART_GROUPS: dict[str, tuple[str, ...]] = {
    "pickscore": ("pickscore-model", "pickscore-processor"),
    "imagereward": ("imagereward-model", "imagereward-tokenizer"),
    "hpsv3": ("hpsv3-model", "hpsv3-base"),
}
# What a plain `fetch-weights` fetches: everything training with the default reward (HPSv2.1) needs.
DEFAULT_PARTS: tuple[str, ...] = ("flux", "hps", "clip")
PART_CHOICES: tuple[str, ...] = (*DEFAULT_PARTS, *PART_GROUPS, *(p for p in HUB_PARTS if p not in DEFAULT_PARTS))


def expand_parts(names: Sequence[str]) -> list[str]:
    """Part names with each group (``pickscore``) replaced by its parts, in HUB_PARTS order, without repeats.

    Raises UsageError naming --only for an unknown name or an empty selection.
    """
    unknown = [name for name in names if name not in HUB_PARTS and name not in PART_GROUPS]
    if unknown:
        raise UsageError(f"unknown part {unknown[0]!r}: choose from {', '.join(PART_CHOICES)} (--only)")
    wanted = {part for name in names for part in PART_GROUPS.get(name, (name,))}
    if not wanted:
        raise UsageError(f"no part selected: choose from {', '.join(PART_CHOICES)} (--only)")
    return [name for name in HUB_PARTS if name in wanted]
