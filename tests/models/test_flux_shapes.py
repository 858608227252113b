"""FLUX's shapes written out (``models/flux_shapes.py``, what the launching command sizes a run from without importing
diffusers) against the models diffusers builds on the meta device: every known model, and the options a config
may set differently (no guidance embedder, other output channels and patch size, no mid-block attention)."""

from __future__ import annotations

import pytest
import torch

from fluxgrpo.models.flux_shapes import transformer_layout, vae_parameter_count
from fluxgrpo.models.known import KNOWN_MODELS
from fluxgrpo.training.memory import (
    _built_transformer_shape,
    lora_adapter_shapes,
    shape_of,
    transformer_shape,
    vae_shape,
)

TRANSFORMERS = {
    **{name: model.transformer for name, model in KNOWN_MODELS.items()},
    "tiny-variant": {
        **KNOWN_MODELS["tiny"].transformer,
        "guidance_embeds": False,
        "out_channels": 16,
        "patch_size": 2,
        "_class_name": "FluxTransformer2DModel",  # diffusers' own keys in a config.json say nothing about shapes
    },
}
VAES = {
    **{name: model.vae for name, model in KNOWN_MODELS.items()},
    "tiny-variant": {
        **KNOWN_MODELS["tiny"].vae,
        "mid_block_add_attention": False,
        "use_quant_conv": True,
        "use_post_quant_conv": True,
        "layers_per_block": 2,
        "latents_mean": None,
    },
}


@pytest.mark.parametrize("name", sorted(TRANSFORMERS))
def test_the_written_out_transformer_is_the_one_diffusers_builds(name):
    from diffusers import FluxTransformer2DModel

    config = TRANSFORMERS[name]
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(config)
    shapes, linears = transformer_layout(config)
    assert list(shapes.items()) == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    built_linears = [
        (n, (m.in_features, m.out_features)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    ]
    assert list(linears.items()) == built_linears
    assert transformer_shape(config) == shape_of(model)
    targets = ("to_q", "to_k", "to_v", "to_out.0", "proj_mlp")
    built_adapters = [
        shape
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith("." + t) for t in targets)
        for shape in ((8, m.in_features), (m.out_features, 8))
    ]
    assert lora_adapter_shapes(config, targets, 8) == tuple(built_adapters)


@pytest.mark.parametrize("name", sorted(VAES))
def test_the_written_out_vae_is_the_one_diffusers_builds(name):
    from diffusers import AutoencoderKL

    config = VAES[name]
    with torch.device("meta"):
        vae = AutoencoderKL.from_config(config)
    assert vae_parameter_count(config) == sum(p.numel() for p in vae.parameters())
    channels = list(vae.config.block_out_channels)
    assert vae_shape(config).decode_channels == channels[min(1, len(channels) - 1)]


def test_a_config_the_written_out_models_do_not_cover_is_built_instead():
    odd = {**KNOWN_MODELS["tiny"].transformer, "some_new_option": 1}
    assert transformer_layout(odd) is None
    assert transformer_shape(odd) == _built_transformer_shape(KNOWN_MODELS["tiny"].transformer)
    assert (
        vae_parameter_count({**KNOWN_MODELS["tiny"].vae, "down_block_types": ("AttnDownEncoderBlock2D",) * 4}) is None
    )


def test_sizing_a_run_does_not_import_diffusers(tmp_path):
    """The launching command plans the run (memory estimate included) before any worker starts; diffusers' import
    belongs to the workers, which load the model."""
    import json
    import subprocess
    import sys

    written = {"_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.42.1", "out_channels": None}
    (tmp_path / "transformer.json").write_text(json.dumps({**KNOWN_MODELS["tiny"].transformer, **written}))
    (tmp_path / "vae.json").write_text(json.dumps({**KNOWN_MODELS["tiny"].vae, "_class_name": "AutoencoderKL"}))
    code = (
        "import sys, json\n"
        "from fluxgrpo.training.memory import transformer_shape, vae_shape, lora_adapter_shapes\n"
        "transformer, vae = (json.load(open(sys.argv[1] + name)) for name in ('/transformer.json', '/vae.json'))\n"
        "transformer_shape(transformer), vae_shape(vae), lora_adapter_shapes(transformer, ('to_q',), 4)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('diffusers', 'transformers', 'peft')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
