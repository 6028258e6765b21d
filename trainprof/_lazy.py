"""Modules imported on first use: ``from trainprof._lazy import pd`` gives a stand-in for pandas
that imports it when an attribute is first read (``pd.DataFrame``, ``pd.factorize``...). A module
whose pandas code runs only for some inputs (a run directory's logs, never a folder of traces)
then costs nothing at import: pandas alone takes a quarter of a second to import."""

from __future__ import annotations

import importlib


class LazyModule:
    __slots__ = ("_name", "_mod")

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_mod", None)

    def _load(self):
        mod = self._mod
        if mod is None:
            mod = importlib.import_module(self._name)
            object.__setattr__(self, "_mod", mod)
        return mod

    def __getattr__(self, attr: str):
        return getattr(self._load(), attr)

    def __dir__(self):
        return dir(self._load())

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{' (imported)' if self._mod is not None else ''}>"


pd = LazyModule("pandas")
