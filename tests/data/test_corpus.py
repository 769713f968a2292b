from pathlib import Path

import pytest

from megatron_slim.data import list_corpus, stdlib_root


def test_stdlib_listing_is_sorted_deterministic_and_python_only():
    first = list_corpus("stdlib")
    second = list_corpus("stdlib")
    paths = [d.relpath for d in first.documents]
    assert paths == [d.relpath for d in second.documents]
    assert first.fingerprint == second.fingerprint
    assert paths == sorted(paths) and len(paths) > 500
    assert all(p.endswith(".py") for p in paths)
    assert not any(part in ("site-packages", "dist-packages", "__pycache__") for p in paths for part in Path(p).parts)
    assert first.num_bytes == sum(len(d.text.encode()) for d in first.documents)
    assert first.documents[0].text == (stdlib_root() / paths[0]).read_text(encoding="utf-8")


def test_bounds_keep_a_prefix_of_the_full_listing():
    full = list_corpus("stdlib", max_files=50)
    few = list_corpus("stdlib", max_files=7)
    assert [d.relpath for d in few.documents] == [d.relpath for d in full.documents[:7]]
    assert few.fingerprint != full.fingerprint
    by_bytes = list_corpus("stdlib", max_bytes=200_000)
    assert 0 < by_bytes.num_bytes <= 200_000
    assert [d.relpath for d in by_bytes.documents] == [d.relpath for d in full.documents[: len(by_bytes)]]


def _make_tree(root: Path) -> None:
    (root / "sub").mkdir()
    (root / ".git").mkdir()
    (root / "b.txt").write_text("second\n")
    (root / "a.md").write_text("first ✓\n")
    (root / "sub" / "c.py").write_text("x = 1\n")
    (root / ".git" / "config").write_text("hidden\n")
    (root / ".hidden.txt").write_text("hidden\n")
    (root / "empty.txt").write_text("")
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (root / "binary.dat").write_bytes(b"\x00\x01\x02")


def test_directory_corpus_keeps_text_files_only(tmp_path):
    _make_tree(tmp_path)
    corpus = list_corpus(tmp_path)
    assert [d.relpath for d in corpus.documents] == ["a.md", "b.txt", "sub/c.py"]
    assert corpus.documents[0].text == "first ✓\n"
    assert [d.relpath for d in list_corpus(tmp_path, suffixes=(".py",)).documents] == ["sub/c.py"]


def test_fingerprint_follows_content_and_names(tmp_path):
    _make_tree(tmp_path)
    before = list_corpus(tmp_path).fingerprint
    (tmp_path / "b.txt").write_text("changed\n")
    changed = list_corpus(tmp_path).fingerprint
    (tmp_path / "b.txt").rename(tmp_path / "b2.txt")
    renamed = list_corpus(tmp_path).fingerprint
    assert len({before, changed, renamed}) == 3


def test_bad_inputs_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="corpus="):
        list_corpus(tmp_path / "missing")
    with pytest.raises(ValueError, match="no readable"):
        list_corpus(tmp_path)
    with pytest.raises(ValueError, match="max_files"):
        list_corpus("stdlib", max_files=-1)
