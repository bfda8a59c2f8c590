from pathlib import Path

from kernel_loader import constants


def test_read_at_call_time_and_cache_precedence(monkeypatch, tmp_path):
    for var in ("KERNEL_LOADER_CACHE", "HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert constants.cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert constants.cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    assert constants.cache_dir() == tmp_path / "hubcache"
    monkeypatch.setenv("KERNEL_LOADER_CACHE", "~/kernels")
    assert constants.cache_dir() == Path(tmp_path / "kernels")


def test_flags_endpoint_and_orgs(monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert constants.hf_endpoint() == "https://huggingface.co"
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:8090/")
    assert constants.hf_endpoint() == "http://127.0.0.1:8090"
    for value, expected in (("1", True), ("true", True), ("ON", True), ("0", False), ("", False)):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert constants.hf_offline() is expected
    monkeypatch.setenv("KERNEL_LOADER_TRUSTED_ORGS", " a, b ,,")
    assert constants.trusted_orgs() == {"kernels-community", "a", "b"}
    monkeypatch.setenv("LOCAL_KERNELS", "   ")
    assert constants.local_kernels() is None
    monkeypatch.setenv("KERNEL_LOADER_BACKEND", " CPU ")
    assert constants.backend_override() == "cpu"
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    assert constants.hf_token() == "hf_x"


def test_timeouts_retries_and_lock_wait(monkeypatch):
    import pytest

    from kernel_loader.errors import SettingError

    for name in ("KERNEL_LOADER_CONNECT_TIMEOUT", "KERNEL_LOADER_READ_TIMEOUT", "KERNEL_LOADER_RETRIES", "KERNEL_LOADER_LOCK_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    assert (constants.connect_timeout(), constants.read_timeout(), constants.retries(), constants.lock_timeout()) == (5.0, 10.0, 2, 600.0)
    monkeypatch.setenv("KERNEL_LOADER_READ_TIMEOUT", "2.5")
    monkeypatch.setenv("KERNEL_LOADER_RETRIES", "0")
    assert (constants.read_timeout(), constants.retries()) == (2.5, 0)
    monkeypatch.setenv("KERNEL_LOADER_CONNECT_TIMEOUT", "soon")
    with pytest.raises(SettingError, match="KERNEL_LOADER_CONNECT_TIMEOUT='soon' is not a number"):
        constants.connect_timeout()
    monkeypatch.setenv("KERNEL_LOADER_READ_TIMEOUT", "0")
    with pytest.raises(SettingError, match="at least"):
        constants.read_timeout()


def test_import_warning_delay(monkeypatch):
    monkeypatch.delenv("KERNEL_LOADER_IMPORT_WARN_S", raising=False)
    assert constants.import_warn_seconds() == constants.DEFAULT_IMPORT_WARN_SECONDS == 30.0
    monkeypatch.setenv("KERNEL_LOADER_IMPORT_WARN_S", "2.5")
    assert constants.import_warn_seconds() == 2.5
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv("KERNEL_LOADER_IMPORT_WARN_S", bad)
        assert constants.import_warn_seconds() == 30.0
