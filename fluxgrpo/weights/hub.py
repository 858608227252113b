"""Real weights from Hugging Face or ModelScope into the standard layout: planned, resumable, verified.

For each selected part (``hub_parts.hub_parts()``: flux, hps, clip by default; the other rewards on request):

1. list the repo at a resolved revision and keep only the allow-listed files (FLUX.1-dev's diffusers
   folders, never the 23 GB single-file checkpoints beside them);
2. compare the disk with the listing: a file is *present* when its size and its sha256 (or, for small HF
   files kept in git, its git blob id) match what the hub lists; a partial download the client can continue
   is *resume*; anything else is *download*;
3. check free disk space for what is missing, for all parts before any part starts;
4. remove the part's manifest (so an interrupted re-fetch never looks complete) and any file the part
   supersedes (the tiny reward's architecture file), download the rest in parallel straight into the folder,
   verify every downloaded file (a mismatch is downloaded once more, then it is an error);
5. write the part's manifest last, listing every file with its size and sha256.

A second run over a complete folder downloads nothing. To avoid re-reading 40 GB on every run, a file that
the part's manifest already records with the hub's sha256, and that has the same size and is not newer than
the manifest, counts as verified; ``rehash=True`` reads every file again.

A network interruption costs little on either hub (see ``hub_clients``): finished files are never fetched
again, and a file cut off mid-way, even by a killed or failed run, is continued from its partial file with a
Range request.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.paths import DEFAULT_FLUX_DIR, DEFAULT_HPS_DIR, DEFAULT_PROMPTS_DIR, ensure_writable_dir
from fluxgrpo.weights.hub_clients import (
    HubClient,
    RemoteFile,
    RepoNotFound,
    open_client,
)
from fluxgrpo.weights.hub_parts import DEFAULT_PARTS, HubPart, expand_parts, hub_parts, part_groups
from fluxgrpo.weights.hub_progress import ProgressView, format_bytes
from fluxgrpo.weights.manifest import (
    Manifest,
    ManifestFile,
    read_manifest,
    write_manifest,
)

SOURCES = ("hf", "modelscope")
FETCH_LOCK = Path(".cache") / "fluxgrpo" / "fetch.lock"
_HASH_CHUNK = 8 << 20


PRESENT = "present"  # on disk, size and digest verified
UNVERIFIED = "unverified"  # on disk with the right size, digest not read (plans made without verify)
RESUME = "resume"  # a partial download the client continues
DOWNLOAD = "download"  # missing or wrong: fetched from byte 0


class MissingFiles(FluxgrpoError):
    """The repo has no file for one of the part's allow-list patterns."""


@dataclass
class PlannedFile:
    remote: RemoteFile
    state: str  # PRESENT | UNVERIFIED | RESUME | DOWNLOAD
    resume_from: int = 0  # bytes already on disk in a partial file (RESUME)
    sha256: str | None = None  # of the file on disk, once verified

    @property
    def path(self) -> str:
        return self.remote.path

    @property
    def size(self) -> int:
        return self.remote.size

    @property
    def bytes_to_fetch(self) -> int:
        return self.size - self.resume_from if self.state in (RESUME, DOWNLOAD) else 0


