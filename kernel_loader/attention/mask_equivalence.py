"""Deciding by evaluation whether a mask function is what a kernel computes anyway.

A backend that applies masks through its own arguments (FlashAttention's ``causal`` and
``window_size``, sdpa's ``is_causal``) cannot apply an arbitrary predicate; dropping one changes
the results. But a predicate may well equal what the kernel computes: a user's
``lambda b, h, q, kv: kv <= q`` is causal. So a pattern holding parts the formatter does not
recognise is compared, cell by cell, with the pattern the kernel computes:

* **what the kernel computes** is the pattern with every unrecognised part removed (custom
  predicates, chunks, blocks: FlashAttention has none of them); a pattern with nothing recognised
  left is causal, or bidirectional when ``config.is_causal`` is False;
* **the grid** is the real one: every (batch row, query, key) of this call, with the query and
  key offsets; cells of padding queries or padding keys do not count (the kernel never computes
  them);
* **the budget**: up to :data:`MASK_CHECK_CELLS` cells (batch x queries x keys) are evaluated at
  once, vectorised. A larger grid is checked on a sample of whole query rows (the first, the last
  and evenly spaced ones, within the budget), and a one-time warning says what was assumed;
* **the answer is cached** per (custom functions, tensors they read, grid shape), so that the
  same call in the next step or layer costs a dict lookup (there for speed only; docs/attention.md,
  "What is there for speed").
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from kernel_loader.attention.mask_functions import (
    MaskFunction,
    add_offsets_to_mask_function,
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    or_masks,
    remap_positions_for_packed_sequence,
)

__all__ = ["MASK_CHECK_CELLS", "KERNEL_KINDS", "MaskDifference", "kernel_pattern", "first_difference"]

#: Cells (batch x queries x keys) evaluated in one go; beyond it, whole query rows are sampled.
#: 4M bool cells take a few MB and a few milliseconds on a CPU.
MASK_CHECK_CELLS = 1 << 22
#: Pattern parts FlashAttention applies itself (through ``causal``, ``window_size``, unpadding and
#: ``cu_seqlens``).
KERNEL_KINDS = frozenset(
    {"causal", "bidirectional", "sliding_window", "sliding_window_bidirectional", "padding", "packed_sequence"}
)
_COMBINATIONS = ("and", "or")
_WRAPPERS = ("remap", "offset")


@dataclass(frozen=True)
class MaskDifference:
    """The first cell where a mask function and the kernel's pattern disagree."""

    batch: int
    query: int  # absolute position (q_offset included)
    key: int  # absolute position (kv_offset included)
    given: bool  # what the mask function says
    kernel: bool  # what the kernel computes

    def describe(self) -> str:
        word = {True: "attends", False: "is masked"}
        return (
            f"at batch row {self.batch}, query {self.query}, key {self.key} the mask function says the pair "
            f"{word[self.given]}, the kernel's pattern says it {word[self.kernel]}"
        )


def kernel_pattern(mask_function: MaskFunction, causal_default: bool = True) -> MaskFunction:
    """What a kernel that knows only :data:`KERNEL_KINDS` computes for ``mask_function``."""
    kept = _recognised(mask_function)
    if kept is not None:
        return kept
    return causal_mask_function if causal_default else bidirectional_mask_function


def _recognised(fn: MaskFunction) -> MaskFunction | None:
    kind = getattr(fn, "mask_kind", "custom")
    params = getattr(fn, "mask_params", {})
    if kind in KERNEL_KINDS:
        return fn
    if kind in _COMBINATIONS:
        parts = [p for p in (_recognised(part) for part in params["parts"]) if p is not None]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return and_masks(*parts) if kind == "and" else or_masks(*parts)
    if kind in _WRAPPERS:
        inner = _recognised(params["parts"][0])
        if inner is None:
            return None
        if kind == "remap" and "position_ids" in params:
            return remap_positions_for_packed_sequence(inner, params["position_ids"])
        if kind == "offset" and "q_offset" in params:
            return add_offsets_to_mask_function(inner, params["q_offset"], params["kv_offset"])
        return None
    return None  # custom predicates, chunks, blocks


def _fingerprint(fn: Any, tokens: list[Any], refs: list[Any]) -> None:
    """What the answer depends on: the pattern's structure, its custom functions and its tensors.

    Functions and tensors enter by identity (and a tensor by its in-place version); ``refs`` keeps
    them alive while the answer is cached, so an identity is never reused meanwhile.
    """
    params = getattr(fn, "mask_params", None)
    if params is None:
        tokens.append(("function", id(fn)))
        refs.append(fn)
        return
    tokens.append(getattr(fn, "mask_kind", "custom"))
    for name, value in sorted(params.items()):
        if name == "parts":
            for part in value:
                _fingerprint(part, tokens, refs)
        elif torch.is_tensor(value):
            tokens.append((name, id(value), value._version))
            refs.append(value)
        else:
            tokens.append((name, value))


