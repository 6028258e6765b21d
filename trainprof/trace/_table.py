"""Columnar tables on numpy alone: what a parsed trace is made of (trainprof.trace), so that
`trainprof analyze` on a folder of traces never imports pandas (a quarter of a second of start-up).

``Table``: named columns of one length, each a numpy array (int64, float64, bool, or object for
per-row lists) or a ``Cat`` (strings stored once). ``t["col"]`` is the column itself;
``t[mask]`` / ``t[int_index_array]`` / ``t[slice]`` is a new Table of those rows (columns share
nothing with the original); ``len(t)``, ``"col" in t``, ``t.columns``, ``t.empty``,
``t.to_pandas()``.

``Cat``: a string column as ``codes`` (int64, one per row, an index into ``values``) and
``values`` (the distinct strings, sorted as pandas sorts a Categorical's categories, so a
pandas view of it has the same categories and codes). Masks are computed once per distinct
value: ``isin``, ``eq``, ``mask(pred)``, ``startswith``.
"""

from __future__ import annotations

import numpy as np


class Cat:
    __slots__ = ("codes", "values")

    def __init__(self, codes: np.ndarray, values: list):
        self.codes = codes
        self.values = values

    @classmethod
    def from_factorized(cls, codes: np.ndarray, uniq: list) -> "Cat":
        """(codes into ``uniq`` in first-seen order) -> a Cat whose values are sorted."""
        uniq = ["" if v is None else v if isinstance(v, str) else str(v) for v in uniq]
        order = sorted(range(len(uniq)), key=uniq.__getitem__)
        values = [uniq[i] for i in order]
        if len(set(values)) != len(values):  # two raw values with one text (e.g. None and "")
            return cls.from_strings([uniq[c] for c in codes.tolist()])
        rank = np.empty(len(uniq), np.int64)
        rank[order] = np.arange(len(uniq))
        return cls(rank[codes] if len(codes) else np.asarray(codes, np.int64), values)

    @classmethod
    def from_strings(cls, strings) -> "Cat":
        seen = dict.fromkeys(strings)
        values = sorted(seen)
        at = {v: i for i, v in enumerate(values)}
        return cls(np.fromiter(map(at.__getitem__, strings), np.int64, len(strings)), values)

    # ------------------------------------------------------------------ rows
    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.values[self.codes[idx]]
        return Cat(self.codes[idx], self.values)

    def __iter__(self):
        values = self.values
        return (values[c] for c in self.codes.tolist())

    def tolist(self) -> list:
        values = self.values
        return [values[c] for c in self.codes.tolist()]

    def to_numpy(self) -> np.ndarray:
        """An object array of the strings (one per row)."""
        return np.array(self.values, dtype=object)[self.codes] if len(self.values) else \
            np.empty(len(self.codes), dtype=object)

    # ------------------------------------------------------------------ masks
    def value_mask(self, pred) -> np.ndarray:
        """pred(str) per distinct value: a bool array over ``values``."""
        return np.fromiter((bool(pred(v)) for v in self.values), bool, len(self.values))

    def mask(self, pred) -> np.ndarray:
        """A bool array over the rows: pred(str) evaluated once per distinct value."""
        if not len(self.values):
            return np.zeros(len(self.codes), bool)
        return self.value_mask(pred)[self.codes]

    def isin(self, names) -> np.ndarray:
        names = set(names)
        return self.mask(names.__contains__)

    def eq(self, name: str) -> np.ndarray:
        return self.mask(name.__eq__)

    def startswith(self, prefix) -> np.ndarray:
        return self.mask(lambda v: v.startswith(prefix))

    def code_of(self, name: str) -> int:
        """The code of ``name`` (-1 when no row has it)."""
        try:
            return self.values.index(name)
        except ValueError:
            return -1

    def nunique(self) -> int:
        return int(len(np.unique(self.codes, return_counts=True)[0]))  # counts: no numpy.ma import

    def to_pandas(self):
        import pandas as pd

        return pd.Categorical.from_codes(self.codes, categories=pd.Index(self.values, dtype=object))


class Table:
    __slots__ = ("_cols", "_n")

    def __init__(self, cols: dict | None = None, n: int | None = None):
        self._cols = dict(cols or {})
        lens = {len(v) for v in self._cols.values()}
        if len(lens) > 1:
            raise ValueError(f"columns of different lengths: {sorted(lens)}")
        self._n = lens.pop() if lens else (n or 0)

    def __len__(self) -> int:
        return self._n

    @property
    def empty(self) -> bool:
        return self._n == 0

    @property
    def columns(self) -> list[str]:
        return list(self._cols)

    def __contains__(self, name) -> bool:
        return name in self._cols

    def get(self, name, default=None):
        return self._cols.get(name, default)

    def __getitem__(self, key):
        if isinstance(key, str):
            return self._cols[key]
        if isinstance(key, list) and key and all(isinstance(k, str) for k in key):
            return Table({k: self._cols[k] for k in key}, self._n)
        if isinstance(key, slice):
            return Table({k: v[key] for k, v in self._cols.items()}, len(range(self._n)[key]))
        idx = np.asarray(key)
        if idx.dtype == bool and len(idx) != self._n:
            raise IndexError(f"a mask of {len(idx)} rows for a table of {self._n}")
        n = int(idx.sum()) if idx.dtype == bool else len(idx)
        return Table({k: v[idx] for k, v in self._cols.items()}, n)

    def __setitem__(self, name: str, values) -> None:
        if len(values) != self._n and self._cols:
            raise ValueError(f"column {name!r} has {len(values)} rows, the table {self._n}")
        if not self._cols:
            self._n = len(values)
        self._cols[name] = values

    def take(self, idx) -> "Table":
        return self[np.asarray(idx, np.int64)]

    def to_pandas(self):
        import pandas as pd

        out = {}
        for k, v in self._cols.items():
            if isinstance(v, Cat):
                out[k] = v.to_pandas()
            elif isinstance(v, np.ndarray) and v.dtype == object:
                out[k] = pd.Series(v, dtype=object)
            else:
                out[k] = v
        return pd.DataFrame(out, index=pd.RangeIndex(self._n)) if out else \
            pd.DataFrame(index=pd.RangeIndex(self._n))

    def __repr__(self) -> str:
        return f"Table({self._n} rows: {', '.join(self._cols)})"


def objects(values) -> np.ndarray:
    """A 1-D object array of ``values`` (lists stay list objects, never a 2-D array)."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    return np.fromiter(values, dtype=object, count=len(values))
