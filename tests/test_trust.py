import pytest

from kernel_loader import trust
from kernel_loader.errors import UntrustedKernelError


def test_default_and_extra_orgs(monkeypatch):
    monkeypatch.delenv("KERNEL_LOADER_TRUSTED_ORGS", raising=False)
    trust.check_trust("kernels-community/x")
    with pytest.raises(UntrustedKernelError) as info:
        trust.check_trust("acme/x")
    assert "acme/x" in str(info.value) and "KERNEL_LOADER_TRUSTED_ORGS=acme" in str(info.value)
    trust.check_trust("acme/x", trust_remote_code=True)
    monkeypatch.setenv("KERNEL_LOADER_TRUSTED_ORGS", "acme")
    trust.check_trust("acme/x")
    assert not trust.is_trusted("kernels-communityX/x")
