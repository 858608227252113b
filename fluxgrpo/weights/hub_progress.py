"""Progress for weight downloads: one overall bar plus one bar per file in flight, on stderr (rich).

The hub clients report bytes in their own shapes (huggingface_hub wants a tqdm-like *class*, modelscope_hub
a callback *class*); the adapters here turn both into ``FileBar.advance(n)``. With ``enabled=False`` nothing
is drawn or printed, but the same calls still work, so the download code has a single path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

if TYPE_CHECKING:
    from rich.progress import TaskID


def format_bytes(n: int) -> str:
    """Decimal units, like the hubs' own file pages: 33.75 GB, 536 B."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


_DESCRIPTION_WIDTH = 40


def _fit(text: str) -> str:
    """Fixed width. A long path keeps its folder and the end of its name (the shard number tells shards apart)."""
    if len(text) > _DESCRIPTION_WIDTH:
        indent = text[: len(text) - len(text.lstrip())]
        folder, _, name = text.strip().rpartition("/")
        head = f"{indent}{folder}/…" if folder else f"{indent}…"
        text = head + name[-(_DESCRIPTION_WIDTH - len(head)) :]
    return text[:_DESCRIPTION_WIDTH].ljust(_DESCRIPTION_WIDTH)


class FileBar:
    """Bytes of one file; every advance also moves the overall bar. Safe to call from worker threads."""

    def __init__(self, view: ProgressView, task_id: Any | None) -> None:
        self._view = view
        self._task_id = task_id

    def advance(self, n: int) -> None:
        if n:
            self._view._advance(self._task_id, n)

    def __enter__(self) -> FileBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self._view._finish(self._task_id)


class ProgressView:
    """The rich display (stderr) for one fetch; a context manager that starts and stops it."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._progress = None
        self._overall: TaskID | None = None
        self._lock = threading.Lock()
        if enabled:
            self._progress = Progress(
                TextColumn("{task.description}", markup=False),
                BarColumn(bar_width=16),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )

    def __enter__(self) -> ProgressView:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def log(self, message: str) -> None:
        """One line on stderr, above the bars."""
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def start_overall(self, description: str, total: int) -> None:
        if self._progress is None:
            return
        with self._lock:
            if self._overall is not None:
                self._progress.remove_task(self._overall)
            self._overall = self._progress.add_task(_fit(description), total=total)

    def end_overall(self) -> None:
        if self._progress is None:
            return
        with self._lock:
            if self._overall is not None:
                self._progress.remove_task(self._overall)
                self._overall = None

    def overall_bar(self) -> FileBar:
        """Advances the overall bar only (for work that is not one file's download, such as hashing)."""
        return FileBar(self, None)

    def file(self, name: str, size: int) -> FileBar:
        if self._progress is None:
            return FileBar(self, None)
        return FileBar(self, self._progress.add_task(_fit(f"  {name}"), total=size))

    def _advance(self, task_id: Any | None, n: int) -> None:
        if self._progress is None:
            return
        if task_id is not None:
            self._progress.advance(task_id, n)
        if self._overall is not None:
            self._progress.advance(self._overall, n)

    def _finish(self, task_id: Any | None) -> None:
        if self._progress is not None and task_id is not None:
            self._progress.remove_task(task_id)


def tqdm_class_for(advance: Callable[[int], None]) -> type:
    """A tqdm look-alike *class* for huggingface_hub's ``tqdm_class=``, forwarding written bytes to ``advance``.

    huggingface_hub instantiates it once per file (plain HTTP and Xet alike). ``update`` counts bytes written
    to the file; Xet's separate network-transfer count (``update_transfer``) is ignored so nothing is counted
    twice.
    """

    class _ForwardingBar:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.n = 0
            self.total = kwargs.get("total")
            self.format_dict: dict[str, Any] = {}

        def update(self, n: float = 1) -> None:
            if n:
                self.n += int(n)
                advance(int(n))

        def update_transfer(self, n: float = 1) -> None:
            pass

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            pass

        set_transfer_postfix_str = set_postfix_str
        set_description = set_postfix_str

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            pass

        def close(self) -> None:
            pass

        def __enter__(self) -> _ForwardingBar:
            return self

        def __exit__(self, *exc: object) -> None:
            self.close()

    return _ForwardingBar


def callback_class_for(advance: Callable[[int], None]) -> type:
    """A modelscope_hub ``ProgressCallback``-shaped *class* (``cls(filename, file_size)``) forwarding to ``advance``.

    modelscope_hub first reports the bytes of a partial file it resumes, and reports a negative amount when
    the server ignores a Range request and the file restarts; both are forwarded as they are.
    """

    class _ForwardingCallback:
        def __init__(self, filename: str, file_size: int) -> None:
            self.filename = filename
            self.file_size = file_size

        def update(self, size: int) -> None:
            advance(int(size))

        def end(self) -> None:
            pass

    return _ForwardingCallback
