"""The builder's text stage: the world's T5 and CLIP learn to parse captions before the transformer reads them.

FLUX's transformer gives every text token the same position (its text ids are zeros), so the joint attention sees
the caption as a set of token features: which object a relation puts on top is there only if the T5 features carry
it, as T5-XXL's do. The world's tiny encoders, trained only by the flow loss, did not learn it: a linear read-out of
a shape word's T5 feature told the top (or left) object from the other in 0.46 of held-out relation captions (chance
0.5), and the base model stood a relation's two objects as the caption says in 0.295 of images (chance 1/3).

So the encoders first learn, from the training captions' words alone (no image), what a pretrained encoder knows:
- T5, per token: the word itself and its **role**, the place in the scene of the object the word belongs to
  (``top``/``bottom``/``left``/``right`` in a relation caption, ``object`` in any other, ``none`` for the rest);
- CLIP's pooled vector: every part of the caption (:data:`CAPTION_SLOTS`) and which object
  the relation puts first (top or left).
The heads are dropped afterwards. The build then keeps the encoders as this stage leaves them (``plan.text_encoders``
False), as FLUX keeps its pretrained ones; trained on by the flow loss, they lose part of what they learnt here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fluxgrpo.lab.plan import BuildPlan, log, training_captions, warmup_cosine
from fluxgrpo.shapes import world
from fluxgrpo.shapes.tokenizers import WORLD_TEXT_LENGTH

if TYPE_CHECKING:
    import torch
    from transformers import CLIPTextModel, PreTrainedTokenizerBase, T5EncoderModel

ROLES = ("none", "object", "top", "bottom", "left", "right")
# The roles of a relation caption's (first, second) object.
_RELATION_ROLES = {
    "above": ("top", "bottom"),
    "below": ("bottom", "top"),
    "left of": ("left", "right"),
    "right of": ("right", "left"),
}
_OBJECT_WORDS = {*world.SHAPES, *world.PLURALS.values(), *world.COLOURS, *world.COUNT_WORDS.values()}
_SEPARATORS = {"and", "left", "right", "above", "below"}


def token_roles(caption: str, pieces: list[str]) -> list[int]:
    """The :data:`ROLES` index of each of ``caption``'s T5 pieces (as the tokenizer writes them, ``▁`` prefixed):
    the role of the object a colour, shape or count word describes, ``none`` for every other piece."""
    parsed = world.parse_caption(caption)
    roles = _RELATION_ROLES[parsed.relation] if parsed.relation else ("object", "object")
    index, out = 0, []
    for piece in pieces:
        word = piece.lstrip("▁")
        if word in _SEPARATORS:
            index = 1
        out.append(ROLES.index(roles[index]) if word in _OBJECT_WORDS else 0)
    return out


CAPTION_SLOTS = ("first_colour", "first_shape", "second_colour", "second_shape", "relation", "count")


def caption_slots(text: str) -> tuple[str, ...]:
    """A caption's parts as labels, one per :data:`CAPTION_SLOTS` ("-" where it has none)."""
    caption = world.parse_caption(text)
    first = caption.objects[0]
    second = caption.objects[1] if len(caption.objects) > 1 else None
    return (
        first.colour or "-",
        first.shape,
        (second.colour or "-") if second else "-",
        second.shape if second else "-",
        caption.relation or "-",
        str(caption.count or "-"),
    )


def pooled_targets(caption: str) -> tuple[str, ...]:
    """What CLIP's pooled vector learns to tell: the caption's parts and whether its first object is the top or left
    one (``-`` without a relation)."""
    relation = world.parse_caption(caption).relation
    first_leads = "-" if relation is None else str(relation in ("above", "left of"))
    return (*caption_slots(caption), first_leads)


