"""Tiny random FLUX, HPS-style and PickScore-style models, built offline and seeded, with the real architecture classes.

They exist so every command and test runs on a laptop CPU through the same loading code as FLUX.1-dev, HPSv2 and
PickScore: the FLUX parts are the diffusers/transformers classes FLUX.1-dev uses (shrunk), the HPS reward model is
an open_clip CLIP with the HPS checkpoint layout, and PickScore is a transformers CLIPModel with a CLIP tokenizer
and image processor. Nothing here downloads anything.

Shapes that follow from the choices below (and that the rest of the code may rely on for the tiny weights only):
- transformer: 2 double-stream + 2 single-stream blocks, 2 heads x 16, so 4*2 + 2*2 = 12 q/k RMSNorms
  (each double block has norm_q, norm_k, norm_added_q, norm_added_k; each single block norm_q, norm_k);
- joint_attention_dim 32 (= T5 d_model), pooled_projection_dim 32 (= CLIP hidden size);
- VAE: 16 latent channels and 4 blocks, so an H x W image is a 16 x H/8 x W/8 latent, as in FLUX;
- a 64 x 64 image is 16 packed tokens of width 64.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffusers import FluxPipeline
    from open_clip.model import CLIP
    from transformers import CLIPModel

# open_clip model config (the format of open_clip's model_configs/*.json). The tokenizer is open_clip's real one
# (49408 tokens, context 77), so the text tower's vocabulary matches ViT-H-14's.
TINY_REWARD_CONFIG: dict[str, Any] = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 224, "layers": 1, "width": 32, "head_width": 16, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}

# The CLIP image processor settings PickScore is used with (laion/CLIP-ViT-H-14-laion2B-s32B-b79K, OpenAI CLIP's
# preprocessing): shortest side to 224 bicubic, centre crop 224, OpenAI CLIP mean and std. Written in the legacy
# feature-extractor form many CLIP repos still ship; CLIPImageProcessor reads both forms.
PICKSCORE_PROCESSOR_CONFIG: dict[str, Any] = {
    "crop_size": 224,
    "do_center_crop": True,
    "do_normalize": True,
    "do_resize": True,
    "feature_extractor_type": "CLIPFeatureExtractor",
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,  # PIL bicubic
    "size": 224,
}

# FLUX.1-dev's own scheduler settings (dynamic shifting by image sequence length).
FLUX_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}

# FLUX.1-dev's VAE latent statistics (DanceGRPO hard-codes the same two numbers).
FLUX_VAE_SCALING_FACTOR = 0.3611
FLUX_VAE_SHIFT_FACTOR = 0.1159

T5_MAX_LENGTH = 512
CLIP_MAX_LENGTH = 77

# Words the tiny T5 vocabulary knows whole; anything else is spelled from single characters.
_T5_WORDS = [
    "a",
    "an",
    "the",
    "of",
    "in",
    "on",
    "at",
    "to",
    "from",
    "with",
    "without",
    "by",
    "for",
    "and",
    "or",
    "but",
    "under",
    "over",
    "above",
    "below",
    "behind",
    "beside",
    "near",
    "far",
    "through",
    "across",
    "into",
    "onto",
    "inside",
    "outside",
    "between",
    "among",
    "around",
    "against",
    "along",
    "during",
    "before",
    "after",
    "while",
    "is",
    "are",
    "was",
    "were",
    "be",
    "been",
    "being",
    "has",
    "have",
    "had",
    "do",
    "does",
    "did",
    "can",
    "could",
    "will",
    "would",
    "should",
    "may",
    "might",
    "must",
    "this",
    "that",
    "these",
    "those",
    "there",
    "here",
    "where",
    "when",
    "which",
    "who",
    "whose",
    "what",
    "why",
    "how",
    "very",
    "more",
    "most",
    "less",
    "least",
    "i",
    "you",
    "he",
    "she",
    "it",
    "we",
    "they",
    "me",
    "him",
    "her",
    "us",
    "them",
    "my",
    "your",
    "his",
    "its",
    "our",
    "their",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "hundred",
    "thousand",
    "first",
    "second",
    "last",
    "next",
    "many",
    "few",
    "some",
    "every",
    "each",
    "all",
    "both",
    "other",
    "another",
    "same",
    "cat",
    "cats",
    "dog",
    "dogs",
    "bird",
    "birds",
    "horse",
    "fish",
    "fox",
    "owl",
    "bear",
    "wolf",
    "lion",
    "tiger",
    "rabbit",
    "deer",
    "whale",
    "dolphin",
    "butterfly",
    "dragon",
    "man",
    "woman",
    "child",
    "children",
    "boy",
    "girl",
    "person",
    "people",
    "king",
    "queen",
    "knight",
    "wizard",
    "robot",
    "astronaut",
    "pilot",
    "sailor",
    "farmer",
    "chef",
    "painter",
    "musician",
    "dancer",
    "monk",
    "witch",
    "soldier",
    "warrior",
    "princess",
    "city",
    "town",
    "village",
    "street",
    "road",
    "bridge",
    "tower",
    "castle",
    "house",
    "home",
    "room",
    "kitchen",
    "garden",
    "forest",
    "tree",
    "trees",
    "flower",
    "flowers",
    "grass",
    "field",
    "meadow",
    "mountain",
    "mountains",
    "hill",
    "valley",
    "river",
    "lake",
    "sea",
    "ocean",
    "beach",
    "island",
    "desert",
    "cave",
    "sky",
    "cloud",
    "clouds",
    "sun",
    "moon",
    "star",
    "stars",
    "planet",
    "space",
    "galaxy",
    "rain",
    "snow",
    "storm",
    "fog",
    "wind",
    "fire",
    "water",
    "ice",
    "stone",
    "rock",
    "sand",
    "wood",
    "metal",
    "glass",
    "gold",
    "silver",
    "steel",
    "paper",
    "light",
    "shadow",
    "night",
    "day",
    "morning",
    "evening",
    "sunset",
    "sunrise",
    "dawn",
    "dusk",
    "winter",
    "spring",
    "summer",
    "autumn",
    "season",
    "weather",
    "red",
    "orange",
    "yellow",
    "green",
    "blue",
    "purple",
    "pink",
    "brown",
    "black",
    "white",
    "gray",
    "grey",
    "dark",
    "bright",
    "colorful",
    "golden",
    "pale",
    "big",
    "small",
    "large",
    "tiny",
    "huge",
    "giant",
    "little",
    "tall",
    "short",
    "long",
    "old",
    "young",
    "new",
    "ancient",
    "modern",
    "futuristic",
    "beautiful",
    "pretty",
    "ugly",
    "cute",
    "happy",
    "sad",
    "angry",
    "calm",
    "quiet",
    "loud",
    "soft",
    "hard",
    "warm",
    "cold",
    "hot",
    "wet",
    "dry",
    "clean",
    "dirty",
    "portrait",
    "landscape",
    "painting",
    "photo",
    "photograph",
    "picture",
    "drawing",
    "sketch",
    "illustration",
    "render",
    "poster",
    "still",
    "life",
    "style",
    "detailed",
    "highly",
    "realistic",
    "photorealistic",
    "cinematic",
    "dramatic",
    "lighting",
    "soft",
    "sharp",
    "focus",
    "depth",
    "bokeh",
    "oil",
    "watercolor",
    "pencil",
    "ink",
    "digital",
    "art",
    "artwork",
    "concept",
    "fantasy",
    "science",
    "fiction",
    "steampunk",
    "cyberpunk",
    "vintage",
    "retro",
    "minimalist",
    "abstract",
    "surreal",
    "impressionist",
    "baroque",
    "gothic",
    "medieval",
    "victorian",
    "neon",
    "glowing",
    "misty",
    "foggy",
    "sitting",
    "standing",
    "walking",
    "running",
    "flying",
    "swimming",
    "reading",
    "eating",
    "drinking",
    "sleeping",
    "playing",
    "holding",
    "wearing",
    "looking",
    "smiling",
    "floating",
    "dancing",
    "singing",
    "riding",
    "climbing",
    "hat",
    "coat",
    "dress",
    "shirt",
    "shoes",
    "glasses",
    "scarf",
    "crown",
    "sword",
    "shield",
    "book",
    "books",
    "cup",
    "tea",
    "coffee",
    "bread",
    "apple",
    "apples",
    "cake",
    "table",
    "chair",
    "window",
    "door",
    "lamp",
    "candle",
    "clock",
    "car",
    "train",
    "boat",
    "ship",
    "plane",
    "bicycle",
    "map",
    "key",
    "mirror",
    "top",
    "side",
    "front",
    "back",
    "left",
    "right",
    "center",
    "middle",
    "corner",
    "edge",
    "view",
    "close",
    "up",
    "wide",
    "angle",
    "shot",
    "lens",
    "camera",
]
_T5_CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()&/%$#@*+=_"


def byte_level_symbols() -> list[str]:
    """The 256 printable stand-ins for bytes used by byte-level BPE, in CLIP's vocabulary order.

    Bytes that are already visible characters map to themselves; the rest (controls, space, a few Latin-1
    gaps) map to code points from 256 upward, in byte order.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    remapped = [b for b in range(256) if b not in set(visible)]
    return [chr(b) for b in visible] + [chr(256 + n) for n in range(len(remapped))]


