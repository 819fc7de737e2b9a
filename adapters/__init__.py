"""LoRA adapters: PEFT parsing and validation, safe upload extraction, stores and the registry."""

from .archive import DEFAULT_MAX_MEMBERS, DEFAULT_MAX_TOTAL_BYTES, extract_adapter_archive
from .catalog import AdapterCatalog, PollingCatalog
from .errors import (
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    AdapterTooLargeError,
    InvalidAdapterError,
    InvalidAdapterNameError,
    RegistryConflictError,
    RegistryUnavailableError,
)
from .local_store import LocalDirStore
from .lora_weights import PROJECTION_NAMES, BaseModelShapes, LoRAAdapter, LoRAModuleWeights
from .peft_format import CONFIG_FILE, WEIGHTS_FILE, load_adapter, parse_adapter_files, read_adapter_dir
from .redis_catalog import RedisCatalog
from .redis_store import RedisStore
from .registry import AdapterInfo, AdapterLimits, AdapterRegistry
from .store import AdapterStore, content_digest, validate_adapter_name
from .store_factory import make_store, register_store_scheme

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_MEMBERS",
    "DEFAULT_MAX_TOTAL_BYTES",
    "PROJECTION_NAMES",
    "WEIGHTS_FILE",
    "AdapterCatalog",
    "AdapterError",
    "AdapterExistsError",
    "AdapterInfo",
    "AdapterLimits",
    "AdapterNotFoundError",
    "AdapterRegistry",
    "AdapterStore",
    "AdapterTooLargeError",
    "BaseModelShapes",
    "InvalidAdapterError",
    "InvalidAdapterNameError",
    "LoRAAdapter",
    "LoRAModuleWeights",
    "LocalDirStore",
    "PollingCatalog",
    "RedisCatalog",
    "RedisStore",
    "RegistryConflictError",
    "RegistryUnavailableError",
    "content_digest",
    "extract_adapter_archive",
    "load_adapter",
    "make_store",
    "parse_adapter_files",
    "read_adapter_dir",
    "register_store_scheme",
    "validate_adapter_name",
]
