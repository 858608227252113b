"""The shapes world: its vocabulary, captions in GenEval's task families, a seeded held-out split, and a renderer.

Everything the laptop test-bed knows about the world is here, torch-free: the checker reward, the prompt sets and the
builder of the shipped weights all read it.

- **Objects**: a circle, square or triangle in one of four saturated colours on a plain light background, 1–3 per
  image, none touching, one to a quadrant of the image (:data:`LAYOUT`; the first shipped world placed them anywhere).
- **Captions** (GenEval's six task families, in its wording without "a photo of"):
  ``single_object`` "a circle"; ``two_object`` "a circle and a square"; ``counting`` "two triangles" or "three
  blue squares"; ``colors`` "a red circle"; ``position`` "a circle left of a square" or "a red circle left of a
  yellow square"; ``color_attr`` "a red circle and a blue square".
- **Split** (seeded, :func:`held_out_combinations`): a few colour–shape pairs, shape–relation–shape triples and
  count–shape pairs never appear in training, neither in pretraining nor in RL. A caption that uses any of them is
  *novel*; the rest are *seen*. The seen captions are split again by string (a fixed fraction goes to evaluation),
  so the held-out prompt set scores seen and novel combinations apart.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from functools import cache, lru_cache
from itertools import product

import numpy as np

SHAPES = ("circle", "square", "triangle")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles"}
# Saturated, far apart in hue, so a nearest-colour segmentation separates them after VAE blur.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 40),
}
BACKGROUND = (240, 240, 240)
RELATIONS = ("left of", "right of", "above", "below")
COUNT_WORDS = {1: "one", 2: "two", 3: "three"}
FAMILIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

# Every word a caption can hold, for the tiny tokenizers (each is one token) and for the parser's error line.
VOCABULARY = (
    "a",
    "and",
    "of",
    "left",
    "right",
    "above",
    "below",
    *SHAPES,
    *PLURALS.values(),
    *COLOURS,
    *COUNT_WORDS.values(),
)

SPLIT_SEED = 0
SEEN_EVAL_FRACTION = 0.2  # of the seen-combination captions, held out from RL by string only
# The grammar has far more position captions than any other family; the prompt sets draw at most this many per
# family (seeded), so training and evaluation weigh the families about evenly.
TRAIN_PER_FAMILY = 40
EVAL_PER_FAMILY = 4
PROMPT_SETS = ("shapes-train", "shapes-heldout")
# RL's prompt list with every family drawn about equally often (``prompt_set``): its repeated lines are sampling
# weights, kept by ``fluxgrpo preprocess``. Trained on ``shapes-train`` (111 captions: 80 of them position and colour
# attribution, 7 single-object colour captions), the shared update teaches counts and places and rebinds "green" to
# blue on the held-out captions (fluxgrpo/docs/results/shapes-world.md, "Where the gain comes from"); drawn evenly, with the
# colour family twice, the colours hold.
BALANCED_TRAIN_SET = "shapes-train-balanced"
BALANCED_DRAWS_PER_FAMILY = 16  # a larger family is drawn down to this many captions (seeded), a smaller one repeated
BALANCED_COLOUR_WEIGHT = 2  # the single-object colour family's draws, times its even share
# An object's radius (the circle it is drawn inside), as a fraction of the image size, drawn uniformly: 9–13 px at
# 64², about one packed latent token (16 px) or more, so a tiny FLUX draws a legible shape (at 0.10–0.16 its
# triangles and squares came out as blobs).
OBJECT_RADIUS = (0.14, 0.20)
# Where objects may sit. ``free``: anywhere, apart (the first shipped world). ``quadrants``: one object to a quadrant
# of the image, its centre within ±2 px (at 64²) of the quadrant's: the 4×4-token transformer then decides which
# quadrant holds what instead of drawing a continuum of layouts, which a model of its size averages into blobs and
# blended colours (issue 48: the same model trained alike on four captions' renders reaches 0.79 strict with
# quadrants, 0.46 without). Relations in this layout join objects in one row or one column, never diagonally.
LAYOUTS = ("free", "quadrants")
LAYOUT = "quadrants"  # the shipped world's (``fluxgrpo/shapes/weights``); ``free`` was the first's
QUADRANT_JITTER = 2 / 64  # of the image side


@dataclass(frozen=True)
class ObjectSpec:
    """One object a caption asks for: a shape, and a colour or None (any colour)."""

    shape: str
    colour: str | None = None

    def words(self) -> str:
        return f"{self.colour} {self.shape}" if self.colour else self.shape


@dataclass(frozen=True)
class Caption:
    """A parsed caption: its family, the objects it asks for, and a count or relation where the family has one.

    ``counting``: ``objects`` holds one spec and ``count`` how many; ``position``: two specs and ``relation`` says
    where the first is with respect to the second.
    """

    family: str
    objects: tuple[ObjectSpec, ...]
    count: int | None = None
    relation: str | None = None

    def text(self) -> str:
        if self.family == "counting":
            assert self.count is not None
            spec = self.objects[0]
            noun = PLURALS[spec.shape] if self.count > 1 else spec.shape
            colour = f"{spec.colour} " if spec.colour else ""
            return f"{COUNT_WORDS[self.count]} {colour}{noun}"
        if self.family == "position":
            first, second = self.objects
            return f"a {first.words()} {self.relation} a {second.words()}"
        return " and ".join(f"a {spec.words()}" for spec in self.objects)

    def colour_shape_pairs(self) -> set[tuple[str, str]]:
        return {(s.colour, s.shape) for s in self.objects if s.colour}


class CaptionError(ValueError):
    """A caption the world's grammar does not describe; the message names the words."""


