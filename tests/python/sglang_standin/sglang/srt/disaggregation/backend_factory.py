"""Stand-in for sglang/srt/disaggregation/backend_factory.py at alphabetc1/sglang d6a0fe41
(added by 48f4c553 "[PD] support file&dynamic backend"): the same config parsing, cache key,
import and no-argument construction, so kvferry's provider is loaded the way SGLang loads it."""
import importlib
import json
from dataclasses import dataclass
from typing import Dict, Optional


@dataclass(frozen=True)
class DynamicBackendConfig:
    backend_name: str
    module_path: str
    class_name: str

    @classmethod
    def from_json_str(cls, s: Optional[str]) -> "DynamicBackendConfig":
        if not s:
            raise ValueError("Dynamic backend requires a non-empty JSON extra config.")
        try:
            obj = json.loads(s)
        except Exception as e:
            raise ValueError(f"Invalid JSON for dynamic backend extra config: {e}") from e
        if not isinstance(obj, dict):
            raise ValueError("Dynamic backend extra config must be a JSON object.")
        for k in ("backend_name", "module_path", "class_name"):
            if k not in obj:
                raise ValueError(f"Missing required field '{k}' in dynamic backend config.")
        return cls(str(obj["backend_name"]), str(obj["module_path"]), str(obj["class_name"]))


class DisaggBackendFactory:
    _provider_cache: Dict[str, object] = {}

    @classmethod
    def get_provider(cls, server_args):
        cfg = DynamicBackendConfig.from_json_str(
            getattr(server_args, "disaggregation_transfer_backend_extra_config", None))
        key = f"{cfg.module_path}:{cfg.class_name}"
        if key in cls._provider_cache:
            return cls._provider_cache[key]
        module = importlib.import_module(cfg.module_path)
        provider = getattr(module, cfg.class_name)()
        if not hasattr(provider, "get_kv_class"):
            raise TypeError(f"Dynamic backend provider {cfg.module_path}.{cfg.class_name} must "
                            "implement get_kv_class(class_type: KVClassType) -> Optional[type].")
        cls._provider_cache[key] = provider
        return provider

    @classmethod
    def get_kv_class(cls, server_args, class_type):
        return cls.get_provider(server_args).get_kv_class(class_type)
