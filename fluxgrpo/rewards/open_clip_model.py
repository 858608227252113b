"""The open_clip models behind HPSv2 and CLIPScore: which architecture a folder holds, and building it empty.

The real weights are ViT-H-14; the tiny ones written by ``fetch-weights --source tiny`` carry their architecture in
``open_clip_config.json`` beside them (``layout.REWARD_ARCH_FILE``), registered with open_clip under a name derived
from its content.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.rewards.base import TextFeatureCache
from fluxgrpo.runtime.device import autocast
from fluxgrpo.weights.config_guard import open_clip_architecture
from fluxgrpo.weights.layout import REWARD_ARCH_FILE, reward_architecture

if TYPE_CHECKING:
    import torch

REAL_REWARD_ARCH = "ViT-H-14"


def register_open_clip_config(config: dict[str, Any], source: Path = Path(REWARD_ARCH_FILE)) -> str:
    """Register an open_clip model config and return the name ``open_clip.create_model`` knows it by.

    Only a plain ViT CLIP's numeric architecture keys are registered (``config_guard.open_clip_architecture``,
    which also accepts the ``{"model_cfg": ...}`` wrapper of open_clip's own ``open_clip_config.json``): a config
    can never name a tokenizer, a Hugging Face model or keyword arguments for them. The name is derived from the
    content, so registering the same architecture twice is harmless and two different tiny architectures never
    collide.
    """
    import open_clip

    model_cfg = open_clip_architecture(source, config)
    digest = hashlib.sha256(json.dumps(model_cfg, sort_keys=True).encode()).hexdigest()[:16]
    name = f"fluxgrpo-reward-{digest}"
    if name not in open_clip.list_models():
        # open_clip registers configs only from files; its registry keeps an entry whose file is gone (a rescan
        # skips a missing path), so the file is removed at once: no folder outlives a killed or failed process.
        with tempfile.TemporaryDirectory(prefix="fluxgrpo-open-clip-") as folder:
            path = Path(folder) / f"{name}.json"
            path.write_text(json.dumps(model_cfg))
            open_clip.add_model_config(path)
    return name


def reward_model_name(hps_dir: str | Path) -> str:
    """The open_clip architecture for the weights in ``hps_dir``: the tiny one's registered name, or ViT-H-14."""
    config = reward_architecture(hps_dir)
    return REAL_REWARD_ARCH if config is None else register_open_clip_config(config)


class _DropRandomInitWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "initialized randomly" not in record.getMessage()


@contextlib.contextmanager
def _quiet_random_init_warning() -> Iterator[None]:
    """open_clip warns that a model built with ``pretrained=None`` is random; ours gets its weights right after."""
    root = logging.getLogger()
    log_filter = _DropRandomInitWarning()
    root.addFilter(log_filter)
    try:
        yield
    finally:
        root.removeFilter(log_filter)


def create_empty_open_clip(arch: str) -> Any:
    """The open_clip model ``arch`` on cpu in float32 with random weights (the caller loads the real ones)."""
    import open_clip

    with _quiet_random_init_warning():
        return open_clip.create_model(arch, pretrained=None, precision="fp32", device="cpu")


def image_size_of(model: Any) -> int:
    """The square input side of an open_clip model's vision tower."""
    size = model.visual.image_size
    return int(size[0] if isinstance(size, tuple | list) else size)


