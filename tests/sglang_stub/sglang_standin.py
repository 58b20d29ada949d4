"""TEST FIXTURE: stand-ins for the two packages SGLang imports that cannot be installed beside the CPU
torch wheel here (tests/sglang_stub/README.md says why and where they are used):

- ``sgl_kernel``: SGLang's compiled kernels; the package index has no CPU build of it;
- ``torchvision``: the index's build links ``libtorch_cuda.so``, which the CPU torch wheel lacks, so
  it fails at import; the CPU build lives on PyTorch's own index, which these machines cannot reach.
  SGLang imports it at module level for multimodal models only.

In a stand-in every name imports, from the package and from any submodule of it (made on first
import by the finder below), and calling one raises ``NotImplementedError`` naming it, so any real use
shows at once instead of computing something made up. Attributes of a name are names too
(``sgl_kernel.scalar_type.scalar_types.uint4b8``): SGLang reads some at import time. Dunder names are
not made up (``__version__``, ``__path__`` probes get the ordinary AttributeError), and no
distribution metadata exists, so code asking what is installed (transformers'
``is_torchvision_available``) sees nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable


class Missing:
    """A name in a stand-in package. Calling it raises; its attributes are further names."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is a stand-in (tests/sglang_stub): the real package is not "
                                  "installed, and SGLang's CPU engine was expected not to call it")

    def __getattr__(self, attr: str) -> Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


def _module_getattr(module_name: str) -> Callable[[str], Missing]:
    def __getattr__(attr: str) -> Missing:
        if attr.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        return Missing(f"{module_name}.{attr}")

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``<package>.<anything>`` on import, as a package so deeper names import too."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


def stand_in(package: str) -> Callable[[str], Missing]:
    """Make ``package`` (being imported now) a stand-in: returns its module ``__getattr__``."""
    if not any(isinstance(f, _Finder) and f.package == package for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(package))
    return _module_getattr(package)
