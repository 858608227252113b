"""Rewards: HPSv2.1 (the real one, batched on device from tensors) and a brightness smoke-test reward.

A reward is any callable ``reward(images, prompts) -> scores`` with images [B, 3, H, W] float in [0, 1] on the
compute device and one prompt per image; scores are [B] float32 (``RewardFn``). ``load_reward(name, ...)`` builds
one by name.

HPSv2.1 is open_clip's ViT-H-14 with the HPS fine-tuned weights. The score is the cosine similarity of the
L2-normalised image and text features (no logit scale), as hpsv2's ``img_score`` computes it. Preprocessing is
hpsv2's validation transform: resize the longest side to 224 (bicubic, antialiased), pad to a square with zeros
(centred), normalise with the OpenAI CLIP mean and std. Unlike DanceGRPO, which scored in fp16 autocast (a reward
resolution of about 2e-4), the encoders run in the runtime's compute dtype and everything after them in float32.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import pickle
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.weights.layout import HPS_CHECKPOINT, OPEN_CLIP_WEIGHTS, check_hps_dir, reward_architecture

if TYPE_CHECKING:
    import torch
    from PIL import Image

REAL_REWARD_ARCH = "ViT-H-14"
# OpenAI CLIP's pixel statistics, which HPSv2 (and open_clip's ViT-H-14 LAION weights) normalise with.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class RewardFn(Protocol):
    """Score generated images against their prompts."""

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """images [B, 3, H, W] float in [0, 1] on the compute device, len(prompts) == B → scores [B] float32."""
        ...


def _check_batch(images: torch.Tensor, prompts: list[str]) -> None:
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be [B, 3, H, W], got {tuple(images.shape)}")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts: one prompt per image")


class BrightnessReward:
    """SMOKE TEST ONLY, not a measure of quality: the mean pixel value of each image, in [0, 1].

    The tiny random HPS model barely varies with the image, so a tiny training run cannot show learning against
    it; brightness is a reward a tiny policy can visibly learn within a minute (the ``tiny-cpu`` config uses it).
    """

    name = "brightness"

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        _check_batch(images, prompts)
        return images.float().mean(dim=(1, 2, 3))


# --- open_clip architecture -------------------------------------------------------------------------------------

_config_dir: tempfile.TemporaryDirectory | None = None


def register_open_clip_config(config: dict[str, Any]) -> str:
    """Register an open_clip model config and return the name ``open_clip.create_model`` knows it by.

    Accepts open_clip's model-config format (embed_dim, vision_cfg, text_cfg), or the ``{"model_cfg": ...}``
    wrapper of open_clip's own ``open_clip_config.json``. The name is derived from the content, so registering the
    same architecture twice is harmless and two different tiny architectures never collide.
    """
    global _config_dir
    import open_clip

    model_cfg = config.get("model_cfg", config)
    if not all(key in model_cfg for key in ("embed_dim", "vision_cfg", "text_cfg")):
        raise FluxgrpoError(
            "reward architecture file lacks embed_dim/vision_cfg/text_cfg: re-run `fluxgrpo fetch-weights` "
            "(or delete the file to use the real ViT-H-14)"
        )
    digest = hashlib.sha256(json.dumps(model_cfg, sort_keys=True).encode()).hexdigest()[:16]
    name = f"fluxgrpo-reward-{digest}"
    if name not in open_clip.list_models():
        # open_clip registers configs only from files, and re-reads every registered path whenever another is
        # added, so the file must outlive the call: it lives in a folder removed when the process exits.
        if _config_dir is None:
            _config_dir = tempfile.TemporaryDirectory(prefix="fluxgrpo-open-clip-")
        path = Path(_config_dir.name) / f"{name}.json"
        path.write_text(json.dumps(model_cfg))
        open_clip.add_model_config(path)
    return name


def reward_model_name(hps_dir: str | Path) -> str:
    """The open_clip architecture for the weights in ``hps_dir``: the tiny one's registered name, or ViT-H-14."""
    config = reward_architecture(hps_dir)
    return REAL_REWARD_ARCH if config is None else register_open_clip_config(config)


def read_state_dict(path: Path) -> dict[str, Any]:
    """A state dict from an HPS checkpoint (``{"state_dict": ...}``) or a plain one (LAION's open_clip .bin)."""
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # The HPS file comes from the HPSv2 authors' training run and was never checked byte by byte here; if it
        # pickles more than tensors and plain containers, the safe loader refuses it. It was fetched by name from
        # the official repository, so loading it fully is the same trust hpsv2 itself extends.
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:
            raise FluxgrpoError(f"cannot read {path} ({exc}): re-run `fluxgrpo fetch-weights`") from exc
    except Exception as exc:
        raise FluxgrpoError(
            f"cannot read {path} ({type(exc).__name__}: {exc}): re-run `fluxgrpo fetch-weights`"
        ) from exc
    state = obj.get("state_dict", obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict) or not state:
        raise FluxgrpoError(f"{path} holds no state dict: re-run `fluxgrpo fetch-weights`")
    if all(key.startswith("module.") for key in state):  # saved from a DDP-wrapped model
        state = {key[len("module."):]: value for key, value in state.items()}
    return state


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


def load_hps_model(hps_dir: str | Path) -> tuple[Any, str]:
    """The HPS open_clip model on cpu in float32, eval, gradients off; and its architecture name.

    The HPS checkpoint holds the full CLIP (every key ViT-H-14 has), so it alone defines the model.
    ``open_clip_pytorch_model.bin`` (LAION's ViT-H-14) is what hpsv2 loads first as initial weights before
    overwriting them all with the checkpoint; it is read here only when the checkpoint lacks some keys, to fill
    them. Both files must be present either way (``fetch-weights`` fetches both, as DanceGRPO's recipe does).
    """
    import open_clip

    hps_dir = Path(hps_dir)
    problems = [(part.problems, part.fix) for part in check_hps_dir(hps_dir) if not part.complete]
    if problems:
        details = "; ".join(p for found, _ in problems for p in found)
        raise FluxgrpoError(f"reward weights in {hps_dir} are not usable ({details}): {problems[0][1]}")

    arch = reward_model_name(hps_dir)
    with _quiet_random_init_warning():
        model = open_clip.create_model(arch, pretrained=None, precision="fp32", device="cpu")
    expected = set(model.state_dict())
    hps_state = read_state_dict(hps_dir / HPS_CHECKPOINT)
    unexpected = sorted(set(hps_state) - expected)
    if unexpected:
        raise FluxgrpoError(
            f"{hps_dir / HPS_CHECKPOINT} does not match the {arch} architecture (unexpected keys such as "
            f"{unexpected[0]}): re-run `fluxgrpo fetch-weights --hps-dir {hps_dir}`"
        )
    try:
        if expected - set(hps_state):
            model.load_state_dict(read_state_dict(hps_dir / OPEN_CLIP_WEIGHTS), strict=True)
            model.load_state_dict(hps_state, strict=False)
        else:
            model.load_state_dict(hps_state, strict=True)
    except RuntimeError as exc:
        first_line = str(exc).splitlines()[0]
        raise FluxgrpoError(
            f"reward weights in {hps_dir} do not fit the {arch} architecture ({first_line}): "
            f"re-run `fluxgrpo fetch-weights --hps-dir {hps_dir}`"
        ) from exc
    return model.eval().requires_grad_(False), arch


# --- preprocessing shared by the tensor and PIL paths ------------------------------------------------------------


def resize_longest_and_pad(images: torch.Tensor, size: int) -> torch.Tensor:
    """[B, 3, H, W] → [B, 3, size, size]: longest side to ``size`` (bicubic, antialiased), centred zero padding.

    The new short side is ``round(short * size / long)``; the padding splits as floor on the left/top. hpsv2 skips
    the padding when the longest side is already ``size``; padding regardless keeps a non-square input square.
    """
    import torch.nn.functional as F

    height, width = images.shape[-2:]
    scale = size / max(height, width)
    if scale != 1.0:
        new_size = (round(height * scale), round(width * scale))
        images = F.interpolate(images, size=new_size, mode="bicubic", align_corners=False, antialias=True)
    pad_h, pad_w = size - images.shape[-2], size - images.shape[-1]
    if pad_h or pad_w:
        images = F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)
    return images


