"""ImageReward v1.0 (Xu et al., NeurIPS 2023): BLIP's ViT-L image tower, its BERT text encoder cross-attending the image,
and an MLP head on the [CLS] feature; reimplemented on transformers' BLIP modules.

The authors' ``image-reward`` package is not used: it imports names transformers 5 no longer has, and pins timm and
fairscale. Its computation, reproduced here (``tests/rewards/test_imagereward.py`` checks it against a plain re-derivation):

- image: Resize(224, bicubic) on the shortest side, CenterCrop(224), RGB, ToTensor, OpenAI CLIP mean/std; then
  BLIP's ViT-L/16 (pre-norm blocks, LayerNorm eps 1e-6), every token of the last layer after the final norm;
- text: bert-base-uncased's tokenizer with BLIP's two added tokens ([DEC], [ENC]), padded/truncated to 35 tokens,
  starting with [CLS] (ImageReward does not swap in [ENC]); BERT layers of self-attention (not causal), cross-attention
  to all image tokens, feed-forward;
- score: ``(mlp(cls) − 0.16717362830052426) / 1.0333394966054072``, the MLP being five linear layers
  768→1024→128→64→16→1 with no activation (dropout only in training), the value ``score`` and ``inference_rank`` return.

The text cross-attends the image, so only the tokenised prompts are cached, not text features. Checkpoint keys are
the authors' (``blip.visual_encoder.*`` timm-style, ``blip.text_encoder.*``, ``mlp.layers.*``); the vision ones are
renamed to transformers' BlipVisionModel names on load, keys the score does not use (BLIP's projections) are ignored.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import FluxgrpoError, not_usable
from fluxgrpo.rewards.base import (
    CLIP_MEAN,
    CLIP_STD,
    TextFeatureCache,
    check_batch,
    check_pil_batch,
    load_pretrained,
    normalize_clip,
    read_state_dict,
)
from fluxgrpo.rewards.clipscore import center_crop_rounded
from fluxgrpo.rewards.pickscore import resize_shortest_edge
from fluxgrpo.rewards.registry import RewardRecord, WeightsPart
from fluxgrpo.runtime.device import autocast
from fluxgrpo.weights.hub_parts import REWARD_HUB_PARTS
from fluxgrpo.weights.layout import (
    IMAGEREWARD_CHECKPOINT,
    IMAGEREWARD_MED_CONFIG,
    IMAGEREWARD_MODEL_DIR,
    IMAGEREWARD_TOKENIZER_DIR,
    IMAGEREWARD_VISION_ARCH_FILE,
    check_imagereward_dir,
    imagereward_dir,
)
from fluxgrpo.weights.tiny_writing import fresh_subfolders, write_subfolder_manifests

if TYPE_CHECKING:
    import torch
    from PIL import Image

IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
IMAGEREWARD_MAX_LENGTH = 35
IMAGE_SIZE = 224
# BLIP's 'large' vision tower (create_vit('large', 224)): ViT-L/16.
VIT_LARGE = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "patch_size": 16, "mlp_ratio": 4}
HEAD_SIZES = (1024, 128, 64, 16, 1)  # the MLP after the 768-wide [CLS] feature

# The authors' timm-style ViT names → transformers' BlipVisionModel names.
_VISION_RENAMES = (
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.fc(\d)\.", r"encoder.layers.\1.mlp.fc\2."),
    (r"^norm\.", "post_layernorm."),
)


def vision_key(authors_key: str) -> str:
    """``blocks.3.attn.proj.weight`` → ``encoder.layers.3.self_attn.projection.weight`` (and so on)."""
    for pattern, replacement in _VISION_RENAMES:
        renamed, count = re.subn(pattern, replacement, authors_key)
        if count:
            return renamed
    return authors_key


# transformers' names → the authors' (to save a tiny checkpoint in the real file's key names).
_AUTHORS_RENAMES = (
    (r"^embeddings\.class_embedding$", "cls_token"),
    (r"^embeddings\.position_embedding$", "pos_embed"),
    (r"^embeddings\.patch_embedding\.", "patch_embed.proj."),
    (r"^encoder\.layers\.(\d+)\.layer_norm(\d)\.", r"blocks.\1.norm\2."),
    (r"^encoder\.layers\.(\d+)\.self_attn\.qkv\.", r"blocks.\1.attn.qkv."),
    (r"^encoder\.layers\.(\d+)\.self_attn\.projection\.", r"blocks.\1.attn.proj."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc(\d)\.", r"blocks.\1.mlp.fc\2."),
    (r"^post_layernorm\.", "norm."),
)


def authors_vision_key(key: str) -> str:
    """The inverse of ``vision_key``."""
    for pattern, replacement in _AUTHORS_RENAMES:
        renamed, count = re.subn(pattern, replacement, key)
        if count:
            return renamed
    return key


def authors_state_dict(vision_model: Any, text_model: Any, head: Any) -> dict[str, Any]:
    """The three modules' weights under the keys of the authors' ImageReward.pt."""
    state = {f"blip.visual_encoder.{authors_vision_key(k)}": v for k, v in vision_model.state_dict().items()}
    state.update({f"blip.text_encoder.{k}": v for k, v in text_model.state_dict().items()})
    state.update({f"mlp.layers.{k}": v for k, v in head.state_dict().items()})
    return state


def _head(width: int) -> Any:
    """The authors' MLP shape as an nn.Sequential with the same indices (dropouts are identities in eval)."""
    import torch.nn as nn

    layers: list[nn.Module] = []
    sizes = (width, *HEAD_SIZES)
    for index, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(fan_in, fan_out))
        if index < 3:  # the authors put a dropout after each of the first three linear layers
            layers.append(nn.Dropout(0.0))
    return nn.Sequential(*layers)


