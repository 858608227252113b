"""The shapes world's rule-based checker (GenEval's evaluator, for shapes): find the objects, then check each claim.

1. **Segment by colour.** Anti-aliased edges and VAE blur mix an object's colour with the background only (objects
   never touch), so each pixel is read as a mix ``background + α·(colour − background)`` of one *anchor* colour:
   the four palette colours and the six halfway blends between them (:data:`BLEND_COLOURS`: orange, purple, teal,
   olive, brown, grey, as GenEval's colour list has orange and purple). A pixel belongs to the anchor whose
   background line passes nearest to it, when it is at least half that colour (α ≥ 0.5) and within
   :data:`MAX_LINE_DISTANCE` of the line; otherwise it is background. A blend is an object of its own colour that
   fails every colour claim; a gradient across one shape falls apart into objects of several colours.
2. **Objects** are the connected components of each colour's mask (``scipy.ndimage.label``, 8-connected), keeping
   those of at least :data:`MIN_AREA_FRACTION` of the image (specks of a blurred or generated image are not objects).
3. **Shape**, from the object's coverage (each pixel's share of its colour against the background, read out to
   :data:`EDGE_PIXELS` past the segmented edge): an upward triangle's vertical distribution is skewed, a square's
   fourth cumulant is twice as strong along its axes as along its diagonals, a circle has neither
   (:func:`shape_features`). Cumulant ratios do not change with size, and a blur leaves them be, so the checker
   reads a VAE's soft reconstructions as it reads the renderer's anti-aliased images.
4. **Claims** follow GenEval's ``evaluate``: an object is *present* when at least as many of its shape are found
   as the caption asks; a *count* is exact (GenEval's include N / exclude N+1); a *colour* is checked on the largest
   objects of the shape (area stands in for GenEval's detector confidence), and holds only when three quarters of
   the object's solid pixels sit within :data:`COLOUR_TOLERANCE` of the named palette colour's line
   (:func:`colour_is_true`): a shape in an in-between hue, or shaded across, is not the colour it is nearest to; a
   *relation* is GenEval's
   ``relative_position`` on bounding boxes (centres offset by more than 0.1 of the boxes' sizes, then the direction
   within 60° of the axis), and must hold for every pair of the two objects found.

``check(image, caption)`` returns a :class:`CheckResult`: each claim with whether it holds and why not, the score
(the fraction of claims that hold, in [0, 1]) and ``strict`` (all hold: GenEval's accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fluxgrpo.shapes.world import BACKGROUND, COLOURS, COUNT_WORDS, PLURALS, Caption, ObjectSpec, parse_caption

# Image sizes the world renders at; the checker's area and shape thresholds are fractions of the image, but a
# generated image of another size is a mistake in the run (the shapes configs render at 64), said in one line.
WORLD_SIZES = (64, 128)
# The blends an image generator drifts to between two palette colours: each the halfway point of a pair. They are
# anchors of the segmentation (so a blend is never read as the palette colour it is nearest to) and never a colour a
# caption can name.
BLEND_COLOURS: dict[str, tuple[int, int, int]] = {
    "brown": (130, 105, 50),  # red + green
    "purple": (130, 60, 130),  # red + blue
    "orange": (228, 120, 40),  # red + yellow
    "teal": (40, 125, 140),  # green + blue
    "olive": (138, 185, 50),  # green + yellow
    "grey": (138, 140, 130),  # blue + yellow
}
# RGB distance from an anchor's background line beyond which a pixel is no mix of that anchor with the background
# (anchors are ≥ 55 apart off the line; the renderer's pixels lie on their lines, a VAE's within ~20 of them).
MAX_LINE_DISTANCE = 45.0
# An object's pixels that stand out from the background by at least this share of its colour's contrast (the rest is
# its anti-aliased or blurred edge) judge its colour claim: three quarters of them (COLOUR_PERCENTILE) must lie within
# COLOUR_TOLERANCE (RGB) of the line between the background and the named palette colour. The renderer's pixels sit on the line and the shipped VAE's reconstructions within
# ~20 of it; a halfway blend sits ≥ 55 off both ends' lines (and is segmented as the blend anyway), a shade (red at
# 70 % brightness) 65, a quarter blend (red a quarter of the way to yellow) 28 and passes.
SOLID_ALPHA = 0.8
COLOUR_TOLERANCE = 40.0
COLOUR_PERCENTILE = 75.0
# The colour of an object on no anchor's line (a dark shade, black, a colour far from the palette and its blends),
# when it stands out from the background by MIN_CONTRAST (the palette colours stand 200-290 from it).
OTHER_COLOUR = "other"
MIN_CONTRAST = 80.0
# The smallest object the renderer draws covers ~1.9 % of a 64² image (a triangle of radius 0.10); a component
# under a quarter of that is a speck.
MIN_AREA_FRACTION = 0.005
# GenEval's POSITION_THRESHOLD: the centres' offset, less this fraction of the two boxes' sizes, gives the relation.
POSITION_THRESHOLD = 0.1

_PALETTE_NAMES = tuple(COLOURS)
ANCHORS: dict[str, tuple[int, int, int]] = {**COLOURS, **BLEND_COLOURS}
_ANCHOR_NAMES = tuple(ANCHORS)
BACKGROUND_RGB = np.array(BACKGROUND, dtype=np.float64)
_DIRECTIONS = np.array([ANCHORS[name] for name in _ANCHOR_NAMES], dtype=np.float64) - BACKGROUND_RGB  # [K, 3]
# How far past an object's segmented edge its coverage is still read (a blur of σ 1.5 px has spent 99 % by 3.5σ/√2).
EDGE_PIXELS = 3.0


class ImageSizeError(ValueError):
    """An image the checker cannot read as the world's: not [H, W, 3], not square, or not a size the world uses."""


