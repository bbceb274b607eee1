"""OmegaConf node -> typed dataclass, with the dataclass's own field errors surfacing unwrapped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


def to_typed(node: Any, *, own_error: type[Exception], wrap: Callable[[OmegaConfBaseException], Exception]) -> Any:
    """``OmegaConf.to_object`` that re-raises ``own_error`` from a ``__post_init__`` as is (OmegaConf wraps it)
    and turns every other OmegaConf error into ``wrap(exc)``, so the user sees one error type per layer."""
    try:
        return OmegaConf.to_object(node)
    except own_error:
        raise
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, own_error):
            raise cause from None
        raise wrap(exc) from None
