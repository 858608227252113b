"""A training checkpoint's ``trainer_state`` read for a resume, its shape checked (``state_checks``) against the
checkpoint's ``COMPLETE`` facts. Apart from ``state_checks`` so that module stays below ``checkpoint.layout``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fluxgrpo.checkpoint.layout import (
    COMPLETE_MARKER,
    DAMAGED_FIX,
    STATE_DIR,
    TRAINER_STATE_FILE,
    read_checkpoint_info,
    read_trainer_state,
)
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.state_checks import check_trainer_state


def read_training_state(checkpoint: Path) -> dict[str, Any]:
    """A training checkpoint's ``trainer_state`` (``training/loop.py`` writes it), checked for its shape and against
    the checkpoint's ``COMPLETE`` facts (world size, iteration).

    Raises:
        FluxgrpoError: one line naming the file.
    """
    file = Path(checkpoint) / STATE_DIR / TRAINER_STATE_FILE
    info = read_checkpoint_info(checkpoint)
    state = check_trainer_state(read_trainer_state(checkpoint), file, info["world_size"], DAMAGED_FIX)
    if state["iteration"] != info["iteration"]:
        raise FluxgrpoError(
            f"{file} is malformed (it is the state after iteration {state['iteration']}, but {COMPLETE_MARKER} says "
            f"{info['iteration']}): {DAMAGED_FIX}"
        )
    return state
