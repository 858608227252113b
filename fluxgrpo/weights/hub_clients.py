"""The two hubs behind ``fetch-weights``: list a repo, fetch one file into a folder, and say what went wrong.

Both clients use their hub's own library for the transport (auth headers, redirects, mirrors, retries) and
write straight into the target folder (``local_dir`` semantics: no cache copy, no symlinks). What differs,
and is handled here:

- Resolving: Hugging Face names the commit a branch points to (``model_info().sha``) and lists LFS files with
  their sha256 and git files with their git blob id; ModelScope lists sha256 for every file but names no
  commit, so its resolved revision is the branch or tag itself.
- Partial files: both clients keep ``<file>.incomplete`` beside the target and continue it with a Range
  request, within a run and in the next one; the file is renamed onto the target only once all its bytes
  arrived (the caller then checks its digest and, on a mismatch, downloads it once more from byte 0).
  modelscope_hub does this itself. ``hf_hub_download`` cannot: its partial files are per process, deleted on
  an exception and orphaned by a kill (shared/reference/hub-files.md §4). So the Hugging Face client streams
  the file's resolve URL with huggingface_hub's own ``http_get`` (its shared HTTP client, auth headers,
  redirects to the CDN, in-run retries, a restart when a server ignores the Range) into our own partial file.
  That plain HTTP path is what huggingface_hub falls back to without ``hf_xet``; the hub serves Xet-backed
  files over it too. Orphans that ``hf_hub_download`` left under ``.cache/huggingface/download/`` are removed.
- Errors: every library exception becomes one ``FluxgrpoError`` line that says what to do.

The libraries are imported inside the clients: ``huggingface_hub`` and ``modelscope_hub`` (0.17 s, no torch;
never ``import modelscope``, which imports torch).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.weights.hub_progress import callback_class_for, tqdm_class_for

HF_DEFAULT_ENDPOINT = "https://huggingface.co"
HF_DOWNLOAD_DIR = Path(".cache") / "huggingface" / "download"  # huggingface_hub's local_dir bookkeeping
PARTIAL_SUFFIX = ".incomplete"  # <file>.incomplete beside <file>: the bytes received so far, continued later
MODELSCOPE_PARTIAL_SUFFIXES = (".incomplete", ".parallel_tmp")


@dataclass(frozen=True)
class RemoteFile:
    """One file as the hub lists it. At least ``size`` is always known; the digests when the hub gives them."""

    path: str  # inside the repo, forward slashes
    size: int
    sha256: str | None = None  # HF: the LFS object id; ModelScope: its Sha256 field
    git_sha1: str | None = None  # HF files kept in git (no LFS): the git blob id, sha1 of "blob <size>\0<bytes>"


class RepoNotFound(FluxgrpoError):
    """The repo (or the revision) does not exist on this hub: the caller may try another candidate repo."""


class HubClient(Protocol):
    source: str
    endpoint: str

    def resolve(self, repo: str, revision: str | None, repo_type: str = "model") -> tuple[str, list[RemoteFile]]:
        """(resolved revision, every file in the repo at it); ``repo_type``: "model" or "dataset"."""

    def preflight(self, repo: str, revision: str, path: str, repo_type: str = "model") -> None:
        """Fail early, before anything is written, if the hub will refuse to serve ``path``."""

    def download(
        self,
        repo: str,
        revision: str,
        remote: RemoteFile,
        root: Path,
        advance: Callable[[int], None],
        repo_type: str = "model",
    ) -> None:
        """Write ``root / remote.path``, reporting written bytes through ``advance``."""

    def partial_bytes(self, root: Path, path: str) -> int:
        """Bytes of an interrupted earlier download of ``path`` that the next download continues."""

    def discard(self, root: Path, path: str, keep_partial: bool) -> None:
        """Remove ``root / path`` (and the client's record of it) so it is downloaded again."""

    def remove_orphans(self, root: Path) -> int:
        """Delete partial files no download can continue; the bytes freed. Call only while holding the root."""

    def quiet(self) -> contextlib.AbstractContextManager[None]:
        """While active, the library draws no progress bars of its own."""

    def token_note(self) -> str | None:
        """A line worth telling the user about where the token goes, or None."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and its explicit causes (``raise … from``), not what it merely interrupted."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__


def _disk_full(exc: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _chain(exc))


class _Never(Exception):
    """Stands in for an exception class this library version does not have, so isinstance() is simply False."""


def _error_class(module: object, name: str) -> type[BaseException]:
    return getattr(module, name, _Never)


def _network_errors() -> tuple[type[BaseException], ...]:
    """Connection-level failures of the HTTP stacks huggingface_hub has used (httpx2 in 2.x, httpx, requests)."""
    import importlib

    found: list[type[BaseException]] = []
    for module_name, names in (
        ("httpx2", ("ConnectError", "TimeoutException", "RemoteProtocolError")),
        ("httpx", ("ConnectError", "TimeoutException", "RemoteProtocolError")),
        ("requests", ("ConnectionError", "Timeout")),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found.extend(getattr(module, name) for name in names if hasattr(module, name))
    return tuple(found)


def _partial_path(root: Path, path: str) -> Path:
    return root / f"{path}{PARTIAL_SUFFIX}"


def _counting_resumed_bytes(bar_class: type) -> type:
    """``bar_class`` that also reports the bytes a resumed download starts with (tqdm's ``initial=``).

    The caller's file bar spans the whole file, as with modelscope_hub, which reports a resumed partial first.
    huggingface_hub builds the bar after it has seen the answer, so ``initial`` is 0 when a server ignored the
    Range and the file restarts, and its in-run retries reuse the bar instead of building another.
    """

    class _CountingResumed(bar_class):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            initial = kwargs.get("initial")
            if isinstance(initial, int) and initial > 0:
                self.update(initial)

    return _CountingResumed


def _where(repo: str, revision: str | None, path: str | None) -> str:
    at = f"{repo}@{revision}" if revision else repo
    return f"{path} from {at}" if path else at


# -- Hugging Face ------------------------------------------------------------------------------------------


class HuggingFaceClient:
    """huggingface_hub with an explicit endpoint (argument > ``HF_ENDPOINT`` > huggingface.co).

    ``token=None`` lets huggingface_hub find one (``HF_TOKEN``, ``hf auth login``); the token is only ever
    handed to huggingface_hub (its request headers), never printed or written by us.
    """

    source = "hf"

    def __init__(self, token: str | None, endpoint: str | None) -> None:
        try:
            from huggingface_hub import HfApi
        except ImportError as exc:
            raise FluxgrpoError(
                f"--source hf needs huggingface_hub ({exc}): `pip install 'huggingface_hub>=1.0'`"
            ) from exc

        # HF_ENDPOINT is read here, not at huggingface_hub's import, so a mirror set later still counts.
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or HF_DEFAULT_ENDPOINT).rstrip("/")
        self._token = token
        self._api = HfApi(endpoint=self.endpoint, token=token)

    def resolve(self, repo: str, revision: str | None, repo_type: str = "model") -> tuple[str, list[RemoteFile]]:
        from huggingface_hub.hf_api import RepoFile

        try:
            info = self._api.repo_info(repo, revision=revision or "main", repo_type=repo_type)
            resolved = info.sha or revision or "main"
            entries = self._api.list_repo_tree(repo, recursive=True, revision=resolved, repo_type=repo_type)
            files = [
                RemoteFile(
                    e.path,
                    e.size,
                    sha256=e.lfs.sha256 if e.lfs is not None else None,
                    git_sha1=None if e.lfs is not None else e.blob_id,
                )
                for e in entries
                if isinstance(e, RepoFile)
            ]
        except Exception as exc:
            raise self.translate(exc, repo, revision) from exc
        return resolved, files

    def preflight(self, repo: str, revision: str, path: str, repo_type: str = "model") -> None:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        try:
            url = hf_hub_url(repo, path, revision=revision, endpoint=self.endpoint, repo_type=repo_type)
            get_hf_file_metadata(url, token=self._token)
        except Exception as exc:
            raise self.translate(exc, repo, revision, path) from exc

    def download(
        self,
        repo: str,
        revision: str,
        remote: RemoteFile,
        root: Path,
        advance: Callable[[int], None],
        repo_type: str = "model",
    ) -> None:
        """Continue (or start) ``<path>.incomplete`` with a Range request, then rename it onto ``root / path``.

        A partial file longer than the remote file cannot be a prefix of it and is started again. A failure
        leaves the partial file for the next attempt.
        """
        from huggingface_hub import hf_hub_url
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers

        target = root / remote.path
        partial = _partial_path(root, remote.path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if partial.is_file() and partial.stat().st_size > remote.size:
                partial.unlink()
            with open(partial, "ab") as fh:
                fh.seek(0, os.SEEK_END)
                # http_get sends "Range: bytes=<resume_size>-", appends a 206, and truncates the file and starts
                # over on a 200 (a server that ignored the Range); it checks the final size against expected_size.
                http_get(
                    hf_hub_url(repo, remote.path, revision=revision, endpoint=self.endpoint, repo_type=repo_type),
                    fh,
                    resume_size=fh.tell(),
                    headers=build_hf_headers(token=self._token),
                    expected_size=remote.size,
                    displayed_filename=remote.path,
                    tqdm_class=_counting_resumed_bytes(tqdm_class_for(advance)),
                )
            os.replace(partial, target)
        except Exception as exc:
            with contextlib.suppress(OSError):
                if partial.stat().st_size == 0:  # refused before any byte arrived: nothing worth keeping
                    partial.unlink()
            raise self.translate(exc, repo, revision, remote.path, root) from exc

    def partial_bytes(self, root: Path, path: str) -> int:
        partial = _partial_path(root, path)
        return partial.stat().st_size if partial.is_file() else 0

    def discard(self, root: Path, path: str, keep_partial: bool) -> None:
        (root / path).unlink(missing_ok=True)
        if not keep_partial:
            _partial_path(root, path).unlink(missing_ok=True)
        # Bookkeeping of hf_hub_download from earlier versions of this client: stale once the file is gone.
        (root / HF_DOWNLOAD_DIR / f"{path}.metadata").unlink(missing_ok=True)

    def remove_orphans(self, root: Path) -> int:
        """hf_hub_download's per-process partial files (earlier versions of this client): nothing continues them."""
        freed = 0
        folder = root / HF_DOWNLOAD_DIR
        if folder.is_dir():
            for partial in folder.rglob("*.incomplete"):
                with contextlib.suppress(OSError):
                    size = partial.stat().st_size
                    partial.unlink()
                    freed += size
        return freed

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        yield  # every bar huggingface_hub draws for a file comes from the tqdm_class we pass

    def token_note(self) -> str | None:
        if self.endpoint == HF_DEFAULT_ENDPOINT:
            return None
        from huggingface_hub import get_token

        if self._token or get_token():
            return f"note: your Hugging Face token is sent to {self.endpoint}"
        return None

    def translate(
        self, exc: BaseException, repo: str, revision: str | None, path: str | None = None, root: Path | None = None
    ) -> FluxgrpoError:
        """One actionable line for a huggingface_hub / network failure (subclasses are tested first)."""
        from huggingface_hub import errors as hf

        if isinstance(exc, FluxgrpoError):
            return exc
        where = _where(repo, revision, path)
        licence = f"https://huggingface.co/{repo}"
        if isinstance(exc, hf.GatedRepoError):
            if exc.response is not None and exc.response.status_code == 403:
                return FluxgrpoError(
                    f"{repo} is gated and this Hugging Face account has no access (HTTP 403): accept the licence at "
                    f"{licence} with this account (access is granted at once), or `hf auth login` / --token with "
                    "an account that has"
                )
            return FluxgrpoError(
                f"{repo} is gated (HTTP 401): accept the licence at {licence} and run `hf auth login` or pass --token"
            )
        if isinstance(exc, hf.RevisionNotFoundError):
            return RepoNotFound(f"revision {revision!r} not found in {repo} on {self.endpoint}: check --revision")
        if isinstance(exc, hf.RepositoryNotFoundError):
            return RepoNotFound(
                f"repository {repo} not found on {self.endpoint} (or it is private: run `hf auth login` or pass "
                "--token)"
            )
        if isinstance(exc, _error_class(hf, "RemoteEntryNotFoundError")):
            return FluxgrpoError(f"{where} is listed but the hub has no such file (404): rerun, or pin --revision")
        if isinstance(exc, _error_class(hf, "DisabledRepoError")):
            return FluxgrpoError(f"repository {repo} has been disabled on {self.endpoint}")
        if isinstance(exc, _error_class(hf, "OfflineModeIsEnabled")):
            return FluxgrpoError("HF_HUB_OFFLINE is set, so nothing can be downloaded: unset it and rerun")
        if isinstance(exc, _error_class(hf, "XetDownloadError")):
            return FluxgrpoError(f"Xet download of {where} failed ({exc}): rerun, or set HF_HUB_DISABLE_XET=1")
        if _disk_full(exc):
            return FluxgrpoError(f"disk full while downloading {where} into {root}: free space and rerun")
        if isinstance(exc, hf.HfHubHTTPError) and exc.response is not None:
            status = exc.response.status_code
            if status == 401:
                return FluxgrpoError(
                    f"{self.endpoint} rejected the Hugging Face token (HTTP 401): run `hf auth login` again or pass "
                    "a valid --token"
                )
            if status == 429:
                return FluxgrpoError(f"{self.endpoint} is rate-limiting requests (HTTP 429): wait a while and rerun")
            return FluxgrpoError(
                f"{self.endpoint} answered HTTP {status} for {where}: rerun later; files already downloaded are kept"
            )
        network = _network_errors()
        for cause in _chain(exc):
            if isinstance(cause, network):
                return FluxgrpoError(
                    f"cannot reach {self.endpoint} ({type(cause).__name__}: {cause}): check the network or proxy, "
                    "use a mirror with --endpoint / HF_ENDPOINT, or try --source modelscope; files already "
                    "downloaded are kept"
                )
        return FluxgrpoError(f"downloading {where} failed: {type(exc).__name__}: {exc}; rerun to continue")


# -- ModelScope --------------------------------------------------------------------------------------------


class ModelScopeClient:
    """modelscope_hub's ``HubApi`` with a fresh config, so the environment is read at call time.

    Endpoint: argument > ``MODELSCOPE_ENDPOINT`` > modelscope.cn. Token: argument > ``MODELSCOPE_API_TOKEN``
    > ``modelscope login``'s stored credential.
    """

    source = "modelscope"

    def __init__(self, token: str | None, endpoint: str | None) -> None:
        try:
            from modelscope_hub import HubApi, HubConfig
        except ImportError as exc:
            raise FluxgrpoError(
                f"--source modelscope needs modelscope_hub ({exc}): `pip install 'modelscope>=1.40'` (or modelscope-hub)"
            ) from exc

        config = HubConfig(endpoint=endpoint, token=token)  # reads MODELSCOPE_* now, not at first import
        # HubConfig.__post_init__ always resolves a str; the field keeps its constructor's Optional annotation
        self.endpoint: str = config.endpoint  # type: ignore[assignment]
        self._api = HubApi(config=config)
        self._downloader = self._api.downloader  # built here: its lazy first use from worker threads would race

    def resolve(self, repo: str, revision: str | None, repo_type: str = "model") -> tuple[str, list[RemoteFile]]:
        resolved = revision or "master"
        try:
            listing = self._api.list_repo_files(repo, repo_type, revision=resolved, recursive=True)
        except Exception as exc:
            raise self.translate(exc, repo, resolved) from exc
        files = [
            RemoteFile(f.path, int(f.size or 0), sha256=(f.sha256 or None)) for f in listing if f.path and not f.is_dir
        ]
        return resolved, files

    def preflight(self, repo: str, revision: str, path: str, repo_type: str = "model") -> None:
        pass  # the listing already needed the same access as a download

    def download(
        self,
        repo: str,
        revision: str,
        remote: RemoteFile,
        root: Path,
        advance: Callable[[int], None],
        repo_type: str = "model",
    ) -> None:
        try:
            # Our own sha256 check follows (once, with one re-download); passing expected_sha256 here would
            # make modelscope_hub hash again and retry with its own back-off.
            self._downloader.download_file(
                repo_id=repo,
                repo_type=repo_type,
                file_path=remote.path,
                revision=revision,
                local_dir=root,
                file_size=remote.size,
                progress_callbacks=[callback_class_for(advance)],
            )
        except Exception as exc:
            raise self.translate(exc, repo, revision, remote.path, root) from exc

    def partial_bytes(self, root: Path, path: str) -> int:
        partial = _partial_path(root, path)  # modelscope_hub's own name for it
        return partial.stat().st_size if partial.is_file() else 0

    def discard(self, root: Path, path: str, keep_partial: bool) -> None:
        (root / path).unlink(missing_ok=True)
        if not keep_partial:
            for suffix in MODELSCOPE_PARTIAL_SUFFIXES:
                (root / f"{path}{suffix}").unlink(missing_ok=True)

    def remove_orphans(self, root: Path) -> int:
        return 0  # its partial files are continued, not orphaned

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """modelscope_hub draws its own tqdm bar per file whatever callbacks it gets: silence it meanwhile."""
        from modelscope_hub import _download
        from tqdm.auto import tqdm

        class _SilentTqdm(tqdm):
            def __init__(self, *args: object, **kwargs: object) -> None:
                kwargs["disable"] = True
                super().__init__(*args, **kwargs)

        original = getattr(_download, "tqdm", None)
        if original is None:
            yield
            return
        _download.tqdm = _SilentTqdm
        try:
            yield
        finally:
            _download.tqdm = original

    def token_note(self) -> str | None:
        return None

    def translate(
        self, exc: BaseException, repo: str, revision: str | None, path: str | None = None, root: Path | None = None
    ) -> FluxgrpoError:
        """One actionable line for a modelscope_hub / network failure."""
        import requests
        from modelscope_hub import errors as ms

        if isinstance(exc, FluxgrpoError):
            return exc
        where = _where(repo, revision, path)
        page = f"{self.endpoint}/models/{repo}"
        if isinstance(exc, ms.AuthenticationError):
            return FluxgrpoError(
                f"ModelScope refused {where} without valid credentials (HTTP 401): run `modelscope login` or pass "
                f"--token; if {page} asks you to accept a licence, accept it first"
            )
        if isinstance(exc, ms.PermissionDeniedError):
            return FluxgrpoError(
                f"ModelScope denied access to {where} (HTTP 403): accept the licence at {page} with the account of "
                "your token (`modelscope login` or --token)"
            )
        if isinstance(exc, ms.NotExistError):
            if path is not None:
                return FluxgrpoError(
                    f"{where} is listed but ModelScope has no such file (404): rerun, or pin --revision"
                )
            return RepoNotFound(
                f"repository {repo} at revision {revision!r} not found on {self.endpoint} (or it is private: "
                "`modelscope login` or --token); check the repo id and --revision"
            )
        if isinstance(exc, ms.FileIntegrityError):
            return FluxgrpoError(f"{where} arrived with the wrong size or content ({exc}): rerun to download it again")
        if _disk_full(exc):
            return FluxgrpoError(f"disk full while downloading {where} into {root}: free space and rerun")
        if path is not None and isinstance(exc, ms.RequestTimeoutError):
            return FluxgrpoError(
                f"timed out downloading {where} ({exc}): rerun to continue from the partial file; on a slow link "
                "raise MODELSCOPE_DOWNLOAD_TOTAL_TIMEOUT (seconds allowed per file, 3600 by default)"
            )
        for cause in _chain(exc):
            if isinstance(cause, (ms.NetworkError, requests.ConnectionError, requests.Timeout)):
                return FluxgrpoError(
                    f"cannot reach {self.endpoint} ({type(cause).__name__}): check the network or proxy, set "
                    "--endpoint / MODELSCOPE_ENDPOINT, or try --source hf; partial files are kept and resume"
                )
        if isinstance(exc, ms.RateLimitError):
            return FluxgrpoError(f"{self.endpoint} is rate-limiting requests: wait a while and rerun")
        if isinstance(exc, ms.HubError):
            return FluxgrpoError(f"ModelScope failed on {where}: {exc}; rerun to continue (partial files resume)")
        return FluxgrpoError(f"downloading {where} failed: {type(exc).__name__}: {exc}; rerun to continue")


def open_client(source: str, *, token: str | None, endpoint: str | None) -> HubClient:
    if source == "hf":
        return HuggingFaceClient(token, endpoint)
    if source == "modelscope":
        return ModelScopeClient(token, endpoint)
    from fluxgrpo.errors import UsageError

    raise UsageError(f"unknown source {source!r}: use --source hf or --source modelscope")
