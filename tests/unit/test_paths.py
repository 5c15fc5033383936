"""Model name → directory: inside the export directory, one directory per distinct name."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_exportobs.core.paths import model_directory, require_writable_directory

EXPORT_DIR = Path("/ci/.exportobs")


@pytest.mark.parametrize(
    ("name", "directory"),
    [
        ("mlp", "mlp"),
        ("tiny-llama_v2.1", "tiny-llama_v2.1"),
        ("..", "model-5ec1f7e7"),
        (".", "model-cdb4ee2a"),
        ("../../etc", "etc-74ccf3c5"),
        (".hidden", "hidden-16924190"),
        ("a b", "a_b-c8687a08"),
        ("a/b", "a_b-c14cddc0"),
        ("a_b", "a_b"),
        ("a_b-c8687a08", "a_b-c8687a08-98c76cf9"),  # a name shaped like a digested one is digested too
        ("модель", "model-b68fadf0"),
        ("模型", "model-c98e118e"),
        ("cache", "cache-5e1ecee0"),
        ("Cache", "Cache-a76ce82a"),
        ("model[MLP-1a2b3c]", "model_MLP-1a2b3c-2255aff8"),
        ("x" * 300, "x" * 64 + "-0d4e2ca9"),
    ],
)
def test_each_name_has_its_own_directory_inside_the_export_directory(name: str, directory: str) -> None:
    path = model_directory(EXPORT_DIR, name)
    assert path == EXPORT_DIR / directory
    assert path.parent == EXPORT_DIR and len(path.name) <= 73


def test_distinct_names_never_share_a_directory() -> None:
    names = ["a b", "a/b", "a_b", "a:b", "a_b-c8687a08", "модель", "模型", "..", ".", "cache", "x" * 300, "x" * 301]
    assert len({model_directory(EXPORT_DIR, n) for n in names}) == len(names)


def test_an_unusable_directory_is_an_os_error(tmp_path: Path) -> None:
    require_writable_directory(tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir").is_dir() and not any((tmp_path / "new" / "dir").iterdir())
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        require_writable_directory(tmp_path / "file" / "dir")
