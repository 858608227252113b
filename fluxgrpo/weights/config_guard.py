"""No config file in a weights folder can make fluxgrpo import code.

The libraries we load weights with resolve names written in their config files: transformers' ``auto_map`` imports
a Python file from the folder (under ``trust_remote_code``), diffusers' ``model_index.json`` names a library and
class per component, and an open_clip model config can name a Hugging Face tokenizer or model with keyword arguments
of its own (``trust_remote_code`` among them). Whoever can write a weights folder could so make ``train`` or
``score`` run their code. Three rules close that:

- ``open_clip_architecture``: an open_clip config is reduced to the known numeric architecture keys; anything else
  (a tokenizer, a model name, keyword arguments) is refused. The tokenizer is always open_clip's bundled one.
- ``flux_pipeline_problems``: every component ``model_index.json`` names must be the class FLUX uses.
- ``folder_config_problems``: no config file a library reads (config.json, tokenizer_config.json, ...) may hold a
  key that names code or a loader (``auto_map``, ``trust_remote_code``, ``quantization_config``, ...).

Each returns one-line problems (or raises FluxgrpoError) naming the file, and ``trust_remote_code`` is passed as
False to every loader that takes it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fluxgrpo.errors import FluxgrpoError

# The config files transformers, diffusers and our own loaders read from a weights folder (tokenizer.json and
# vocab.json are token tables read by the Rust tokenizers library, and name nothing).
CONFIG_FILE_NAMES = frozenset(
    {
        "config.json",
        "model_index.json",
        "scheduler_config.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "preprocessor_config.json",
        "processor_config.json",
        "image_processor_config.json",
        "generation_config.json",
        "chat_template.json",
        "med_config.json",
        "vision_config.json",
        "open_clip_config.json",
    }
)
# Keys that make a library import code, fetch a model or pick an implementation by name.
CODE_NAMING_KEYS = frozenset(
    {
        "auto_map",
        "trust_remote_code",
        "custom_pipeline",
        "quantization_config",
        "attn_implementation",
        "_attn_implementation",
        "hf_tokenizer_name",
        "hf_model_name",
        "tokenizer_kwargs",
        "timm_model_name",
        "custom_text",
    }
)
# model_index.json: the (library, class) FLUX.1-dev names for each component. Tokenizers come slow or fast.
FLUX_PIPELINE_CLASSES: dict[str, frozenset[tuple[str, str]]] = {
    "scheduler": frozenset({("diffusers", "FlowMatchEulerDiscreteScheduler")}),
    "text_encoder": frozenset({("transformers", "CLIPTextModel")}),
    "text_encoder_2": frozenset({("transformers", "T5EncoderModel")}),
    "tokenizer": frozenset({("transformers", "CLIPTokenizer"), ("transformers", "CLIPTokenizerFast")}),
    "tokenizer_2": frozenset({("transformers", "T5Tokenizer"), ("transformers", "T5TokenizerFast")}),
    "transformer": frozenset({("diffusers", "FluxTransformer2DModel")}),
    "vae": frozenset({("diffusers", "AutoencoderKL")}),
}
FLUX_PIPELINE_CLASS = "FluxPipeline"

# open_clip architecture: the numeric keys a plain ViT CLIP takes (the tiny files and LAION's ViT-H-14 config use
# no others). Each is a whole number in [1, OPEN_CLIP_MAX_VALUE] unless listed as a real.
OPEN_CLIP_TOP_KEYS = frozenset({"embed_dim", "quick_gelu", "vision_cfg", "text_cfg"})
OPEN_CLIP_VISION_KEYS = frozenset({"image_size", "layers", "width", "head_width", "mlp_ratio", "patch_size"})
OPEN_CLIP_TEXT_KEYS = frozenset({"context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio"})
OPEN_CLIP_REAL_KEYS = frozenset({"mlp_ratio"})
OPEN_CLIP_MAX_VALUE = 1 << 20


def _code_keys(value: Any, trail: str = "") -> Iterator[str]:
    """Dotted paths of every CODE_NAMING_KEYS key at any depth of a JSON document."""
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{trail}.{key}" if trail else str(key)
            if key in CODE_NAMING_KEYS:
                yield here
            yield from _code_keys(item, here)
    elif isinstance(value, list):
        for position, item in enumerate(value):
            yield from _code_keys(item, f"{trail}[{position}]")


def read_config_document(path: Path) -> tuple[Any, str | None]:
    """(the JSON document, None), or (None, a one-line problem) when ``path`` is not readable JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, f"{path} is not readable JSON ({type(exc).__name__})"


def config_file_problems(path: Path) -> list[str]:
    """One line if the config file ``path`` is unreadable or names code (see CODE_NAMING_KEYS); else none."""
    document, problem = read_config_document(path)
    if problem is not None:
        return [problem]
    found = list(_code_keys(document))
    if not found:
        return []
    return [
        f"{path} names code or a loader to use ({', '.join(found[:3])}), which fluxgrpo never follows from a "
        "weights folder"
    ]


