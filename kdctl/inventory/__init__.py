"""The inventory: which hosts, engines and router kdctl manages, loaded from YAML."""

from kdctl.inventory._load import (
    ENV_INVENTORY,
    ENV_STATE_DIR,
    LoadedInventory,
    backend_kinds,
    format_problems,
    load_inventory,
    local_path,
    pydantic_problems,
    resolve_api_key,
    resolve_inventory_path,
    resolve_service_env,
    router_kinds,
    unknown_name,
)
from kdctl.inventory._yaml import read_mapping
from kdctl.inventory.models import (
    BackendSpec,
    CommandService,
    FromEnv,
    GateSettings,
    HostSpec,
    Inventory,
    RouterSpec,
    SystemdService,
)

__all__ = [
    "ENV_INVENTORY",
    "ENV_STATE_DIR",
    "BackendSpec",
    "CommandService",
    "FromEnv",
    "GateSettings",
    "HostSpec",
    "Inventory",
    "LoadedInventory",
    "RouterSpec",
    "SystemdService",
    "backend_kinds",
    "format_problems",
    "load_inventory",
    "local_path",
    "pydantic_problems",
    "read_mapping",
    "resolve_api_key",
    "resolve_inventory_path",
    "resolve_service_env",
    "router_kinds",
    "unknown_name",
]
