"""Full-bandwidth models in llama.cpp: GGUF out (export_gguf: the trunk in llama.cpp's layout, the feedback weights
in a sidecar beside it) and LlamaCppModel (llama.cpp runs the stack, fullband's core feeds the state back).
llama-cpp-python is imported only by LlamaCppModel (make llama-env builds it)."""

from fullband.hf.gguf_out import GGUF_TYPES, check_exportable, export_gguf, sidecar_path

__all__ = ["GGUF_TYPES", "LlamaCppModel", "check_exportable", "export_gguf", "sidecar_path"]


def __getattr__(name: str):
    if name == "LlamaCppModel":
        from fullband.llamacpp.model import LlamaCppModel

        return LlamaCppModel
    raise AttributeError(f"module 'fullband.llamacpp' has no attribute {name!r}")
