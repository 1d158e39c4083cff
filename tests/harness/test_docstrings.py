"""Every public name in meshkit says why it exists: the project's bar, checked so it stays true.

Walks every meshkit module (the `__main__` CLIs excepted: importing one would run it) and lists the
public functions and classes defined there, and the public methods and properties those classes define
themselves, that have no docstring of their own. Overrides of a base class's method (`forward`,
`backward`, `extra_repr`) inherit their contract and are not listed; a dataclass's generated
`Name(field, ...)` signature does not count as a docstring.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import meshkit


def _modules():
    for info in pkgutil.walk_packages(meshkit.__path__, "meshkit."):
        if info.name.rsplit(".", 1)[-1] != "__main__":
            yield importlib.import_module(info.name)


def _own_doc(obj) -> bool:
    doc = obj.__doc__ or ""
    if inspect.isclass(obj) and doc.startswith(obj.__name__ + "("):  # dataclass's generated signature
        return False
    return bool(doc.strip())


def _undocumented_methods(cls) -> list[str]:
    missing = []
    for name, attr in vars(cls).items():
        if name.startswith("_") or any(name in vars(base) for base in cls.__mro__[1:]):
            continue
        func = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
        # a function stored as a field's default (dataclass callables) is not a method of this class
        if inspect.isfunction(func) and func.__name__ == name and not _own_doc(func):
            missing.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    return missing


def undocumented() -> list[str]:
    """The public functions, classes, methods and properties of meshkit without a docstring."""
    missing = []
    for module in _modules():
        for name, obj in vars(module).items():
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if obj.__module__ != module.__name__:  # re-exported: checked where it is defined
                continue
            if not _own_doc(obj):
                missing.append(f"{module.__name__}.{name}")
            if inspect.isclass(obj):
                missing += _undocumented_methods(obj)
    return missing


def test_every_public_name_has_a_docstring():
    missing = undocumented()
    assert not missing, "public names without a docstring (say why it exists):\n  " + "\n  ".join(missing)


def test_every_module_has_a_docstring():
    missing = [m.__name__ for m in _modules() if not (m.__doc__ or "").strip()]
    assert not missing, "modules without a docstring (their job, for docs/architecture.md):\n  " + "\n  ".join(missing)


def test_the_walk_sees_undocumented_names():
    """The check itself can fail: a class and a method without docstrings are reported, overrides not."""

    class Base:
        def hook(self):
            """Documented on the base."""

    class Bare(Base):
        def hook(self):  # an override: inherits the contract
            return 1

        def fresh(self):
            return 2

    Bare.__module__ = "probe"
    assert not _own_doc(Bare)
    assert _undocumented_methods(Bare) == ["probe.test_the_walk_sees_undocumented_names.<locals>.Bare.fresh"]
