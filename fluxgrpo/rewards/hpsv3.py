"""HPSv3 (Ma et al., ICCV 2025): Qwen2-VL-7B-Instruct fine-tuned into a preference model that reads its score off the
hidden state of an added ``<|Reward|>`` token; reimplemented on transformers' Qwen2-VL modules.

The authors' ``hpsv3`` package is not used: it pins transformers 4.45.2 and imports trl, deepspeed and fire. Their
computation (``HPSv3RewardInferencer.reward`` with ``HPSv3_7B.yaml``), reproduced here and checked in
``tests/rewards/test_hpsv3.py``:

- image: RGB, resized by qwen-vl-utils' ``fetch_image`` with PIL's bicubic filter to ``smart_resize(H, W)``: sides
  multiples of 28 holding 256·28² pixels (min_pixels = max_pixels), 448×448 for a square image; then Qwen2-VL's image
  processor: ÷255, OpenAI CLIP mean/std, 14-pixel patches each repeated over the two temporal frames and ordered in
  2×2 groups for the merger → ``[h/14 · w/14, 1176]`` rows with grid ``(1, h/14, w/14)``;
- text: Qwen2-VL-Instruct's chat template over one user turn holding the image and then the authors' instruction
  (``INSTRUCTION`` with the prompt) and ``RATING_REQUEST``, with a generation prompt; ``<|image_pad|>`` repeated once
  per merged patch; ``<|Reward|>`` added to the tokenizer as a special token (so its id is the checkpoint's last
  embedding row); right padding;
- model: the vision tower's merged patch features replace the image pads' embeddings, and the text decoder runs with
  plain sequential positions 0..L−1 on all three rotary sections. The authors' forward calls the decoder directly and
  so never uses Qwen2-VL's multimodal (M-RoPE) image positions; HPSv3 was trained that way, so it is kept. The
  rotary inverse frequencies are rounded to bfloat16, as the authors' ``model.to(torch.bfloat16)`` left them in
  training and inference (``round_rotary_tables_as_trained``);
- score: ``rm_head`` (Linear 3584→1024, ReLU, Dropout, Linear 1024→16, ReLU, Linear 16→2) in float32 on the final
  hidden state at ``<|Reward|>``; it gives (μ, σ) and the score is μ, as the authors' README and DanceGRPO take it.

Deliberate differences: float32 activations by default (``--reward-dtype bf16`` casts the model to bfloat16 with
the head in float32, which is how the authors run it; transformers 4.45 also rounded the vision tower's rotary angles
and their cosines to bfloat16 there, current transformers computes them in float32); PyTorch's SDPA attention where
the authors use FlashAttention-2 when it is installed; ``lm_head`` is not loaded (the score never reads it). In
training the image is resized on tensors (bicubic, antialiased, width then height, each pass clamped like PIL's 8-bit
resize but without its rounding to 1/255).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import FluxgrpoError, not_usable
from fluxgrpo.rewards.base import check_batch, check_pil_batch, load_pretrained, normalize_clip, resize_like_pil
from fluxgrpo.rewards.registry import RewardRecord, WeightsPart
from fluxgrpo.tiny_tokenizers import byte_level_symbols
from fluxgrpo.weights.hub_parts import REWARD_HUB_PARTS
from fluxgrpo.weights.layout import (
    HPSV3_BASE_DIR,
    HPSV3_CHECKPOINT,
    HPSV3_MODEL_DIR,
    check_hpsv3_dir,
    hpsv3_dir,
)
from fluxgrpo.weights.tiny_writing import fresh_subfolders, write_subfolder_manifests

if TYPE_CHECKING:
    import torch
    from PIL import Image
    from torch import nn
    from transformers import Qwen2Tokenizer, Qwen2VLConfig

# qwen-vl-utils' smart_resize with the authors' min_pixels = max_pixels = 256·28²; 28 = patch 14 × merge 2.
IMAGE_PIXELS = 256 * 28 * 28
RESIZE_FACTOR = 28
MAX_ASPECT_RATIO = 200
REWARD_TOKEN = "<|Reward|>"
IMAGE_PAD = "<|image_pad|>"
# The authors' instruction (hpsv3/dataset/data_collator_qwen.py), word for word, trailing spaces included: the model
# was trained on it.
INSTRUCTION = "\n".join(
    (
        "",
        "You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. ",
        "",
        "**Visual Quality:**  ",
        "Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:",
        "- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.",
        "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.",
        "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).",
        "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.",
        "- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. ",
        "",
        "**Text Alignment:**  ",
        "Assess how well the image matches the textual prompt across the following sub-dimensions:",
        "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.",
        "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.",
        "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.",
        "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.",
        "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.",
        "Textual prompt - {text_prompt}",
        "",
        "",
        "",
    )
)
RATING_REQUEST = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"
# The rm_head of HPSv3_7B.yaml (rm_head_type "ranknet", no kwargs, output_dim 2); indices match the checkpoint's keys.
HEAD_SIZES = (1024, 16, 2)
HEAD_DROPOUT = 0.05


def smart_resize(height: int, width: int) -> tuple[int, int]:
    """(h, w) multiples of 28 near ``IMAGE_PIXELS`` pixels with the image's aspect ratio (qwen-vl-utils' rule)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"HPSv3 scores images with an aspect ratio below {MAX_ASPECT_RATIO}, got {height}x{width} (height x width)"
        )
    factor = RESIZE_FACTOR
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > IMAGE_PIXELS:
        beta = math.sqrt(height * width / IMAGE_PIXELS)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < IMAGE_PIXELS:
        beta = math.sqrt(IMAGE_PIXELS / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def conversation_text(prompt: str) -> str:
    """What Qwen2-VL-Instruct's chat template renders for the authors' message, with one ``<|image_pad|>``."""
    user = f"<|vision_start|>{IMAGE_PAD}<|vision_end|>{INSTRUCTION.format(text_prompt=prompt)}{RATING_REQUEST}"
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def patchify(pixels: torch.Tensor, patch: int = 14, merge: int = 2, temporal: int = 2) -> torch.Tensor:
    """Normalised [B, C, h, w] → [B · h/patch · w/patch, C · temporal · patch²] rows in Qwen2-VL's order: patches in
    ``merge``×``merge`` groups (row-major over groups), each patch as (channel, frame, y, x) with the image repeated
    over the ``temporal`` frames, as the image processor builds a still image's two-frame clip."""
    batch, channels, height, width = pixels.shape
    grid_h, grid_w = height // patch, width // patch
    rows = pixels.reshape(batch, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    rows = rows.permute(0, 2, 5, 3, 6, 1, 4, 7)  # B, gh/m, gw/m, m, m, C, py, px
    rows = rows.unsqueeze(6).expand(*rows.shape[:6], temporal, patch, patch)
    return rows.reshape(batch * grid_h * grid_w, channels * temporal * patch * patch)


# -- the model ---------------------------------------------------------------------------------------------------------


def _qwen2_vl_classes() -> tuple[Any, Any, Any]:
    try:
        from transformers import Qwen2VLConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel,
            Qwen2VLTextModel,
        )
    except ImportError as exc:
        raise FluxgrpoError(
            f"the hpsv3 reward needs transformers' Qwen2VLTextModel (transformers 4.52 or newer; {exc}): "
            "run `pip install 'fluxgrpo[hpsv3]'`"
        ) from exc
    return Qwen2VLConfig, Qwen2VisionTransformerPretrainedModel, Qwen2VLTextModel


def read_base_config(path: Path, vocab_rows: int, fix: str) -> Qwen2VLConfig:
    """Qwen2-VL's config.json as a ``Qwen2VLConfig``: see ``read_base_config_values``."""
    try:
        values = json.loads(path.read_text())
        return read_base_config_values(values, vocab_rows)
    except (OSError, ValueError, TypeError) as exc:
        raise FluxgrpoError(f"cannot read {path} as a Qwen2-VL config ({type(exc).__name__}: {exc}): {fix}") from exc


def read_base_config_values(values: dict[str, Any], vocab_rows: int) -> Qwen2VLConfig:
    """A ``Qwen2VLConfig`` from config.json's values, with ``vocab_rows`` token embeddings (the authors resize them
    to the tokenizer's length once ``<|Reward|>`` is added) and SDPA attention."""
    config_class, _, _ = _qwen2_vl_classes()
    config = config_class(**values)
    config.text_config.vocab_size = vocab_rows
    for sub in (config, config.text_config, config.vision_config):
        sub._attn_implementation = "sdpa"
    return config


def build_hpsv3_modules(config: Qwen2VLConfig, empty: bool = False) -> Any:
    """An ``nn.ModuleDict`` of ``visual`` (the vision tower with its merger), ``language_model`` (the decoder without
    lm_head) and ``rm_head``, random; ``empty`` puts the parameters on the meta device (buffers stay real)."""

    import torch.nn as nn

    _, vision_class, text_class = _qwen2_vl_classes()
    if empty:
        from accelerate import init_empty_weights

        context: Any = init_empty_weights(include_buffers=False)
    else:
        context = contextlib.nullcontext()
    with context:
        visual = vision_class._from_config(config.vision_config)
        language_model = text_class._from_config(config.text_config)
        width = config.text_config.hidden_size
        rm_head = nn.Sequential(
            nn.Linear(width, HEAD_SIZES[0]),
            nn.ReLU(),
            nn.Dropout(HEAD_DROPOUT),
            nn.Linear(HEAD_SIZES[0], HEAD_SIZES[1]),
            nn.ReLU(),
            nn.Linear(HEAD_SIZES[1], HEAD_SIZES[2]),
        )
    return nn.ModuleDict({"visual": visual, "language_model": language_model, "rm_head": rm_head})


def module_key(authors_key: str) -> str | None:
    """The checkpoint's key → ours; None for ``lm_head`` (unused by the score).

    The authors saved ``Qwen2VLForConditionalGeneration`` of transformers 4.45 (``visual.*``, ``model.*`` for the
    decoder); newer transformers name the same tensors ``model.visual.*`` and ``model.language_model.*``. Both load.
    """
    if authors_key.startswith("lm_head."):
        return None
    for prefix, ours in (
        ("model.visual.", "visual."),
        ("model.language_model.", "language_model."),
        ("visual.", "visual."),
        ("model.", "language_model."),
        ("rm_head.", "rm_head."),
    ):
        if authors_key.startswith(prefix):
            return ours + authors_key[len(prefix) :]
    return authors_key  # reported as unexpected


def authors_key(key: str) -> str:
    """Ours → the checkpoint's (transformers 4.45 names), to write a tiny checkpoint as the real one is written."""
    if key.startswith("language_model."):
        return "model." + key[len("language_model.") :]
    return key


def embedding_rows(checkpoint: Path, fix: str) -> int:
    """The token-embedding row count the checkpoint holds (the tokenizer's length with ``<|Reward|>``)."""
    from safetensors import safe_open

    try:
        with safe_open(str(checkpoint), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if module_key(key) == "language_model.embed_tokens.weight":
                    return int(f.get_slice(key).get_shape()[0])
    except (OSError, ValueError, RuntimeError) as exc:  # safetensors raises SafetensorError, a RuntimeError/OSError
        raise FluxgrpoError(f"cannot read {checkpoint} ({type(exc).__name__}: {exc}): {fix}") from exc
    raise FluxgrpoError(f"{checkpoint} has no token embeddings (model.embed_tokens.weight): {fix}")


def load_hpsv3_weights(
    modules: nn.ModuleDict, checkpoint: Path, device: torch.device | str, dtype: torch.dtype, fix: str
) -> None:
    """Assign the checkpoint's tensors to ``modules`` (built empty), each read once straight to ``device`` in
    ``dtype``: the host never holds more than one tensor of the 7B model."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    unexpected = []
    with safe_open(str(checkpoint), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118
            ours = module_key(key)
            if ours is None:
                continue
            if ours.split(".", 1)[0] not in modules:
                unexpected.append(key)
                continue
            tensor = f.get_tensor(key)
            state[ours] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
    expected = set(modules.state_dict())
    missing = sorted(expected - set(state))
    unexpected += sorted(set(state) - expected)
    if missing or unexpected:
        first = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise FluxgrpoError(
            f"{checkpoint} does not fit HPSv3's Qwen2-VL ({len(missing)} missing and {len(unexpected)} unexpected "
            f"keys, {first}): {fix}"
        )
    try:
        modules.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        first_line = str(exc).splitlines()[0]
        raise FluxgrpoError(f"{checkpoint} does not fit HPSv3's Qwen2-VL ({first_line}): {fix}") from exc


def load_hpsv3(folder: str | Path, device: torch.device | str, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """(modules, tokenizer, config) from an HPSv3 folder, on ``device`` in ``dtype`` (rm_head float32), eval."""

    folder = Path(folder)
    status = check_hpsv3_dir(folder)
    if not status.complete:
        raise not_usable(f"HPSv3 weights in {folder}", status.problems, status.fix)
    fix = f"re-run `fluxgrpo fetch-weights --only hpsv3 --hps-dir {folder.parent}`"
    checkpoint = folder / HPSV3_MODEL_DIR / HPSV3_CHECKPOINT
    base = folder / HPSV3_BASE_DIR
    rows = embedding_rows(checkpoint, fix)
    config = read_base_config(base / "config.json", rows, fix)

    from transformers import AutoTokenizer

    tokenizer = load_pretrained(
        lambda: AutoTokenizer.from_pretrained(base, trust_remote_code=False), base, "the HPSv3 tokenizer", fix
    )
    # The authors' create_model_and_processor: <|Reward|> appended as a special token, embeddings resized to match.
    tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    reward_id = tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    if len(tokenizer) != rows or reward_id != rows - 1:
        raise FluxgrpoError(
            f"the tokenizer in {base} has {len(tokenizer)} tokens with {REWARD_TOKEN} added (id {reward_id}), but "
            f"{checkpoint.name} has {rows} embedding rows: the tokenizer is not the one HPSv3 was trained with: {fix}"
        )
    if image_id != config.image_token_id:
        raise FluxgrpoError(
            f"{IMAGE_PAD} is token {image_id} in {base}'s tokenizer but {config.image_token_id} in its config.json: "
            f"{fix}"
        )

    modules = build_hpsv3_modules(config, empty=True)
    load_hpsv3_weights(modules, checkpoint, device, dtype, fix)
    modules.to(device=device, dtype=dtype)
    round_rotary_tables_as_trained(modules)
    modules["rm_head"].float()
    return modules.eval().requires_grad_(False), tokenizer, config


def round_rotary_tables_as_trained(modules: nn.ModuleDict) -> None:
    """Give every rotary embedding the inverse frequencies HPSv3 was trained and run with: bfloat16-rounded.

    The authors' ``create_model_and_processor`` calls ``model.to(torch.bfloat16)``, which casts the rotary
    ``inv_freq`` buffers too; their code then computes the angles from those rounded frequencies (in float32 for
    the decoder). The rounding is up to 2⁻⁹ relative, which at the ~800 positions of an HPSv3 sequence turns some
    decoder angles by most of a radian: it is part of the function the model learned, so float32 scoring keeps it
    (stored in float32, as the rotary code reads it either way).
    """
    import torch

    for module in modules.modules():
        for name in ("inv_freq", "original_inv_freq"):
            table = getattr(module, name, None)
            if isinstance(table, torch.Tensor):
                module.register_buffer(name, table.to(torch.bfloat16).to(torch.float32), persistent=False)


class HpsV3Reward:
    """HPSv3 scores (μ), batched on ``device``; see the module docstring for the exact computation.

    ``folder`` is ``hpsv3_dir(hps_dir)``. The model runs in ``compute_dtype`` (float32 unless ``--reward-dtype
    bf16``), the head in float32. Each prompt's tokens are cached: GRPO scores every prompt G times per iteration.
    """

    name = "hpsv3"

    def __init__(
        self,
        folder: str | Path,
        device: torch.device | str = "cpu",
        batch_size: int = 8,
        text_cache_size: int = 4096,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        import torch

        self.device = torch.device(device)
        self.compute_dtype = torch.float32 if compute_dtype is None else compute_dtype
        self.modules, self.tokenizer, config = load_hpsv3(folder, self.device, self.compute_dtype)
        vision = config.vision_config
        self.patch, self.merge, self.temporal = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
        self.image_token_id = config.image_token_id
        self.reward_token_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.batch_size = batch_size
        self._tokens: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._text_cache_size = text_cache_size

    # -- images → (pixel rows, grids) ------------------------------------------------------------------------------

    def preprocess(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, 3, H, W] in [0, 1] → pixel rows [B · n, 1176] and grids [B, 3] (t, h, w in patches)."""
        import torch

        height, width = smart_resize(*images.shape[-2:])
        pixels = resize_like_pil(images.to(self.device, torch.float32), height, width)
        rows = patchify(normalize_clip(pixels), self.patch, self.merge, self.temporal)
        grid = torch.tensor([1, height // self.patch, width // self.patch], device=self.device)
        return rows, grid.expand(images.shape[0], 3)

    def preprocess_pil(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """The authors' path: PIL bicubic to ``smart_resize`` of each image's own size, then the image processor."""
        import torch
        from PIL import Image as PILImage
        from torchvision.transforms.functional import to_tensor

        rows, grids = [], []
        for image in images:
            rgb = image.convert("RGB")
            height, width = smart_resize(rgb.height, rgb.width)
            resized = rgb.resize((width, height), PILImage.Resampling.BICUBIC)
            pixels = normalize_clip(to_tensor(resized).unsqueeze(0).to(self.device))
            rows.append(patchify(pixels, self.patch, self.merge, self.temporal))
            grids.append([1, height // self.patch, width // self.patch])
        return torch.cat(rows), torch.tensor(grids, device=self.device)

    # -- scoring ----------------------------------------------------------------------------------------------------

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        check_batch(images, prompts)
        return self.score_pixels(*self.preprocess(images), prompts)

    def score_pil(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        check_pil_batch(images, prompts)
        return self.score_pixels(*self.preprocess_pil(images), prompts)

    def score_pixels(self, rows: torch.Tensor, grids: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Pixel rows and grids [B, 3] (from ``preprocess``/``preprocess_pil``) → HPSv3 μ [B] float32."""
        import torch

        if len(prompts) != grids.shape[0]:
            raise ValueError(f"{grids.shape[0]} images but {len(prompts)} prompts: one prompt per image")
        row_counts = grids.prod(dim=-1).tolist()
        starts = [0, *itertools.accumulate(row_counts)]
        scores = []
        with torch.no_grad():
            for first in range(0, len(prompts), self.batch_size):
                last = min(first + self.batch_size, len(prompts))
                pads = [count // self.merge**2 for count in row_counts[first:last]]
                input_ids, attention_mask = self._batch_tokens(prompts[first:last], pads)
                mu_sigma = self.reward_logits(
                    input_ids, attention_mask, rows[starts[first] : starts[last]], grids[first:last]
                )
                scores.append(mu_sigma[:, 0])
        return torch.cat(scores)

    def reward_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor, grids: torch.Tensor
    ) -> torch.Tensor:
        """The authors' forward: [B, 2] float32 (μ, σ) at each sequence's ``<|Reward|>`` token."""
        import torch

        visual, language_model = self.modules["visual"], self.modules["language_model"]
        embeds = language_model.embed_tokens(input_ids)
        vision_out = visual(rows.to(self.compute_dtype), grid_thw=grids)
        image_embeds = getattr(vision_out, "pooler_output", vision_out)  # transformers < 5 returns the tensor
        image_mask = (input_ids == self.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(image_mask, image_embeds.to(embeds.dtype))
        batch, length = input_ids.shape
        # Sequential positions on all three rotary sections: what the authors' direct decoder call gets.
        positions = torch.arange(length, device=input_ids.device).view(1, 1, length).expand(3, batch, length)
        hidden = language_model(
            inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions, use_cache=False
        ).last_hidden_state
        at_reward = input_ids == self.reward_token_id
        return self.modules["rm_head"](hidden[at_reward].float()).view(batch, -1)

    def _batch_tokens(self, prompts: list[str], image_pads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ids and attention mask [B, L], right-padded, each with its image's pad count."""
        import torch

        sequences = []
        for prompt, pads in zip(prompts, image_pads, strict=True):
            ids = self._prompt_tokens(prompt)
            at = int((ids == self.image_token_id).nonzero()[0, 0])
            sequences.append(torch.cat([ids[:at], ids.new_full((pads,), self.image_token_id), ids[at + 1 :]]))
        length = max(len(ids) for ids in sequences)
        input_ids = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for index, ids in enumerate(sequences):
            input_ids[index, : len(ids)] = ids
            attention_mask[index, : len(ids)] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    def _prompt_tokens(self, prompt: str) -> torch.Tensor:
        """The conversation's ids with a single image pad, cached per prompt (least recently used dropped)."""
        import torch

        if prompt in self._tokens:
            self._tokens.move_to_end(prompt)
            return self._tokens[prompt]
        ids = torch.tensor(self.tokenizer(conversation_text(prompt))["input_ids"], dtype=torch.long)
        if int((ids == self.reward_token_id).sum()) != 1 or int((ids == self.image_token_id).sum()) != 1:
            raise ValueError(
                f"prompt {prompt[:60]!r} contains Qwen2-VL's special tokens ({REWARD_TOKEN} or {IMAGE_PAD}): HPSv3 "
                "reads its score at the one reward token; remove them from the prompt"
            )
        self._tokens[prompt] = ids
        while len(self._tokens) > self._text_cache_size:
            self._tokens.popitem(last=False)
        return ids


def _load(hps_dir: Path, device: torch.device | str, dtype: torch.dtype) -> HpsV3Reward:
    return HpsV3Reward(hpsv3_dir(hps_dir), device, compute_dtype=dtype)


def _write_tiny(hps_dir: Path, seed: int) -> dict[str, int]:
    return {"hpsv3": write_tiny_hpsv3(hpsv3_dir(hps_dir), seed)}


RECORD = RewardRecord(
    "hpsv3",
    _load,
    parts=(
        WeightsPart(
            "hpsv3",
            lambda hps_dir: check_hpsv3_dir(hpsv3_dir(hps_dir)),
            hub=REWARD_HUB_PARTS["hpsv3"],
        ),
    ),
    write_tiny=_write_tiny,
    parameters=7_748_610_610,  # Qwen2-VL-7B without lm_head, + the rm_head
    casts_weights=True,
)


def write_tiny_hpsv3(folder: Path, seed: int = 0) -> int:
    """Write a tiny HPSv3 (``model/``: HPSv3.safetensors in the authors' keys; ``base/``: a Qwen2-VL config.json in
    the real file's format and a Qwen2 tokenizer) with a manifest in each; returns bytes."""
    from safetensors.torch import save_file

    folder = Path(folder)
    model_dir, base_dir = folder / HPSV3_MODEL_DIR, folder / HPSV3_BASE_DIR
    fresh_subfolders(model_dir, base_dir)
    tokenizer = build_tiny_qwen2_tokenizer()
    save_file(build_tiny_hpsv3_state(tokenizer, seed), model_dir / HPSV3_CHECKPOINT, metadata={"format": "pt"})
    tokenizer.save_pretrained(base_dir)
    (base_dir / "config.json").write_text(json.dumps(tiny_hpsv3_base_config(tokenizer), indent=2) + "\n")
    return write_subfolder_manifests("hpsv3", model_dir, base_dir)


# HPSv3: a Qwen2-VL with two decoder layers of width 32 and two vision blocks (the real patch, merge and temporal sizes,
# so images go through exactly the real preprocessing), and the real rm_head shape. The tokenizer is byte-level BPE
# with Qwen2's special tokens after the 256 byte symbols and merges that spell each word of the authors' instruction
# (so a conversation is ~700 tokens, not ~2900 bytes).
QWEN2_VL_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TINY_HPSV3_VISION: dict[str, Any] = {
    "depth": 2,
    "embed_dim": 32,
    "hidden_size": 32,
    "mlp_ratio": 2,
    "num_heads": 2,
    "in_chans": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def build_tiny_qwen2_tokenizer() -> Qwen2Tokenizer:
    """A Qwen2 tokenizer: the 256 byte symbols, merges spelling the instruction's words, then Qwen2-VL's specials."""
    from transformers import Qwen2Tokenizer

    symbols = byte_level_symbols()
    bytes_only = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(symbols)}, merges=[])
    pieces = bytes_only.backend_tokenizer.pre_tokenizer.pre_tokenize_str(INSTRUCTION + RATING_REQUEST)
    vocab = {s: i for i, s in enumerate(symbols)}
    merges: list[tuple[str, str]] = []
    for piece, _ in pieces:
        for end in range(2, len(piece) + 1):  # "Ġwor" + "d" → "Ġword", one merge per prefix
            left, right = piece[: end - 1], piece[end - 1]
            if piece[:end] not in vocab:
                vocab[piece[:end]] = len(vocab)
                merges.append((left, right))
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN2_VL_SPECIAL_TOKENS[1:])})
    return tokenizer


def tiny_hpsv3_base_config(tokenizer: Qwen2Tokenizer) -> dict[str, Any]:
    """config.json of the tiny Qwen2-VL, in the real Qwen2-VL-7B-Instruct file's (flat, transformers 4.4x) format."""
    ids = dict(
        zip(QWEN2_VL_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN2_VL_SPECIAL_TOKENS)), strict=True)
    )
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 4096,  # unused: use_sliding_window is false, as in the real config
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": dict(TINY_HPSV3_VISION),
        # head_dim 8: four rotary frequencies, split over (time, height, width) as the real [16, 24, 24] splits 64
        "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        "vocab_size": len(tokenizer) + 2,  # the config's row count is padded past the tokenizer's, as the real one is
    }


# The decoder's query and key weights: random weights of the usual 0.02 make attention nearly uniform, so the tiny
# model would not tell rotary positions apart (what the plain-positions and rounded-tables tests check); much larger
# ones make it chaotic, so that the 8-bit rounding of the PIL path moves its scores more than their spread.
TINY_HPSV3_ATTENTION_STD = 0.35


def build_tiny_hpsv3_state(tokenizer: Qwen2Tokenizer, seed: int = 0) -> dict[str, Any]:
    """A random tiny HPSv3's weights under the authors' checkpoint keys (transformers 4.45 names, ``lm_head`` kept),
    all bfloat16 as in the real file; seeded, global RNG untouched.

    The embeddings have one row per token with ``<|Reward|>`` added; the head gets weights of std 1.5/√fan_in so
    scores vary visibly with the image, the decoder's query and key projections ``TINY_HPSV3_ATTENTION_STD``.
    """
    import torch

    rows = len(tokenizer) + 1  # <|Reward|>
    config = read_base_config_values(tiny_hpsv3_base_config(tokenizer), rows)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        modules = build_hpsv3_modules(config)
        for layer in modules["rm_head"]:
            if isinstance(layer, torch.nn.Linear):
                torch.nn.init.normal_(layer.weight, std=1.5 / layer.in_features**0.5)
                torch.nn.init.normal_(layer.bias, std=0.1)
        for layer in modules["language_model"].layers:  # attention sharp enough that positions matter
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                torch.nn.init.normal_(projection.weight, std=TINY_HPSV3_ATTENTION_STD)
        lm_head = torch.randn(rows, config.text_config.hidden_size) * 0.02
    state = {authors_key(key): value for key, value in modules.state_dict().items()}
    state["lm_head.weight"] = lm_head
    return {key: value.to(torch.bfloat16).contiguous() for key, value in state.items()}