def build_imagereward_modules(med_config: dict[str, Any], vision: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(vision tower, text encoder, head) with random weights, shaped by ``med_config`` and ``vision``."""
    from transformers import BlipTextConfig, BlipVisionConfig, BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    vision_model = BlipVisionModel(
        BlipVisionConfig(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["hidden_size"] * vision["mlp_ratio"],
            num_hidden_layers=vision["num_hidden_layers"],
            num_attention_heads=vision["num_attention_heads"],
            patch_size=vision["patch_size"],
            image_size=IMAGE_SIZE,
            layer_norm_eps=1e-6,
            hidden_act="gelu",
        )
    )
    text_config = BlipTextConfig(
        vocab_size=med_config["vocab_size"],
        hidden_size=med_config["hidden_size"],
        intermediate_size=med_config["intermediate_size"],
        num_hidden_layers=med_config["num_hidden_layers"],
        num_attention_heads=med_config["num_attention_heads"],
        max_position_embeddings=med_config["max_position_embeddings"],
        layer_norm_eps=med_config.get("layer_norm_eps", 1e-12),
        hidden_act=med_config.get("hidden_act", "gelu"),
        encoder_hidden_size=vision["hidden_size"],  # BLIP sets encoder_width to the vision width
        pad_token_id=med_config.get("pad_token_id", 0),
        bos_token_id=None,
        # transformers builds the cross-attention only for a decoder config; the forward passes is_decoder=False, so
        # the self-attention stays bidirectional, as BLIP's BertModel in 'multimodal' mode.
        is_decoder=True,
    )
    text_model = BlipTextModel(text_config, add_pooling_layer=False)
    return vision_model, text_model, _head(med_config["hidden_size"])


def _read_json(path: Path, fix: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FluxgrpoError(f"cannot read {path} ({type(exc).__name__}: {exc}): {fix}") from exc


def load_imagereward(folder: str | Path) -> tuple[Any, Any, Any, Any]:
    """(vision tower, text encoder, head, tokenizer) from an ImageReward folder, on cpu in float32, eval."""
    folder = Path(folder)
    status = check_imagereward_dir(folder)
    if not status.complete:
        raise not_usable(f"ImageReward weights in {folder}", status.problems, status.fix)
    fix = f"re-run `fluxgrpo fetch-weights --only imagereward --hps-dir {folder.parent}`"
    model_dir = folder / IMAGEREWARD_MODEL_DIR
    med_config = _read_json(model_dir / IMAGEREWARD_MED_CONFIG, fix)
    arch_file = model_dir / IMAGEREWARD_VISION_ARCH_FILE
    vision = _read_json(arch_file, fix) if arch_file.is_file() else VIT_LARGE
    vision_model, text_model, head = build_imagereward_modules(med_config, vision)

    state = read_state_dict(model_dir / IMAGEREWARD_CHECKPOINT, fix)
    parts: dict[str, dict[str, Any]] = {"blip.visual_encoder.": {}, "blip.text_encoder.": {}, "mlp.layers.": {}}
    for key, value in state.items():
        for prefix, bucket in parts.items():
            if key.startswith(prefix):
                bucket[key[len(prefix) :]] = value
    vision_state = {vision_key(key): value for key, value in parts["blip.visual_encoder."].items()}
    # Buffers the checkpoint may carry that are rebuilt from the config (BERT's position ids).
    text_state = {k: v for k, v in parts["blip.text_encoder."].items() if not k.endswith("position_ids")}
    for name, module, sub_state in (
        ("blip.visual_encoder", vision_model, vision_state),
        ("blip.text_encoder", text_model, text_state),
        ("mlp.layers", head, parts["mlp.layers."]),
    ):
        try:
            module.load_state_dict(sub_state, strict=True)
        except RuntimeError as exc:
            first_line = str(exc).splitlines()[0]
            raise FluxgrpoError(
                f"{model_dir / IMAGEREWARD_CHECKPOINT} does not fit ImageReward's {name} ({first_line}): {fix}"
            ) from exc

    from transformers import BertTokenizer

    tokenizer_dir = folder / IMAGEREWARD_TOKENIZER_DIR
    tokenizer = load_pretrained(lambda: BertTokenizer.from_pretrained(tokenizer_dir), tokenizer_dir, "ImageReward", fix)
    # BLIP's init_tokenizer: a [DEC] beginning-of-sequence token and an [ENC] token, appended to the vocabulary.
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    if len(tokenizer) != med_config["vocab_size"]:
        raise FluxgrpoError(
            f"the ImageReward tokenizer in {tokenizer_dir} has {len(tokenizer)} tokens with BLIP's two added, but "
            f"{IMAGEREWARD_MED_CONFIG} expects {med_config['vocab_size']}: {fix}"
        )
    return (*(m.eval().requires_grad_(False) for m in (vision_model, text_model, head)), tokenizer)


class ImageRewardReward:
    """ImageReward v1.0 scores, batched on ``device``; see the module docstring for the exact computation.

    ``folder`` is ``imagereward_dir(hps_dir)``. Encoders run in ``compute_dtype`` (autocast; float32 means none),
    the head and the normalisation in float32, as the authors' ``.float()`` before the MLP.
    """

    name = "imagereward"

    def __init__(
        self,
        folder: str | Path,
        device: torch.device | str = "cpu",
        batch_size: int = 32,
        text_cache_size: int = 4096,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        import torch

        vision_model, text_model, head, tokenizer = load_imagereward(folder)
        self.device = torch.device(device)
        self.vision_model = vision_model.to(self.device)
        self.text_model = text_model.to(self.device)
        self.head = head.to(self.device)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.compute_dtype = torch.float32 if compute_dtype is None else compute_dtype
        self._tokens = TextFeatureCache(self._tokenize, text_cache_size)  # rows: ids and mask, stacked

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [0, 1] → normalised [B, 3, 224, 224] pixels, as the authors' transform makes them."""
        import torch

        pixels = resize_shortest_edge(images.to(self.device, torch.float32), IMAGE_SIZE, "bicubic")
        return normalize_clip(center_crop_rounded(pixels, IMAGE_SIZE))

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        check_batch(images, prompts)
        return self.score_pixels(self.preprocess(images), prompts)

    def score_pil(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        """The authors' input path: their torchvision transform on each PIL image."""
        import torch
        from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize, ToTensor

        check_pil_batch(images, prompts)
        transform = Compose(
            [
                Resize(IMAGE_SIZE, interpolation=InterpolationMode.BICUBIC),
                CenterCrop(IMAGE_SIZE),
                ToTensor(),
                Normalize(CLIP_MEAN, CLIP_STD),
            ]
        )
        pixels = torch.stack([transform(image.convert("RGB")) for image in images]).to(self.device)
        return self.score_pixels(pixels, prompts)

    def score_pixels(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Normalised pixels [B, 3, 224, 224] → ImageReward scores [B] float32."""
        import torch

        if len(prompts) != pixels.shape[0]:
            raise ValueError(f"{pixels.shape[0]} images but {len(prompts)} prompts: one prompt per image")
        tokens = self._tokens(prompts)  # [B, 2, L]: input ids and attention mask
        scores = []
        with torch.no_grad():
            for start in range(0, pixels.shape[0], self.batch_size):
                chunk = slice(start, start + self.batch_size)
                with autocast(self.device.type, dtype=self.compute_dtype):
                    image_embeds = self.vision_model(pixel_values=pixels[chunk]).last_hidden_state
                    image_mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
                    text = self.text_model(
                        input_ids=tokens[chunk, 0],
                        attention_mask=tokens[chunk, 1],
                        encoder_hidden_states=image_embeds,
                        encoder_attention_mask=image_mask,
                        is_decoder=False,
                    )
                cls = text.last_hidden_state[:, 0, :].float()
                raw = self.head(cls).squeeze(-1)
                scores.append((raw - IMAGEREWARD_MEAN) / IMAGEREWARD_STD)
        return torch.cat(scores)

    def _tokenize(self, prompts: list[str]) -> torch.Tensor:
        """[n, 2, 35] int64: each prompt's input ids and attention mask (padded to 35, truncated)."""
        import torch

        encoded = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=IMAGEREWARD_MAX_LENGTH, return_tensors="pt"
        )
        return torch.stack([encoded["input_ids"], encoded["attention_mask"]], dim=1).to(self.device)


def _load(hps_dir: Path, device: torch.device | str, dtype: torch.dtype) -> ImageRewardReward:
    return ImageRewardReward(imagereward_dir(hps_dir), device, compute_dtype=dtype)


def _write_tiny(hps_dir: Path, seed: int) -> dict[str, int]:
    return {"imagereward": write_tiny_imagereward(imagereward_dir(hps_dir), seed)}


RECORD = RewardRecord(
    "imagereward",
    _load,
    parts=(
        WeightsPart(
            "imagereward",
            lambda hps_dir: check_imagereward_dir(imagereward_dir(hps_dir)),
            hub=REWARD_HUB_PARTS["imagereward"],
        ),
    ),
    write_tiny=_write_tiny,
    parameters=446_206_689,  # BLIP ViT-L + BERT-base with cross-attention + the MLP head
)


def write_tiny_imagereward(folder: Path, seed: int = 0) -> int:
    """Write a tiny ImageReward (``model/``: ImageReward.pt in the authors' keys + med_config.json + the tiny vision
    shape; ``tokenizer/``: a WordPiece vocab.txt + tokenizer_config.json) with a manifest in each; returns bytes."""
    import torch

    from fluxgrpo.rewards.tiny import TINY_IMAGEREWARD_VISION, tiny_bert_vocab, tiny_imagereward_med_config

    folder = Path(folder)
    model_dir, tokenizer_dir = folder / IMAGEREWARD_MODEL_DIR, folder / IMAGEREWARD_TOKENIZER_DIR
    fresh_subfolders(model_dir, tokenizer_dir)
    torch.save(build_tiny_imagereward_state(seed), model_dir / IMAGEREWARD_CHECKPOINT)
    (model_dir / IMAGEREWARD_MED_CONFIG).write_text(json.dumps(tiny_imagereward_med_config(), indent=2) + "\n")
    (model_dir / IMAGEREWARD_VISION_ARCH_FILE).write_text(json.dumps(TINY_IMAGEREWARD_VISION, indent=2) + "\n")
    (tokenizer_dir / "vocab.txt").write_text("\n".join(tiny_bert_vocab()) + "\n")
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "model_max_length": 512}))
    return write_subfolder_manifests("imagereward", model_dir, tokenizer_dir)


def build_tiny_imagereward_state(seed: int = 0) -> dict[str, Any]:
    """A random tiny ImageReward's weights under the authors' checkpoint keys; seeded, global RNG untouched.

    The head gets weights of std 1.5/√fan_in so scores vary visibly with the image (the real head's init, std
    1/769, would make every tiny score the same to many digits).
    """
    import torch

    from fluxgrpo.rewards.tiny import TINY_IMAGEREWARD_VISION, tiny_imagereward_med_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vision, text, head = build_imagereward_modules(tiny_imagereward_med_config(), TINY_IMAGEREWARD_VISION)
        for layer in head:
            if isinstance(layer, torch.nn.Linear):
                torch.nn.init.normal_(layer.weight, std=1.5 / layer.in_features**0.5)
                torch.nn.init.normal_(layer.bias, std=0.1)
    return authors_state_dict(vision, text, head)