def folder_config_problems(folder: Path) -> list[str]:
    """The problems of every config file (CONFIG_FILE_NAMES) directly inside ``folder``."""
    if not folder.is_dir():
        return []
    problems: list[str] = []
    for path in sorted(folder.iterdir()):
        if path.name in CONFIG_FILE_NAMES and path.is_file():
            problems.extend(config_file_problems(path))
    return problems


def flux_pipeline_problems(flux_dir: Path, components: tuple[str, ...]) -> list[str]:
    """model_index.json must name FLUX's own class for each component, and every component folder's configs must
    name no code."""
    problems: list[str] = []
    index_path = flux_dir / "model_index.json"
    if index_path.is_file():
        document, problem = read_config_document(index_path)
        if problem is not None:
            problems.append(problem)
        elif not isinstance(document, dict):
            problems.append(f"{index_path} is not a JSON object")
        else:
            problems.extend(config_file_problems(index_path))
            problems.extend(_model_index_problems(index_path, document))
    for component in components:
        problems.extend(folder_config_problems(flux_dir / component))
    return problems


def _model_index_problems(path: Path, document: dict[str, Any]) -> list[str]:
    problems = []
    class_name = document.get("_class_name", FLUX_PIPELINE_CLASS)
    if class_name != FLUX_PIPELINE_CLASS:
        problems.append(f"{path} names the pipeline {class_name!r}, not {FLUX_PIPELINE_CLASS}")
    for key, entry in document.items():
        if not isinstance(entry, list):
            continue
        if entry in ([None, None], []):  # an optional component left out
            continue
        allowed = FLUX_PIPELINE_CLASSES.get(key)
        named = tuple(entry) if len(entry) == 2 and all(isinstance(part, str) for part in entry) else None
        if allowed is None or named not in allowed:
            expected = " or ".join(f"{lib}.{cls}" for lib, cls in sorted(allowed)) if allowed else "nothing"
            problems.append(f"{path} names {json.dumps(entry)} for {key!r} (FLUX uses {expected})")
    return problems


def _architecture_number(path: Path, key: str, value: Any) -> int | float:
    real = key.rsplit(".", 1)[-1] in OPEN_CLIP_REAL_KEYS
    kinds = (int, float) if real else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        what = "a number" if real else "a whole number"
        raise FluxgrpoError(f"{path}: {key} is {json.dumps(value)}, not {what}: {_ARCH_FIX}")
    if not 0 < value <= OPEN_CLIP_MAX_VALUE:
        raise FluxgrpoError(f"{path}: {key} is {value}, outside (0, {OPEN_CLIP_MAX_VALUE}]: {_ARCH_FIX}")
    return value


_ARCH_FIX = (
    "fluxgrpo reads only an open_clip ViT's numeric architecture keys from it; re-run `fluxgrpo fetch-weights` "
    "(or delete the file to use the real ViT-H-14)"
)


def open_clip_architecture(path: Path, config: Any) -> dict[str, Any]:
    """The open_clip model config held by ``path`` reduced to a plain ViT CLIP's numeric keys.

    Accepts open_clip's model-config format (embed_dim, vision_cfg, text_cfg) or the ``{"model_cfg": ...,
    "preprocess_cfg": ...}`` wrapper of open_clip's own ``open_clip_config.json`` (preprocess_cfg is not used).

    Raises:
        FluxgrpoError: one line naming the file and the first key that is unknown, missing or not a number in range.
    """
    if isinstance(config, dict) and "model_cfg" in config:
        extra = sorted(set(config) - {"model_cfg", "preprocess_cfg"})
        if extra:
            raise FluxgrpoError(f"{path}: unknown key {extra[0]!r}: {_ARCH_FIX}")
        config = config["model_cfg"]
    if not isinstance(config, dict):
        raise FluxgrpoError(f"{path} is not a JSON object: {_ARCH_FIX}")
    missing = [key for key in ("embed_dim", "vision_cfg", "text_cfg") if key not in config]
    if missing:
        raise FluxgrpoError(f"{path} lacks {missing[0]}: {_ARCH_FIX}")
    unknown = sorted(set(config) - OPEN_CLIP_TOP_KEYS)
    if unknown:
        raise FluxgrpoError(f"{path}: unknown key {unknown[0]!r}: {_ARCH_FIX}")
    quick_gelu = config.get("quick_gelu", False)
    if not isinstance(quick_gelu, bool):
        raise FluxgrpoError(f"{path}: quick_gelu is {json.dumps(quick_gelu)}, not true or false: {_ARCH_FIX}")
    architecture: dict[str, Any] = {"embed_dim": _architecture_number(path, "embed_dim", config["embed_dim"])}
    if quick_gelu:
        architecture["quick_gelu"] = True
    for tower, allowed in (("vision_cfg", OPEN_CLIP_VISION_KEYS), ("text_cfg", OPEN_CLIP_TEXT_KEYS)):
        values = config[tower]
        if not isinstance(values, dict):
            raise FluxgrpoError(f"{path}: {tower} is not a JSON object: {_ARCH_FIX}")
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise FluxgrpoError(f"{path}: unknown key {tower}.{unknown[0]}: {_ARCH_FIX}")
        architecture[tower] = {
            key: _architecture_number(path, f"{tower}.{key}", value) for key, value in sorted(values.items())
        }
    return architecture