def parse_caption(text: str) -> Caption:
    """Read a caption back into its claims. Raises :class:`CaptionError` naming unknown words or the bad phrase."""
    words = text.strip().lower().split()
    unknown = sorted({w for w in words if w not in VOCABULARY})
    if unknown:
        raise CaptionError(
            f"{text!r}: the shapes world has no word {', '.join(repr(w) for w in unknown)} "
            f"(it knows: {' '.join(VOCABULARY)})"
        )
    if not words:
        raise CaptionError("an empty caption")

    def spec_at(i: int) -> tuple[ObjectSpec, int]:
        # "a [colour] shape" starting at words[i]; returns the spec and the index after it.
        if i >= len(words) or words[i] != "a":
            raise CaptionError(f"{text!r}: expected 'a' at word {i + 1}")
        colour = None
        j = i + 1
        if j < len(words) and words[j] in COLOURS:
            colour = words[j]
            j += 1
        if j >= len(words) or words[j] not in SHAPES:
            raise CaptionError(f"{text!r}: expected a shape ({', '.join(SHAPES)}) at word {j + 1}")
        return ObjectSpec(words[j], colour), j + 1

    counts = {word: n for n, word in COUNT_WORDS.items()}
    if words[0] in counts:
        count = counts[words[0]]
        rest = words[1:]
        colour = rest[0] if rest and rest[0] in COLOURS else None
        noun = rest[-1] if rest else ""
        singular = {plural: shape for shape, plural in PLURALS.items()}
        shape = noun if count == 1 else singular.get(noun)
        if shape not in SHAPES or len(rest) != (2 if colour else 1):
            raise CaptionError(f"{text!r}: a count is followed by an optional colour and a shape (plural past one)")
        return Caption("counting", (ObjectSpec(shape, colour),), count=count)

    first, i = spec_at(0)
    if i == len(words):
        return Caption("colors" if first.colour else "single_object", (first,))
    if words[i] == "and":
        second, j = spec_at(i + 1)
        if j != len(words):
            raise CaptionError(f"{text!r}: unexpected words after the second object")
        colours = (first.colour is not None, second.colour is not None)
        if colours == (True, True):
            return Caption("color_attr", (first, second))
        if colours == (False, False):
            return Caption("two_object", (first, second))
        raise CaptionError(f"{text!r}: give both objects a colour or neither")
    for relation in RELATIONS:
        rel_words = relation.split()
        if words[i : i + len(rel_words)] == rel_words:
            second, j = spec_at(i + len(rel_words))
            if j != len(words):
                raise CaptionError(f"{text!r}: unexpected words after the second object")
            return Caption("position", (first, second), relation=relation)
    raise CaptionError(f"{text!r}: expected 'and' or a relation ({', '.join(RELATIONS)}) at word {i + 1}")


