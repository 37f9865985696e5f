"""A typed per-plugin store on the training context (modelled on pytest's Stash)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar, cast, final

from nvtrain.validators import FieldTypeError, FieldValueError, refused

__all__ = ["Stash", "StashKey"]

T = TypeVar("T")
D = TypeVar("D")


@final
class StashKey(Generic[T]):
    """A key into a :class:`Stash`; the type parameter is the value's type.

    Plugins create one key per value at import time (``KEY = StashKey[int]()``), so
    two plugins cannot collide by choosing the same string.
    """

    __slots__ = ("name",)

    def __init__(self, name: str | None = None) -> None:
        if name is not None and not (isinstance(name, str) and name):
            error = FieldValueError if isinstance(name, str) else FieldTypeError
            raise refused("StashKey", "name", name, "a non-empty str naming the key in messages, or None", error=error)
        #: Shown in ``repr()`` and in a missing key's error; "" for a key made without one.
        self.name = name or ""

    def __repr__(self) -> str:
        return f"StashKey({self.name!r})" if self.name else super().__repr__()


@final
class Stash:
    """Type-safe storage for plugin state that lives as long as the context."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[StashKey[Any], object] = {}

    def __setitem__(self, key: StashKey[T], value: T) -> None:
        self._data[key] = value

    def __getitem__(self, key: StashKey[T]) -> T:
        try:
            return cast(T, self._data[key])
        except KeyError:
            raise KeyError(f"nothing stashed under {key!r}") from None

    def get(self, key: StashKey[T], default: D) -> T | D:
        return self._data.get(key, default)  # type: ignore[return-value]  # per step: no cast() call

    def setdefault(self, key: StashKey[T], default: T) -> T:
        return cast(T, self._data.setdefault(key, default))

    def __delitem__(self, key: StashKey[T]) -> None:
        del self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)
