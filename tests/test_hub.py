"""Built-in aliases: cache location, and failed fetches that leave nothing half-written."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from specsample.models import hub


def test_cache_dir_env_and_xdg(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path / "mine"))
    assert hub.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(hub.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.cache_dir() == tmp_path / "xdg" / "specsample"


def _fake_alias(monkeypatch, wheel: hub.Wheel) -> str:
    alias = dataclasses.replace(hub.ALIASES["smollm2-135m-instruct"], name="fake-model", wheels=(wheel,))
    monkeypatch.setitem(hub.ALIASES, "fake-model", alias)
    return "fake-model"


def _leftovers(cache: Path) -> list[str]:
    models = cache / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


def test_download_failure_leaves_nothing(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path))
    name = _fake_alias(monkeypatch, hub.Wheel("specsample-no-such-package-xyz==9.9.9", "x.whl", "0" * 64, "x.gguf"))
    with pytest.raises(hub.FetchError, match="could not download specsample-no-such-package-xyz"):
        hub.alias_folder(name, progress=False)
    assert _leftovers(tmp_path) == []


def test_wrong_hash_leaves_nothing(monkeypatch, tmp_path) -> None:
    # a tiny real wheel from PyPI, declared with the wrong sha256
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path))
    name = _fake_alias(monkeypatch, hub.Wheel("six==1.16.0", "six-1.16.0-py2.py3-none-any.whl", "0" * 64, "six.py"))
    with pytest.raises(hub.FetchError, match="sha256"):
        hub.alias_folder(name, progress=False)
    assert _leftovers(tmp_path) == []


def test_a_folder_cached_without_its_gguf_gets_it(monkeypatch, tmp_path) -> None:
    """The GGUF is kept beside the converted folder; a folder converted before that gets the file fetched into it,
    and a failed fetch leaves the folder as it was."""
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path))
    name = _fake_alias(monkeypatch, hub.Wheel("x==1", "x.whl", "0" * 64, "x.gguf"))
    folder = tmp_path / "models" / name
    folder.mkdir(parents=True)
    (folder / "specsample.json").write_text("{}")  # converted and cached
    monkeypatch.setattr(hub, "_fetch_gguf", lambda alias, work, progress: (_ for _ in ()).throw(hub.FetchError("x")))
    with pytest.raises(hub.FetchError):
        hub.alias_gguf(name, progress=False)
    assert sorted(p.name for p in folder.iterdir()) == ["specsample.json"]
    assert _leftovers(tmp_path) == [name]

    def fetch(alias, work, progress):
        (work / "got.gguf").write_bytes(b"GGUF")
        return work / "got.gguf"

    monkeypatch.setattr(hub, "_fetch_gguf", fetch)
    assert hub.alias_gguf(name, progress=False) == folder / hub.GGUF_NAME
    assert (folder / hub.GGUF_NAME).read_bytes() == b"GGUF" and _leftovers(tmp_path) == [name]
