"""`nvidia-smi topo -m`: how each pair of GPUs is connected (NV#, PIX, PXB, PHB, NODE, SYS)."""

from __future__ import annotations

import re

from pydantic import BaseModel

from kdctl.errors import TransportError
from kdctl.transports import Transport

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Topology(BaseModel):
    gpus: list[int] = []
    # "i-j" (i < j) -> the link type nvidia-smi names.
    links: dict[str, str] = {}
    error: str | None = None

    def link(self, a: int, b: int) -> str | None:
        lo, hi = sorted((a, b))
        return self.links.get(f"{lo}-{hi}")


def parse_topo(text: str) -> Topology:
    """The GPU x GPU block of the matrix; NIC rows and the affinity columns are left out."""
    lines = [_ANSI.sub("", ln) for ln in text.splitlines()]
    header = next((ln for ln in lines if re.search(r"\tGPU\d+", "\t" + ln.strip())), None)
    if header is None:
        return Topology(error="no GPU header in topo -m output")
    columns = [c.strip() for c in header.strip().split("\t")]
    gpu_cols = {i: int(c[3:]) for i, c in enumerate(columns) if re.fullmatch(r"GPU\d+", c)}
    gpus: list[int] = []
    links: dict[str, str] = {}
    for ln in lines:
        cells = ln.split("\t")
        if not re.fullmatch(r"GPU\d+", cells[0].strip()):
            continue
        me = int(cells[0].strip()[3:])
        gpus.append(me)
        for pos, other in gpu_cols.items():
            if pos + 1 < len(cells) and other != me:
                lo, hi = sorted((me, other))
                links[f"{lo}-{hi}"] = cells[pos + 1].strip()
    return Topology(gpus=gpus, links=links)


def probe_topology(transport: Transport, *, timeout: float = 15.0) -> Topology:
    try:
        result = transport.run(["nvidia-smi", "topo", "-m"], timeout=timeout)
    except TransportError as exc:
        return Topology(error=str(exc))
    if not result.ok:
        return Topology(error=(result.stderr.strip() or f"exit {result.exit_code}")[:200])
    return parse_topo(result.stdout)
