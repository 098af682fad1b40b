"""The `reference` kind: the reference engine in this process, the exactness oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import SecretStr

from kdctl import __version__
from kdctl.backends._base import Backend
from kdctl.backends._types import EngineInfo, GenerateRequest, GenerateResult
from kdctl.backends.health import HealthResult
from kdctl.backends.reference.engine import ReferenceEngine
from kdctl.errors import InputError
from kdctl.inventory import BackendSpec


class ReferenceBackend(Backend):
    kind = "reference"

    def __init__(
        self,
        name: str,
        spec: BackendSpec,
        *,
        api_key: SecretStr | None = None,
        timeout: float | None = None,
        client: Any = None,
    ) -> None:
        super().__init__(name, spec, api_key=api_key, timeout=timeout)
        if not spec.model:
            raise InputError(f"backend {name}: a reference backend needs 'model' (a folder)")
        self._engine: ReferenceEngine | None = None

    @property
    def engine(self) -> ReferenceEngine:
        if self._engine is None:
            assert self.spec.model is not None
            self._engine = ReferenceEngine(Path(self.spec.model).expanduser())
        return self._engine

    def health(self) -> HealthResult:
        try:
            self.engine.generate(GenerateRequest(input_ids=[0], max_new_tokens=1))
        except Exception as exc:
            return HealthResult(state="down", detail=f"{type(exc).__name__}: {exc}")
        return HealthResult(state="up")

    def info(self) -> EngineInfo:
        return EngineInfo(
            model=self.spec.model,
            served_name=self.spec.served_model_name or self.spec.model,
            version=f"kdctl-reference {__version__}",
            tp_size=1,
            context_length=self.engine.context_length,
        )

    def generate(self, req: GenerateRequest) -> GenerateResult:
        return self.engine.generate(req)