def normalize_clip(pixels: torch.Tensor) -> torch.Tensor:
    """Per-channel (x - mean) / std with the OpenAI CLIP statistics."""
    import torch

    mean = torch.tensor(CLIP_MEAN, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
    return (pixels - mean) / std


def pil_to_tensor(image: Image.Image) -> torch.Tensor:
    """PIL image → [3, H, W] float32 in [0, 1] (RGB conversion, then torchvision's ToTensor)."""
    from torchvision.transforms.functional import to_tensor

    return to_tensor(image.convert("RGB"))


class HpsV2Reward:
    """HPSv2.1 scores, batched on ``device``; see the module docstring for the exact computation.

    Text features are cached per prompt (bounded), since GRPO scores every prompt G times per iteration.
    """

    name = "hpsv2"

    def __init__(self, hps_dir: str | Path, device: Any = "cpu", batch_size: int = 32, text_cache_size: int = 4096):
        import open_clip
        import torch

        model, arch = load_hps_model(hps_dir)
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.architecture = arch
        self.tokenizer = open_clip.get_tokenizer(arch)
        image_size = self.model.visual.image_size
        self.image_size = int(image_size[0] if isinstance(image_size, tuple | list) else image_size)
        self.batch_size = batch_size
        self._text_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._text_cache_size = text_cache_size

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        import torch

        _check_batch(images, prompts)
        pixels = images.to(self.device, torch.float32)
        pixels = normalize_clip(resize_longest_and_pad(pixels, self.image_size))
        return self._score_pixels(pixels, prompts)

    def score_pil(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        """hpsv2's own input path: PIL images of any size → RGB → ToTensor → the same resize/pad/normalise."""
        import torch

        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts: one prompt per image")
        pixels = torch.cat(
            [
                resize_longest_and_pad(pil_to_tensor(image).unsqueeze(0).to(self.device), self.image_size)
                for image in images
            ]
        )
        return self._score_pixels(normalize_clip(pixels), prompts)

    def _score_pixels(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Normalised pixels [B, 3, S, S] → cosine(image features, text features) [B] float32."""
        import torch
        import torch.nn.functional as F

        from fluxgrpo.runtime.device import autocast

        text_features = self._text_features(prompts)
        scores = []
        with torch.no_grad():
            for start in range(0, pixels.shape[0], self.batch_size):
                with autocast(self.device.type):
                    features = self.model.encode_image(pixels[start : start + self.batch_size])
                features = F.normalize(features.float(), dim=-1)
                scores.append((features * text_features[start : start + self.batch_size]).sum(dim=-1))
        return torch.cat(scores)

    def _text_features(self, prompts: list[str]) -> torch.Tensor:
        """[B, E] float32 L2-normalised text features, one row per prompt, from the cache where possible."""
        import torch
        import torch.nn.functional as F

        from fluxgrpo.runtime.device import autocast

        missing = list(dict.fromkeys(p for p in prompts if p not in self._text_cache))
        if missing:
            with torch.no_grad(), autocast(self.device.type):
                features = self.model.encode_text(self.tokenizer(missing).to(self.device))
            features = F.normalize(features.float(), dim=-1)
            for prompt, row in zip(missing, features, strict=True):
                self._text_cache[prompt] = row
        rows = []
        for prompt in prompts:
            self._text_cache.move_to_end(prompt)
            rows.append(self._text_cache[prompt])
        while len(self._text_cache) > self._text_cache_size:
            self._text_cache.popitem(last=False)
        return torch.stack(rows)


_REWARDS: dict[str, Callable[[Path, Any], RewardFn]] = {
    "hpsv2": lambda hps_dir, device: HpsV2Reward(hps_dir, device),
    "brightness": lambda hps_dir, device: BrightnessReward(),
}


def reward_names() -> list[str]:
    return list(_REWARDS)


def load_reward(name: str, hps_dir: str | Path, device: Any = "cpu") -> RewardFn:
    """The reward called ``name`` (``reward_names()``), loaded from ``hps_dir`` onto ``device`` if it has weights."""
    factory = _REWARDS.get(name)
    if factory is None:
        raise UsageError(f"unknown reward {name!r}: use --reward with one of {', '.join(_REWARDS)}")
    return factory(Path(hps_dir), device)