def all_captions() -> list[Caption]:
    """Every caption of the grammar, in a fixed order."""
    out: list[Caption] = [Caption("single_object", (ObjectSpec(s),)) for s in SHAPES]
    out += [Caption("two_object", (ObjectSpec(a), ObjectSpec(b))) for a, b in product(SHAPES, SHAPES) if a != b]
    for n, shape in product((2, 3), SHAPES):
        out.append(Caption("counting", (ObjectSpec(shape),), count=n))
        out += [Caption("counting", (ObjectSpec(shape, c),), count=n) for c in COLOURS]
    out += [Caption("colors", (ObjectSpec(s, c),)) for s, c in product(SHAPES, COLOURS)]
    coloured = [ObjectSpec(s, c) for s, c in product(SHAPES, COLOURS)]
    for a, b in product(SHAPES, SHAPES):
        if a != b:
            out += [Caption("position", (ObjectSpec(a), ObjectSpec(b)), relation=r) for r in RELATIONS]
    for first, second in product(coloured, coloured):
        if first.shape != second.shape:
            out += [Caption("position", (first, second), relation=r) for r in RELATIONS]
    out += [Caption("color_attr", (a, b)) for a, b in product(coloured, coloured) if a != b and a.shape != b.shape]
    return out


@dataclass(frozen=True)
class HeldOut:
    """The combinations training never shows (pretraining and RL alike)."""

    colour_shape: frozenset[tuple[str, str]]
    relation_triples: frozenset[tuple[str, str, str]]  # (first shape, relation, second shape)
    count_shape: frozenset[tuple[int, str]]


@lru_cache(maxsize=1)
def held_out_combinations(seed: int = SPLIT_SEED) -> HeldOut:
    """The seeded choice: one colour per shape (3 of 12 pairs, no colour held out twice), 3 of 24 relation
    triples (one per relation family, none its own mirror), and 1 of 6 count–shape pairs."""
    rng = random.Random(seed)
    colours = rng.sample(sorted(COLOURS), len(SHAPES))
    colour_shape = frozenset(zip(colours, SHAPES, strict=True))
    triples = [(a, r, b) for a, b in product(SHAPES, SHAPES) if a != b for r in RELATIONS]
    chosen: list[tuple[str, str, str]] = []
    for triple in rng.sample(triples, len(triples)):
        a, r, b = triple
        mirror = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}[r]
        if any(c[1] == r for c in chosen) or (b, mirror, a) in chosen:
            continue
        chosen.append(triple)
        if len(chosen) == 3:
            break
    count_shape = frozenset({(rng.choice((2, 3)), rng.choice(SHAPES))})
    return HeldOut(colour_shape, frozenset(chosen), count_shape)


def is_novel(caption: Caption, held: HeldOut | None = None) -> bool:
    """True when the caption uses a combination training never shows."""
    held = held or held_out_combinations()
    if caption.colour_shape_pairs() & held.colour_shape:
        return True
    if caption.family == "position":
        first, second = caption.objects
        if (first.shape, caption.relation, second.shape) in held.relation_triples:
            return True
    if caption.family == "counting":
        assert caption.count is not None
        if (caption.count, caption.objects[0].shape) in held.count_shape:
            return True
    return False


@dataclass(frozen=True)
class Split:
    train: tuple[str, ...]  # seen combinations: the RL prompts (and the captions pretraining draws from)
    eval_seen: tuple[str, ...]  # seen combinations, strings RL never trains on
    eval_novel: tuple[str, ...]  # held-out combinations