class OpenClipCosine:
    """An open_clip model on ``device`` that gives cosine(image features, text features) per (image, prompt).

    Text features are cached per prompt (bounded), since GRPO scores every prompt G times per iteration. The
    encoders run in ``compute_dtype`` (autocast; float32 means none); normalisation and the cosine in float32.
    """

    def __init__(
        self,
        model: Any,
        arch: str,
        device: torch.device | str,
        batch_size: int,
        text_cache_size: int,
        compute_dtype: torch.dtype | None,
    ) -> None:
        import open_clip
        import torch

        self.device = torch.device(device)
        self.model = model.eval().requires_grad_(False).to(self.device)
        self.architecture = arch
        self.tokenizer = open_clip.get_tokenizer(arch)
        self.image_size = image_size_of(self.model)
        self.batch_size = batch_size
        self.compute_dtype = torch.float32 if compute_dtype is None else compute_dtype
        self._text_features = TextFeatureCache(self._encode_text, text_cache_size)

    def cosine(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Normalised pixels [B, 3, S, S] → cosine(image features, text features) [B] float32."""
        import torch

        text_features = self._text_features(prompts)
        scores = []
        with torch.no_grad():
            for start in range(0, pixels.shape[0], self.batch_size):
                features = self._image_features(pixels[start : start + self.batch_size])
                scores.append((features * text_features[start : start + self.batch_size]).sum(dim=-1))
        return torch.cat(scores)

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised pixels [B, 3, S, S] → [B, E] float32 L2-normalised image features (the evaluation's
        diversity embedding, ``training/eval.py``)."""
        import torch

        with torch.no_grad():
            return torch.cat(
                [
                    self._image_features(pixels[start : start + self.batch_size])
                    for start in range(0, pixels.shape[0], self.batch_size)
                ]
            )

    def _image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        with autocast(self.device.type, dtype=self.compute_dtype):
            features = self.model.encode_image(pixels)
        return F.normalize(features.float(), dim=-1)

    def _encode_text(self, prompts: list[str]) -> torch.Tensor:
        """[n, E] float32 L2-normalised text features."""
        import torch
        import torch.nn.functional as F

        with torch.no_grad(), autocast(self.device.type, dtype=self.compute_dtype):
            features = self.model.encode_text(self.tokenizer(prompts).to(self.device))
        return F.normalize(features.float(), dim=-1)


def _resblocks(state: dict[str, Any], prefix: str) -> int:
    found = {key[len(prefix) :].split(".", 1)[0] for key in state if key.startswith(prefix)}
    return len({part for part in found if part.isdigit()})


# The tensors whose sizes ``architecture_mismatch`` reads (besides the resblocks it counts).
ARCHITECTURE_KEYS = (
    "text_projection",
    "visual.conv1.weight",
    "visual.positional_embedding",
    "visual.transformer.resblocks.0.mlp.c_fc.weight",
    "token_embedding.weight",
    "positional_embedding",
    "transformer.resblocks.0.mlp.c_fc.weight",
)


def architecture_mismatch(config: dict[str, Any], state: dict[str, Any]) -> str | None:
    """The first size ``config`` (``config_guard.open_clip_architecture``'s) states that the checkpoint's own tensors
    contradict, or None: an architecture is built only at the size its weights have, never at one a config file
    names (a width of 2²⁰ would ask the allocator for many GiB before loading failed)."""
    vision, text = config.get("vision_cfg", {}), config.get("text_cfg", {})

    def dim(key: str, axis: int) -> int | None:
        tensor = state.get(key)
        return int(tensor.shape[axis]) if tensor is not None and tensor.dim() > axis else None

    width, text_width = dim("visual.conv1.weight", 0), dim("token_embedding.weight", 1)
    positions = dim("visual.positional_embedding", 0)
    fc = dim("visual.transformer.resblocks.0.mlp.c_fc.weight", 0)
    text_fc = dim("transformer.resblocks.0.mlp.c_fc.weight", 0)
    patch = vision.get("patch_size")
    stated: list[tuple[str, Any, Any]] = [
        ("embed_dim", config.get("embed_dim"), dim("text_projection", 1)),
        ("vision_cfg.width", vision.get("width"), width),
        ("vision_cfg.patch_size", patch, dim("visual.conv1.weight", 2)),
        ("vision_cfg.layers", vision.get("layers"), _resblocks(state, "visual.transformer.resblocks.") or None),
        ("text_cfg.width", text.get("width"), text_width),
        ("text_cfg.vocab_size", text.get("vocab_size"), dim("token_embedding.weight", 0)),
        ("text_cfg.context_length", text.get("context_length"), dim("positional_embedding", 0)),
        ("text_cfg.layers", text.get("layers"), _resblocks(state, "transformer.resblocks.") or None),
    ]
    if patch and positions and "image_size" in vision:
        stated.append(("vision_cfg.image_size", (vision["image_size"] // patch) ** 2 + 1, positions))
    if width and fc and "mlp_ratio" in vision:
        stated.append(("vision_cfg.mlp_ratio", int(width * vision["mlp_ratio"]), fc))
    if text_width and text_fc and "mlp_ratio" in text:
        stated.append(("text_cfg.mlp_ratio", int(text_width * text["mlp_ratio"]), text_fc))
    for key, value, actual in stated:
        if value is None:
            continue
        if actual is None:
            return f"{key} is {value}, but the weights hold no tensor of that size"
        if value != actual:
            return f"{key} is {value}, but the weights' tensors imply {actual}"
    if width and vision.get("head_width", 1) > width:
        return f"vision_cfg.head_width is {vision['head_width']}, wider than the tower ({width})"
    if text_width and (text.get("heads", 1) > text_width or text_width % text.get("heads", 1)):
        return f"text_cfg.heads is {text['heads']}, which does not divide the text width {text_width}"
    return None


def create_fitting_open_clip(hps_dir: str | Path, state: dict[str, Any], weights: Path, fix: str) -> tuple[Any, str]:
    """(the empty open_clip model for ``hps_dir``, its architecture name), refused in one line when the tiny
    architecture file disagrees with the sizes of ``state`` (the tensors read from ``weights``)."""

    config = reward_architecture(hps_dir)
    if config is not None:
        problem = architecture_mismatch(config, state)
        if problem is not None:
            raise FluxgrpoError(
                f"{Path(hps_dir) / REWARD_ARCH_FILE} does not describe the weights in {weights} ({problem}), so no "
                f"model was built: {fix}"
            )
    arch = REAL_REWARD_ARCH if config is None else register_open_clip_config(config, Path(hps_dir) / REWARD_ARCH_FILE)
    return create_empty_open_clip(arch), arch
