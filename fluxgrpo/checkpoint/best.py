"""``--keep-best``: the run's ``best/`` folder, a hard-linked copy of its best evaluated checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from fluxgrpo.checkpoint.layout import (
    BEST_DIR,
    BEST_FILE,
    TMP_SUFFIX,
    io_error,
    is_best_checkpoint,
    publish_folder,
    read_json,
    remove_tree,
    write_durably,
)


def publish_best(checkpoint: str | Path, facts: dict[str, Any]) -> Path:
    """Make the complete ``checkpoint`` the run's ``best/`` (rank 0, after the save): returns ``best/``.

    Its files are hard-linked (a checkpoint's files are never rewritten once it is complete, so a link costs no
    space and no time; copied where the filesystem has no hard links) into ``best.tmp/`` with ``BEST.json``
    (``facts``: iteration, metric, value) written last, then renamed over the previous ``best/`` as a checkpoint is
    published: an interrupted update leaves the previous ``best/`` or the new one, never a mix. ``--keep-last``
    pruning deletes ``checkpoint-{k}`` folders only; the linked files live on in ``best/``.
    """
    source = Path(checkpoint)
    final = source.parent / BEST_DIR
    tmp = final.with_name(final.name + TMP_SUFFIX)
    remove_tree(tmp)

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    try:
        shutil.copytree(source, tmp, copy_function=link_or_copy)
        record = {**facts, "checkpoint": source.name}
        write_durably(tmp / BEST_FILE, lambda f: f.write((json.dumps(record, indent=2) + "\n").encode()))
    except OSError as exc:
        raise io_error(exc, "writing", tmp) from None
    publish_folder(tmp, final)
    return final


def read_best(output_dir: str | Path) -> dict[str, Any] | None:
    """``best/BEST.json`` of a run (iteration, metric, value, checkpoint), or None when it keeps no best."""
    path = Path(output_dir) / BEST_DIR
    return read_json(path / BEST_FILE) if is_best_checkpoint(path) else None