@dataclass(frozen=True)
class FoundObject:
    shape: str
    colour: str  # a palette colour, or a blend's name (BLEND_COLOURS): never a colour a caption names
    area: int  # pixels
    box: tuple[int, int, int, int]  # x0, y0, x1, y1: pixel edges, x1/y1 exclusive
    # its solid pixels within COLOUR_TOLERANCE of its palette colour (colour_is_true): a colour claim needs it
    true_colour: bool = True

    def colour_words(self) -> str:
        return self.colour if self.true_colour or self.colour not in COLOURS else f"off-{self.colour}"

    @property
    def centre(self) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2, (y0 + y1) / 2


@dataclass(frozen=True)
class Claim:
    """One thing a caption says, and whether the image shows it."""

    kind: str  # present | count | colour | relation | scene
    text: str  # what it claims, in the caption's words: "two triangles", "the circle is red", ...
    holds: bool
    found: str  # what the image shows instead, when it does not hold ("" when it does)

    def label(self) -> str:
        """``✓ text`` or ``✗ text (found)``: one line for a grid caption."""
        return f"✓ {self.text}" if self.holds else f"✗ {self.text} ({self.found})"


@dataclass(frozen=True)
class CheckResult:
    caption: str
    claims: tuple[Claim, ...]
    objects: tuple[FoundObject, ...]

    @property
    def score(self) -> float:
        return sum(c.holds for c in self.claims) / len(self.claims)

    @property
    def strict(self) -> bool:
        return all(c.holds for c in self.claims)


def _as_rgb_uint8(image: np.ndarray) -> np.ndarray:
    if image.ndim != 3 or image.shape[2] != 3:
        raise ImageSizeError(f"an image must be [H, W, 3] RGB, got shape {tuple(image.shape)}")
    height, width = image.shape[:2]
    if height != width or height not in WORLD_SIZES:
        raise ImageSizeError(
            f"a {width}x{height} image: the shapes world renders at {' or '.join(f'{s}x{s}' for s in WORLD_SIZES)} "
            "(train and sample the shapes configs at --height/--width 64)"
        )
    if image.dtype != np.uint8:
        image = np.clip(np.rint(np.asarray(image, dtype=np.float64) * 255.0), 0, 255).astype(np.uint8)
    return image


