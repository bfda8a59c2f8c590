"""Re-labelling transformers' mask closures so kernel_loader's formatters know what they are.

kernel_loader's formatters read a mask function's ``mask_kind`` / ``mask_params`` to tell what a
pattern is (FlashAttention applies causal, sliding window, padding and packed sequences through its
own arguments). transformers builds its patterns from closures made by a handful of factories
(``and_masks``, ``sliding_window_overlay``, ...); each is recognised by its code object, which is
exact for the installed version, and its parameters are read from the closure. The labelled
wrapper evaluates transformers' own function, so the mask values never change.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["MaskDescriber", "describer_for", "adapt_mask_formatter"]


class MaskDescriber:
    """Labels transformers' mask functions with kernel_loader's ``mask_kind`` / ``mask_params``."""

    def __init__(self, masking_utils: Any) -> None:
        import torch

        self._plain: dict[int, str] = {}
        for attr, kind in (("causal_mask_function", "causal"), ("bidirectional_mask_function", "bidirectional")):
            fn = getattr(masking_utils, attr, None)
            if fn is not None:
                self._plain[id(fn)] = kind
        one = torch.ones(1, 1, dtype=torch.bool)
        zero = torch.zeros(1, dtype=torch.long)
        probe = getattr(masking_utils, "causal_mask_function")
        # factory name -> (probe arguments, kind, how the closure's variables map to params)
        factories: dict[str, tuple[tuple, str, Callable[[dict], dict]]] = {
            "and_masks": ((probe,), "and", lambda v: {"parts": tuple(v["mask_functions"])}),
            "or_masks": ((probe,), "or", lambda v: {"parts": tuple(v["mask_functions"])}),
            "sliding_window_overlay": ((1,), "sliding_window", lambda v: {"window": v["sliding_window"]}),
            "sliding_window_bidirectional_overlay": (
                (1,),
                "sliding_window_bidirectional",
                lambda v: {"window": v["sliding_window"]},
            ),
            "chunked_overlay": ((1, zero), "chunked", lambda v: {"chunk_size": v["chunk_size"]}),
            "_legacy_chunked_overlay": ((1,), "chunked", lambda v: {"chunk_size": v["chunk_size"]}),
            "padding_mask_function": ((one,), "padding", lambda v: {"padding_mask": v["padding_mask"]}),
            "packed_sequence_mask_function": (
                (one,),
                "packed_sequence",
                lambda v: {"packed_sequence_mask": v["packed_sequence_mask"]},
            ),
            "remap_positions_for_packed_sequence": (
                (probe, one),
                "remap",
                lambda v: {"parts": (v["mask_function"],), "position_ids": v["position_ids"]},
            ),
            "add_offsets_to_mask_function": (
                (probe, 0, 0),
                "offset",
                lambda v: {"parts": (v["mask_function"],), "q_offset": v["q_offset"], "kv_offset": v["kv_offset"]},
            ),
        }
        self._closures: dict[Any, tuple[str, Callable[[dict], dict]]] = {}
        for name, (args, kind, params) in factories.items():
            factory = getattr(masking_utils, name, None)
            if factory is None:
                continue
            try:
                code = factory(*args).__code__
            except Exception:  # a factory whose signature changed: leave its masks unlabelled
                logger.debug("transformers.masking_utils.%s could not be probed", name, exc_info=True)
                continue
            self._closures[code] = (kind, params)

    def describe(self, fn: Any) -> Any:
        """``fn`` wrapped with labels, or ``fn`` itself when it is not one of transformers' own."""
        if fn is None or hasattr(fn, "mask_kind"):
            return fn
        kind = self._plain.get(id(fn))
        params: dict[str, Any] = {}
        if kind is None:
            code = getattr(fn, "__code__", None)
            entry = self._closures.get(code) if code is not None else None
            if entry is None or not fn.__closure__:
                return fn  # a user's own predicate: formatters treat it as "custom"
            kind, to_params = entry
            variables = dict(zip(code.co_freevars, (cell.cell_contents for cell in fn.__closure__)))
            try:
                params = to_params(variables)
            except KeyError:
                return fn
            if "parts" in params:
                params["parts"] = tuple(self.describe(part) for part in params["parts"])

        def labelled(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
            return fn(batch_idx, head_idx, q_idx, kv_idx)

        labelled.mask_kind = kind  # type: ignore[attr-defined]
        labelled.mask_params = params  # type: ignore[attr-defined]
        return labelled


@functools.lru_cache(maxsize=4)
def describer_for(masking_utils: Any) -> MaskDescriber:
    """The describer of one ``transformers.masking_utils`` module (its factories probed once)."""
    return MaskDescriber(masking_utils)


def adapt_mask_formatter(formatter: Callable[..., Any], describer: MaskDescriber, flavor: str) -> Callable[..., Any]:
    """kernel_loader's formatter, callable the way this transformers version calls mask formatters.

    transformers 5.x passes ``q_length`` / ``q_offset`` (the signature kernel_loader uses);
    4.57 passes ``cache_position`` (the absolute positions of the queries) instead.
    """

    @functools.wraps(formatter)
    def mask_formatter(*args: Any, **kwargs: Any) -> Any:
        if "mask_function" in kwargs:
            kwargs["mask_function"] = describer.describe(kwargs["mask_function"])
        if flavor == "4.57" and "cache_position" in kwargs:
            cache_position = kwargs.pop("cache_position")
            q_length = int(cache_position.shape[0])
            kwargs["q_length"] = q_length
            kwargs["q_offset"] = int(cache_position[0]) if q_length else 0
        return formatter(*args, **kwargs)

    mask_formatter.__kernel_loader_formatter__ = formatter  # type: ignore[attr-defined]
    return mask_formatter
