"""TEST FIXTURE: a stand-in for ``torchvision`` (every name imports, every call raises NotImplementedError
naming itself); see tests/sglang_stub/sglang_standin.py for why it exists and how it behaves."""

from sglang_standin import stand_in

__getattr__ = stand_in(__name__)
# transformers finds the package (find_spec) and then parses its version: 0 says "older than any real one",
# so it takes none of its torchvision-only paths
__version__ = "0+standin"
