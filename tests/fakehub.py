"""Fake Hugging Face and ModelScope hubs on 127.0.0.1, for download tests that never touch the network.

Each server is a stdlib ``ThreadingHTTPServer`` in a daemon thread that serves repositories from folders
on disk, speaks just enough of each hub's API for huggingface_hub 2.x / modelscope_hub (the requests are
listed in shared/reference/feasibility.md §7), records every request, and shuts itself down after
``lifetime_s`` even if a test forgets to.

Fault injection, per file and counted (``times=-1`` means every time):
- ``corrupt``: serve the right number of bytes with the first byte changed (a hash mismatch).
- ``drop``: send the headers and half the body, then close the connection.
- ``refuse``: answer the content request with 403, as if access were withdrawn mid-run (a pending ``drop``
  of the same file goes first, so drop-then-refuse leaves a partial file behind a failed run).
Repositories can be gated (HF: 401 without a token, 403 with a token that has no grant) and unknown
repositories, revisions and files answer 404 with the hub's error code.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

# Suffixes the real repos keep in git LFS (FLUX.1-dev's .gitattributes); everything else is a git blob.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".model", ".jpg")


@dataclass
class FakeRepo:
    """A repository served from ``root``: every file under it, at commit ``sha``."""

    repo_id: str
    root: Path
    gated: bool = False
    granted_tokens: frozenset[str] = frozenset()
    sha: str = ""
    repo_type: str = "model"  # or "dataset": served under Hugging Face's /api/datasets and /datasets/ routes

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if not self.sha:
            self.sha = hashlib.sha1(self.repo_id.encode()).hexdigest()

    def files(self) -> list[str]:
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)


@dataclass
class RecordedRequest:
    method: str
    path: str  # URL path, percent-decoded
    query: dict[str, str]
    range: str | None
    authorized: bool  # an Authorization header or a ModelScope session cookie was sent


@dataclass
class _Fault:
    remaining: int  # -1: forever

    def take(self) -> bool:
        if self.remaining == 0:
            return False
        if self.remaining > 0:
            self.remaining -= 1
        return True


@dataclass
class FakeHub:
    """One fake hub. ``flavour`` is "hf" or "modelscope"; use as a context manager or call start()/stop()."""

    flavour: str
    repos: list[FakeRepo]
    lifetime_s: float = 120.0
    requests: list[RecordedRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.flavour not in ("hf", "modelscope"):
            raise ValueError(f"unknown flavour {self.flavour!r}")
        self._by_id = {r.repo_id: r for r in self.repos}
        self._faults: dict[tuple[str, str, str], _Fault] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._watchdog: threading.Timer | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self._watchdog = threading.Timer(self.lifetime_s, self.stop)
        self._watchdog.daemon = True
        self._watchdog.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._watchdog is not None:
            self._watchdog.cancel()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the hub first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- faults ------------------------------------------------------------------------------------
    def corrupt(self, repo_id: str, path: str, times: int = 1) -> None:
        self._faults[("corrupt", repo_id, path)] = _Fault(times)

    def drop(self, repo_id: str, path: str, times: int = 1) -> None:
        self._faults[("drop", repo_id, path)] = _Fault(times)

    def refuse(self, repo_id: str, path: str, times: int = 1) -> None:
        self._faults[("refuse", repo_id, path)] = _Fault(times)

    def clear_faults(self) -> None:
        self._faults.clear()

    def _fault(self, kind: str, repo_id: str, path: str) -> bool:
        with self._lock:
            fault = self._faults.get((kind, repo_id, path))
            return fault is not None and fault.take()

    # -- what was asked for ------------------------------------------------------------------------
    def record(self, request: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def content_requests(self, methods: tuple[str, ...] = ("GET",)) -> list[tuple[str, str, str | None]]:
        """(repo_id, file path, Range header) for every request of file bytes (GET; HEAD too if asked), in order."""
        out = []
        with self._lock:
            recorded = list(self.requests)
        for req in recorded:
            if req.method not in methods:
                continue
            located = _locate_content(self.flavour, req)
            if located is not None:
                out.append((*located, req.range))
        return out

    def reset_requests(self) -> None:
        with self._lock:
            self.requests.clear()


def _locate_content(flavour: str, req: RecordedRequest) -> tuple[str, str] | None:
    parts = req.path.strip("/").split("/")
    if flavour == "hf":
        if parts[:1] == ["datasets"]:
            parts = parts[1:]
        if len(parts) >= 5 and parts[2] == "resolve":
            return f"{parts[0]}/{parts[1]}", "/".join(parts[4:])
        return None
    if len(parts) == 6 and parts[:3] == ["api", "v1", "models"] and parts[5] == "repo" and "FilePath" in req.query:
        return f"{parts[3]}/{parts[4]}", req.query["FilePath"]
    return None


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) byte of a ``bytes=a-`` / ``bytes=a-b`` range; None when absent."""
    if not header or not header.startswith("bytes="):
        return None
    first_s, _, last_s = header[len("bytes=") :].partition("-")
    first = int(first_s)
    last = int(last_s) if last_s else size - 1
    return first, min(last, size - 1)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
        pass

    # -- plumbing ----------------------------------------------------------------------------------
    def _record(self) -> tuple[str, dict[str, str]]:
        split = urlsplit(self.path)
        path = unquote(split.path)
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        cookie = self.headers.get("Cookie") or ""
        authorized = bool(self.headers.get("Authorization")) or "m_session_id=" in cookie
        self.fake.record(RecordedRequest(self.command, path, query, self.headers.get("Range"), authorized))
        return path, query

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, document: object, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(document).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _hf_error(self, status: int, code: str, message: str) -> None:
        self._json(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

    def _ms_error(self, status: int, message: str) -> None:
        self._json(status, {"Code": status, "Success": False, "Message": message})

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth.removeprefix("Bearer ").strip() or None

    def _serve_bytes(self, repo: FakeRepo, rel: str, headers: dict[str, str]) -> None:
        """The file, honouring Range, with the configured faults."""
        drop = self.command == "GET" and self.fake._fault("drop", repo.repo_id, rel)
        if self.command == "GET" and not drop and self.fake._fault("refuse", repo.repo_id, rel):
            if self.fake.flavour == "hf":
                self._hf_error(403, "Forbidden", "access withdrawn")
            else:
                self._ms_error(403, "access withdrawn")
            return
        data = (repo.root / rel).read_bytes()
        status, first, last = 200, 0, len(data) - 1
        span = _parse_range(self.headers.get("Range"), len(data))
        if span is not None and self.command == "GET":
            first, last = span
            if first >= len(data):
                self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                return
            status = 206
            headers = {**headers, "Content-Range": f"bytes {first}-{last}/{len(data)}"}
        body = data[first : last + 1]
        if self.command == "GET" and body and self.fake._fault("corrupt", repo.repo_id, rel):
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        drop = drop and len(body) > 1
        self.send_response(status)
        for key, value in {**headers, "Accept-Ranges": "bytes"}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if drop:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)

    # -- verbs -------------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_POST(self) -> None:
        self._record()
        self._send(404)

    def do_GET(self) -> None:
        path, query = self._record()
        try:
            if self.fake.flavour == "hf":
                self._hf(path, query)
            else:
                self._modelscope(path, query)
        except (BrokenPipeError, ConnectionResetError):
            pass

    # -- Hugging Face ------------------------------------------------------------------------------
    def _hf(self, path: str, query: dict[str, str]) -> None:
        parts = path.strip("/").split("/")
        repo_type = "model"
        if parts[:1] == ["datasets"]:  # /datasets/<repo>/resolve/…: a dataset's file
            repo_type, parts = "dataset", parts[1:]
        if parts[:2] in (["api", "models"], ["api", "datasets"]) and len(parts) >= 4:
            repo = self.fake._by_id.get(f"{parts[2]}/{parts[3]}")
            if repo is None or repo.repo_type != parts[1].removesuffix("s"):
                return self._hf_error(404, "RepoNotFound", "Repository not found")
            rest = parts[4:]
            if not rest:
                return self._hf_info(repo)
            if rest[0] == "revision" and len(rest) == 2:
                return self._hf_info(repo) if self._hf_rev_ok(repo, rest[1]) else self._hf_bad_rev(rest[1])
            if rest[0] == "tree" and len(rest) >= 2:
                if not self._hf_rev_ok(repo, rest[1]):
                    return self._hf_bad_rev(rest[1])
                return self._hf_tree(repo, "/".join(rest[2:]))
            return self._send(404)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self.fake._by_id.get(f"{parts[0]}/{parts[1]}")
            if repo is None or repo.repo_type != repo_type:
                return self._hf_error(404, "RepoNotFound", "Repository not found")
            if not self._hf_rev_ok(repo, parts[3]):
                return self._hf_bad_rev(parts[3])
            if repo.gated:
                token = self._token()
                if token is None:
                    return self._hf_error(
                        401,
                        "GatedRepo",
                        f"Access to model {repo.repo_id} is restricted. You must "
                        "have access to it and be authenticated to access it. Please log in.",
                    )
                if token not in repo.granted_tokens:
                    return self._hf_error(
                        403,
                        "GatedRepo",
                        f"Access to model {repo.repo_id} is restricted and you are not in the authorized list.",
                    )
            rel = "/".join(parts[4:])
            if not (repo.root / rel).is_file():
                return self._hf_error(404, "EntryNotFound", f"{rel} does not exist")
            data = (repo.root / rel).read_bytes()
            if repo.is_lfs(rel):
                digest = hashlib.sha256(data).hexdigest()
                headers = {"ETag": f'"{digest}"', "X-Linked-Etag": f'"{digest}"', "X-Linked-Size": str(len(data))}
            else:
                headers = {"ETag": f'"{git_blob_sha1(data)}"'}
            return self._serve_bytes(repo, rel, {**headers, "X-Repo-Commit": repo.sha})
        self._send(404)

    @staticmethod
    def _hf_rev_ok(repo: FakeRepo, revision: str) -> bool:
        return revision in ("main", repo.sha)

    def _hf_bad_rev(self, revision: str) -> None:
        self._hf_error(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    def _hf_info(self, repo: FakeRepo) -> None:
        self._json(
            200,
            {
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "sha": repo.sha,
                "private": False,
                "gated": "auto" if repo.gated else False,
                "siblings": [{"rfilename": f} for f in repo.files()],
            },
        )

    def _hf_tree(self, repo: FakeRepo, under: str) -> None:
        entries, folders = [], set()
        for rel in repo.files():
            if under and not rel.startswith(under.rstrip("/") + "/"):
                continue
            parent = rel.rpartition("/")[0]
            while parent and parent not in folders:
                folders.add(parent)
                entries.append({"type": "directory", "path": parent, "oid": git_blob_sha1(parent.encode()), "size": 0})
                parent = parent.rpartition("/")[0]
            data = (repo.root / rel).read_bytes()
            entry = {"type": "file", "path": rel, "size": len(data)}
            if repo.is_lfs(rel):
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
                entry["oid"] = git_blob_sha1(pointer.encode())
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(pointer)}
            else:
                entry["oid"] = git_blob_sha1(data)
            entries.append(entry)
        self._json(200, entries)

    # -- ModelScope --------------------------------------------------------------------------------
    def _modelscope(self, path: str, query: dict[str, str]) -> None:
        parts = path.strip("/").split("/")
        if parts[:3] != ["api", "v1", "models"] or len(parts) < 6:
            return self._ms_error(404, "not found")
        repo = self.fake._by_id.get(f"{parts[3]}/{parts[4]}")
        if repo is None:
            return self._ms_error(404, f"model {parts[3]}/{parts[4]} does not exist")
        if repo.gated and not (
            self.headers.get("Authorization") or "m_session_id=" in (self.headers.get("Cookie") or "")
        ):
            return self._ms_error(401, "login required")
        revision = query.get("Revision", "master")
        if parts[5] == "revisions":
            return self._json(
                200,
                {
                    "Code": 200,
                    "Success": True,
                    "Data": {"RevisionMap": {"Branches": [{"Revision": "master"}], "Tags": []}},
                },
            )
        if revision not in ("master", repo.sha):
            return self._ms_error(404, f"revision {revision} does not exist")
        if parts[5:] == ["repo", "files"]:
            return self._ms_files(repo, query.get("Root", ""))
        if parts[5:] == ["repo"] and "FilePath" in query:
            rel = query["FilePath"]
            if not (repo.root / rel).is_file():
                return self._ms_error(404, f"file {rel} does not exist")
            return self._serve_bytes(repo, rel, {"Content-Type": "application/octet-stream"})
        self._ms_error(404, "not found")

    def _ms_files(self, repo: FakeRepo, under: str) -> None:
        files = []
        for rel in repo.files():
            if under and not rel.startswith(under.strip("/") + "/"):
                continue
            data = (repo.root / rel).read_bytes()
            files.append(
                {
                    "Name": rel.rpartition("/")[2],
                    "Path": rel,
                    "Type": "blob",
                    "Size": len(data),
                    "Sha256": hashlib.sha256(data).hexdigest(),
                    "Revision": repo.sha,
                    "IsLFS": repo.is_lfs(rel),
                }
            )
        self._json(200, {"Code": 200, "Success": True, "Data": {"Files": files}})


