"""SGLang's own MLA attention for a DeepSeek model's prefill on the CPU, as for its decode.

SGLang 0.5.23 registers no DeepSeek dispatch for the CPU's `torch_native` attention backend,
so the CUDA Triton one is used (models/deepseek_common/attention_backend_handler.py,
`get_handler` and `handle_attention_triton`): a prefill with no cached prefix takes the MHA
path (forward_mha.py), which writes the MLA latent cache and then calls the attention with
the heads' keys and values and `save_kv_cache=False`. The torch_native backend's
`forward_extend` (layers/attention/torch_native_backend.py) ignores those and attends over the
layer's cache buffers, which for an MLA pool hold the latent vector (mem_cache/memory_pool.py,
`MLATokenToKVPool.get_key_buffer`/`get_value_buffer`): every prefilled position's attention is
computed on the wrong keys and values, silently where the latent's width happens to equal the
heads' (the tiny models'), while a decode, on the MLA path, reads the cache as it should. Here
`torch_native` dispatches as SGLang's backends without an MHA prefill do: the MLA path for
every forward. docs/sglang-compatibility.md shows what it changes. A Llama is not touched."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_HANDLERS = "sglang.srt.models.deepseek_common.attention_backend_handler"


def _register(module: ModuleType) -> None:
    def handle_attention_torch_native(attn: Any, forward_batch: Any) -> Any:
        return module._dispatch_mla_subtype(attn, forward_batch)

    module.AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Registers the handler once SGLang's module of handlers has run, in every process
    SGLang starts (its scheduler is spawned, not forked)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _HANDLERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _register(module)

        loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport())
