import json
from pathlib import Path

from kernel_loader.machine import Machine
from kernel_loader.resolution import Resolution, VariantDecision


def test_explain_and_json_tell_the_whole_story():
    res = Resolution(
        "org/k@v1", "hub", "org/k", "v1", "a" * 40, "torch-universal", Path("/c/build/torch-universal"),
        [VariantDecision("torch-universal", True, "Python-only build for any backend", 0),
         VariantDecision("torch27-cxx11-cu118-x86_64-linux", False, "built for torch 2.7, this machine has torch 2.8")],
        ["http://mirror (repo type model)"], resolved_revision="v1",
        machine=Machine("2.8", True, "cpu", None, "x86_64", "linux"),
    )
    text = res.explain()
    for needle in ("org/k@v1", "source:   hub", "a" * 40, "torch-universal", "torch 2.7", "http://mirror", "torch 2.8, cxx11 ABI"):
        assert needle in text
    data = json.loads(json.dumps(res.to_json()))
    assert data["decisions"][1] == {"variant": "torch27-cxx11-cu118-x86_64-linux", "accepted": False,
                                    "reason": "built for torch 2.7, this machine has torch 2.8", "rank": None}
    assert data["machine"]["backend"] == "cpu" and data["path"] == "/c/build/torch-universal"
    assert [d.variant for d in res.rejected] == ["torch27-cxx11-cu118-x86_64-linux"]
