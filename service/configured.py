"""What every buffer component shares: it is built from its typed options and reports them as its config."""

from __future__ import annotations

from typing import Any, Self

from replayd.wire.components import Options


class Configured:
    """A server component configured by options (proto/components.py), which validated them."""

    options: Options

    @classmethod
    def from_options(cls, options: Options) -> Self:
        return cls(**options.params())

    @property
    def name(self) -> str:
        return self.options.kind

    def to_config(self) -> dict[str, Any]:
        return self.options.to_config()
