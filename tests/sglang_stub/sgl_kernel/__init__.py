"""TEST FIXTURE: a stand-in for ``sgl_kernel`` (every name imports, every call raises NotImplementedError
naming itself); see tests/sglang_stub/sglang_standin.py for why it exists and how it behaves."""

from sglang_standin import stand_in

__getattr__ = stand_in(__name__)
