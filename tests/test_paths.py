"""fluxgrpo.paths: the one atomic write every tmp-then-rename goes through, and default file modes."""

from __future__ import annotations

import os

import pytest

from fluxgrpo.paths import give_default_mode, write_atomic


def test_write_atomic_writes_text_bytes_and_through_a_writer(tmp_path):
    assert write_atomic(tmp_path / "a.txt", "héllo\n").read_bytes() == "héllo\n".encode()
    assert write_atomic(tmp_path / "b.bin", b"\x00\x01", durable=True).read_bytes() == b"\x00\x01"
    assert write_atomic(tmp_path / "c.bin", lambda f: f.write(b"written")).read_bytes() == b"written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "c.bin"]  # no temporary left behind


def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary(tmp_path):
    target = write_atomic(tmp_path / "state.json", '{"old": true}')

    def half_then_fail(f):
        f.write(b'{"new": ')
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, half_then_fail)
    assert target.read_text() == '{"old": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_give_default_mode_follows_the_umask(tmp_path, umask, mode):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(b"")
    os.chmod(path, 0o600)
    previous = os.umask(umask)
    try:
        give_default_mode(path)
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == mode
