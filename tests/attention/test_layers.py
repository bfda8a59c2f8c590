"""The attention package and the transformers bridge are layered: every import points down.

Imports are read from the source with ``ast`` (function-level imports included, since a lazy
import upward is still an upward dependency), so this fails the moment a module reaches up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kernel_loader

ROOT = Path(kernel_loader.__file__).parent

# Lowest layer first. A module may import modules of lower layers only (not its own layer).
ATTENTION_LAYERS = [
    ["mask_functions"],
    ["registry"],
    ["mask_builders"],
    ["mask_equivalence"],
    ["mask_formatters"],
    ["backends", "backends.contract", "backends.flash_api"],
    ["backends.eager", "backends.sdpa", "backends.flex", "backends.flash"],
    ["backends.paged"],
    ["kernel_backends"],
    ["fallback"],
    [""],  # kernel_loader.attention itself: registers built-ins, installs the kernel-id resolver
]
BRIDGE_LAYERS = [["mask_labels"], ["routing"], ["patching"], [""]]


def _module_name(package: str, path: Path, base: Path) -> str:
    rel = path.relative_to(base).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([package, *parts]) if parts else package


def _imports(path: Path, package_of_file: str) -> set[str]:
    """Every kernel_loader module ``path`` imports, absolute, wherever the import statement sits."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of_file.rsplit(".", node.level - 1)[0] if node.level > 1 else package_of_file
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            # ``from pkg import sub`` may name a submodule
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {m for m in found if m.startswith("kernel_loader")}


def _layer_of(layers: list[list[str]], package: str) -> dict[str, int]:
    return {
        (f"{package}.{name}" if name else package): level for level, names in enumerate(layers) for name in names
    }


def _violations(package: str, layers: list[list[str]]) -> list[str]:
    base = ROOT.joinpath(*package.split(".")[1:])
    level = _layer_of(layers, package)
    problems = []
    for path in sorted(base.rglob("*.py")):
        name = _module_name(package, path, base)
        if name not in level:
            problems.append(f"{name} has no layer: add it to the layer list")
            continue
        own_package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for imported in _imports(path, own_package):
            if imported != package and not imported.startswith(package + "."):
                continue
            while imported not in level:
                imported = imported.rsplit(".", 1)[0]  # a name inside a module -> the module
            targets.add(imported)
        for target in sorted(targets - {name}):
            if level[target] >= level[name]:
                problems.append(f"{name} (layer {level[name]}) imports {target} (layer {level[target]})")
    return problems


@pytest.mark.parametrize(
    "package, layers",
    [("kernel_loader.attention", ATTENTION_LAYERS), ("kernel_loader.integrations.transformers", BRIDGE_LAYERS)],
)
def test_every_import_points_down(package, layers):
    assert _violations(package, layers) == []


def test_attention_never_imports_the_bridge():
    base = ROOT / "attention"
    for path in base.rglob("*.py"):
        assert not any(m.startswith("kernel_loader.integrations") for m in _imports(path, "kernel_loader.attention"))


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    # a copy of the package where the registry reaches up into kernel_backends, as it once did
    import shutil

    fake_root = tmp_path / "kernel_loader"
    shutil.copytree(ROOT / "attention", fake_root / "attention")
    registry = fake_root / "attention" / "registry.py"
    registry.write_text(registry.read_text() + "\n\ndef _late():\n    from kernel_loader.attention.kernel_backends import register_kernel_backend\n")
    monkeypatch.setattr(f"{__name__}.ROOT", fake_root)
    assert _violations("kernel_loader.attention", ATTENTION_LAYERS) == [
        "kernel_loader.attention.registry (layer 1) imports "
        "kernel_loader.attention.kernel_backends (layer 8)"
    ]
