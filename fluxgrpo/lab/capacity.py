"""Is the shapes world's base model short of data, of text features or of size?
``python -m fluxgrpo.lab.capacity --flux-dir D``.

Two readings of the shipped (or any built) FLUX folder, through the builder's own pieces, printed as one JSON
document:

- its rectified-flow loss on the builder's own training renders, on fresh renders of the same captions and on renders
  of the held-out captions: a gap between the first two would be memorising (more renders would help); none means
  the model is short of fitting even what it saw;
- how well a linear read-out of the T5 features the transformer is handed, fitted on the training captions, recovers
  each part of the held-out captions (colours, shapes, relation, count), seen and novel combinations apart: whether
  the captions reach the transformer intact. The read-out sees the tokens in order; the transformer does not (FLUX's
  text positions are all zero), so a second read-out asks each colour or shape word alone whether its object is the
  one a relation puts first (top or left): 0.5 is a caption whose word order never reaches the transformer;
- the flow loss on renders of the relation captions told with the true caption, with its relation's direction
  swapped (above ↔ below) and with its axis swapped (above ↔ left of): equal losses are a model that ignores the
  relation words.

The results page (``fluxgrpo/docs/results/shapes-world.md``, "Where RL tops out") reads them against what RL changes
(``lab.measure``'s claim breakdown).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from fluxgrpo.lab.build_text import CAPTION_SLOTS, caption_slots
from fluxgrpo.shapes import world

__all__ = ["CAPTION_SLOTS", "capacity", "caption_slots", "slot_probe"]


def flow_loss(pipe: Any, images: np.ndarray, captions: list[str], seed: int = 7, batch: int = 250) -> float:
    """The base model's rectified-flow loss on rendered images of ``captions`` (σ drawn as the builder draws them,
    guidance input 1): the training objective, read on any renders."""
    import torch

    from fluxgrpo.grpo.latents import image_ids, pack_latents
    from fluxgrpo.grpo.rollout import predict_velocity
    from fluxgrpo.grpo.schedule import model_timesteps
    from fluxgrpo.grpo.types import Conditioning
    from fluxgrpo.lab.build import draw_sigmas, encode_dataset
    from fluxgrpo.shapes.tokenizers import WORLD_TEXT_LENGTH

    vae = pipe.vae
    packed = pack_latents((encode_dataset(vae, images) - vae.config.shift_factor) * vae.config.scaling_factor)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    with torch.no_grad():
        for start in range(0, len(packed), batch):
            x0 = packed[start : start + batch]
            noise = torch.randn(x0.shape, generator=generator)
            sigma = draw_sigmas(len(x0), generator)
            noisy = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
            embeds, pooled, _ = pipe.encode_prompt(
                prompt=captions[start : start + batch], prompt_2=None, max_sequence_length=WORLD_TEXT_LENGTH
            )
            cond = Conditioning(embeds, pooled, torch.zeros(WORLD_TEXT_LENGTH, 3))
            velocity = predict_velocity(pipe.transformer, noisy, cond, model_timesteps(sigma),
                                        torch.ones(len(x0)), image_ids(64, 64), "cpu")  # fmt: skip
            losses.append((velocity.float() - (noise - x0)).pow(2).mean(dim=(1, 2)))
    return float(torch.cat(losses).mean())


def slot_probe(train: np.ndarray, train_labels: list[str], test: np.ndarray, test_labels: list[str]) -> float:
    """Accuracy on ``test`` of a linear read-out (ridge regression onto one-hot labels, standardised features, a
    bias) fitted on ``train``: is the part of the caption linearly there in the features?"""
    classes = sorted(set(train_labels))
    mean, std = train.mean(0), train.std(0) + 1e-6

    def design(x: np.ndarray) -> np.ndarray:
        return np.hstack([(x - mean) / std, np.ones((len(x), 1))])

    targets = np.eye(len(classes))[[classes.index(label) for label in train_labels]]
    x = design(train)
    weights = np.linalg.solve(x.T @ x + np.eye(x.shape[1]), x.T @ targets)
    predicted = [classes[i] for i in (design(test) @ weights).argmax(1)]
    return float(np.mean([p == t for p, t in zip(predicted, test_labels, strict=True)]))


def capacity(flux_dir: Path, images: int = 2000) -> dict[str, Any]:
    """Is the base model short of data, of text features or of size? Its flow loss on the builder's own training
    renders, on fresh renders of the same captions and on renders of the held-out captions (a gap between the first
    two would be memorising); and how well a linear read-out of the T5 features of the training captions recovers
    each part of the held-out captions, seen and novel apart (what the transformer is handed)."""
    import torch
    from diffusers import FluxPipeline

    from fluxgrpo.lab.build import render_dataset
    from fluxgrpo.lab.plan import FULL_PLAN, training_captions
    from fluxgrpo.shapes.tokenizers import WORLD_TEXT_LENGTH

    pipe = FluxPipeline.from_pretrained(flux_dir, dtype=torch.float32, trust_remote_code=False)
    train_captions = training_captions()
    parts = world.split()
    heldout_captions = [*parts.eval_seen, *parts.eval_novel]
    # The builder's own first renders (same seed, same order), fresh renders of the same captions, held-out renders.
    built, built_index = render_dataset(images, FULL_PLAN.seed)
    fresh, fresh_index = render_dataset(images, FULL_PLAN.seed + 1000)
    held, held_index = render_dataset(images, FULL_PLAN.seed + 1001, heldout_captions)
    loss = {
        "training_renders": flow_loss(pipe, built, [train_captions[i] for i in built_index]),
        "fresh_renders_of_training_captions": flow_loss(pipe, fresh, [train_captions[i] for i in fresh_index]),
        "renders_of_heldout_captions": flow_loss(pipe, held, [heldout_captions[i] for i in held_index]),
    }

    def t5_features(captions: list[str]) -> np.ndarray:
        with torch.no_grad():
            embeds, _, _ = pipe.encode_prompt(prompt=captions, prompt_2=None, max_sequence_length=WORLD_TEXT_LENGTH)
        return embeds.flatten(1).numpy()

    train_x = t5_features(train_captions)
    train_slots = [caption_slots(c) for c in train_captions]
    probe: dict[str, dict[str, float]] = {}
    for kind, captions in (("seen", list(parts.eval_seen)), ("novel", list(parts.eval_novel))):
        test_x = t5_features(captions)
        test_slots = [caption_slots(c) for c in captions]
        for slot, name in enumerate(CAPTION_SLOTS):
            train_y = [labels[slot] for labels in train_slots]
            test_y = [labels[slot] for labels in test_slots]
            probe.setdefault(name, {})[kind] = round(slot_probe(train_x, train_y, test_x, test_y), 4)
    relation_train = [c for c in train_captions if world.parse_caption(c).relation]
    relation_held = [c for c in heldout_captions if world.parse_caption(c).relation]
    t5, t5_tokenizer = pipe.text_encoder_2, pipe.tokenizer_2
    order = slot_probe(*word_leads(t5, t5_tokenizer, relation_train), *word_leads(t5, t5_tokenizer, relation_held))
    rendered, index = render_dataset(images, FULL_PLAN.seed + 1002, relation_train)
    told = [relation_train[i] for i in index]
    relation_loss = {
        "true_caption": flow_loss(pipe, rendered, told, seed=3),
        "direction_swapped": flow_loss(pipe, rendered, [swap_relation(c, _OPPOSITE) for c in told], seed=3),
        "axis_swapped": flow_loss(pipe, rendered, [swap_relation(c, _OTHER_AXIS) for c in told], seed=3),
    }
    return {
        "flow_loss": {k: round(v, 4) for k, v in loss.items()},
        "t5_slot_probe_heldout": probe,
        "t5_word_knows_its_object_leads_heldout": round(order, 4),
        "relation_renders_flow_loss": {k: round(v, 5) for k, v in relation_loss.items()},
    }


_OPPOSITE = {"above": "below", "below": "above", "left of": "right of", "right of": "left of"}
_OTHER_AXIS = {"above": "left of", "below": "right of", "left of": "above", "right of": "below"}


def swap_relation(caption: str, swap: dict[str, str]) -> str:
    """``caption`` with its relation words replaced as ``swap`` says (its objects kept in place)."""
    parsed = world.parse_caption(caption)
    assert parsed.relation is not None
    return caption.replace(f" {parsed.relation} ", f" {swap[parsed.relation]} ")


def word_leads(t5: Any, tokenizer: Any, captions: list[str]) -> tuple[np.ndarray, list[str]]:
    """Each colour and shape word of the relation ``captions``: its own T5 feature (the transformer reads text
    tokens without their order: FLUX's text positions are all zero) and whether its object is the one the relation
    puts first (top or left): :func:`slot_probe`'s input for "does a word know where its object goes"."""
    import torch

    from fluxgrpo.lab.build_text import ROLES, token_roles
    from fluxgrpo.shapes.tokenizers import WORLD_TEXT_LENGTH

    ids = tokenizer(captions, padding="max_length", max_length=WORLD_TEXT_LENGTH, return_tensors="pt").input_ids
    with torch.no_grad():
        features = t5(ids)[0]
    rows, labels = [], []
    for caption, row, feature in zip(captions, ids, features, strict=True):
        for k, role in enumerate(token_roles(caption, tokenizer.convert_ids_to_tokens(row.tolist()))):
            if ROLES[role] in ("top", "bottom", "left", "right"):
                rows.append(feature[k].numpy())
                labels.append(str(ROLES[role] in ("top", "left")))
    return np.array(rows), labels


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="python -m fluxgrpo.lab.capacity", description=__doc__.splitlines()[0])
    parser.add_argument("--flux-dir", default="data/flux")
    parser.add_argument("--images", type=int, default=2000, help="renders per flow-loss reading")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps(capacity(Path(args.flux_dir), args.images), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
