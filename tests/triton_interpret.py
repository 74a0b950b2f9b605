"""Importing a module of autosel's Triton kernels for the tests: as it is on a GPU, under Triton's CPU interpreter
without one."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = DEVICE == "cpu"


def import_kernels(name: str):
    if not INTERPRET:
        return importlib.import_module(name)
    # @triton.jit fixes interpret mode at decoration, so import a private copy under the variable, then put back both
    # the variable and any copy other test modules imported, leaving their view of triton untouched.
    saved_module = sys.modules.pop(name, None)
    saved_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module(name)
    finally:
        if saved_env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        if saved_module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved_module


@pytest.fixture(autouse=True, scope="module")
def interpreter_env():
    """Imported into a test module, sets TRITON_INTERPRET for its tests: the interpreter also reads the variable while
    launching (triton imports gluon lazily and asserts it)."""
    if not INTERPRET:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield
