"""Stand-ins laid out as Triton 3.7's CUDA launcher is, for DirectLaunch's tests (the Triton
installed for the tests is another release). In 3.7 one C launch function serves every kernel:
``CudaLauncher.__call__`` hands it the launch flags, metadata, hooks, scratch buffers, the
argument annotations and signature handle, then the kernel's arguments as one sequence; a
kernel with host descriptors gets the wrapper closure ``inner`` (over ``launcher``,
``tensordesc_indices``, ``tensordesc_meta``), which expands each descriptor through
``make_tensordesc_arg`` (the map from ``fill_tma_descriptor_tiled``, tf32 rounding as element
type 11) into the last argument. Read from Triton 3.7.1's ``backends/nvidia/driver.py``."""

from __future__ import annotations

import sys

TMA_DTYPE_DEVICE_TO_HOST = {i: i for i in range(16)}
TMA_DTYPE_DEVICE_TO_HOST.update({8: 10, 9: 8, 10: 9})
TMA_TF32 = 11


def make_tensordesc_arg(arg, metadata):
    """Triton 3.7's expansion of one host descriptor: the encoded map, then shape and strides."""
    elem_type = TMA_TF32 if arg.round_f32_to_tf32 else TMA_DTYPE_DEVICE_TO_HOST[metadata["elem_type"]]
    tmap = sys.modules["triton.runtime.driver"].driver.active.utils.fill_tma_descriptor_tiled(
        arg.base.data_ptr(), metadata["swizzle"], metadata["elem_size"], elem_type, metadata["block_size"],
        arg.shape, arg.strides, 1 if arg.padding == "nan" else 0)
    return [tmap, *arg.shape, *arg.strides]


def wrap(launcher, tensordesc_indices, tensordesc_meta):
    """Triton 3.7's wrapper around the C launch function."""
    def inner(*args):
        final = []
        slot = 0
        for i, arg in enumerate(args[-1]):
            if i in tensordesc_indices:
                final.extend(make_tensordesc_arg(arg, tensordesc_meta[slot]))
                slot += 1
            else:
                final.append(arg)
        return launcher(*args[:-1], final)

    return inner


class CudaLauncher:
    """Triton 3.7's launcher object: the attributes DirectLaunch reads, and its own call."""

    def __init__(self, c_launch, indices=(), metas=None, scratch=0):
        self.launch = wrap(c_launch, set(indices), metas) if indices else c_launch
        self.arg_annotations = ("annotations",)
        self.kernel_signature = "signature handle"
        self.num_ctas = 1
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = False

    def __call__(self, gx, gy, gz, stream, function, kernel_metadata, launch_metadata, enter_hook, exit_hook, *args):
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, kernel_metadata,
                    launch_metadata, enter_hook, exit_hook, None, None, self.arg_annotations, self.kernel_signature,
                    args)