def build_tiny_clip_tokenizer() -> Any:
    """A CLIP BPE tokenizer with no merges: 256 byte symbols, 256 end-of-word variants, start and end tokens.

    Token ids 0..511 coincide with the full CLIP vocabulary's; only the merges (and so the length) differ.
    """
    from transformers import CLIPTokenizer

    symbols = byte_level_symbols()
    tokens = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={tok: i for i, tok in enumerate(tokens)}, merges=[], model_max_length=CLIP_MAX_LENGTH)


def build_tiny_t5_tokenizer() -> Any:
    """A T5 unigram tokenizer over a few hundred common English words plus single ASCII characters."""
    from transformers import T5Tokenizer

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -4.0)]
    seen = {p for p, _ in pieces}
    # Whole words score far above characters so a known word is one token; characters spell the rest.
    for word in _T5_WORDS:
        piece = "▁" + word
        if piece not in seen:
            pieces.append((piece, -6.0))
            seen.add(piece)
    for char in _T5_CHARACTERS:
        for piece in (char, "▁" + char):
            if piece not in seen:
                pieces.append((piece, -12.0))
                seen.add(piece)
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)


# The tiny FLUX transformer: FLUX.1-dev's structure at toy width. Tests that build a transformer without
# weight files start from this and override what they need (e.g. fewer blocks).
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,  # 16 latent channels x 2x2 packing
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,  # = the tiny T5's d_model
    "pooled_projection_dim": 32,  # = the tiny CLIP's hidden size
    "guidance_embeds": True,  # FLUX.1-dev is guidance-distilled
    "axes_dims_rope": (4, 6, 6),  # each even, summing to attention_head_dim
}