@dataclass
class PartPlan:
    """One part's repo, resolved revision, target folder, and what each file needs."""

    part: str
    source: str
    repo: str
    revision: str  # resolved: a commit sha on HF; the branch or tag on ModelScope, whose listing names no commit
    root: Path
    manifest_name: str
    files: list[PlannedFile]

    @property
    def to_fetch(self) -> list[PlannedFile]:
        return [f for f in self.files if f.state in (RESUME, DOWNLOAD)]

    @property
    def bytes_total(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def bytes_to_fetch(self) -> int:
        return sum(f.bytes_to_fetch for f in self.files)

    @property
    def bytes_present(self) -> int:
        return sum(f.size for f in self.files if f.state in (PRESENT, UNVERIFIED))

    def to_dict(self) -> dict[str, Any]:
        return {
            "part": self.part,
            "source": self.source,
            "repo": self.repo,
            "revision": self.revision,
            "dir": str(self.root),
            "manifest": str(self.root / self.manifest_name),
            "bytes_total": self.bytes_total,
            "bytes_to_fetch": self.bytes_to_fetch,
            "files": [
                {
                    "path": f.path,
                    "size": f.size,
                    "sha256": f.remote.sha256,
                    "state": f.state,
                    "resume_from": f.resume_from,
                }
                for f in self.files
            ],
        }


@dataclass
class FetchPlan:
    """What a fetch would do; ``fetch-weights --dry-run`` prints it."""

    source: str
    endpoint: str
    parts: list[PartPlan]

    @property
    def bytes_total(self) -> int:
        return sum(p.bytes_total for p in self.parts)

    @property
    def bytes_to_fetch(self) -> int:
        return sum(p.bytes_to_fetch for p in self.parts)

    @property
    def files_to_fetch(self) -> int:
        return sum(len(p.to_fetch) for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "endpoint": self.endpoint,
            "bytes_total": self.bytes_total,
            "bytes_to_fetch": self.bytes_to_fetch,
            "files_to_fetch": self.files_to_fetch,
            "parts": [p.to_dict() for p in self.parts],
        }


@dataclass
class PartResult:
    part: str
    repo: str
    revision: str
    dir: str
    manifest: str | None  # the manifest written; None on a dry run
    files: int
    bytes_total: int
    files_downloaded: int = 0
    bytes_downloaded: int = 0  # over the network this run (bytes continued from a partial file not counted)
    bytes_present: int = 0  # already on disk and verified before this run


@dataclass
class FetchSummary:
    source: str
    endpoint: str
    dry_run: bool
    seconds: float
    parts: list[PartResult]
    plan: FetchPlan = field(repr=False)

    @property
    def files(self) -> int:
        return sum(p.files for p in self.parts)

    @property
    def files_downloaded(self) -> int:
        return sum(p.files_downloaded for p in self.parts)

    @property
    def bytes_downloaded(self) -> int:
        return sum(p.bytes_downloaded for p in self.parts)

    @property
    def bytes_present(self) -> int:
        return sum(p.bytes_present for p in self.parts)

    @property
    def revisions(self) -> dict[str, str]:
        return {p.part: p.revision for p in self.parts}

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "endpoint": self.endpoint,
            "dry_run": self.dry_run,
            "seconds": round(self.seconds, 3),
            "files": self.files,
            "files_downloaded": self.files_downloaded,
            "bytes_downloaded": self.bytes_downloaded,
            "bytes_present": self.bytes_present,
            "revisions": self.revisions,
            "parts": [vars(p) for p in self.parts],
            **({"plan": self.plan.to_dict()} if self.dry_run else {}),
        }


# -- public API ----------------------------------------------------------------------------------------------


def plan_fetch(
    source: str,
    *,
    parts: Sequence[str] = DEFAULT_PARTS,
    flux_dir: str | Path = DEFAULT_FLUX_DIR,
    hps_dir: str | Path = DEFAULT_HPS_DIR,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    verify: bool = False,
    prompts_dir: str | Path = DEFAULT_PROMPTS_DIR,
) -> FetchPlan:
    """List the repos and compare with the disk; writes nothing.

    Without ``verify`` a file with the right size is reported ``unverified`` (counted as present) unless its
    manifest already vouches for it; with ``verify`` its digest is read.
    """
    selected = _select_parts(parts, revision)
    client = open_client(source, token=token, endpoint=endpoint)
    view = ProgressView(enabled=False)
    plans = [
        _plan_part(
            client, part, _part_root(part, flux_dir, hps_dir, prompts_dir), revision, view, verify=verify, rehash=False
        )
        for part in selected
    ]
    return FetchPlan(source, client.endpoint, plans)


