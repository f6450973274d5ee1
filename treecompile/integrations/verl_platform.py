"""verl on a machine without a GPU: its platform interface on the CPU.

verl looks its device up through a platform object (``verl.plugin.platform``): the device
name, the collective backend, seeds, memory calls. With no accelerator none matches, and
building an engine fails looking a device up. `use_cpu_platform` installs one for the CPU
(device ``"cpu"``, the ``gloo`` backend), so that verl's actor engine, and the tree engine of
`treecompile.integrations.verl_actor`, run on the CPU: the way to try them, and to test them,
without a GPU. Call it before importing verl's workers::

    import torch
    from treecompile.integrations.verl_platform import use_cpu_platform

    if not torch.cuda.is_available():
        use_cpu_platform()

This module imports verl only inside `use_cpu_platform`.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["use_cpu_platform"]


def use_cpu_platform() -> None:
    """Makes verl run on the CPU: device ``"cpu"``, the ``gloo`` backend, no memory calls.

    Raises:
        ImportError: verl is not installed.
    """
    from verl.plugin.platform import PlatformBase, set_platform

    class CpuPlatform(PlatformBase):
        """verl's platform interface on the CPU."""

        device_name = "cpu"
        vendor_name = "cpu"

        @property
        def device_module(self):
            return torch.cpu

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    set_platform(CpuPlatform())
