"""The host-emulated kernels (tests/gpu/emulator.py) as fixtures for every test in tests/gpu."""

from tests.gpu.emulator import emu_lib, emulated

__all__ = ["emu_lib", "emulated"]
