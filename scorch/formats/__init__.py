"""Sparse tensor formats: level types, coordinate expressions, the ``Format`` DSL and the named formats."""
from .expr import Add, CoordExpr, Div, Mod, Sub, Var
from .format import Format
from .levels import Compressed, Dense, Fixed, Level, LevelStorage, PackedLevel, Singleton, packed_level
from .named import NAMES, bsc, bsr, coo, coo_nd, csc, csf, csr, dcsc, dcsr, dense, dense_nd, dia, ell, nm, resolve

__all__ = ["Format", "Level", "LevelStorage", "PackedLevel", "packed_level", "Dense", "Compressed", "Singleton",
           "Fixed", "CoordExpr", "Var", "Div", "Mod", "Add", "Sub", "dense", "dense_nd", "coo", "coo_nd", "csr", "csc",
           "dcsr", "dcsc", "csf", "bsr", "bsc", "ell", "dia", "nm", "resolve", "NAMES"]