@lru_cache(maxsize=1)
def split(seed: int = SPLIT_SEED) -> Split:
    """The seeded split of :func:`all_captions` into training, seen-evaluation and novel-evaluation captions.

    The seen captions are split by string per family, so every family with seen captions has both halves.
    """
    held = held_out_combinations(seed)
    rng = random.Random(seed + 1)
    train: list[str] = []
    eval_seen: list[str] = []
    eval_novel: list[str] = []
    for family in FAMILIES:
        captions = [c for c in all_captions() if c.family == family]
        seen = [c.text() for c in captions if not is_novel(c, held)]
        eval_novel += [c.text() for c in captions if is_novel(c, held)]
        rng.shuffle(seen)
        n_eval = round(len(seen) * SEEN_EVAL_FRACTION) if len(seen) >= 5 else 0
        eval_seen += sorted(seen[:n_eval])
        train += sorted(seen[n_eval:])
    return Split(tuple(train), tuple(eval_seen), tuple(eval_novel))


# --- scenes and rendering -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacedObject:
    shape: str
    colour: str
    x: float  # centre, in pixels of the image it is rendered at
    y: float
    radius: float  # the circle the shape is drawn inside


@dataclass
class Scene:
    size: int
    objects: list[PlacedObject] = field(default_factory=list)


def _relation_holds(relation: str, a: PlacedObject, b: PlacedObject, margin: float) -> bool:
    dx, dy = b.x - a.x, b.y - a.y
    return {
        "left of": dx > margin and abs(dy) < abs(dx),
        "right of": -dx > margin and abs(dy) < abs(dx),
        "above": dy > margin and abs(dx) < abs(dy),
        "below": -dy > margin and abs(dx) < abs(dy),
    }[relation]


# How far a shape reaches from its centre, in radii: a square's corners (half side 0.85·r) and a triangle's vertices
# (circumradius 1.2·r) lie outside the circle of radius r. Objects are kept 3 px apart at these reaches, so two of one
# colour never touch and merge into one component (at radius 9–13 px they did, in 1 % of the counting scenes).
_REACH = {"circle": 1.0, "square": 0.85 * 2**0.5, "triangle": 1.2}


def _reach(shape: str, radius: float) -> float:
    return _REACH[shape] * radius


