"""Suite-wide setup.

TRITON_INTERPRET must be set before triton is first imported so the Triton kernels run on the
CPU; the cache and Hub variables are pointed at throwaway places so no test touches the user's
cache or the real Hub.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
