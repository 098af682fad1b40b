"""Stands in for SGLang's compiled kernel package, published only for CUDA, so that SGLang's CPU
engine imports: its modules name these kernels at import, while a model it can run in plain
PyTorch (`--attention-backend torch_native`, no `torch.ops.sgl_kernel`) never calls them. Any
call fails the request, loudly, rather than letting a substitute compute in SGLang's place."""

from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0.0"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def absent(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name} was called: not installed on this CPU")

    absent.__name__ = name
    return absent