@dataclass(frozen=True)
class FetchRequest:
    """What ``fetch-weights --source hf|modelscope`` asks for.

    ``parts`` are names from ``hub_parts.part_choices()`` (a group such as "pickscore" stands for its parts). ``revision``
    (branch, tag or commit) pins the repo of a single selected part; ``token`` and ``endpoint`` default to the
    hub's own settings (HF_TOKEN / ``hf auth login``, HF_ENDPOINT; MODELSCOPE_API_TOKEN / ``modelscope login``,
    MODELSCOPE_ENDPOINT). ``dry_run`` only plans (see ``plan_fetch``). Progress and notes go to stderr when
    ``progress``.
    """

    source: str  # "hf" or "modelscope"
    parts: Sequence[str] = DEFAULT_PARTS
    flux_dir: str | Path = DEFAULT_FLUX_DIR
    hps_dir: str | Path = DEFAULT_HPS_DIR
    prompts_dir: str | Path = DEFAULT_PROMPTS_DIR
    revision: str | None = None
    token: str | None = None
    endpoint: str | None = None
    dry_run: bool = False
    max_workers: int = 8
    progress: bool = True
    rehash: bool = False


def fetch_from_hub(request: FetchRequest) -> FetchSummary:
    """Fetch the selected parts from ``request.source`` into the standard layout.

    Raises ``FluxgrpoError`` with one actionable line on any failure; files finished before it are kept and count
    on the next run.
    """
    source, parts, revision = request.source, request.parts, request.revision
    flux_dir, hps_dir, prompts_dir = request.flux_dir, request.hps_dir, request.prompts_dir
    token, endpoint, max_workers, rehash = request.token, request.endpoint, request.max_workers, request.rehash
    started = time.monotonic()
    if max_workers < 1:
        raise UsageError(f"--max-workers must be at least 1, got {max_workers}")
    if request.dry_run:
        plan = plan_fetch(
            source,
            parts=parts,
            flux_dir=flux_dir,
            hps_dir=hps_dir,
            revision=revision,
            token=token,
            endpoint=endpoint,
            prompts_dir=prompts_dir,
        )
        results = [_result(p, manifest=None, downloaded=0, fetched_bytes=0) for p in plan.parts]
        return FetchSummary(source, plan.endpoint, True, time.monotonic() - started, results, plan)

    selected = _select_parts(parts, revision)
    client = open_client(source, token=token, endpoint=endpoint)
    roots = {part.name: _part_root(part, flux_dir, hps_dir, prompts_dir) for part in selected}
    with ProgressView(request.progress) as view:
        note = client.token_note()
        if note:
            view.log(note)
        # Nothing is written (not even a folder) until every repo has been listed and has agreed to serve a
        # file this run needs (a gated repo refuses only downloads, not listings).
        listings = {part.name: _resolve_part(client, part, revision, view) for part in selected}
        for part in selected:
            sized = _classify(client, part, roots[part.name], *listings[part.name], view, verify=False, rehash=rehash)
            if sized.to_fetch:
                client.preflight(sized.repo, sized.revision, sized.to_fetch[0].path, hub_parts()[sized.part].repo_type)
        with _hold(sorted(set(roots.values()))), client.quiet():
            for root in sorted(set(roots.values())):
                freed = client.remove_orphans(root)
                if freed:
                    view.log(
                        f"removed {format_bytes(freed)} of partial downloads in {root} that nothing can "
                        "continue (left by an earlier Hugging Face download)"
                    )
            plans = [
                _classify(client, part, roots[part.name], *listings[part.name], view, verify=True, rehash=rehash)
                for part in selected
            ]
            for part_plan in plans:
                _log_plan(view, part_plan)
            _check_disk_space(plans)
            results = [_fetch_part(client, plan, max_workers, view) for plan in plans]
    return FetchSummary(
        source, client.endpoint, False, time.monotonic() - started, results, FetchPlan(source, client.endpoint, plans)
    )


# -- planning ------------------------------------------------------------------------------------------------


def _select_parts(parts: Sequence[str], revision: str | None) -> list[HubPart]:
    known = hub_parts()
    selected = [known[name] for name in expand_parts(parts)]
    if revision is not None and len(selected) > 1:
        raise UsageError(
            "--revision pins one repository: pass it with a single part, e.g. `--only flux --revision <commit>` "
            f"(pickscore is two repositories: {', '.join(part_groups()['pickscore'])})"
        )
    return selected


