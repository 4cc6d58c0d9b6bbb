"""LlamaCppModel: a GGUF file decoded by llama.cpp (through llama-cpp-python), with latent feedback.

llama.cpp runs the transformer stack; everything the method adds is fullband's own core (fullband.model.core.
FeedbackModel), which this class supplies with a stack, as every runtime does: llama.cpp takes the stack inputs as
the batch's embeddings (`embd`) and hands back the final-norm state (its embeddings output, pooling none) beside
the logits. So `fullband.generate(LlamaCppModel(...), ...)` decodes STANDARD, SOFT, FUSED k (adaptive too) and
EXACT with the core's plain rule, fusion and pass loop, and only the stack differs from the native model.

A file with a sidecar (fullband.hf.gguf_out) holds a full-bandwidth model; any other Llama-family GGUF file
decodes STANDARD. Batch 1 (one llama.cpp sequence). `exact_kernels` (default) keeps llama.cpp's keys and values in
float32 and its flash attention off, so an F32 file computes what the native model does to float rounding."""

from __future__ import annotations

import collections
import ctypes
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fullband.errors import CheckpointError, InputError, MissingPackage
from fullband.gguf_file import gguf_path, inspect_gguf
from fullband.hf.gguf_out import read_sidecar, sidecar_tokenizer
from fullband.model.config import ModelConfig
from fullband.model.core import FeedbackModel
from fullband.model.fusion import build_fusion
from fullband.model.layers import RMSNorm
from fullband.version import check_tested


_LOG: collections.deque = collections.deque(maxlen=20)  # llama.cpp's last warnings and errors, for our messages
LLAMA_MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS: llama.cpp's thread arrays hold no more
LOGGED, CONT = (3, 4), 5  # ggml_log_level (ggml.h): WARN, ERROR; CONT continues the line before; INFO is 2
_QUIET = None  # the log callback installed (kept alive here: llama.cpp holds a pointer to it)


def _llama_cpp(verbose: bool = False):
    """llama_cpp, its log sent to stderr (verbose) or kept: the last warnings and errors (LOGGED) for the message
    of a failure."""
    global _QUIET
    try:
        import llama_cpp
    except ImportError:
        raise MissingPackage("the llama.cpp engine needs llama-cpp-python, which this Python does not have "
                             f"({sys.executable}): run it from .venv-llama (make llama-env builds it), or pip install "
                             "'fullband[llamacpp]'") from None
    check_tested("llama-cpp-python", llama_cpp.__version__, "fullband's llama.cpp engine")

    keep = LogKeeper(_LOG)

    def log(level: int, text: bytes, _) -> None:
        if verbose:
            sys.stderr.write(text.decode("utf-8", "replace"))
        else:
            keep(level, text)

    _QUIET = llama_cpp.llama_log_callback(log)
    llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))
    return llama_cpp


class LogKeeper:
    """llama.cpp's log lines at the LOGGED levels into `lines` (a CONT line counts at the level of the one before)."""

    def __init__(self, lines: collections.deque) -> None:
        self.lines, self.last = lines, 0

    def __call__(self, level: int, text: bytes) -> None:
        self.last = level = self.last if level == CONT else level
        line = text.decode("utf-8", "replace").strip()
        if level in LOGGED and line:
            self.lines.append(line)


def _said() -> str:
    return f" (llama.cpp: {' | '.join(_LOG)})" if _LOG else ""


class LlamaCppCache:
    """The positions a llama.cpp context holds for the one sequence it decodes (its KV memory lives in llama.cpp).
    A read without a cache (a Jacobi pass before the last) overwrites the context: a cache it overwrote refuses to
    be continued."""

    def __init__(self, model: "LlamaCppModel", max_len: int) -> None:
        self.model, self.max_len, self.length, self.epoch = model, max_len, 0, -1

    def grow(self, max_len: int) -> None:
        """Room for max_len positions, as far as the context goes (a longer sequence is refused when it gets there)."""
        self.max_len = min(max_len, self.model.n_ctx)