def text_stage_captions(plan: BuildPlan) -> list[str]:
    """What the text stage reads: the training split's captions, or every caption of the grammar (text alone, as a
    pretrained encoder has read text the image model never drew), each training caption then listed
    ``plan.text_train_weight`` times, as the stage draws its rows uniformly from the list."""
    if plan.text_captions == "grammar":
        grammar = [caption.text() for caption in world.all_captions()]
        return grammar + training_captions() * (plan.text_train_weight - 1)
    return training_captions()


def tokenize_captions(
    clip_tokenizer: PreTrainedTokenizerBase, t5_tokenizer: PreTrainedTokenizerBase, captions: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(CLIP ids [n, 77], T5 ids [n, 12]) padded exactly as ``models.flux.encode_prompts`` pads them."""
    from fluxgrpo.models.flux import CLIP_MAX_LENGTH

    clip_ids = clip_tokenizer(
        captions, padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True, return_tensors="pt"
    ).input_ids
    t5_ids = t5_tokenizer(
        captions, padding="max_length", max_length=WORLD_TEXT_LENGTH, truncation=True, return_tensors="pt"
    ).input_ids
    return clip_ids, t5_ids


def pretrain_text_encoders(
    clip: CLIPTextModel,
    clip_tokenizer: PreTrainedTokenizerBase,
    t5: T5EncoderModel,
    t5_tokenizer: PreTrainedTokenizerBase,
    captions: list[str],
    plan: BuildPlan,
) -> list[float]:
    """Train ``clip`` and ``t5`` in place on ``captions`` (``plan.text_steps`` steps of cross-entropy through small
    heads, then dropped). Leaves both in eval mode with gradients off; returns the loss per step."""
    import torch

    if plan.text_steps == 0:
        return []
    clip_ids, t5_ids = tokenize_captions(clip_tokenizer, t5_tokenizer, captions)
    roles = torch.tensor(
        [
            token_roles(c, t5_tokenizer.convert_ids_to_tokens(row.tolist()))
            for c, row in zip(captions, t5_ids, strict=True)
        ]
    )
    slots = [pooled_targets(c) for c in captions]
    classes = [sorted({s[k] for s in slots}) for k in range(len(slots[0]))]
    slot_labels = torch.tensor([[classes[k].index(s[k]) for k in range(len(s))] for s in slots])
    torch.manual_seed(plan.seed + 30)
    width = t5.config.d_model
    role_head = torch.nn.Linear(width, len(ROLES))
    word_head = torch.nn.Linear(width, t5.config.vocab_size)
    slot_heads = torch.nn.ModuleList(torch.nn.Linear(clip.config.hidden_size, len(c)) for c in classes)
    heads = torch.nn.ModuleList([role_head, word_head, slot_heads])
    clip.requires_grad_(True).train()
    t5.requires_grad_(True).train()
    trained = [*clip.parameters(), *t5.parameters(), *heads.parameters()]
    optimizer = torch.optim.AdamW(trained, lr=plan.text_lr, weight_decay=1e-4)
    generator = torch.Generator().manual_seed(plan.seed + 31)
    cross_entropy = torch.nn.functional.cross_entropy
    losses = []
    for step in range(plan.text_steps):
        for group in optimizer.param_groups:
            group["lr"] = plan.text_lr * warmup_cosine(step, plan.text_steps, 20)
        rows = torch.randint(len(captions), (plan.text_batch,), generator=generator)
        features = t5(t5_ids[rows])[0]
        loss = cross_entropy(role_head(features).flatten(0, 1), roles[rows].flatten())
        loss = loss + cross_entropy(word_head(features).flatten(0, 1), t5_ids[rows].flatten())
        pooled = clip(clip_ids[rows]).pooler_output
        for k, head in enumerate(slot_heads):
            loss = loss + cross_entropy(head(pooled), slot_labels[rows, k]) / len(slot_heads)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == plan.text_steps - 1:
            log(f"text step {step}/{plan.text_steps} loss {loss.item():.4f}")
    clip.eval().requires_grad_(False)
    t5.eval().requires_grad_(False)
    return losses