def sample_scene(caption: Caption, rng: random.Random, size: int = 64, layout: str = LAYOUT) -> Scene:
    """A random scene the caption describes truly: its objects, any colour where it names none, placed apart
    (anywhere, or one to a quadrant: ``layout``, one of :data:`LAYOUTS`)."""
    if layout == "quadrants":
        return _quadrant_scene(caption, rng, size)
    if layout != "free":
        raise ValueError(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")
    specs = list(caption.objects) * (caption.count or 1)
    for _ in range(1000):
        placed: list[PlacedObject] = []
        for spec in specs:
            radius = rng.uniform(*OBJECT_RADIUS) * size
            colour = spec.colour or rng.choice(sorted(COLOURS))
            for _ in range(200):
                x = rng.uniform(radius + 2, size - radius - 2)
                y = rng.uniform(radius + 2, size - radius - 2)
                if all(
                    (x - p.x) ** 2 + (y - p.y) ** 2 > (_reach(spec.shape, radius) + _reach(p.shape, p.radius) + 3) ** 2
                    for p in placed
                ):
                    placed.append(PlacedObject(spec.shape, colour, x, y, radius))
                    break
        if len(placed) != len(specs):
            continue
        if caption.relation and not _relation_holds(caption.relation, placed[0], placed[1], 0.15 * size):
            continue
        return Scene(size, placed)
    raise RuntimeError(f"no scene found for {caption.text()!r} at {size}px")  # never hit at 64px or more


_QUADRANTS = ((0, 0), (1, 0), (0, 1), (1, 1))  # (column, row)


def _quadrant_scene(caption: Caption, rng: random.Random, size: int) -> Scene:
    specs = list(caption.objects) * (caption.count or 1)
    jitter = QUADRANT_JITTER * size
    for _ in range(1000):
        cells = rng.sample(_QUADRANTS, len(specs))
        if caption.relation and cells[0][0] != cells[1][0] and cells[0][1] != cells[1][1]:
            continue  # a diagonal pair reads as neither above nor beside
        placed = []
        for spec, (column, row) in zip(specs, cells, strict=True):
            radius = rng.uniform(*OBJECT_RADIUS) * size
            colour = spec.colour or rng.choice(sorted(COLOURS))
            x = (column + 0.5) * size / 2 + rng.uniform(-jitter, jitter)
            y = (row + 0.5) * size / 2 + rng.uniform(-jitter, jitter)
            placed.append(PlacedObject(spec.shape, colour, x, y, radius))
        apart = all(
            (a.x - b.x) ** 2 + (a.y - b.y) ** 2 > (_reach(a.shape, a.radius) + _reach(b.shape, b.radius) + 1) ** 2
            for i, a in enumerate(placed)
            for b in placed[i + 1 :]
        )
        if not apart or (caption.relation and not _relation_holds(caption.relation, placed[0], placed[1], 0.15 * size)):
            continue
        return Scene(size, placed)
    raise RuntimeError(f"no scene found for {caption.text()!r} at {size}px")


_SUPERSAMPLE = 4


def render(scene: Scene) -> np.ndarray:
    """The scene as an ``[H, W, 3]`` uint8 image: drawn by PIL at 4× and box-filtered down (anti-aliased edges)."""
    from PIL import Image, ImageDraw

    big = scene.size * _SUPERSAMPLE
    image = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        x, y, r = obj.x * _SUPERSAMPLE, obj.y * _SUPERSAMPLE, obj.radius * _SUPERSAMPLE
        fill = COLOURS[obj.colour]
        if obj.shape == "circle":
            draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
        elif obj.shape == "square":
            half = 0.85 * r  # about a circle's area
            draw.rectangle((x - half, y - half, x + half, y + half), fill=fill)
        else:
            draw.regular_polygon((x, y + 0.2 * r, 1.2 * r), n_sides=3, fill=fill)  # pointing up
    return np.asarray(image.resize((scene.size, scene.size), Image.Resampling.BOX))


def render_caption(text: str, seed: int, size: int = 64, layout: str = LAYOUT) -> np.ndarray:
    """One true image of a caption, seeded."""
    return render(sample_scene(parse_caption(text), random.Random(seed), size, layout))


def _capped(captions: tuple[str, ...], per_family: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    for family in FAMILIES:
        members = [t for t in captions if parse_caption(t).family == family]
        out += members if len(members) <= per_family else sorted(rng.sample(members, per_family))
    return out


def _balanced(captions: tuple[str, ...], seed: int) -> list[str]:
    """Each family's captions as :data:`BALANCED_DRAWS_PER_FAMILY` draws: a larger family drawn down to that many
    (:func:`_capped`), every caption of a smaller one repeated round(draws / captions) times; the colour family's
    repeats :data:`BALANCED_COLOUR_WEIGHT` times as many."""
    sizes = Counter(parse_caption(t).family for t in captions)
    out: list[str] = []
    for caption in _capped(captions, BALANCED_DRAWS_PER_FAMILY, seed):
        family = parse_caption(caption).family
        repeats = max(1, round(BALANCED_DRAWS_PER_FAMILY / sizes[family]))
        out += [caption] * (repeats * (BALANCED_COLOUR_WEIGHT if family == "colors" else 1))
    return out


@cache
def prompt_set(name: str) -> tuple[str, ...]:
    """A named prompt set: ``shapes-train`` (RL's prompts; seen combinations), ``shapes-train-balanced`` (the same
    captions, a sample of them, drawn about equally often per family: repeated lines, see
    :data:`BALANCED_TRAIN_SET`) or ``shapes-heldout`` (evaluation: up to :data:`EVAL_PER_FAMILY` seen-combination and
    as many novel-combination captions per family)."""
    parts = split()
    if name == "shapes-train":
        return tuple(_capped(parts.train, TRAIN_PER_FAMILY, SPLIT_SEED + 2))
    if name == BALANCED_TRAIN_SET:
        return tuple(_balanced(prompt_set("shapes-train"), SPLIT_SEED + 5))
    if name == "shapes-heldout":
        seen = _capped(parts.eval_seen, EVAL_PER_FAMILY, SPLIT_SEED + 3)
        novel = _capped(parts.eval_novel, EVAL_PER_FAMILY, SPLIT_SEED + 4)
        return tuple(seen + novel)
    raise KeyError(name)


def combination_kind(text: str) -> str:
    """``"novel"`` when the caption uses a held-out combination, else ``"seen"``."""
    return "novel" if is_novel(parse_caption(text)) else "seen"