class LlamaCppModel(FeedbackModel):
    """`path`: a GGUF file (fullband convert CKPT OUT.gguf writes one with its feedback sidecar). `n_ctx`: the most
    positions a sequence may reach (default: the model's max_seq_len, at most 4096); `threads`: llama.cpp's
    (default: torch's); `verbose`: llama.cpp's log on stderr (default: kept, its warnings quoted in our errors)."""

    def __init__(self, path: str | Path, *, n_ctx: int | None = None, threads: int | None = None,
                 exact_kernels: bool = True, verbose: bool = False) -> None:
        super().__init__()
        if threads is not None and not 1 <= threads <= LLAMA_MAX_THREADS:
            raise InputError(f"threads={threads} for llama.cpp; accepted: 1 <= threads <= {LLAMA_MAX_THREADS} "
                             "(GGML_MAX_N_THREADS: more crash it)")
        L = _llama_cpp(verbose)
        self.path = gguf_path(path)
        inspect_gguf(self.path)  # the header checked, with errors naming the file
        import gguf

        self._reader = gguf.GGUFReader(str(self.path))
        side, self._meta = read_sidecar(self.path)
        self.config = cfg = _config(self.path, self._meta)
        self.norm_in = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.fusion = build_fusion(cfg.fusion, cfg.d_model)
        if side:
            self.load_state_dict(side, strict=False)
        self.embed, self._output = self._tensor("token_embd.weight"), None
        self.n_ctx = min(n_ctx or min(cfg.max_seq_len, 4096), cfg.max_seq_len)
        threads = threads or min(torch.get_num_threads(), LLAMA_MAX_THREADS)
        L.llama_backend_init()
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0
        # no repacked weight buffers: llama.cpp's AMX matmul (what they select for Q4 / Q8 weights on an AMX CPU)
        # crashes in llama-cpp-python 0.3.36 on a Xeon with AMX; F32 / F16 weights never use them
        params.use_extra_bufts = False
        self._model = L.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise CheckpointError(f"{str(self.path)!r}: llama.cpp could not load this file{_said()}")
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = self.n_ctx
        cp.embeddings, cp.pooling_type, cp.n_threads, cp.n_threads_batch = True, 0, threads, threads
        if exact_kernels:
            cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
            cp.flash_attn_type = 0  # disabled: its CPU kernel accumulates in half precision
        self._ctx = L.llama_init_from_model(self._model, cp)
        if not self._ctx:
            raise CheckpointError(f"{str(self.path)!r}: llama.cpp could not create a context of n_ctx={self.n_ctx}"
                                  f"{_said()}")
        self._mem = L.llama_get_memory(self._ctx)
        self._batch = b = L.llama_batch_init(self.n_ctx, cfg.d_model, 1)
        for i in range(self.n_ctx):  # every position of sequence 0 and an output: set once, decode sets positions
            b.n_seq_id[i], b.logits[i] = 1, 1
            b.seq_id[i][0] = 0
        self._pos = np.ctypeslib.as_array(b.pos, shape=(self.n_ctx,))
        self._L, self._epoch, self._tops, self._outputs = L, 0, None, {}
        self.eval()

    def _tensor(self, name: str) -> Tensor:
        """A tensor of the file dequantized to float32, laid out as torch lays out a weight."""
        for t in self._reader.tensors:
            if t.name == name:
                import gguf

                values = gguf.quants.dequantize(t.data, t.tensor_type)
                shape = tuple(int(n) for n in reversed(t.shape))
                # a copy: the file is mapped read-only
                return torch.from_numpy(np.array(values.reshape(shape), dtype=np.float32))
        raise CheckpointError(f"{str(self.path)!r} holds no tensor {name!r}")

    @property
    def tokenizer(self):
        """The model's tokenizer: the sidecar's (fullband's own files), else the GGUF file's (transformers reads it)."""
        from fullband.data.tokenizer import PretrainedTokenizer

        return sidecar_tokenizer(self._meta) or PretrainedTokenizer.from_pretrained(self.path)

    # ---------------------------------------------------------------- the stack, from llama.cpp
    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        return self.embed[input_ids]

    def new_cache(self, batch: int, max_len: int) -> LlamaCppCache:
        if batch != 1:
            raise InputError(f"the llama.cpp engine decodes one sequence at a time; got a batch of {batch} prompts")
        cache = LlamaCppCache(self, 0)
        cache.grow(max_len)
        self._L.llama_memory_clear(self._mem, True)
        self._epoch += 1
        cache.epoch = self._epoch
        return cache

    def stack(self, x: Tensor, cache=None) -> tuple[Tensor, Tensor]:
        """The whole stack over x (1, T, D) at positions 0..T-1, replacing what the context held."""
        if x.shape[0] != 1:
            raise InputError(f"the llama.cpp engine decodes one sequence at a time; got a batch of {x.shape[0]}")
        T = x.shape[1]
        self._L.llama_memory_clear(self._mem, True)
        self._epoch += 1
        top = self._decode(x[0], 0)
        if cache is not None:
            cache.length, cache.epoch = T, self._epoch
        return top, top

    def stack_step(self, x: Tensor, positions: Tensor, cache, kv_len: int, mask: Tensor | None = None):
        if cache.epoch != self._epoch:
            raise InputError("this llama.cpp cache was overwritten by another read of the same context (it holds "
                             "one sequence); read the prompt again")
        position = int(positions.reshape(-1)[0])
        if position != cache.length:
            raise InputError(f"the llama.cpp engine appends positions in order: the cache holds {cache.length}, "
                             f"the step is at {position}")
        top = self._decode(x[0], position)
        cache.length += 1
        return top, top

    @torch.compiler.disable  # llama.cpp's call: a compiled step (compile=True) compiles the host math around it
    def _decode(self, x: Tensor, start: int) -> Tensor:
        """llama_decode of inputs x (T, D) at positions start.., every position an output -> final-norm (1, T, D)."""
        L, b, (T, D) = self._L, self._batch, x.shape
        if start + T > self.n_ctx:
            raise InputError(f"{start + T} positions do not fit the llama.cpp context (n_ctx={self.n_ctx}); pass a "
                             "larger n_ctx (--n-ctx), at most the model's max_seq_len")
        inputs = x.detach().to(torch.float32).contiguous()
        ctypes.memmove(b.embd, inputs.data_ptr(), T * D * 4)
        self._pos[:T] = np.arange(start, start + T) if T > 1 else start
        b.n_tokens = T
        if (rc := L.llama_decode(self._ctx, b)) != 0:
            raise InputError(f"llama_decode failed (code {rc}) at positions {start}..{start + T - 1}{_said()}")
        self._tops = top = self._buffer("embeddings", D)[:T].clone()
        return top[None].to(x.dtype)

    def _buffer(self, name: str, width: int) -> Tensor:
        """llama.cpp's output buffer `name` (embeddings or logits) as an (n_ctx, width) float32 view, row i the i-th
        output of the last decode (every position is one). Read before the next decode: llama.cpp reuses it."""
        pointer = getattr(self._L, f"llama_get_{name}")(self._ctx)
        address = ctypes.cast(pointer, ctypes.c_void_p).value
        if not address:
            raise InputError(f"llama.cpp holds no {name} output (no decode yet){_said()}")
        view = self._outputs.get(name)
        if view is None or view[0] != address:  # the buffer moved (llama.cpp reallocates on growth)
            view = self._outputs[name] = address, torch.from_numpy(
                np.ctypeslib.as_array(pointer, shape=(self.n_ctx, width)))
        return view[1]

    def head(self, top: Tensor) -> Tensor:
        """The logits llama.cpp computed beside each state in `top` (..., D) (the last decode's outputs); a state it
        did not compute goes through the output matrix here."""
        flat = top.reshape(-1, top.shape[-1])
        V = self.config.vocab_size
        rows = [_find(self._tops, v) for v in flat]
        computed = self._buffer("logits", V)
        if all(i is not None for i in rows):  # copied out: llama.cpp reuses the buffer at the next decode
            logits = computed[rows]
        else:
            logits = torch.empty(flat.shape[0], V)
            for row, (i, v) in enumerate(zip(rows, flat)):
                logits[row] = self._output_matrix() @ v.float() if i is None else computed[i]
        return logits.reshape(*top.shape[:-1], V).to(top.dtype)

    def _output_matrix(self) -> Tensor:
        if self._output is None:
            self._output = self.embed if self.config.tie_embeddings else self._tensor("output.weight")
        return self._output

    def close(self) -> None:
        """Free llama.cpp's context and model (also on garbage collection)."""
        if getattr(self, "_ctx", None):
            self._L.llama_batch_free(self._batch)
            self._L.llama_free(self._ctx)
            self._L.llama_model_free(self._model)
            self._ctx = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: llama_cpp may be gone
            pass


def _find(tops: Tensor | None, v: Tensor) -> int | None:
    """The row of `tops` equal to v (the last row first: the common case), None when none is."""
    if tops is None:
        return None
    v = v.to(tops.dtype)
    for i in range(tops.shape[0] - 1, -1, -1):
        if torch.equal(tops[i], v):
            return i
    return None


def _config(path: Path, meta: dict[str, str]) -> ModelConfig:
    """The sidecar's model config; for another GGUF file, its Llama config as fullband reads it (no feedback)."""
    if meta:
        return ModelConfig(**json.loads(meta["config"]))
    from fullband.hf.gguf import pretrained_config, require_native
    from fullband.hf.llama import config_from_llama

    require_native(path, use="the llama.cpp engine")
    return config_from_llama(pretrained_config(path), fusion="none")