def _part_root(part: HubPart, flux_dir: str | Path, hps_dir: str | Path, prompts_dir: str | Path) -> Path:
    base = {"flux": Path(flux_dir), "hps": Path(hps_dir), "prompts": Path(prompts_dir)}[part.root]
    return base / part.subdir if part.subdir else base


def _plan_part(
    client: HubClient,
    part: HubPart,
    root: Path,
    revision: str | None,
    view: ProgressView,
    *,
    verify: bool,
    rehash: bool,
) -> PartPlan:
    repo, resolved, files = _resolve_part(client, part, revision, view)
    return _classify(client, part, root, repo, resolved, files, view, verify=verify, rehash=rehash)


def _resolve_part(
    client: HubClient, part: HubPart, revision: str | None, view: ProgressView
) -> tuple[str, str, list[RemoteFile]]:
    """(repo, resolved revision, allow-listed files) from the first candidate repo that has them all."""
    candidates = part.repos.get(client.source, ())
    if not candidates:
        others = [source for source, repos in part.repos.items() if repos]
        raise UsageError(
            f"{part.name} has no known repository on {client.source}: fetch it with "
            f"`fluxgrpo fetch-weights --source {others[0]} --only {part.name}`"
            if others
            else f"{part.name} has no known repository on any hub"
        )
    first_error: FluxgrpoError | None = None
    for repo in candidates:
        try:
            resolved, listing = client.resolve(repo, revision, part.repo_type)
            return repo, resolved, _allowed_files(part, repo, resolved, listing, client.endpoint)
        except (RepoNotFound, MissingFiles) as exc:
            first_error = first_error or exc
            if repo != candidates[-1]:
                view.log(f"{part.name}: {exc}; trying the next candidate repo")
    assert first_error is not None
    raise first_error


def _allowed_files(
    part: HubPart, repo: str, revision: str, listing: list[RemoteFile], endpoint: str
) -> list[RemoteFile]:
    """The listed files the part takes: every required entry must match, optional patterns may not."""

    def matching(pattern: str) -> list[RemoteFile]:
        return [f for f in listing if fnmatchcase(f.path, pattern)]

    chosen: dict[str, RemoteFile] = {}
    unmatched: list[str] = []
    for entry in part.allow:
        alternatives = (entry,) if isinstance(entry, str) else entry
        found = next((hits for hits in map(matching, alternatives) if hits), [])
        if not found:
            unmatched.append(" or ".join(alternatives))
        chosen.update((f.path, f) for f in found)
    if unmatched:
        raise MissingFiles(
            f"{repo}@{revision} on {endpoint} has no file matching {', '.join(unmatched)} (needed for {part.name}): "
            "check the repo, or pin a --revision that has it"
        )
    for pattern in part.optional:
        chosen.update((f.path, f) for f in matching(pattern))
    return sorted(chosen.values(), key=lambda f: f.path)


def _classify(
    client: HubClient,
    part: HubPart,
    root: Path,
    repo: str,
    revision: str,
    files: list[RemoteFile],
    view: ProgressView,
    *,
    verify: bool,
    rehash: bool,
) -> PartPlan:
    """Compare each listed file with the disk. Reads file contents only when ``verify``."""
    vouched = {} if rehash else _vouched_by_manifest(root, part.manifest_name)
    planned: list[PlannedFile] = []
    to_hash: list[PlannedFile] = []
    for remote in files:
        target = root / remote.path
        if target.is_file() and target.stat().st_size == remote.size:
            known = vouched.get(remote.path)
            if known is not None and remote.sha256 is not None and known == (remote.size, remote.sha256):
                planned.append(PlannedFile(remote, PRESENT, sha256=remote.sha256))
            else:
                planned.append(PlannedFile(remote, UNVERIFIED))
                to_hash.append(planned[-1])
            continue
        partial = client.partial_bytes(root, remote.path)
        if 0 < partial < remote.size:
            planned.append(PlannedFile(remote, RESUME, resume_from=partial))
        else:
            planned.append(PlannedFile(remote, DOWNLOAD))
    if verify and to_hash:
        view.start_overall(f"{part.name}: verifying files on disk", sum(f.size for f in to_hash))
        bar = view.overall_bar()
        for item in to_hash:
            digest = _digest(root / item.path, item.remote, bar.advance)
            if _matches(item.remote, digest):
                item.state, item.sha256 = PRESENT, digest.sha256
            else:
                item.state = DOWNLOAD
        view.end_overall()
    return PartPlan(part.name, client.source, repo, revision, root, part.manifest_name, planned)


def _vouched_by_manifest(root: Path, manifest_name: str) -> dict[str, tuple[int, str]]:
    """{path: (size, sha256)} for files the manifest lists that were not modified after it was written."""
    manifest = read_manifest(root, manifest_name)
    if manifest is None:
        return {}
    written_ns = (root / manifest_name).stat().st_mtime_ns
    vouched = {}
    for entry in manifest.files:
        target = root / entry.path
        if entry.sha256 and target.is_file():
            stat = target.stat()
            if stat.st_size == entry.size and stat.st_mtime_ns <= written_ns:
                vouched[entry.path] = (entry.size, entry.sha256)
    return vouched


@dataclass(frozen=True)
class _Digest:
    size: int
    sha256: str
    git_sha1: str | None  # only computed when the hub lists a git blob id instead of a sha256


def _digest(path: Path, remote: RemoteFile, advance: Callable[[int], None]) -> _Digest:
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    # git's blob id hashes a "blob <size>\0" header, then the bytes.
    git = hashlib.sha1(b"blob %d\0" % size) if remote.sha256 is None and remote.git_sha1 else None
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            sha256.update(chunk)
            if git is not None:
                git.update(chunk)
            advance(len(chunk))
    return _Digest(size, sha256.hexdigest(), git.hexdigest() if git is not None else None)


def _matches(remote: RemoteFile, digest: _Digest) -> bool:
    if digest.size != remote.size:
        return False
    if remote.sha256 is not None:
        return digest.sha256 == remote.sha256
    if remote.git_sha1 is not None:
        return digest.git_sha1 == remote.git_sha1
    return True  # the hub lists no digest for this file: its size is all there is to check


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def _log_plan(view: ProgressView, plan: PartPlan) -> None:
    revision = plan.revision[:12] if len(plan.revision) == 40 else plan.revision
    fetch = plan.to_fetch
    resumed = sum(f.resume_from for f in fetch)
    view.log(
        f"{plan.part}: {plan.repo}@{revision} ({plan.source}) — {_files(len(plan.files))}, "
        f"{format_bytes(plan.bytes_total)}; {len(plan.files) - len(fetch)} present, {len(fetch)} to download "
        f"({format_bytes(plan.bytes_to_fetch)}"
        + (f", continuing {format_bytes(resumed)} already received" if resumed else "")
        + ")"
    )


# -- checks before writing -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _hold(roots: list[Path]) -> Iterator[None]:
    """One fetch per folder at a time: two would race on the same files and manifests."""

    with contextlib.ExitStack() as stack:
        for root in roots:
            lock_path = root / FETCH_LOCK
            ensure_writable_dir(root, "weights", "--flux-dir / --hps-dir / --prompts-dir")
            try:
                stack.enter_context(FileLock(str(lock_path), timeout=0))
            except Timeout:
                raise FluxgrpoError(
                    f"another fetch-weights is already writing to {root} (lock {lock_path}): wait for it to finish"
                ) from None
        yield


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _check_disk_space(plans: list[PartPlan]) -> None:
    """Refuse up front when what is missing does not fit, summing parts that share a filesystem."""
    needs: dict[int, tuple[Path, int, list[str]]] = {}
    for plan in plans:
        need = plan.bytes_to_fetch
        if not need:
            continue
        anchor = _existing_ancestor(plan.root)
        device = anchor.stat().st_dev
        _, total, names = needs.get(device, (anchor, 0, []))
        if str(plan.root) not in names:
            names.append(str(plan.root))
        needs[device] = (anchor, total + need, names)
    for anchor, need, names in needs.values():
        free = shutil.disk_usage(anchor).free
        if need > free:
            raise FluxgrpoError(
                f"not enough free disk space in {', '.join(names)}: {format_bytes(need)} ({need} bytes) to download "
                f"but {format_bytes(free)} ({free} bytes) free there; free some space or pass --flux-dir / "
                "--hps-dir on a bigger disk"
            )


