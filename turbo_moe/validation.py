"""The configuration error and the checks that raise it, one set for every config (`ModelConfig`, `TrainConfig` and
its sub-configs): a bad value names the field, the value it got and what the field allows.

    CHECK = Checks("ModelConfig")
    CHECK.integer("top_k", cfg.top_k, minimum=1)        # ConfigError: "ModelConfig.top_k: must be a positive int, got 0"
    try: ... except ConfigError as error: error.field, error.value, error.allowed   # caught by type, never by text
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NoReturn, Sequence


class ConfigError(ValueError):
    """`config.field` got `value`, which it does not allow; `allowed` says what it does allow, in words. A ValueError,
    so `except ValueError` still catches it; code that reacts to it reads the attributes, not the message."""

    def __init__(self, config: str, field: str, value: Any, allowed: str, message: str | None = None):
        self.config, self.field, self.value, self.allowed = config, field, value, allowed
        super().__init__(message or f"{config}.{field}: must be {allowed}, got {value!r}")

    def __reduce__(self):  # pickles with its fields (a worker process's error reaches its parent whole)
        return type(self), (self.config, self.field, self.value, self.allowed, str(self))


class ConfigTypeError(ConfigError, TypeError):
    """A value of the wrong type (a str where an int goes): also a TypeError, like Python's own type checks."""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class Checks:
    """The checks of one config, named `config` in its errors ("ModelConfig", "TrainConfig")."""

    config: str

    def fail(self, field: str, value: Any, allowed: str, message: str | None = None, *,
             wrong_type: bool = False) -> NoReturn:
        """Raise the error; `message` replaces the standard one, "<config>.<field>: must be <allowed>, got <value>"."""
        raise (ConfigTypeError if wrong_type else ConfigError)(self.config, field, value, allowed, message)

    def require(self, condition: bool, field: str, value: Any, allowed: str, detail: str | None = None) -> None:
        """`detail`: what went wrong when it says more than the standard message (another field's value, the reason)."""
        if not condition:
            self.fail(field, value, allowed, None if detail is None else f"{self.config}.{field}: {detail}")

    def integer(self, field: str, value: Any, minimum: int) -> None:
        """An int (not a bool) >= minimum (1: "a positive int", 0: "a non-negative int")."""
        allowed = {1: "a positive int", 0: "a non-negative int"}.get(minimum, f"an int >= {minimum}")
        self.require(is_int(value) and value >= minimum, field, value, allowed)

    def number(self, field: str, value: Any, allowed: str, within: Callable[[float], bool] = lambda v: True) -> None:
        """A finite number (int or float, not a bool) for which `within` holds, described by `allowed`."""
        self.require(is_number(value) and within(value), field, value, allowed)

    def boolean(self, field: str, value: Any) -> None:
        self.require(isinstance(value, bool), field, value, "a bool")

    def choice(self, field: str, value: Any, choices: Sequence[Any]) -> None:
        """One of `choices` (compared with ==)."""
        if value not in choices:
            self.fail(field, value, f"one of {tuple(choices)}",
                      f"{self.config}.{field}: got {value!r}; expected one of {tuple(choices)}")