def build_tiny_flux_pipeline(seed: int = 0) -> FluxPipeline:
    """A random FluxPipeline with FLUX.1-dev's component classes, seeded; the global RNG is left untouched."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tokenizer = build_tiny_clip_tokenizer()
    t5_tokenizer = build_tiny_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(clip_tokenizer),
                hidden_size=32,
                intermediate_size=37,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=CLIP_MAX_LENGTH,
                projection_dim=32,
                hidden_act="quick_gelu",
                bos_token_id=clip_tokenizer.bos_token_id,
                eos_token_id=clip_tokenizer.eos_token_id,
                pad_token_id=clip_tokenizer.pad_token_id,
            )
        )
        t5 = T5EncoderModel(
            T5Config(
                vocab_size=len(t5_tokenizer),
                d_model=32,
                d_kv=8,
                d_ff=37,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                feed_forward_proj="gated-gelu",
                is_encoder_decoder=False,
                use_cache=False,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            )
        )
        transformer = FluxTransformer2DModel(**TINY_TRANSFORMER_CONFIG)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            latent_channels=16,
            norm_num_groups=4,
            sample_size=64,
            use_quant_conv=False,
            use_post_quant_conv=False,
            scaling_factor=FLUX_VAE_SCALING_FACTOR,
            shift_factor=FLUX_VAE_SHIFT_FACTOR,
        )
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG)
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tokenizer,
        text_encoder_2=t5,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )


def build_tiny_reward_model(seed: int = 0) -> CLIP:
    """A random open_clip CLIP with the TINY_REWARD_CONFIG architecture, seeded; the global RNG is untouched."""
    import torch
    from open_clip.model import CLIP

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIP(**copy.deepcopy(TINY_REWARD_CONFIG))
    return model.eval()


def build_tiny_pickscore_model(seed: int = 0) -> CLIPModel:
    """A random transformers CLIPModel shaped like PickScore's (a CLIP with projections), shrunk; seeded.

    The vision tower takes 224 x 224 inputs, what the processor config produces (49 patches of 32); the text tower
    uses the tiny CLIP tokenizer's 514 ids with CLIP's 77 positions. The global RNG is left untouched.
    """
    import torch
    from transformers import CLIPConfig, CLIPModel

    tokenizer = build_tiny_clip_tokenizer()
    config = CLIPConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 37,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": CLIP_MAX_LENGTH,
            "hidden_act": "gelu",
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "image_size": PICKSCORE_PROCESSOR_CONFIG["crop_size"],
            "patch_size": 32,
            "hidden_size": 32,
            "intermediate_size": 37,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "hidden_act": "gelu",
        },
        projection_dim=16,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config)
    return model.eval()
