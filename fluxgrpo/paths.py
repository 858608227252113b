"""Default locations, the same as DanceGRPO's so existing data keeps working. Every one is a flag."""

DEFAULT_FLUX_DIR = "data/flux"
DEFAULT_HPS_DIR = "hps_ckpt"
DEFAULT_EMBEDDINGS_DIR = "data/rl_embeddings"
DEFAULT_OUTPUT_DIR = "data/outputs/grpo"
EMBEDDINGS_INDEX = "videos2caption.json"
DEFAULT_SAMPLES_DIR = "data/outputs/samples"


def ensure_writable_dir(folder, what: str, flag: str) -> None:
    """Create ``folder`` if needed and prove it writable, before any model loads.

    Args:
        what: what goes there, for the message ("embeddings", "images", "checkpoints").
        flag: the flag that chooses the folder ("--out", "--output-dir").

    Raises:
        FluxgrpoError: it cannot be created or written, naming the flag that picks another.
    """
    import os
    from pathlib import Path

    from fluxgrpo.errors import FluxgrpoError

    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-probe-{os.getpid()}.tmp"  # per process: ranks may probe one folder at once
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise FluxgrpoError(
            f"cannot write {what} to {folder} ({exc.strerror or exc}): pass a writable folder with {flag}"
        ) from None
