"""Component settings derived from the user config tree, by field name.

A component (the trainer, an env worker, the agent loop, the reward pool) keeps its own frozen settings
dataclass, so that it can be built without a whole `Config`; the values a run gives it come from the
user's sections. `derive` declares once how: every field of the component is

- read from the first of the user sections that has a field of the same name (or of the name that
  `rename` maps it to),
- `given` by the caller at build time (values that are not a section's field of that name: the run
  seed, a learning rate chosen by phase, a nested settings object built by another derivation), or
- `kept` at the component's own default (a knob the user config does not expose).

A read field may name a `convert` function, for a section value that spells the component's value
differently (the user's 0 for "off" where the component takes None).

The declaration is checked when it is made (at import): a component field with no source, a rename to a
field no section has, a field named twice, or a name that is no field of the component raises at once,
so adding a field to a component without wiring it (or removing a section field a component reads)
fails on import rather than silently running on a default. Building checks the sections' types and that
exactly the declared `given` values are passed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def _field_names(cls: type) -> tuple[str, ...]:
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"{cls!r} is not a dataclass")
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


class Derivation(Generic[T]):
    """How the dataclass `target` is filled from instances of `sources` (see the module doc)."""

    def __init__(
        self,
        target: type[T],
        sources: tuple[type, ...],
        rename: Mapping[str, str],
        given: frozenset[str],
        kept: frozenset[str],
        convert: Mapping[str, Callable[[Any], Any]],
    ) -> None:
        self.target, self.sources = target, sources
        self.given, self.kept, self.convert = given, kept, convert
        names = _field_names(target)
        source_fields = [set(_field_names(s)) for s in sources]
        for name in (*rename, *given, *kept, *convert):
            if name not in names:
                raise TypeError(f"derive({target.__name__}): {name!r} is not a field of {target.__name__}")
        overlap = ((set(rename) | set(convert)) & (given | kept)) | (given & kept)
        if overlap:
            raise TypeError(f"derive({target.__name__}): {sorted(overlap)} declared twice")
        read: dict[str, tuple[int, str]] = {}  # target field -> (source index, source field)
        for name in names:
            if name in given or name in kept:
                continue
            wanted = rename.get(name, name)
            where = [i for i, fields in enumerate(source_fields) if wanted in fields]
            if not where:
                sections = ", ".join(s.__name__ for s in sources)
                raise TypeError(
                    f"derive({target.__name__}): field {name!r} has no source (no field {wanted!r} in "
                    f"{sections}); rename it, give it or keep its default"
                )
            read[name] = (where[0], wanted)
        self.read = read

    def __call__(self, *sections: Any, **given: Any) -> T:
        """The component's settings of `sections` (instances of `sources`, in order) and `given`."""
        if len(sections) != len(self.sources) or not all(
            isinstance(s, cls) for s, cls in zip(sections, self.sources, strict=True)
        ):
            want = ", ".join(cls.__name__ for cls in self.sources)
            got = ", ".join(type(s).__name__ for s in sections)
            raise TypeError(f"{self.target.__name__}: expected sections ({want}), got ({got})")
        if set(given) != self.given:
            raise TypeError(
                f"{self.target.__name__}: expected given values {sorted(self.given)}, got {sorted(given)}"
            )
        kwargs = {name: getattr(sections[i], field) for name, (i, field) in self.read.items()}
        for name, convert in self.convert.items():
            kwargs[name] = convert(kwargs[name])
        return self.target(**kwargs, **given)

    def sources_of(self) -> dict[str, str]:
        """Component field -> `Section.field` it is read from (documentation and tests)."""
        return {name: f"{self.sources[i].__name__}.{field}" for name, (i, field) in self.read.items()}


def derive(
    target: type[T],
    *sources: type,
    rename: Mapping[str, str] | None = None,
    given: Iterable[str] = (),
    kept: Iterable[str] = (),
    convert: Mapping[str, Callable[[Any], Any]] | None = None,
) -> Derivation[T]:
    """Declare how `target` is built from `sources` (user section classes; the first having a field
    wins); `rename`: component field -> section field where the names differ; `given`: fields the caller
    passes at build time; `kept`: fields left at the component's default; `convert`: read field -> the
    function of the section's value that gives the component's. Checked here, at declaration."""
    return Derivation(
        target, tuple(sources), dict(rename or {}), frozenset(given), frozenset(kept), dict(convert or {})
    )
