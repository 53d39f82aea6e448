"""Custom models and datasets without forking: ``model.factory`` / ``data.factory``.

A factory is named ``pkg.module:function`` and imported at start, so a custom-model image only has
to put its package on the path. Every failure names the config key, the spec and the fix.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from ..config import ConfigError


def load_factory(spec: str, key: str) -> Callable[..., Any]:
    """Import the callable named by ``spec`` (``pkg.module:function``) for config key ``key``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}={spec!r}: expected 'pkg.module:function', for example 'my_models.gpt:build_model'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{key}={spec!r}: cannot import module '{module_name}' ({exc}); install the package in the image "
            "or put it on PYTHONPATH"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise ConfigError(
                f"{key}={spec!r}: module '{module_name}' has no attribute '{attr}'; callables there: "
                f"{', '.join(public) or 'none'}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{key}={spec!r}: '{attr}' is a {type(target).__name__}, not a callable")
    return target


def call_factory(spec: str, key: str, expected: type | tuple[type, ...], *args: Any, **kwargs: Any) -> Any:
    """Load and call a factory, checking that it returned an instance of ``expected``."""
    factory = load_factory(spec, key)
    result = factory(*args, **kwargs)
    if not isinstance(result, expected):
        names = " or ".join(
            t.__module__ + "." + t.__qualname__ for t in (expected if isinstance(expected, tuple) else (expected,))
        )
        raise ConfigError(
            f"{key}={spec!r} returned {type(result).__module__}.{type(result).__qualname__}; expected {names}"
        )
    return result