def _mix(pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(alpha, distance)``, each ``[H, W, K]``: every pixel as ``background + α·(anchor − background)`` for each
    of the :data:`ANCHORS` (α clipped to [0, 1]), and its RGB distance from that line."""
    offset = pixels.astype(np.float64) - BACKGROUND_RGB
    alpha = np.clip((offset @ _DIRECTIONS.T) / (_DIRECTIONS**2).sum(axis=1), 0.0, 1.0)
    distance = np.linalg.norm(offset[:, :, None, :] - alpha[..., None] * _DIRECTIONS[None, None], axis=-1)
    return alpha, distance


def segment(image: np.ndarray) -> np.ndarray:
    """``[H, W]`` int8: the anchor index of each pixel's colour (:data:`ANCHORS` order: the palette's
    :data:`COLOURS` first, then the :data:`BLEND_COLOURS`, then :data:`OTHER_COLOUR`), -1 for the background.

    A pixel on no anchor's background line (a shade, a colour of no anchor) that stands out from the background by
    :data:`MIN_CONTRAST` or more is :data:`OTHER_COLOUR`: still part of an object, never a colour a caption names."""
    pixels = _as_rgb_uint8(image)
    alpha, distance = _mix(pixels)
    candidate = np.where(alpha >= 0.5, distance, np.inf)
    nearest = candidate.argmin(axis=-1)
    is_object = np.take_along_axis(candidate, nearest[..., None], axis=-1)[..., 0] <= MAX_LINE_DISTANCE
    contrast = np.linalg.norm(pixels.astype(np.float64) - BACKGROUND_RGB, axis=-1)
    is_other = ~is_object & (distance.min(axis=-1) > MAX_LINE_DISTANCE) & (contrast >= MIN_CONTRAST)
    labels = np.where(is_object, nearest, -1)
    return np.where(is_other, len(_ANCHOR_NAMES), labels).astype(np.int8)


def colour_is_true(pixels: np.ndarray, colour: str) -> bool:
    """Whether ``pixels`` ([N, 3], an object's) are the palette ``colour``: its solid pixels (standing out from the
    background by at least :data:`SOLID_ALPHA` of the colour's own contrast) lie within :data:`COLOUR_TOLERANCE` of
    the line from the background to the colour (their :data:`COLOUR_PERCENTILE` th percentile). The line, not the point: a blur or anti-aliasing moves a pixel
    along it towards the background; a hue shift or a shade moves it off."""
    if colour not in COLOURS:
        return False
    direction = np.array(COLOURS[colour], dtype=np.float64) - BACKGROUND_RGB
    offset = pixels.astype(np.float64) - BACKGROUND_RGB
    alpha = (offset @ direction) / float(direction @ direction)
    # solid: as far from the background as SOLID_ALPHA of the colour is, in any direction (a blended pixel counts)
    solid = np.linalg.norm(offset, axis=-1) >= SOLID_ALPHA * float(np.linalg.norm(direction))
    if not solid.any():
        return False
    off_line = np.linalg.norm(offset[solid] - alpha[solid, None] * direction, axis=-1)
    return float(np.percentile(off_line, COLOUR_PERCENTILE)) <= COLOUR_TOLERANCE


def shape_features(weights: np.ndarray) -> tuple[float, float]:
    """``(skew, corner_ratio)`` of an object's coverage map (each pixel's share of the object's colour, [H, W]).

    Both are ratios of cumulants of the coverage as a distribution over the plane, so they do not depend on the
    object's size, and a Gaussian blur (anti-aliasing, a VAE's softness) leaves the third and fourth cumulants
    unchanged: it only adds to the variance.

    - ``skew``: the vertical third moment over the variance^1.5. An upward triangle's rows widen linearly towards
      its base, a triangular distribution: −2√2/5 ≈ −0.57. Circles and squares are symmetric: 0.
    - ``corner_ratio``: the fourth cumulant along the axes over that along the diagonals. A square's projection on
      an axis is uniform (κ4 = −s⁴/120), on a diagonal triangular (κ4 = −s⁴/240): 2. A circle looks the same in
      every direction, and so does a triangle to fourth order (three-fold symmetry): 1.
    """
    total = float(weights.sum())
    rows, cols = np.indices(weights.shape, dtype=np.float64)
    x = np.asarray(cols - float((weights * cols).sum()) / total)
    y = np.asarray(rows - float((weights * rows).sum()) / total)

    def moment(values: np.ndarray, order: int) -> float:
        return float((weights * values**order).sum()) / total  # ** on a small crop: an object and its edge

    def fourth_cumulant(values: np.ndarray) -> float:
        return moment(values, 4) - 3 * moment(values, 2) ** 2

    variance = (moment(x, 2) + moment(y, 2)) / 2
    skew = moment(y, 3) / variance**1.5
    u, v = np.asarray((x + y) / np.sqrt(2)), np.asarray((x - y) / np.sqrt(2))
    diagonal = fourth_cumulant(u) + fourth_cumulant(v)
    corner_ratio = (fourth_cumulant(x) + fourth_cumulant(y)) / diagonal if diagonal < 0 else 0.0
    return skew, corner_ratio


# Between each shape's value and the next, nearer the ideal circle's, since blur and clipping pull the triangle's
# skew and the square's ratio towards it (measured: a Gaussian blur of σ 1.5 px on a 64² image leaves triangles
# below −0.28 and squares above 1.36).
TRIANGLE_SKEW = -0.15
SQUARE_CORNER_RATIO = 1.3


def classify_shape(weights: np.ndarray) -> str:
    """Triangle by its skew, square by its corners, else circle (:func:`shape_features`)."""
    skew, corner_ratio = shape_features(weights)
    if skew < TRIANGLE_SKEW:
        return "triangle"
    return "square" if corner_ratio > SQUARE_CORNER_RATIO else "circle"


def _coverage(pixels: np.ndarray, colour: str) -> np.ndarray:
    """Each pixel's share of ``colour`` against the background: its projection on the line between the two (1 inside
    the object, 0 on the background, the anti-aliased fraction on an edge)."""
    if colour == OTHER_COLOUR:  # no line to project on: the pixel's contrast against the background, saturating
        return np.clip(np.linalg.norm(pixels - BACKGROUND_RGB, axis=-1) / (2 * MIN_CONTRAST), 0.0, 1.0)
    direction = np.array(ANCHORS[colour], dtype=np.float64) - BACKGROUND_RGB
    return ((pixels - BACKGROUND_RGB) @ direction) / float(direction @ direction)


def _components(labels_by_colour: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """``(components, colours)``: every connected region of one anchor colour numbered from 1 (``components[y, x]``,
    0 for the background), and each number's colour at ``colours[n − 1]``.

    A region of a blend or of :data:`OTHER_COLOUR` that touches a palette colour's region is the rim or a shading of
    that object, not an object of its own (a generated red object's orange edge): it joins the palette region it
    shares the longest border with, whose colour claim then reads its pixels too (:func:`colour_is_true`). A blend
    region that touches no palette region is an object of the blend's colour."""
    from scipy import ndimage

    eight = np.ones((3, 3), dtype=bool)
    components = np.zeros(labels_by_colour.shape, dtype=np.int32)
    colours: list[str] = []
    for index, colour in enumerate(_PALETTE_NAMES):
        labels, count = ndimage.label(labels_by_colour == index, structure=eight)
        components[labels > 0] = labels[labels > 0] + len(colours)
        colours += [colour] * count
    palette = components.copy()
    for index, colour in enumerate((*_ANCHOR_NAMES, OTHER_COLOUR)):
        if colour in COLOURS:
            continue
        labels, count = ndimage.label(labels_by_colour == index, structure=eight)
        for label in range(1, count + 1):
            mask = labels == label
            border = palette[ndimage.binary_dilation(mask, structure=eight) & ~mask]
            border = border[border > 0]
            if border.size:
                components[mask] = np.bincount(border).argmax()
            else:
                colours.append(colour)
                components[mask] = len(colours)
    return components, colours


def find_objects(image: np.ndarray) -> list[FoundObject]:
    """The objects in an image, largest first."""
    from scipy import ndimage

    pixels = _as_rgb_uint8(image)
    labelled, colours = _components(segment(pixels))
    min_area = MIN_AREA_FRACTION * labelled.size
    components = np.zeros(labelled.shape, dtype=np.int32)
    # colour, area, box, true colour of component len(kept) + 1
    kept: list[tuple[str, int, tuple[int, int, int, int], bool]] = []
    for label, slices in enumerate(ndimage.find_objects(labelled), start=1):
        if slices is None:
            continue
        mask = labelled == label
        area = int(mask.sum())
        if area < min_area:
            continue
        rows, cols = slices
        colour = colours[label - 1]
        kept.append(
            (colour, area, (cols.start, rows.start, cols.stop, rows.stop), colour_is_true(pixels[mask], colour))
        )
        components[mask] = len(kept)
    if not kept:
        return []
    # Each object's shape is read from its coverage over the pixels nearer to it than to any other object, out to
    # EDGE_PIXELS: the soft edge the hard segmentation cut off belongs to it too.
    distance, (near_row, near_col) = ndimage.distance_transform_edt(components == 0, return_indices=True)
    nearest = components[near_row, near_col]
    margin = int(np.ceil(EDGE_PIXELS))
    found: list[FoundObject] = []
    for number, (colour, area, box, true) in enumerate(kept, start=1):
        x0, y0, x1, y1 = box
        crop = np.s_[max(y0 - margin, 0) : y1 + margin, max(x0 - margin, 0) : x1 + margin]
        region = (nearest[crop] == number) & (distance[crop] <= EDGE_PIXELS)
        weights = np.where(region, _coverage(pixels[crop].astype(np.float64), colour), 0.0)
        found.append(FoundObject(classify_shape(weights), colour, area, box, true))
    return sorted(found, key=lambda obj: (-obj.area, obj.box))


def relative_position(a: FoundObject, b: FoundObject) -> set[str]:
    """Where ``a`` is with respect to ``b``: GenEval's ``relative_position`` (image y grows downwards)."""
    (ax, ay), (bx, by) = a.centre, b.centre
    offset = np.array([ax - bx, ay - by])
    dims = np.array([a.box[2] - a.box[0] + b.box[2] - b.box[0], a.box[3] - a.box[1] + b.box[3] - b.box[1]])
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * dims, 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def _noun(shape: str, n: int) -> str:
    return shape if n == 1 else PLURALS[shape]


def _describe(objects: list[FoundObject]) -> str:
    if not objects:
        return "none"
    return ", ".join(f"{obj.colour_words()} {obj.shape}" for obj in objects)


def _object_claims(spec: ObjectSpec, count: int, exact: bool, objects: list[FoundObject]) -> list[Claim]:
    """GenEval's include (and, for a count, exclude) of one spec: present/count, then colour on the largest found."""
    of_shape = [obj for obj in objects if obj.shape == spec.shape]
    number = f"{COUNT_WORDS[count]} {_noun(spec.shape, count)}" if count > 1 or exact else f"a {spec.shape}"
    enough = len(of_shape) >= count
    if exact:
        holds = len(of_shape) == count
        claims = [Claim("count", number, holds, "" if holds else f"{len(of_shape)} found")]
    else:
        claims = [Claim("present", number, enough, "" if enough else "none found")]
    if spec.colour is not None:
        largest = of_shape[:count]
        holds = enough and all(obj.colour == spec.colour and obj.true_colour for obj in largest)
        subject = f"the {_noun(spec.shape, count)} {'are' if count > 1 else 'is'} {spec.colour}"
        found = "" if holds else (_describe(largest) if enough else f"{len(of_shape)} found")
        claims.append(Claim("colour", subject, holds, found))
    return claims


def _matching(spec: ObjectSpec, objects: list[FoundObject]) -> list[FoundObject]:
    # The largest object of the shape: GenEval's top detection (a position caption asks for one of each).
    return [obj for obj in objects if obj.shape == spec.shape][:1]


def claims_of(caption: Caption, objects: list[FoundObject]) -> list[Claim]:
    """Each claim of ``caption`` checked against the objects found (largest first)."""
    if caption.family == "counting":
        assert caption.count is not None
        return _object_claims(caption.objects[0], caption.count, True, objects)
    claims: list[Claim] = []
    for spec in caption.objects:
        claims += _object_claims(spec, 1, False, objects)
    if caption.family == "position":
        assert caption.relation is not None
        first, second = caption.objects
        text = f"the {first.shape} is {caption.relation} the {second.shape}"
        a, b = _matching(first, objects), _matching(second, objects)
        if not a or not b:
            claims.append(Claim("relation", text, False, f"no {first.shape if not a else second.shape} to place"))
        else:
            relations = relative_position(a[0], b[0])
            holds = caption.relation in relations
            found = "" if holds else (" and ".join(sorted(relations)) or "overlapping") + " instead"
            claims.append(Claim("relation", text, holds, found))
    return claims


def objects_asked(caption: Caption) -> int:
    """How many objects the caption's scene holds: its count, or one per object it names (the renderer draws no
    others)."""
    return caption.count if caption.count is not None else len(caption.objects)


def scene_claim(caption: Caption, objects: list[FoundObject] | tuple[FoundObject, ...]) -> Claim:
    """The scene holds nothing but what the caption asks for: as many objects as it names, of any shape and colour.

    Not one of GenEval's claims (it penalizes extra objects only in counting): the ``shapes-scene`` reward adds it so
    that a policy trained on it cannot score a caption's claims by scattering fragments of every colour.
    """
    asked = objects_asked(caption)
    holds = len(objects) == asked
    return Claim(
        "scene",
        f"nothing else ({asked} object{'s' if asked > 1 else ''})",
        holds,
        "" if holds else f"{len(objects)} found",
    )


def check(image: np.ndarray, caption: str | Caption, *, scene: bool = False) -> CheckResult:
    """Check one image (``[H, W, 3]``, uint8 or float in [0, 1]) against one caption of the world; with ``scene``,
    also that nothing else is in it (:func:`scene_claim`).

    Raises :class:`~fluxgrpo.shapes.world.CaptionError` for a caption outside the grammar (naming its words) and
    :class:`ImageSizeError` for an image the world cannot be (naming its size).
    """
    parsed = parse_caption(caption) if isinstance(caption, str) else caption
    objects = find_objects(image)
    claims = claims_of(parsed, objects) + ([scene_claim(parsed, objects)] if scene else [])
    return CheckResult(parsed.text(), tuple(claims), tuple(objects))
