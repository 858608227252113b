"""The builder's text stage (``lab/build_text.py``): each T5 token's role, and that the stage teaches word order."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from fluxgrpo.lab import build
from fluxgrpo.lab.build_text import ROLES, pooled_targets, pretrain_text_encoders, text_stage_captions, token_roles
from fluxgrpo.lab.capacity import slot_probe, word_leads
from fluxgrpo.lab.plan import FULL_PLAN
from fluxgrpo.shapes import world


def _pieces(caption: str) -> list[str]:
    return ["▁" + word for word in caption.split()] + ["</s>", "<pad>"]


@pytest.mark.parametrize(
    ("caption", "expected"),
    [
        ("a red circle left of a yellow square", "none left left none none none right right none none"),
        ("a red circle right of a yellow square", "none right right none none none left left none none"),
        ("a blue square below a green triangle", "none bottom bottom none none top top none none"),
        ("a blue square above a blue triangle", "none top top none none bottom bottom none none"),
        ("a blue circle and a green square", "none object object none none object object none none"),
        ("three red circles", "object object object none none"),
        ("a triangle", "none object none none"),
    ],
)
def test_every_word_of_an_object_gets_its_place_in_the_scene(caption, expected):
    assert [ROLES[r] for r in token_roles(caption, _pieces(caption))] == expected.split()


def test_the_pooled_targets_say_which_object_leads():
    assert pooled_targets("a red circle below a yellow square")[-1] == "False"
    assert pooled_targets("a red circle left of a yellow square")[-1] == "True"
    assert pooled_targets("two red circles")[-1] == "-"


def test_the_text_stage_reads_the_training_split_or_the_grammar_with_training_captions_weighted_up():
    train = set(world.split().train)
    grammar = [caption.text() for caption in world.all_captions()]
    assert sorted(text_stage_captions(FULL_PLAN)) == sorted(train)
    assert text_stage_captions(replace(FULL_PLAN, text_captions="grammar")) == grammar
    weighted = text_stage_captions(replace(FULL_PLAN, text_captions="grammar", text_train_weight=3))
    for caption in (world.split().train[0], world.split().eval_novel[0]):
        assert weighted.count(caption) == (3 if caption in train else 1)
    assert len(weighted) == len(grammar) + 2 * len(train)


def test_the_text_stage_teaches_t5_which_object_a_relation_puts_first():
    """Before it, a linear read-out of a colour or shape word's T5 feature cannot tell the top (or left) object from
    the other; after it, it can, on the held-out relation captions, which the stage never saw."""
    parts = world.split()
    seen = [c for c in parts.train if world.parse_caption(c).relation]
    unseen = [c for c in (*parts.eval_seen, *parts.eval_novel) if world.parse_caption(c).relation]
    clip, clip_tokenizer, t5, t5_tokenizer = build.build_text_encoders(3, t5_dropout=0.0)  # the shipped plan's
    before = slot_probe(*word_leads(t5, t5_tokenizer, seen), *word_leads(t5, t5_tokenizer, unseen))
    plan = replace(build.QUICK_PLAN, text_steps=400, text_batch=16, text_lr=1e-2)
    losses = pretrain_text_encoders(clip, clip_tokenizer, t5, t5_tokenizer, seen, plan)
    after = slot_probe(*word_leads(t5, t5_tokenizer, seen), *word_leads(t5, t5_tokenizer, unseen))
    assert len(losses) == 400 and not t5.training and not any(p.requires_grad for p in t5.parameters())
    assert before < 0.65 and after > 0.85, (before, after)
