"""Attention functions by backend, each behind transformers' attention-function contract.

``contract`` holds what they all share (GQA grouping, causality, the pattern applied without a
mask); ``flash_api`` describes a FlashAttention kernel module and builds its call options for
``flash`` and ``paged``. Nothing here knows about registries, names or kernel ids.
"""
