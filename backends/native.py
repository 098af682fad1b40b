"""The team's native engine. In `http` mode it speaks SGLang's API and is that client under its
own name; `command` mode (before the engine has a server) runs its binary with a JSON request."""

from __future__ import annotations

from kdctl.backends.sglang import SGLangBackend


class NativeBackend(SGLangBackend):
    kind = "native"
