"""A stand-in for torchvision, for the SGLang interop tests only (put on ``sys.path`` by
``tests/integrations/sglang/conftest.py``; never installed).

SGLang's ``srt/configs`` package imports ``multimodal/internvl_utils.py``, which imports
``torchvision.transforms`` at module level, and transformers' processors (imported by other
SGLang configs) import torchvision names at module level too. The cache modules never use
any of them, and no CPU torchvision build for torch 2.13 is on the package index. So every
``torchvision.*`` module imports, every name in it resolves to :class:`Unavailable`, and
calling one raises ``RuntimeError``: nothing that needs torchvision can pass silently.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stand-in"


class _Names(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable


class Unavailable(metaclass=_Names):
    """Any torchvision name: attributes resolve, calls raise."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is a stand-in in the SGLang interop tests")


def _module_getattr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return Unavailable


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr
        return module

    def exec_module(self, module):
        pass


__getattr__ = _module_getattr
if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