# -- downloading ---------------------------------------------------------------------------------------------


def _fetch_part(client: HubClient, plan: PartPlan, max_workers: int, view: ProgressView) -> PartResult:
    manifest_path = plan.root / plan.manifest_name
    manifest_path.unlink(missing_ok=True)  # stale until every file below is verified again
    for name in hub_parts()[plan.part].replaces:
        superseded = plan.root / name
        if superseded.is_file():
            superseded.unlink()
            view.log(f"{plan.part}: removed {superseded} (it described other weights than the ones fetched)")
    todo = sorted(plan.to_fetch, key=lambda f: f.size, reverse=True)  # longest transfers start first
    fetched_bytes = 0
    if todo:
        view.start_overall(f"{plan.part}: {plan.repo}", sum(f.size for f in todo))
        with ThreadPoolExecutor(max_workers=min(max_workers, len(todo)), thread_name_prefix="fetch") as pool:
            futures = [pool.submit(_fetch_file, client, plan, item, view) for item in todo]
            try:
                for future in as_completed(futures):
                    fetched_bytes += future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                view.log(f"{plan.part}: stopping; waiting for the downloads in flight to finish")
                raise
        view.end_overall()
    manifest = Manifest(
        part=plan.part,
        source=plan.source,
        files=[ManifestFile(f.path, f.size, f.sha256) for f in plan.files],
        repo=plan.repo,
        revision=plan.revision,
    )
    write_manifest(plan.root, manifest, plan.manifest_name)
    view.log(f"{plan.part}: complete, {_files(len(plan.files))} verified → {manifest_path}")
    return _result(plan, manifest=str(manifest_path), downloaded=len(todo), fetched_bytes=fetched_bytes)


def _fetch_file(client: HubClient, plan: PartPlan, item: PlannedFile, view: ProgressView) -> int:
    """Download one file and verify it; one more full download on a digest mismatch. Returns bytes fetched."""
    remote, root = item.remote, plan.root
    fetched = 0
    digest: _Digest | None = None
    for attempt in range(2):
        # The first attempt may continue a partial file; the second starts from byte 0.
        client.discard(root, remote.path, keep_partial=attempt == 0)
        resumed_from = client.partial_bytes(root, remote.path)
        with view.file(remote.path, remote.size) as bar:
            client.download(plan.repo, plan.revision, remote, root, bar.advance, hub_parts()[plan.part].repo_type)
        fetched += remote.size - resumed_from
        digest = _digest(root / remote.path, remote, lambda n: None)
        if _matches(remote, digest):
            item.sha256 = digest.sha256  # its state stays what the plan said; the manifest needs the digest
            return fetched
        view.log(f"{plan.part}: {remote.path} does not match the hub's digest; downloading it again")
    client.discard(root, remote.path, keep_partial=False)
    assert digest is not None
    kind, expected, got = (
        ("sha256", remote.sha256, digest.sha256)
        if remote.sha256 is not None
        else ("git blob id", remote.git_sha1, digest.git_sha1)
        if remote.git_sha1 is not None
        else ("size", str(remote.size), str(digest.size))
    )
    raise FluxgrpoError(
        f"{remote.path} from {plan.repo}@{plan.revision} failed its {kind} check twice (expected {expected}, got "
        f"{got}): {client.endpoint} serves other bytes than it lists; rerun later or try the other --source"
    )


def _result(plan: PartPlan, *, manifest: str | None, downloaded: int, fetched_bytes: int) -> PartResult:
    return PartResult(
        part=plan.part,
        repo=plan.repo,
        revision=plan.revision,
        dir=str(plan.root),
        manifest=manifest,
        files=len(plan.files),
        bytes_total=plan.bytes_total,
        files_downloaded=downloaded,
        bytes_downloaded=fetched_bytes,
        bytes_present=plan.bytes_present,
    )