# -- repository builders ---------------------------------------------------------------------------

# FLUX.1-dev's file list (shared/reference/hub-files.md §1), with tiny sizes. The root single-file
# checkpoints are here so a test can prove they are never requested.
FLUX_DEV_FILES: dict[str, int] = {
    ".gitattributes": 300,
    "README.md": 400,
    "LICENSE.md": 500,
    "dev_grid.jpg": 900,
    "flux1-dev.safetensors": 4000,
    "ae.safetensors": 1500,
    "model_index.json": 536,
    "scheduler/scheduler_config.json": 300,
    "text_encoder/config.json": 613,
    "text_encoder/model.safetensors": 3000,
    "text_encoder_2/config.json": 782,
    "text_encoder_2/model-00001-of-00002.safetensors": 5000,
    "text_encoder_2/model-00002-of-00002.safetensors": 4500,
    "text_encoder_2/model.safetensors.index.json": 700,
    "tokenizer/merges.txt": 1200,
    "tokenizer/special_tokens_map.json": 588,
    "tokenizer/tokenizer_config.json": 705,
    "tokenizer/vocab.json": 1500,
    "tokenizer_2/special_tokens_map.json": 600,
    "tokenizer_2/spiece.model": 2000,
    "tokenizer_2/tokenizer.json": 2400,
    "tokenizer_2/tokenizer_config.json": 900,
    "transformer/config.json": 500,
    "transformer/diffusion_pytorch_model-00001-of-00003.safetensors": 200_000,
    "transformer/diffusion_pytorch_model-00002-of-00003.safetensors": 9000,
    "transformer/diffusion_pytorch_model-00003-of-00003.safetensors": 3800,
    "transformer/diffusion_pytorch_model.safetensors.index.json": 1200,
    "vae/config.json": 774,
    "vae/diffusion_pytorch_model.safetensors": 1600,
}
HPS_FILES = {
    "HPS_v2.pt": 3000,
    "HPS_v2_compressed.pt": 1900,
    "HPS_v2.1_compressed.pt": 2100,
    "README.md": 200,
    ".gitattributes": 100,
}
CLIP_FILES = {
    "open_clip_pytorch_model.bin": 3900,
    "open_clip_model.safetensors": 3800,
    "model.safetensors": 3700,
    "open_clip_config.json": 400,
    "config.json": 450,
    "README.md": 300,
}


