"""Bridges that let other libraries use kernel_loader without code changes on their side.

* :mod:`kernel_loader.integrations.transformers` -- ``attn_implementation="org/kernel-repo"`` and
  the ``flash_attention_2`` / ``flash_attention_3`` fallback in transformers, through our loader
  instead of the ``kernels`` package.

Nothing is imported here: a bridge touches its library only when it is imported and enabled.
"""
