"""Name -> function registries for attention implementations and their mask formatters.

Semantics follow transformers' ``GeneralInterface``: ``Interface.register(name, fn)`` changes the
class-wide (global) mapping seen by every instance; ``instance[name] = fn`` changes only that
instance (a model file can override ``"sdpa"`` for itself); lookups check the instance first,
then the global mapping.

Two additions: a name that is not registered is offered to the name resolvers installed with
:func:`install_name_resolver` (``kernel_loader.attention`` installs the one that loads kernel ids,
``"org/repo[@rev][:fn]"`` and ``"paged|org/repo"``, from ``kernel_backends``), and an unknown name
raises :class:`UnknownAttentionBackendError` listing what is registered.

This module imports nothing else of ``kernel_loader.attention``: the registries are plain
mappings that every layer above may use, and loading kernels is a job installed from outside.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, ClassVar

from kernel_loader.errors import UnknownAttentionBackendError

logger = logging.getLogger(__name__)

_warned_none_name = False

NameResolver = Callable[[str], bool]
"""``resolver(name) -> bool``: register ``name`` in both registries (globally) and return True, or
return False when ``name`` is not for it. It may raise the error that explains why ``name``
cannot be had (a kernel that does not load)."""

_resolvers: list[NameResolver] = []


def install_name_resolver(resolver: NameResolver) -> None:
    """Offer every unregistered name looked up in either registry to ``resolver`` (idempotent)."""
    if resolver not in _resolvers:
        _resolvers.append(resolver)


def _resolve(name: object) -> bool:
    return isinstance(name, str) and any(resolver(name) for resolver in _resolvers)


class _Interface(MutableMapping):
    """A local mapping layered over a class-wide one.

    Each subclass gets its own ``_global_mapping`` (declared in the class body), so registering an
    attention function never leaks into the mask registry.
    """

    _global_mapping: ClassVar[dict[str, Callable[..., Any]]] = {}
    _kind: ClassVar[str] = "function"

    def __init__(self) -> None:
        self._local_mapping: dict[str, Callable[..., Any]] = {}

    def __getitem__(self, key: str) -> Callable[..., Any]:
        if key in self._local_mapping:
            return self._local_mapping[key]
        if key in self._global_mapping:
            return self._global_mapping[key]
        # A resolver registers the name globally (a kernel id: its attention function and mask
        # formatter), so the next lookup is a plain dict hit.
        if _resolve(key) and key in self._global_mapping:
            return self._global_mapping[key]
        raise KeyError(key)

    def __setitem__(self, key: str, value: Callable[..., Any]) -> None:
        self._local_mapping[key] = value

    def __delitem__(self, key: str) -> None:
        del self._local_mapping[key]

    def __contains__(self, key: object) -> bool:
        # Plain membership never triggers a kernel download.
        return key in self._local_mapping or key in self._global_mapping

    def __iter__(self) -> Iterator[str]:
        return iter({**self._global_mapping, **self._local_mapping})

    def __len__(self) -> int:
        return len(self._global_mapping.keys() | self._local_mapping.keys())

    @classmethod
    def register(cls, key: str, value: Callable[..., Any]) -> None:
        """Register ``value`` under ``key`` for every instance (global)."""
        if not isinstance(key, str) or not key:
            raise TypeError(f"{cls.__name__}.register needs a non-empty string name, got {key!r}")
        if not callable(value):
            raise TypeError(f"{cls.__name__}.register({key!r}, ...) needs a callable, got {type(value).__name__}")
        cls._global_mapping[key] = value

    @classmethod
    def unregister(cls, key: str) -> None:
        """Remove a global registration (no error when absent)."""
        cls._global_mapping.pop(key, None)

    def valid_keys(self) -> list[str]:
        """Every name this instance can resolve without loading a kernel."""
        return list(self.keys())

    def _unknown(self, name: str) -> UnknownAttentionBackendError:
        return UnknownAttentionBackendError(
            f"{name!r} is not a registered attention {self._kind} (registered: "
            f"{', '.join(sorted(self.valid_keys()))}). Register it with "
            f"{type(self).__name__}.register({name!r}, fn), or give a kernel id such as "
            "'kernels-community/flash-attn2'."
        )

    def get_interface(self, name: str | None, default: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Return the function registered under ``name``.

        A kernel id is loaded and registered first. ``None`` returns ``default`` (with a one-time
        warning, as in transformers: a module used on its own may not know its implementation).

        Raises:
            UnknownAttentionBackendError: ``name`` is neither registered nor a kernel id
                (a ``KeyError``).
            InvalidKernelRefError, KernelNotFoundError, UnusableKernelError, ...: ``name`` is a
                kernel id that cannot be loaded or exports nothing usable.
        """
        global _warned_none_name
        if name is None:
            if not _warned_none_name:
                _warned_none_name = True
                logger.warning(
                    "Attention implementation name is None; using the default. Set "
                    "config._attn_implementation (e.g. 'sdpa') unless this module runs standalone."
                )
            if default is None:
                raise self._unknown("None")
            return default
        try:
            return self[name]
        except KeyError as exc:
            if isinstance(exc, UnknownAttentionBackendError) or exc.args != (name,):
                raise
            raise self._unknown(name) from None


class AttentionInterface(_Interface):
    """Registry of attention functions ``fn(module, query, key, value, attention_mask, **kw)``.

    Built-ins: ``eager``, ``sdpa``, ``flex_attention``, ``flash_attention_2``,
    ``flash_attention_3`` and the ``paged|`` variants; kernel ids register themselves on lookup.
    """

    _global_mapping: ClassVar[dict[str, Callable[..., Any]]] = {}
    _kind = "function"


class AttentionMaskInterface(_Interface):
    """Registry of mask formatters, keyed by the attention implementation's name.

    A formatter has the signature ``(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
    mask_function=causal_mask_function, attention_mask=None, **kwargs)`` and returns what the
    attention function of the same name expects (4D bool, 4D float, 2D padding, BlockMask or None).
    """

    _global_mapping: ClassVar[dict[str, Callable[..., Any]]] = {}
    _kind = "mask formatter"


ALL_ATTENTION_FUNCTIONS: AttentionInterface = AttentionInterface()
ALL_MASK_ATTENTION_FUNCTIONS: AttentionMaskInterface = AttentionMaskInterface()