def write_random_repo(root: Path, sizes: dict[str, int], seed: int) -> Path:
    """Files of the given sizes filled with seeded random bytes (distinct per path); a ``.json`` file is a JSON
    object of that size padded with random hex, since the weights checks read config files."""
    for rel, size in sizes.items():
        path = Path(root) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        stream = hashlib.shake_256(f"{seed}:{rel}".encode()).digest(size)
        if rel.endswith(".json"):
            stream = b'{"pad": "' + stream.hex().encode()[: size - 11] + b'"}'
        path.write_bytes(stream)
    return Path(root)


def free_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens (a closed port), for network-failure tests."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def sha256_of(path: os.PathLike[str] | str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def isolate_hub_environment(tmp_path, monkeypatch) -> None:
    """Point both hub libraries at ``tmp_path`` and drop every token/endpoint variable, so no real token,
    cache or server can take part in a test."""
    from huggingface_hub import constants as hf_constants

    hf_home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms_cache"))
    monkeypatch.setenv("MODELSCOPE_HOME", str(tmp_path / "ms_home"))
    for name in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_ENDPOINT",
        "MODELSCOPE_API_TOKEN",
        "MODELSCOPE_ENDPOINT",
        "HF_HUB_OFFLINE",
        "HF_OIDC_RESOURCE",
    ):
        monkeypatch.delenv(name, raising=False)
    # huggingface_hub read HF_HOME & co. when it was first imported (perhaps by another test): point those at
    # tmp too.
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(hf_home / "token"))
    monkeypatch.setattr(hf_constants, "HF_STORED_TOKENS_PATH", str(hf_home / "stored_tokens"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", False)