class _Answers:
    """A small LRU of verdicts, keyed by fingerprint and grid."""

    def __init__(self, size: int = 128) -> None:
        self._size = size
        self._items: OrderedDict[Any, tuple[MaskDifference | None, list[Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> tuple[bool, MaskDifference | None]:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return True, self._items[key][0]
        return False, None

    def put(self, key: Any, value: MaskDifference | None, refs: list[Any]) -> None:
        with self._lock:
            self._items[key] = (value, refs)
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


_answers = _Answers()
_warned_sampled: set[Any] = set()


def _query_rows(q_length: int, batch_size: int, kv_length: int, budget: int) -> torch.Tensor | None:
    """None (every row fits the budget) or the sampled query rows: first, last, evenly spaced."""
    if batch_size * q_length * kv_length <= budget:
        return None
    count = max(2, min(q_length, budget // max(1, batch_size * kv_length)))
    return torch.linspace(0, q_length - 1, count).round().long().unique()


def _evaluate(fn: MaskFunction, b: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    h = torch.zeros((), dtype=torch.long, device=b.device)
    return torch.as_tensor(fn(b, h, q, kv), device=b.device).to(torch.bool)


def first_difference(
    mask_function: MaskFunction,
    expected: MaskFunction,
    *,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    padding: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    budget: int = MASK_CHECK_CELLS,
    kernel_label: str = "the kernel's",
) -> MaskDifference | None:
    """The first real cell where ``mask_function`` and ``expected`` disagree, or None.

    ``padding`` is the 2D ``[batch, >= kv_offset + kv_length]`` padding mask (True = real token):
    cells whose key or query is padding are not compared. Past ``budget`` cells only a sample of
    query rows is compared, with a one-time ``UserWarning`` naming what was assumed. Answers are
    cached per (custom functions and tensors of the pattern, grid shape, padding).
    """
    tokens: list[Any] = []
    refs: list[Any] = []
    _fingerprint(mask_function, tokens, refs)
    _fingerprint(expected, tokens, refs)
    if padding is not None:
        tokens.append(("padding", id(padding), padding._version))
        refs.append(padding)
    key = (tuple(tokens), batch_size, q_length, kv_length, int(q_offset), int(kv_offset), budget)
    known, answer = _answers.get(key)
    if known:
        return answer
    device = padding.device if padding is not None else torch.device(device)
    rows = _query_rows(q_length, batch_size, kv_length, budget)
    q_index = torch.arange(q_length, device=device) if rows is None else rows.to(device)
    b = torch.arange(batch_size, device=device)[:, None, None]
    q = (q_index + int(q_offset))[None, :, None]
    kv = (torch.arange(kv_length, device=device) + int(kv_offset))[None, None, :]
    differ = _evaluate(mask_function, b, q, kv) ^ _evaluate(expected, b, q, kv)
    differ = differ.expand(batch_size, q_index.numel(), kv_length)
    if padding is not None:
        real_key = padding[:, kv_offset : kv_offset + kv_length].to(torch.bool)
        q_pos = (q_index + int(q_offset)).clamp(max=padding.shape[-1] - 1)
        real_query = padding[:, q_pos].to(torch.bool)
        differ = differ & real_key[:, None, :] & real_query[:, :, None]
    answer = None
    if bool(differ.any()):
        bi, qi, ki = (int(x) for x in torch.nonzero(differ)[0])
        cell = (b.new_tensor([bi])[:, None, None], q[:, qi : qi + 1], kv[:, :, ki : ki + 1])
        answer = MaskDifference(
            batch=bi,
            query=int(q_index[qi]) + int(q_offset),
            key=ki + int(kv_offset),
            given=bool(_evaluate(mask_function, *cell).reshape(-1)[0]),
            kernel=bool(_evaluate(expected, *cell).reshape(-1)[0]),
        )
    elif rows is not None:
        warn_key = tuple(t for t in tokens if isinstance(t, tuple) and t[0] == "function") or key
        if warn_key not in _warned_sampled:
            _warned_sampled.add(warn_key)
            warnings.warn(
                f"A custom mask function was checked against {kernel_label} pattern on {rows.numel()} of {q_length} "
                f"query rows only ({batch_size}x{q_length}x{kv_length} cells is past the budget of {budget}); it "
                "agreed there and is assumed to agree on the other rows. Use attn_implementation='sdpa', 'eager' "
                "or 'flex_attention' to apply it exactly.",
                UserWarning,
                stacklevel=4,
            )
    _answers.put(key, answer, refs)
    return answer


def clear_answers() -> None:
    """Forget cached verdicts and sampled-check warnings (for tests)."""
    _answers.clear()
    _warned_sampled.clear()
